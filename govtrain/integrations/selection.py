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
run's admitted rows (`GovernedRun.admitted_rows`), or it is refused (`selection_admitted`):

- a row with the task's columns is compared by row digest (`govtrain.data.rows`);
- a tokenized row (`input_ids`, with an `attention_mask` that strips its padding, and `labels`) by its token
  ids, and for a task with one label per example its label, against the admitted examples encoded by the run's
  task and tokenizer, cut at `model.max_length` and uncut, each with and without a final EOS; a row without an
  attention mask is compared as it is and with the pad tokens at either end stripped;
- a row that can be compared neither way, or a data set whose rows cannot be listed (an iterable one), is
  refused as one that cannot be checked.

What it does not catch: an admitted row altered beyond the normal form (a word changed, tokenized another way),
and a callback that remembers an evaluation and acts on it at a later step.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping

from transformers import EarlyStoppingCallback, TrainingArguments

from govtrain.errors import Code, ConfigError
from govtrain.train.governed import GovernedRun

EVALUATION_FLAGS = ("should_training_stop", "should_epoch_stop", "should_save")
_SCHEDULES = ("reduce_lr_on_plateau", "greedy")  # schedules that step on an evaluation metric
_UNCUT = 1 << 30  # a max_length no example reaches: the untruncated encoding
_CHUNK = 64


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
        self._tokens: dict[tuple[int, ...], dict[int | None, str]] | None = None

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
            owner = self._owner(row, f"row {index}", name, why)
            if owner is not None:
                matched.append((f"row {index}", owner))
        if matched:
            raise ConfigError(Code.SELECTION_ADMITTED, f"{name}: {admitted_summary(matched, total)}, and {why}, "
                                                       "so it would select on private data that no spend entry "
                                                       "charges: evaluate on held-out rows, or turn that off")

    def _owner(self, row: Any, where: str, name: str, why: str) -> str | None:
        """The contribution whose admitted row `row` is, or None; refused where it can be compared neither way."""
        from govtrain.data.rows import row_digest

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
            owner = self.run.admitted_rows.digests.get(row_digest(example))
            if owner is not None:
                return owner
        ids = row.get("input_ids")
        if _token_ids(ids):
            checked = True
            owner = self._token_owner(ids, row.get("attention_mask"), _label(row))
            if owner is not None:
                return owner
        if not checked:
            raise ConfigError(Code.SELECTION_ADMITTED, f"{name}: cannot check {where} (columns {sorted(map(str, row))}:"
                                                       f" neither the task's columns nor input_ids), and {why}: give "
                                                       "rows with the task's columns or input_ids, or turn that off")
        return None

    def _token_owner(self, ids: list[int], mask: Any, label: Any) -> str | None:
        index = self._token_index()
        if isinstance(mask, list) and len(mask) == len(ids) and all(isinstance(m, (int, bool)) for m in mask):
            candidates = [[token for token, keep in zip(ids, mask) if keep]]
        else:  # no mask: as it is, and with the pad tokens at either end stripped
            pad, start, end = self.run.tokenizer.pad_token_id, 0, len(ids)
            while pad is not None and start < end and ids[start] == pad:
                start += 1
            while pad is not None and end > start and ids[end - 1] == pad:
                end -= 1
            candidates = [list(ids), ids[start:end]]
        for candidate in candidates:
            labels = index.get(tuple(candidate))
            if not labels:
                continue
            if None in labels:  # labels per token: the ids are the row
                return labels[None]
            if not isinstance(label, int) or isinstance(label, bool):  # no label given: the text is the row
                return next(iter(labels.values()))
            if label in labels:
                return labels[label]
        return None

    def _token_index(self) -> dict[tuple[int, ...], dict[int | None, str]]:
        """Token ids of every admitted example (cut and uncut, with and without a final EOS) -> {label (None for
        labels per token): contribution}. Built once, on first use."""
        if self._tokens is not None:
            return self._tokens
        import torch

        admitted, tokenizer = self.run.admitted_rows, self.run.tokenizer
        eos = tokenizer.eos_token_id
        index: dict[tuple[int, ...], dict[int | None, str]] = {}
        for length in (self.run.config.file.model.max_length, _UNCUT):
            for start in range(0, len(admitted.examples), _CHUNK):
                chunk = admitted.examples[start:start + _CHUNK]
                batch = self.task.encode(chunk, tokenizer, length, torch.device("cpu"))
                ids, mask = batch.inputs["input_ids"].tolist(), batch.inputs.get("attention_mask")
                mask = mask.tolist() if mask is not None else [[1] * len(row) for row in ids]
                targets = batch.targets.tolist() if batch.targets.dim() == 1 else [None] * len(ids)
                for k, (row, keep, target) in enumerate(zip(ids, mask, targets)):
                    tokens = [token for token, on in zip(row, keep) if on]
                    forms = [tokens]
                    if eos is not None:
                        forms.append(tokens[:-1] if tokens and tokens[-1] == eos else [*tokens, eos])
                    for form in forms:
                        index.setdefault(tuple(form), {}).setdefault(target, admitted.owners[start + k])
        self._tokens = index
        return index


def _listed(dataset: Any) -> Iterator[Any] | None:
    """The rows of a map-style data set (a list, a `datasets.Dataset`, a torch `Dataset` with a length), or None."""
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")) or isinstance(dataset, (str, bytes)):
        return None
    return (dataset[i] for i in range(len(dataset)))


def _plain(value: Any) -> Any:
    """A tensor or array as Python lists and numbers, so rows compare however they are formatted."""
    return value.tolist() if hasattr(value, "tolist") and not isinstance(value, (list, str)) else value


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, int) and not isinstance(v, bool)
                                                           for v in value)


def _label(row: Mapping[str, Any]) -> Any:
    for key in ("labels", "label", "label_ids"):
        if key in row:
            value = row[key]
            return value[0] if isinstance(value, list) and len(value) == 1 else value
    return None


__all__ = ["EVALUATION_FLAGS", "SelectionCheck", "changed_by_evaluation", "evaluation_flags", "named",
           "selection_settings"]
