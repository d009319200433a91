"""Evaluation that chooses what a governed Trainer releases, and the check that it scores held-out rows only
(issue 20, item 3).

Evaluating the run's model is post-processing as long as nothing it produces flows back into what is released.
Once a setting lets evaluation choose what is saved or when training stops, its score on admitted rows is a
use of private data that no spend entry charges (as a Trainer `trial`, or `govtrain tune` on an admitted
file, would be). The settings (`selection_settings`):

- `load_best_model_at_end` (the best checkpoint's adapter is what `run.save()` records);
- `metric_for_best_model` (the Trainer then tracks the best checkpoint and keeps it from deletion; the
  `reduce_lr_on_plateau` and `greedy` schedules set it and step on it, as `lr_scheduler_type` also shows);
- `save_strategy = "best"` (where the installed transformers has it);
- an `EarlyStoppingCallback`, given to the Trainer or added later;
- at run time, any callback that changes `control.should_training_stop`, `should_epoch_stop` or
  `should_save` while an evaluation is logged and handed to `on_evaluate` (`EVALUATION_FLAGS`).

While one is on, every evaluation data set (one, or each of a dict) must be checkably disjoint from the
run's admitted rows (`GovernedRun.admitted_rows`), or it is refused (`selection_admitted`). Inputs are
compared, never labels (an admitted text under a flipped label is still the admitted row):

- a row with the task's columns by its input digest (`govtrain.data.rows`);
- a tokenized row (`input_ids`, with or without the `attention_mask` that strips its padding) by its token ids
  without the tokenizer's structural special tokens (BOS, EOS, CLS, SEP, pad), against the admitted examples
  encoded by the run's task and its own copy of the tokenizer, cut at `model.max_length` and uncut, the same
  tokens left out (so `add_special_tokens=False` changes nothing);
- a row that can be compared neither way, or a data set whose rows cannot be listed (an iterable one), is
  refused as one that cannot be checked.

For a causal LM (`task.causal`) the same token ids are also compared by prefix (`govtrain.data.rows.PrefixIndex`,
review 3, F7): a position's logit reads only the tokens before it, so an admitted row with one token appended
(its label -100) has the admitted row's eval loss. A row is refused when an admitted row's tokens are its
opening, or it is the opening of an admitted row, the shared opening `MIN_PREFIX` (8) tokens or more; and
a tokenized row with `labels` is compared also as the text it scores up to where its labels leave its input_ids
(`_scored_owner`: the position-i logit reads input_ids[:i] and is scored against labels[i]);
a row in the task's columns is encoded by the run's task for this (uncut and cut at `model.max_length`).

What is evaluated is what was checked: the Trainer evaluates a list of the rows as read (`materialised`), never
the data set object, whose batch access (`__getitems__`) may serve other rows than its `__getitem__`, and
a `data_collator` replaced after the Trainer was built is refused while a setting is on. The settings are read
again after every evaluation (a callback may turn one on in `on_evaluate`), and each evaluation is recorded as
checked or not (`Evaluations`, `predict()` too): before the run is recorded, an unchecked evaluation with a
best checkpoint tracked or the weights moved since the last governed step (a checkpoint reloaded) is refused,
however the settings looked whenever they were read. Weights other than the last governed step's are
released only when they are exactly those of the checkpoint `load_best_model_at_end` names, as this Trainer
saved it after a governed step (`ungoverned_update` otherwise: review 3 had a callback restore the weights it
liked best on admitted rows, and the run recorded them).

What it does not catch: an admitted row altered beyond the normal form (a word changed), a causal LM's row
that is an admitted row's first 7 tokens or fewer (below `MIN_PREFIX`) or holds one after other tokens (the
logits then differ), a callback that remembers an evaluation and acts on it at a later step, and code of yours
that reads any data itself (`compute_metrics`, a callback, the `processing_class` that pads evaluation batches).
What such code can do with what it read is bounded elsewhere: a hyperparameter it writes is refused before the
next update (`mechanisms/hyperparameters.py`), weights it writes are refused (`Weights`), and a stop it decides
releases nothing (`train()` records the run only after all of `training.steps`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import torch
from transformers import EarlyStoppingCallback, TrainingArguments

from govtrain.data.rows import PrefixIndex
from govtrain.errors import Code, ConfigError
from govtrain.train.governed import GovernedRun
from govtrain.train.weights import trainable_weights

EVALUATION_FLAGS = ("should_training_stop", "should_epoch_stop", "should_save")
_SCHEDULES = ("reduce_lr_on_plateau", "greedy")  # schedules that step on an evaluation metric
_UNCUT = 1 << 30  # a max_length no example reaches: the untruncated encoding
_MODEL_INPUTS = ("input_ids", "inputs_embeds")  # what carries the tokens a row puts before the model
_LABELS = ("labels", "label", "label_ids")  # what the Trainer's collators pass to the model as labels


def selection_settings(args: TrainingArguments, callbacks: Iterable[Any]) -> list[str]:
    """The settings on which let evaluation choose what is saved or when training stops, as the user wrote them."""
    from transformers.trainer_utils import SaveStrategy

    found = []
    if args.load_best_model_at_end:
        found.append("load_best_model_at_end")
    if args.metric_for_best_model is not None:
        found.append(f"metric_for_best_model = {args.metric_for_best_model!r}")
    best = getattr(SaveStrategy, "BEST", None)
    if best is not None and args.save_strategy == best:
        found.append('save_strategy = "best"')
    if args.lr_scheduler_type in _SCHEDULES:
        found.append(f"lr_scheduler_type = {str(getattr(args.lr_scheduler_type, 'value', args.lr_scheduler_type))!r}")
    for callback in callbacks:
        kind = callback if isinstance(callback, type) else type(callback)
        if issubclass(kind, EarlyStoppingCallback):
            found.append(kind.__name__)
    return found


def evaluation_flags(control: Any) -> dict[str, bool]:
    return {flag: getattr(control, flag) for flag in EVALUATION_FLAGS}


def changed_by_evaluation(before: dict[str, bool], control: Any) -> list[str]:
    """The settings a callback made during one evaluation, as `selection_settings` names settings."""
    return [f"a callback that sets control.{flag} = {getattr(control, flag)} in response to an evaluation"
            for flag in EVALUATION_FLAGS if getattr(control, flag) != before[flag]]


def named(data: Any, name: str) -> dict[str, Any]:
    """`{name: data}`, or `{name[key]: each}` for a dict of data sets; None: nothing to check."""
    if data is None:
        return {}
    if isinstance(data, Mapping):
        return {f"{name}[{key!r}]": item for key, item in data.items()}
    return {name: data}


class SelectionCheck:
    """Refuses evaluation data with admitted rows while a selection setting is on (module docstring)."""

    def __init__(self, run: GovernedRun) -> None:
        from govtrain.tasks import task_for

        self.run = run
        self.task = task_for(run.config.file)
        self._tokens: dict[tuple[int, ...], str] | None = None
        self._prefixes: PrefixIndex | None = None

    def check(self, datasets: Mapping[str, Any], settings: list[str]) -> None:
        """Each named data set, in order: refused at the first that holds admitted rows or cannot be checked."""
        if not settings:
            return
        why = (f"{', '.join(settings)} {'lets' if len(settings) == 1 else 'let'} evaluation choose what is "
               "released or when training stops")
        for name, dataset in datasets.items():
            self._check(name, dataset, why)

    def _check(self, name: str, dataset: Any, why: str) -> None:
        from govtrain.data.rows import admitted_summary

        rows = _listed(dataset)
        if rows is None:
            raise ConfigError(Code.SELECTION_ADMITTED, f"{name}: cannot check a {type(dataset).__name__}, whose rows "
                                                       f"cannot be listed before it is evaluated, and {why}: give a "
                                                       "data set with a length and rows, or turn that off")
        matched, total = [], 0
        for index, row in enumerate(rows):
            total += 1
            found = self._owner(row, f"row {index}", name, why)
            if found is not None:
                matched.append((f"row {index}", found[1], found[0]))
        if matched:
            raise ConfigError(Code.SELECTION_ADMITTED, f"{name}: {admitted_summary(matched, total)}, and {why}, "
                                                       "so it would select on private data that no spend entry "
                                                       "charges: evaluate on held-out rows, or turn that off")

    def _owner(self, row: Any, where: str, name: str, why: str) -> tuple[str, str] | None:
        """(how `row` holds an admitted row, that row's contribution) as `PrefixIndex.match` says it, or None;
        refused where it can be compared neither way."""
        from govtrain.data.rows import input_digest

        if not isinstance(row, Mapping):
            raise ConfigError(Code.SELECTION_ADMITTED, f"{name}: cannot check {where}, a {type(row).__name__} rather "
                                                       f"than a row of columns, and {why}: give rows with the task's "
                                                       "columns or input_ids, or turn that off")
        row = {key: _plain(value) for key, value in row.items()}
        checked = False
        try:
            example = self.task.example(row, where)
        except ConfigError as e:
            if e.code is not Code.BAD_DATA:
                raise
        else:
            checked = True
            owner = self.run.admitted_rows.digests.get(input_digest(example))
            if owner is not None:
                return "is", owner
            found = self._example_match(example) if self.task.causal else None
            if found is not None:
                return found
        unreadable = [key for key in _MODEL_INPUTS if key in row and not _token_ids(row[key])]
        if unreadable:
            raise ConfigError(Code.SELECTION_ADMITTED, f"{name}: cannot check {where}: its {', '.join(unreadable)} "
                                                       "is not a flat list of token ids, and the model would read it; "
                                                       f"and {why}: give input_ids as token ids, or turn that off")
        ids = row.get("input_ids")
        if _token_ids(ids):
            checked = True
            found = self._token_owner(ids, row.get("attention_mask"))
            if found is not None:
                return found
            uneven = [key for key in _LABELS if isinstance(row.get(key), list) and len(row[key]) != len(ids)]
            if self.task.causal and uneven:  # a collator pads one to the other: what is scored cannot be told
                raise ConfigError(Code.SELECTION_ADMITTED, f"{name}: cannot check {where}: its {uneven[0]} has "
                                                           f"{len(row[uneven[0]])} entries for {len(ids)} input_ids, "
                                                           f"and {why}: give one label per input token, or turn "
                                                           "that off")
            found = self._scored_owner(ids, row) if self.task.causal else None
            if found is not None:
                return found
        if not checked:
            raise ConfigError(Code.SELECTION_ADMITTED, f"{name}: cannot check {where} (columns {sorted(map(str, row))}:"
                                                       f" neither the task's columns nor input_ids), and {why}: give "
                                                       "rows with the task's columns or input_ids, or turn that off")
        return None

    def _token_owner(self, ids: list[int], mask: Any) -> tuple[str, str] | None:
        """(how, contribution) of the admitted example these token ids are (or, for a causal task, share an
        opening with: `PrefixIndex.match`), the structural special tokens left out on both sides: with the
        padding the attention mask strips taken out, and as they are."""
        from govtrain.data.rows import special_ids

        index, special = self._token_index(), special_ids(self.run._tokenizer)
        forms = [ids]
        if isinstance(mask, list) and len(mask) == len(ids) and all(isinstance(m, (int, bool)) for m in mask):
            forms.insert(0, [token for token, keep in zip(ids, mask) if keep])
        for form in forms:
            tokens = tuple(token for token in form if token not in special)
            owner = index.get(tokens)
            if owner is not None:
                return "is", owner
            found = self._prefix_index().match(tokens) if self.task.causal else None
            if found is not None:
                return found
        return None

    def _example_match(self, example: Any) -> tuple[str, str] | None:
        """A causal task's example encoded by the run's task as a tokenized row of it would be (uncut, and cut at
        `model.max_length`), against the prefix index. A length at which the task refuses the example (no target
        token left) gives no encoding to compare and is passed over; the other still is compared."""
        from govtrain.data.rows import token_rows

        for length in (_UNCUT, self.run.config.file.model.max_length):
            try:
                (tokens,) = token_rows(self.task, [example], self.run._tokenizer, length)
            except ConfigError as e:
                if e.code is not Code.BAD_DATA:
                    raise
                continue
            found = self._prefix_index().match(tokens)
            if found is not None:
                return found
        return None

    def _scored_owner(self, ids: list[int], row: Mapping[str, Any]) -> tuple[str, str] | None:
        """For a causal LM: (how, contribution) of an admitted row whose opening the row scores through labels
        that leave its input_ids. The logit at position i reads input_ids[:i] and is scored against label i, so
        where input_ids[:i] opens an admitted row and label i is not the input token, the row scores the text
        input_ids[:i] + [label i] (review 5: an admitted row with its last token replaced, its labels the admitted
        row's, scored its loss bit for bit). Every such position up to the row's longest admitted opening is
        checked (review 6: a junk label first hid a later fork), under every key a collator makes labels of."""
        from govtrain.data.rows import special_ids

        special, index = special_ids(self.run._tokenizer), self._prefix_index()
        mask = row.get("attention_mask")
        keep = mask if isinstance(mask, list) and len(mask) == len(ids) else [1] * len(ids)
        read = [bool(keep[r]) and ids[r] not in special for r in range(len(ids))]  # the tokens compared
        plain = [token for token, kept in zip(ids, read) if kept]
        reach = index.longest_opening(plain)
        for key in _LABELS:
            labels = row.get(key)
            if not isinstance(labels, list):
                continue
            if len(labels) != len(ids):
                continue  # refused by `_owner`
            scored = [r for r, label in enumerate(labels) if r and label != -100]
            if scored:  # the text scored ends at the last scored label (review 7: an ignored tail hid an opening)
                found = index.match([token for token, kept in zip(ids[:scored[-1] + 1], read) if kept])
                if found is not None:
                    return found
            before = 0  # compared tokens before position r: the context of label r
            for r, label in enumerate(labels):
                if before > reach:
                    break  # no admitted row opens with this context: nothing later can be scored as one
                fork = type(label) is int and label != -100 and label not in special and not (read[r] and
                                                                                           label == ids[r])
                if r and fork:  # label 0 is never scored: the model shifts the labels by one
                    found = index.match((*plain[:before], label))
                    if found is not None:
                        return found
                before += read[r]
        return None

    def _prefix_index(self) -> PrefixIndex:
        """`_token_index` sorted for prefix search (a causal task); built once, on first use."""
        if self._prefixes is None:
            self._prefixes = PrefixIndex.of(self._token_index())
        return self._prefixes

    def _token_index(self) -> dict[tuple[int, ...], str]:
        """`AdmittedRows.tokens` cut at `model.max_length` and uncut, with the run's own tokenizer (a patched
        `run.tokenizer` changes nothing here either). Built once, on first use."""
        if self._tokens is None:
            admitted, tokenizer = self.run.admitted_rows, self.run._tokenizer
            self._tokens = {**admitted.tokens(self.task, tokenizer, _UNCUT),
                            **admitted.tokens(self.task, tokenizer, self.run.config.file.model.max_length)}
        return self._tokens


class Evaluations:
    """Every evaluation and prediction a governed Trainer ran, whether its rows were checked held out, the
    collator it was built with, and the weights at each checkpoint it saved: what `before_release` reads."""

    def __init__(self, run: GovernedRun, collator: Any) -> None:
        self.run, self.collator = run, collator
        self.unchecked: list[str] = []  # the data sets evaluated without a check, one entry per evaluation
        self.checkpoints: dict[str, bytes] = {}  # checkpoint folder name: digest of the trainable weights saved

    def check_collator(self, collator: Any, settings: list[str]) -> None:
        if settings and collator is not self.collator:
            raise ConfigError(Code.SELECTION_ADMITTED, f"data_collator was replaced after the Trainer was built, and "
                                                       f"{', '.join(settings)} lets evaluation choose what is released:"
                                                       " the rows it collates would not be the rows checked; build "
                                                       "the Trainer with the collator you need, or turn that off")

    def saved(self, folder: str) -> None:
        """The Trainer saved a checkpoint in `folder`, of the weights the last governed step left (checked just
        before it saved): their digest, from the run's own copy, is what a reload must match (review 4: a
        callback wrote weights of its own before a save and put the governed ones back after it)."""
        self.checkpoints[folder] = weights_digest(self.run._weights.trainable)

    def before_release(self, state: Any, args: Any) -> None:
        """Refuse (nothing recorded) when what is released may have been chosen other than by checked held-out
        evaluation: an unchecked evaluation or prediction ran and the Trainer tracked a best checkpoint, or the
        weights are not the last governed step's. Weights other than the last step's are released only when
        they are, bit for bit, those of the checkpoint the Trainer's `load_best_model_at_end` names, saved by
        this Trainer after a governed step, and every evaluation and prediction was checked (review 3, F5)."""
        chose = []
        if self.unchecked and (state.best_model_checkpoint is not None or state.best_metric is not None):
            chose.append(f"the Trainer tracked a best checkpoint ({state.best_model_checkpoint or state.best_metric})")
        now = trainable_weights(self.run.model)
        moved = not self.run._weights.same(now)
        if moved and self.unchecked:
            chose.append("the weights are not those of the last governed step (a checkpoint was loaded)")
        if chose:
            raise ConfigError(Code.SELECTION_ADMITTED, f"{len(self.unchecked)} evaluation(s) ran without a check that "
                                                       f"their rows are held out (e.g. {self.unchecked[0]}), and "
                                                       f"{' and '.join(chose)}: an evaluation may have chosen what "
                                                       "is released, so nothing is recorded; turn selection on "
                                                       "before training, with held-out rows, or leave it off")
        if not moved:
            return
        best = state.best_model_checkpoint if args.load_best_model_at_end else None
        if best is None or self.checkpoints.get(Path(best).name) != weights_digest(now):
            raise ConfigError(Code.UNGOVERNED_UPDATE, "the weights are neither the last governed step's nor those of "
                                                      "the best checkpoint this Trainer saved and "
                                                      "load_best_model_at_end loaded: something else wrote them, so "
                                                      "nothing is recorded; leave the model's parameters alone while "
                                                      "the run is open")
        self.run._weights.update()  # the released weights: a governed step's, chosen on held-out rows


def weights_digest(weights: dict[str, torch.Tensor]) -> bytes:
    """SHA-256 over the names, dtypes, shapes and bytes of `weights`, in name order."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        tensor = weights[name].detach().cpu().contiguous()
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.digest()


def materialised(dataset: Any) -> list[Any] | None:
    """The rows of `dataset` as read, one by one, into a list (None: rows that cannot be listed): what is checked
    and then evaluated."""
    rows = _listed(dataset)
    return None if rows is None else list(rows)


def _listed(dataset: Any) -> Iterator[Any] | None:
    """The rows of a map-style data set (a list, a `datasets.Dataset`, a torch `Dataset` with a length), or None."""
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")) or isinstance(dataset, (str, bytes)):
        return None
    return (dataset[i] for i in range(len(dataset)))


def _plain(value: Any) -> Any:
    """A tensor, array, tuple or numpy scalar as Python lists and numbers, so rows compare however they are
    formatted (review 4: input_ids as a tuple, or a list of numpy ints, were passed over unchecked)."""
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple, str)):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, int) and not isinstance(v, bool)
                                                           for v in value)


__all__ = ["EVALUATION_FLAGS", "Evaluations", "SelectionCheck", "changed_by_evaluation", "evaluation_flags",
           "materialised", "named", "selection_settings"]
