"""Attacks by user and operator code that selects what is released (issue 20, items 3 and 5).

The adversary is code that chooses the released adapter, or when training stops, by its score on admitted
rows, a use of private data that nothing charges: the Hugging Face Trainer's best-model and early-stopping
machinery (`load_best_model_at_end`, `metric_for_best_model`, `save_strategy="best"`, `EarlyStoppingCallback`,
a callback of its own that stops or saves when an evaluation comes in) fed an `eval_dataset` of admitted rows,
and `govtrain tune`'s selection file made of admitted rows that are not byte for byte an admitted file (a blank
line appended, re-saved as CSV, two admitted files concatenated, whitespace, key order and Unicode form changed,
one admitted row among held-out ones), and, for a causal LM, rows that score as admitted rows without being
them (an admitted row with a token appended, its first 8 tokens or more: review 3, F7). Each is refused with
`selection_admitted` and nothing changes: the ledger (`tests.conftest.snapshot`), the trials (none runs), the
model's weights. Selection on rows that are held out (a causal LM's sharing a short opening with admitted rows
included) stays allowed and is recorded, and evaluation that selects nothing stays allowed on any data.
"""

from __future__ import annotations

import csv
import io
import json
import sys
import unicodedata
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import govtrain  # noqa: E402
from govtrain.errors import Code, ConfigError  # noqa: E402
from govtrain.integrations.hf import GovernedTrainer  # noqa: E402
from govtrain.verify.verifier import verify_ledger  # noqa: E402
from tests.conftest import Corpus, snapshot  # noqa: E402
from tests.test_api import QUIET, _corpus, _same, _trainable  # noqa: E402
from tests.test_hf_trainer import _arguments, _Log  # noqa: E402
from tests.test_train import WORDS, _admit, _config, tiny_model  # noqa: E402,F401
from tests.test_tune import _entries, _grid, _tune, _valid  # noqa: E402


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- govtrain tune: a selection file of admitted rows ----------------------------------------------------------

def _accents(corpus: Corpus) -> Path:
    """An admitted contribution whose text is not ASCII (NFC), for the Unicode-form case."""
    from govtrain.gate.admission import admit

    path = corpus.dir / "data" / "accents.jsonl"
    rows = [{"text": f"un café très {WORDS[i]}", "label": i % 2} for i in range(4)]
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    with corpus.open() as ledger:
        admit(ledger, corpus.attestation(path, contribution_id="accents"), path, now=corpus.now)
    return path


def _csv(rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, quoting=csv.QUOTE_ALL, lineterminator="\r\n")
    writer.writerow(["label", "text"])
    writer.writerows([[row["label"], row["text"]] for row in rows])
    return out.getvalue()


def _reworded(row: dict) -> str:
    """The same example: keys reordered, whitespace runs, JSON spacing and Unicode form changed."""
    text = "  " + unicodedata.normalize("NFD", row["text"]).replace(" ", " \t  ") + "\u00a0"
    return json.dumps({"label": row["label"], "text": text}, ensure_ascii=False, separators=(" ,  ", " : "))


def _held_out_with_one_admitted(corpus: Corpus, data: Path) -> bytes:
    held = _valid(corpus).read_text().splitlines(keepends=True)
    return "".join(held[:6] + [data.read_text().splitlines(keepends=True)[3]] + held[6:]).encode()


SELECTIONS = {  # name -> (selection file name, its bytes from the corpus's admitted files, rows matched / all rows)
    "blank_line_appended": ("selection.jsonl", lambda c, d: (d / "pub.jsonl").read_bytes() + b"\n", "40 of 40"),
    "resaved_as_csv": ("selection.csv", lambda c, d: _csv(_rows(d / "pub.jsonl")).encode(), "40 of 40"),
    "two_files_concatenated": ("selection.jsonl", lambda c, d: (d / "pub.jsonl").read_bytes() +
                               (d / "sens.jsonl").read_bytes(), "80 of 80"),
    "whitespace_key_order_unicode": ("selection.jsonl", lambda c, d: "\r\n".join(
        _reworded(row) for row in _rows(d / "accents.jsonl") + _rows(d / "sens.jsonl")).encode(), "44 of 44"),
    "one_row_among_held_out": ("selection.jsonl", lambda c, d: _held_out_with_one_admitted(c, d / "pub.jsonl"),
                               "1 of 13"),
}


@pytest.mark.parametrize("name", sorted(SELECTIONS))
def test_tune_refuses_a_selection_file_of_admitted_rows_and_writes_nothing(corpus: Corpus, name: str):
    _admit(corpus, "pub")
    _admit(corpus, "sens", data_class="sensitive", clip_norm_u=500_000, eps_budget_u=3_000_000)
    _accents(corpus)
    file, content, matched = SELECTIONS[name]
    selection = corpus.dir / file
    selection.write_bytes(content(corpus, corpus.dir / "data"))
    with corpus.open() as ledger:  # none of them is an admitted file byte for byte: the old check passed them
        assert selection.read_bytes() not in [(corpus.dir / "data" / p).read_bytes() for p in
                                              ("pub.jsonl", "sens.jsonl", "accents.jsonl")]
        assert len(ledger.store.admissions()) == 3
    before = snapshot(corpus.url)
    result = _tune(corpus, Path("/nonexistent-model"), _grid(corpus, '"optimizer.lr" = [0.01]', f'data = "{file}"'))
    assert result.exit_code == 2 and "error[selection_admitted]" in result.stderr, result.output
    assert f"{matched} rows" in result.stderr and f"{file}:" in result.stderr, result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("error[")] == \
        [result.stderr.strip().splitlines()[-1]]  # one `error[code]: what is wrong and what to do` line
    assert snapshot(corpus.url) == before
    assert not (corpus.dir / "adapter").exists()  # no trial config written, no trial run
    assert not _entries(corpus.url, "spend")


def test_tune_still_refuses_an_admitted_file_byte_for_byte_even_outside_training_data(corpus: Corpus):
    """The file-digest check stays: a contribution admitted but absent from training.data is still private."""
    _admit(corpus, "pub")
    moved = corpus.dir / "pub-copy.jsonl"
    (corpus.dir / "data" / "pub.jsonl").rename(moved)
    _admit(corpus, "sens", data_class="sensitive", clip_norm_u=500_000, eps_budget_u=3_000_000)
    before = snapshot(corpus.url)
    result = _tune(corpus, Path("/nonexistent-model"), _grid(corpus, '"optimizer.lr" = [0.01]',
                                                               f'data = "{moved.name}"'))
    assert result.exit_code == 2 and "error[selection_admitted]" in result.stderr, result.output
    assert "'pub'" in result.stderr and snapshot(corpus.url) == before


def test_tune_accepts_a_held_out_selection_file_and_records_the_search(corpus: Corpus, tiny_model: Path):
    _admit(corpus, "pub")
    _valid(corpus)
    result = _tune(corpus, tiny_model, _grid(corpus, '"optimizer.lr" = [0.01]'), "--id", "held", steps=2)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["selected"]["run_id"] == "held-trial-0"
    assert verify_ledger(corpus.url).by_kind["tune"] == 1


def test_a_row_digest_is_of_the_example_not_of_the_bytes(tmp_path: Path):
    """The normal form (govtrain/data/rows.py): format, quoting, key order, blank lines, whitespace runs and
    Unicode form do not change a row's digest; a changed word or label does."""
    import datasets

    from govtrain.data import read_data
    from govtrain.data.rows import row_digest
    from govtrain.tasks import Classification
    from govtrain.train.data import rows_of

    rows = [{"text": f"un café {WORDS[i]}  est", "label": i % 2} for i in range(5)]
    (tmp_path / "a.jsonl").write_text("\n\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n\n")
    (tmp_path / "b.csv").write_text(_csv(rows))
    (tmp_path / "c.jsonl").write_text("\n".join(_reworded(r) for r in rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "e"))
    task = Classification(num_labels=2)
    digests = {}
    for name in ("a.jsonl", "b.csv", "c.jsonl", "d.parquet", "e"):
        read = rows_of(read_data(tmp_path / name), ("label",))
        digests[name] = [row_digest(task.example(row, where)) for where, row in read]
    assert len({tuple(d) for d in digests.values()}) == 1 and len(set(digests["a.jsonl"])) == 5
    changed = [task.example({"text": rows[0]["text"] + " x", "label": 0}, "-"),
               task.example({"text": rows[0]["text"], "label": 1}, "-")]
    assert not {row_digest(e) for e in changed} & set(digests["a.jsonl"])


# -- the Trainer: evaluation that chooses what is saved, or when training stops -------------------------------

def _admitted(run, name: str = "pub", n: int = 8, *, mask: bool = True) -> list[dict]:
    """Admitted rows as a user passes them: tokenized with labels, half of them padded to a fixed length (with
    their attention mask, or without one)."""
    rows = _rows(run.config.data_dir / f"{name}.jsonl")[:n]
    encoded = [dict(run.tokenizer(r["text"], **({"padding": "max_length", "max_length": 16} if i % 2 else {})))
               | {"labels": r["label"]} for i, r in enumerate(rows)]
    return encoded if mask else [{k: v for k, v in row.items() if k != "attention_mask"} for row in encoded]


def _held_out(run, n: int = 8) -> list[dict]:
    """Rows no contribution holds (other words, in another order)."""
    return [dict(run.tokenizer(f"{WORDS[9 + i % 8]} {WORDS[i % 9]} film is")) | {"labels": i % 2} for i in range(n)]


def _trainer(run, **kwargs) -> GovernedTrainer:
    return GovernedTrainer(run, processing_class=run.tokenizer, **kwargs)  # its collator pads the rows


def _evaluating(tmp_path: Path, **overrides) -> transformers.TrainingArguments:
    return _arguments(tmp_path, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4, **overrides)


def _refused(tmp_path: Path, model: Path, build, says: str) -> ConfigError:
    """`build(run)` is refused with selection_admitted, naming `says`, before anything moved or was written."""
    corpus = _corpus(tmp_path, "refused")
    before = snapshot(corpus.url)
    with govtrain.GovernedRun.open(_config(corpus, model, 4), corpus.url, insecure_seed=1, **QUIET) as run:
        weights = _trainable(run)
        with pytest.raises(ConfigError) as refused:
            build(run)
        assert refused.value.code is Code.SELECTION_ADMITTED, refused.value
        assert says in refused.value.detail, refused.value.detail
        assert "\n" not in refused.value.detail
        assert _same(weights, run) and run.steps == 0
    assert snapshot(corpus.url) == before
    assert not (corpus.dir / "adapter" / "adapter_config.json").exists()
    return refused.value


def _save_strategy_best() -> dict:
    from transformers.trainer_utils import SaveStrategy

    if not hasattr(SaveStrategy, "BEST"):
        pytest.skip("this transformers has no save_strategy='best'")
    return dict(save_strategy="best", metric_for_best_model="loss")


SETTINGS = {  # what lets evaluation choose what is saved or when training stops -> (arguments, callbacks)
    "load_best_model_at_end": (lambda: dict(load_best_model_at_end=True, save_strategy="steps", save_steps=2), []),
    "metric_for_best_model": (lambda: dict(metric_for_best_model="loss", save_strategy="steps", save_steps=2,
                                           save_total_limit=1), []),
    "save_strategy": (_save_strategy_best, []),
    "lr_scheduler_type": (lambda: dict(lr_scheduler_type="reduce_lr_on_plateau"), []),
    "EarlyStoppingCallback": (dict, [lambda: transformers.EarlyStoppingCallback(early_stopping_patience=1)]),
    "EarlyStoppingCallback class": (dict, [lambda: transformers.EarlyStoppingCallback]),
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_a_trainer_selecting_on_admitted_rows_is_refused_when_built(tmp_path: Path, tiny_model: Path, setting: str):
    arguments, callbacks = SETTINGS[setting]
    error = _refused(tmp_path, tiny_model, lambda run: _trainer(
        run, args=_evaluating(tmp_path, **arguments()), eval_dataset=_admitted(run),
        callbacks=[c() for c in callbacks]), setting.split()[0])
    assert "eval_dataset: 8 of 8 rows" in error.detail


def test_a_dict_of_eval_datasets_one_of_them_admitted_is_refused(tmp_path: Path, tiny_model: Path):
    error = _refused(tmp_path, tiny_model, lambda run: _trainer(
        run, args=_evaluating(tmp_path, load_best_model_at_end=True, metric_for_best_model="eval_held_loss",
                              save_strategy="steps", save_steps=2),
        eval_dataset={"held": _held_out(run), "train_copy": _admitted(run, "sens", 6, mask=False)}),
        "eval_dataset['train_copy']: 6 of 6 rows")
    assert "'held'" not in error.detail


def test_rows_in_the_tasks_own_form_are_compared_by_row_digest(tmp_path: Path, tiny_model: Path):
    """Untokenized rows (a `datasets.Dataset` of text and label, whitespace changed) are compared as examples."""
    import datasets

    def build(run):
        rows = [{"text": "  " + r["text"].replace(" ", "   "), "label": r["label"]}
                for r in _rows(run.config.data_dir / "pub.jsonl")[:5]]
        held = [{"text": f"{WORDS[9 + i % 8]} {WORDS[i % 9]} film is", "label": i % 2} for i in range(3)]
        return _trainer(run, args=_evaluating(tmp_path, load_best_model_at_end=True, save_strategy="steps",
                                              save_steps=2),
                        eval_dataset=datasets.Dataset.from_list(held + rows))

    _refused(tmp_path, tiny_model, build, "eval_dataset: 5 of 8 rows")


def test_rows_that_cannot_be_checked_are_refused_when_evaluation_selects(tmp_path: Path, tiny_model: Path):
    _refused(tmp_path, tiny_model, lambda run: _trainer(
        run, args=_evaluating(tmp_path, load_best_model_at_end=True, save_strategy="steps", save_steps=2),
        eval_dataset=[{"features": [0.5, 0.25], "labels": 1}] * 3), "cannot check")


def test_an_early_stopping_callback_added_later_is_refused_and_not_added(tmp_path: Path, tiny_model: Path):
    def build(run):
        trainer = _trainer(run, args=_evaluating(tmp_path), eval_dataset=_admitted(run))
        try:
            trainer.add_callback(transformers.EarlyStoppingCallback(early_stopping_patience=1))
        finally:
            assert not any(isinstance(c, transformers.EarlyStoppingCallback)
                           for c in trainer.callback_handler.callbacks)

    _refused(tmp_path, tiny_model, build, "EarlyStoppingCallback")


def test_evaluate_on_admitted_rows_is_refused_while_a_selection_setting_is_on(tmp_path: Path, tiny_model: Path):
    log = _Log()

    def build(run):
        trainer = _trainer(run, args=_evaluating(tmp_path, load_best_model_at_end=True, save_strategy="steps",
                                                 save_steps=2),
                           eval_dataset=_held_out(run), callbacks=[log])
        try:
            trainer.evaluate(eval_dataset=_admitted(run))
        finally:
            assert not any("eval_loss" in entry for entry in log.logs)  # refused before it evaluated

    _refused(tmp_path, tiny_model, build, "load_best_model_at_end")


class _Stop(transformers.TrainerCallback):
    """A callback of the user's own that acts on an evaluation: stops training, or saves a checkpoint."""

    def __init__(self, event: str, flag: str) -> None:
        self.event, self.flag = event, flag

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self.event == "on_evaluate":
            setattr(control, self.flag, True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.event == "on_log" and "eval_loss" in (logs or {}):
            setattr(control, self.flag, True)


class _AtStep(transformers.TrainerCallback):
    """The ledger and the weights after each step, before that step's evaluation."""

    def __init__(self, run, url: str) -> None:
        self.run, self.url = run, url
        self.steps: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)
        self.ledger, self.weights = snapshot(self.url), _trainable(self.run)


@pytest.mark.parametrize("event, flag", [("on_evaluate", "should_training_stop"), ("on_log", "should_training_stop"),
                                         ("on_evaluate", "should_save")])
def test_a_callback_acting_on_an_evaluation_of_admitted_rows_is_refused_at_that_evaluation(
        tmp_path: Path, tiny_model: Path, event: str, flag: str):
    corpus = _corpus(tmp_path, "custom")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 6), corpus.url, insecure_seed=1, **QUIET) as run:
        at = _AtStep(run, corpus.url)
        trainer = _trainer(run, args=_evaluating(tmp_path), eval_dataset=_admitted(run),
                           callbacks=[at, _Stop(event, flag)])
        with pytest.raises(ConfigError) as refused:
            trainer.train()
        assert refused.value.code is Code.SELECTION_ADMITTED and flag in refused.value.detail, refused.value
        assert "eval_dataset: 8 of 8 rows" in refused.value.detail
        assert at.steps == [1, 2]  # refused at the first evaluation: no step after it
        assert _same(at.weights, run) and snapshot(corpus.url) == at.ledger
        assert run.result.adapter_sha256 is None
    assert snapshot(corpus.url) == at.ledger  # no run entry: nothing was released
    assert "run" not in verify_ledger(corpus.url).by_kind


def test_evaluation_that_selects_nothing_stays_allowed_on_admitted_rows(tmp_path: Path, tiny_model: Path):
    corpus = _corpus(tmp_path, "logging")
    log = _Log()
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 4), corpus.url, insecure_seed=1, **QUIET) as run:
        trainer = _trainer(run, args=_evaluating(tmp_path), eval_dataset=_admitted(run), callbacks=[log])
        trainer.train()
        assert "eval_copy_loss" in trainer.evaluate(eval_dataset={"copy": _admitted(run, "sens")})
    assert any("eval_loss" in entry for entry in log.logs)
    assert verify_ledger(corpus.url).by_kind["run"] == 1


def test_a_held_out_eval_set_selects_the_best_checkpoint_and_the_run_is_recorded(tmp_path: Path, tiny_model: Path):
    """The demanding user's case: load_best_model_at_end and EarlyStoppingCallback on rows no contribution holds.
    The run entry records the adapter of the checkpoint the Trainer chose."""
    from safetensors.torch import load_file

    corpus = _corpus(tmp_path, "held")
    stopper = transformers.EarlyStoppingCallback(early_stopping_patience=100)
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 8), corpus.url, insecure_seed=1, **QUIET) as run:
        trainer = _trainer(run, args=_evaluating(tmp_path, load_best_model_at_end=True, save_strategy="steps",
                                                 save_steps=2, metric_for_best_model="loss"),
                           eval_dataset=_held_out(run), callbacks=[stopper])
        trainer.train()
        assert trainer.state.best_model_checkpoint is not None and trainer.state.best_metric is not None
        assert sum("eval_loss" in entry for entry in trainer.state.log_history) >= 2  # every 2 steps
        assert run.result.adapter_sha256 is not None
        best = load_file(str(Path(trainer.state.best_model_checkpoint) / "adapter_model.safetensors"))
    saved = load_file(str(corpus.dir / "adapter" / "adapter_model.safetensors"))
    assert saved.keys() == best.keys() and all(torch.equal(saved[k], best[k]) for k in saved)
    assert verify_ledger(corpus.url).by_kind["run"] == 1


def test_a_causal_lm_trainer_selecting_on_admitted_rows_is_refused(tmp_path: Path):
    """TRL's SFTTrainer given the admitted prompt/completion rows (whitespace changed), and a Trainer given them
    tokenized as a user would (prompt and completion as one text, no EOS): both refused before anything moved."""
    trl = pytest.importorskip("trl")
    import datasets

    from govtrain.integrations.hf import GovernedSFTTrainer
    from tests import causal_models
    from tests.test_causal_lm import _contribution, _run_toml
    from tests.test_causal_lm import _rows as lm_rows
    from tests.test_hf_trainer import _corpus_lm

    model = causal_models.save(tmp_path / "tiny-llama", "llama", layers=6)
    corpus = _corpus_lm(tmp_path, "lm")
    _contribution(corpus, "pairs", lm_rows("pair", 20))
    _contribution(corpus, "texts", lm_rows("text", 20))
    settings = dict(output_dir=str(tmp_path / "sft"), use_cpu=True, report_to=[], disable_tqdm=True,
                    lr_scheduler_type="constant", eval_strategy="steps", eval_steps=2, save_strategy="steps",
                    save_steps=2, load_best_model_at_end=True)
    before = snapshot(corpus.url)
    with govtrain.GovernedRun.open(_run_toml(corpus, model, 4), corpus.url, insecure_seed=1, **QUIET) as run:
        weights = _trainable(run)
        pairs = [{"prompt": f"  {r['prompt']}", "completion": f" {r['completion']}  "} for r in lm_rows("pair", 3)]
        with pytest.raises(ConfigError) as refused:
            GovernedSFTTrainer(run, args=trl.SFTConfig(**settings, bf16=False, gradient_checkpointing=False),
                               eval_dataset=datasets.Dataset.from_list(pairs))
        assert refused.value.code is Code.SELECTION_ADMITTED and "eval_dataset: 3 of 3 rows" in refused.value.detail
        tokenized = [dict(run.tokenizer(r["text"])) for r in lm_rows("text", 4)] + \
            [dict(run.tokenizer(f"{r['prompt']} {r['completion']}")) for r in lm_rows("pair", 2)]
        with pytest.raises(ConfigError) as refused:
            GovernedTrainer(run, args=transformers.TrainingArguments(**settings), eval_dataset=tokenized)
        assert refused.value.code is Code.SELECTION_ADMITTED and "eval_dataset: 6 of 6 rows" in refused.value.detail
        assert _same(weights, run)
    assert snapshot(corpus.url) == before


def test_an_early_stop_on_held_out_rows_pauses_the_run(tmp_path: Path, tiny_model: Path):
    """EarlyStoppingCallback stops on held-out rows (here at its second evaluation: no later one can improve by
    the threshold); the run is not recorded with steps left, and opening it again resumes where it stopped."""
    corpus = _corpus(tmp_path, "early")
    config = _config(corpus, tiny_model, 12)
    stopper = transformers.EarlyStoppingCallback(early_stopping_patience=1, early_stopping_threshold=1e9)
    with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=1, **QUIET) as run:
        trainer = _trainer(run, args=_evaluating(tmp_path, metric_for_best_model="loss"), eval_dataset=_held_out(run),
                           callbacks=[stopper])
        trainer.train()
        stopped = run.steps
        assert trainer.state.global_step == 4 and stopped < 12 and run.result.adapter_sha256 is None
    assert "run" not in verify_ledger(corpus.url).by_kind
    with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=1, **QUIET) as run:
        assert run.steps == stopped


# -- review 2: selection past the checks (P2, P3, P7) ----------------------------------------------------------

TUNE_CHANGES = {  # an admitted row the model reads as itself, whose row digest differs
    "zero-width spaces": lambda row: {"text": row["text"].replace(" ", " \u200b"), "label": row["label"]},
    "upper case": lambda row: {"text": row["text"].upper(), "label": row["label"]},
    "flipped label": lambda row: {"text": row["text"], "label": 1 - row["label"]},
}


@pytest.mark.parametrize("change", sorted(TUNE_CHANGES))
def test_tune_refuses_admitted_rows_the_model_reads_as_admitted(corpus: Corpus, tiny_model: Path, change: str):
    """P3: every row of the selection file an admitted row as the tokenizer reads it (BERT's normaliser drops
    U+200B and lower-cases), or the admitted text under a flipped label (ranking trials by accuracy on it ranks
    them on the admitted rows' true labels): the tune ran and was recorded. Inputs are compared now, by digest
    and by the base model's tokens."""
    _admit(corpus, "pub")
    selection = corpus.dir / "valid.jsonl"
    selection.write_text("".join(json.dumps(TUNE_CHANGES[change](row), ensure_ascii=False) + "\n"
                                 for row in _rows(corpus.dir / "data" / "pub.jsonl")))
    before = snapshot(corpus.url)
    result = _tune(corpus, tiny_model, _grid(corpus, '"optimizer.lr" = [0.01, 0.05]'), "--id", "t", steps=2)
    assert result.exit_code == 2 and "error[selection_admitted]" in result.stderr, result.output
    assert "40 of 40 rows" in result.stderr and "valid.jsonl:1" in result.stderr, result.stderr
    assert snapshot(corpus.url) == before and not _entries(corpus.url, "spend")
    assert not (corpus.dir / "adapter").exists()


def _admitted_as(run, *, flip: bool = False, **tokenizing) -> list[dict]:
    """Admitted rows tokenized as a user may tokenize them, labels flipped or not."""
    return [dict(run.tokenizer(r["text"], **tokenizing)) | {"labels": 1 - r["label"] if flip else r["label"]}
            for r in _rows(run.config.data_dir / "pub.jsonl")[:8]]


@pytest.mark.parametrize("how", ["flipped labels", "no special tokens"])
def test_a_trainer_selecting_on_admitted_inputs_tokenized_otherwise_is_refused(tmp_path: Path, tiny_model: Path,
                                                                             how: str):
    """P2: the token check matched ids only with the same label, and only with the special tokens the run's
    encoding adds: best-checkpoint selection by accuracy on the admitted rows' true labels got through."""
    rows = {"flipped labels": dict(flip=True), "no special tokens": dict(add_special_tokens=False)}[how]
    _refused(tmp_path, tiny_model, lambda run: _trainer(
        run, args=_evaluating(tmp_path, load_best_model_at_end=True, save_strategy="steps", save_steps=2),
        eval_dataset=_admitted_as(run, **rows)), "eval_dataset: 8 of 8 rows")


class _TwoFaced(torch.utils.data.Dataset):
    """Held-out rows by `__getitem__` (what a check reads), admitted ones by `__getitems__` (what torch's
    DataLoader reads for a batch)."""

    def __init__(self, held: list[dict], admitted: list[dict]) -> None:
        self.held, self.admitted, self.batches_read = held, admitted, 0

    def __len__(self) -> int:
        return len(self.held)

    def __getitem__(self, i: int) -> dict:
        return self.held[i]

    def __getitems__(self, indices: list[int]) -> list[dict]:
        self.batches_read += 1
        return [self.admitted[i] for i in indices]


def test_the_trainer_evaluates_the_rows_it_checked(tmp_path: Path, tiny_model: Path):
    """P2: a data set serving other rows to the DataLoader than to the check was scored on admitted rows. The
    Trainer evaluates a list of the rows as read and checked: the other face is never read."""
    corpus = _corpus(tmp_path, "faces")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 4), corpus.url, insecure_seed=1, **QUIET) as run:
        data = _TwoFaced(_held_out(run), _admitted(run))
        trainer = _trainer(run, args=_evaluating(tmp_path, load_best_model_at_end=True, save_strategy="steps",
                                                 save_steps=2), eval_dataset=data)
        trainer.train()
        assert trainer.state.best_model_checkpoint is not None and run.result.adapter_sha256 is not None
    assert data.batches_read == 0
    assert verify_ledger(corpus.url).by_kind["run"] == 1


def test_a_collator_replaced_after_the_trainer_was_built_is_refused_while_evaluation_selects(
        tmp_path: Path, tiny_model: Path):
    """P2: `trainer.data_collator` replaced after construction collated admitted rows in place of the checked
    held-out ones."""
    def build(run):
        trainer = _trainer(run, args=_evaluating(tmp_path, load_best_model_at_end=True, save_strategy="steps",
                                                 save_steps=2), eval_dataset=_held_out(run))
        pad, private = transformers.DataCollatorWithPadding(run.tokenizer), _admitted(run)
        trainer.data_collator = lambda rows: pad([private[i % len(private)] for i in range(len(rows))])
        trainer.train()

    _refused(tmp_path, tiny_model, build, "data_collator was replaced")


class _Toggle(transformers.TrainerCallback):
    """Turns best-model selection on after each evaluation's check and off before the next."""

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        args.metric_for_best_model, args.greater_is_better, args.load_best_model_at_end = "loss", False, True

    def on_step_begin(self, args, state, control, **kwargs):
        args.metric_for_best_model, args.load_best_model_at_end = None, False


class _Hidden(transformers.TrainingArguments):
    """Best-model selection that reads as off to govtrain's code and as on to the Trainer's."""

    def __getattribute__(self, name):
        value = object.__getattribute__(self, name)
        if name in ("metric_for_best_model", "load_best_model_at_end") and \
                sys._getframe(1).f_globals.get("__name__", "").startswith("govtrain"):
            return None if name == "metric_for_best_model" else False
        return value


@pytest.mark.parametrize("how", ["toggled by a callback", "hidden from govtrain"])
def test_selection_settings_govtrain_never_sees_on_cannot_choose_what_is_recorded(tmp_path: Path, tiny_model: Path,
                                                                               how: str):
    """P7: a callback turned metric_for_best_model and load_best_model_at_end on in on_evaluate and off in
    on_step_begin; the Trainer chose checkpoint-4 by eval loss on admitted rows and the run recorded it. The
    settings are read again after every evaluation; and, however they read, a run whose evaluation was never
    checked is not recorded once a best checkpoint was tracked or loaded."""
    corpus = _corpus(tmp_path, "toggle")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 6), corpus.url, insecure_seed=1, **QUIET) as run:
        at = _AtStep(run, corpus.url)
        if how == "toggled by a callback":
            args, callbacks = _evaluating(tmp_path, save_strategy="steps", save_steps=2), [at, _Toggle()]
        else:
            args, callbacks = _Hidden(
                output_dir=str(tmp_path / "trainer"), use_cpu=True, logging_steps=2, lr_scheduler_type="constant",
                report_to=[], disable_tqdm=True, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4,
                save_strategy="steps", save_steps=2, load_best_model_at_end=True, metric_for_best_model="loss"), [at]
        trainer = _trainer(run, args=args, eval_dataset=_admitted(run), callbacks=callbacks)
        with pytest.raises(ConfigError) as refused:
            trainer.train()
        assert refused.value.code is Code.SELECTION_ADMITTED, refused.value
        if how == "toggled by a callback":
            assert at.steps == [1, 2] and "eval_dataset: 8 of 8 rows" in refused.value.detail
            assert _same(at.weights, run)
        else:
            assert at.steps == [1, 2, 3, 4, 5, 6] and "ran without a check" in refused.value.detail
        assert snapshot(corpus.url) == at.ledger and run.result.adapter_sha256 is None
    assert "run" not in verify_ledger(corpus.url).by_kind


# -- review 3, F5 (b): what is released is a governed step's weights, or the best checkpoint on held-out rows ---


class _PickBest(transformers.TrainerCallback):
    """Scores the model with `predict()` on admitted rows after each step, keeps the weights it liked best and
    writes them back at the end of training (no Trainer checkpoint involved)."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows, self.trainer, self.best = rows, None, None

    def on_step_end(self, args, state, control, **kwargs):
        loss = self.trainer.predict(self.rows).metrics["test_loss"]
        if self.best is None or loss < self.best[0]:
            self.best = (loss, {n: p.detach().clone() for n, p in self.trainer.model.named_parameters()
                                if p.requires_grad})

    def on_train_end(self, args, state, control, **kwargs):
        with torch.no_grad():
            for name, p in self.trainer.model.named_parameters():
                if name in self.best[1]:
                    p.copy_(self.best[1][name])


@pytest.mark.parametrize("rows", ["admitted", "held out"])
def test_a_callback_that_writes_back_the_weights_it_liked_is_refused_and_nothing_is_recorded(
        tmp_path: Path, tiny_model: Path, rows: str):
    """F5 (b): a callback scored each step with predict() on admitted rows and restored the best weights at the
    end, and the run recorded them. Predictions are recorded as evaluations are (unchecked: no selection setting is
    on, so the rows are not compared, held out or not), and weights other than the last governed step's after an
    unchecked one are refused."""
    corpus = _corpus(tmp_path, "pick")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 6), corpus.url, insecure_seed=1, **QUIET) as run:
        data = ([dict(run.tokenizer(e.text)) | {"labels": e.label} for e in run.admitted_rows.examples[:8]]
                if rows == "admitted" else _held_out(run))
        pick = _PickBest(data)
        trainer = _trainer(run, args=_arguments(tmp_path), callbacks=[pick])
        pick.trainer = trainer
        with pytest.raises(ConfigError) as refused:
            trainer.train()
        assert run.result.adapter_sha256 is None and run.steps == 6
    assert refused.value.code is Code.SELECTION_ADMITTED and "predict(test_dataset)" in refused.value.detail
    assert "the weights are not those of the last governed step" in refused.value.detail
    assert verify_ledger(corpus.url).by_kind.get("run") is None


def test_the_best_checkpoint_on_held_out_rows_is_released_when_it_is_not_the_last(tmp_path: Path, tiny_model: Path):
    """The honest reload: a metric that prefers the first evaluation makes checkpoint-2 the best of 8 steps; its
    weights, as this Trainer saved them after a governed step, are what is released and recorded."""
    from safetensors.torch import load_file

    corpus = _corpus(tmp_path, "best")
    calls = iter(range(100))
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 8), corpus.url, insecure_seed=1, **QUIET) as run:
        trainer = _trainer(run, args=_evaluating(tmp_path, load_best_model_at_end=True, save_strategy="steps",
                                                 save_steps=2, metric_for_best_model="first",
                                                 greater_is_better=True),
                           eval_dataset=_held_out(run), compute_metrics=lambda _: {"first": -next(calls)})
        trainer.train()
        assert Path(trainer.state.best_model_checkpoint).name == "checkpoint-2"
        last = load_file(str(Path(trainer.args.output_dir) / "checkpoint-8" / "adapter_model.safetensors"))
        best = load_file(str(Path(trainer.state.best_model_checkpoint) / "adapter_model.safetensors"))
    saved = load_file(str(corpus.dir / "adapter" / "adapter_model.safetensors"))
    assert all(torch.equal(saved[k], best[k]) for k in saved) and not all(torch.equal(saved[k], last[k]) for k in saved)
    assert verify_ledger(corpus.url).by_kind["run"] == 1


def test_weights_written_after_the_best_checkpoint_is_loaded_are_refused(tmp_path: Path, tiny_model: Path):
    """load_best_model_at_end on held-out rows, and a callback that writes the weights after the load: they are
    neither the last step's nor the checkpoint's, so nothing is recorded."""

    class Nudge(transformers.TrainerCallback):
        def on_train_end(self, args, state, control, model=None, **kwargs):
            with torch.no_grad():
                next(p for p in model.parameters() if p.requires_grad).add_(0.01)

    corpus = _corpus(tmp_path, "nudged")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 4), corpus.url, insecure_seed=1, **QUIET) as run:
        trainer = _trainer(run, args=_evaluating(tmp_path, load_best_model_at_end=True, save_strategy="steps",
                                                 save_steps=2, metric_for_best_model="loss"),
                           eval_dataset=_held_out(run), callbacks=[Nudge()])
        with pytest.raises(ConfigError) as refused:
            trainer.train()
    assert refused.value.code is Code.UNGOVERNED_UPDATE
    assert verify_ledger(corpus.url).by_kind.get("run") is None


# -- review 3: a causal LM scores an admitted row's opening as that row (F7) -----------------------------------

@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    """tests/causal_models.py's tiny random Llama and its word-level tokenizer (BOS, no pad token)."""
    from tests import causal_models

    return causal_models.save(tmp_path_factory.mktemp("tiny-llama"), "llama", layers=6)


def _long_texts(n: int) -> list[dict]:
    """Texts of 16 words of the tiny vocabulary (17 tokens with BOS, none unknown), so that an admitted row's first
    8 tokens are not a whole row."""
    from tests.causal_models import WORDS as LM

    return [{"text": f"the {LM[i % 9]} sat on the {LM[9 + i % 8]} mat of the dog who sat on a red mat"}
            for i in range(n)]


def _held_out_texts(n: int) -> list[dict]:
    """Held-out texts that open with an admitted row's first 6 words, then go on with their own; and texts of 7
    words that are an admitted row's opening (under `MIN_PREFIX`, an opening that many texts share)."""
    from tests.causal_models import WORDS as LM

    return [{"text": f"the {LM[i % 9]} sat on the {LM[9 + i % 8]} world is very good hello"} for i in range(n)] + \
        [{"text": f"the {LM[i % 9]} sat on the {LM[9 + i % 8]} mat"} for i in range(n)]


def _lm_corpus(tmp_path: Path) -> Corpus:
    from tests.test_causal_lm import _contribution
    from tests.test_hf_trainer import _corpus_lm

    corpus = _corpus_lm(tmp_path, "lm")
    _contribution(corpus, "texts", _long_texts(40))
    return corpus


def _tokenized(run, texts: list[dict], extra: list[int] | None = None, *, cut: int | None = None,
               pad: tuple[int, int] = (0, 0), width: int = 0) -> list[dict]:
    """Texts tokenized as a user would (BOS first), `extra` token ids appended with label -100, cut to their
    first `cut` ids, and padded left and right (to `width` ids at least) with the pad id under an attention mask
    of 0."""
    rows = []
    for row in texts:
        ids = run.tokenizer(row["text"])["input_ids"][:cut]
        labels = list(ids) + [-100] * len(extra or [])
        ids = list(ids) + list(extra or [])
        left, right = pad[0], max(pad[1], width - pad[0] - len(ids))
        rows.append({"input_ids": [run.tokenizer.pad_token_id] * left + ids + [run.tokenizer.pad_token_id] * right,
                     "attention_mask": [0] * left + [1] * len(ids) + [0] * right,
                     "labels": [-100] * left + labels + [-100] * right})
    return rows


def _lm_selecting(tmp_path: Path, **overrides) -> transformers.TrainingArguments:
    return _evaluating(tmp_path, load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=False,
                       save_strategy="steps", save_steps=2, **overrides)


def _dataset(rows: list[dict]):
    import datasets

    return datasets.Dataset.from_list(rows)


def _forked(run, last: int, *, junk: bool = False, key: str = "labels") -> list[dict]:
    """Admitted rows with their last input token replaced by `last`, their labels the admitted row's (the first
    a junk token, never scored, if `junk`), under `key`."""
    rows = []
    for row in _tokenized(run, _long_texts(8)):
        labels = row.pop("labels")
        rows.append(dict(row, input_ids=row["input_ids"][:-1] + [last],
                         **{key: ([last] + labels[1:]) if junk else labels}))
    return rows


F7_ROWS = {  # the admitted rows as a causal LM scores them, but not the same token ids -> (rows, matched, says)
    "one token appended, its label -100": lambda run, yes: (_tokenized(run, _long_texts(8), [yes]), "starts with"),
    "one token appended, padded both sides": lambda run, yes: (_tokenized(run, _long_texts(8), [yes], pad=(2, 3)),
                                                               "starts with"),
    "the first 8 tokens": lambda run, yes: (_tokenized(run, _long_texts(8), cut=9), "is the start of"),
    "the first 12 tokens, no BOS": lambda run, yes: (
        [dict(run.tokenizer(" ".join(r["text"].split()[:12]), add_special_tokens=False)) for r in _long_texts(8)],
        "is the start of"),
    "text rows with a word appended": lambda run, yes: (
        _dataset([{"text": r["text"] + " yes"} for r in _long_texts(8)]),
        "starts with"),
    # review 5: the input_ids leave the admitted row, the labels do not (the position-i logit reads ids[:i])
    "last token replaced, labels the admitted row's": lambda run, yes: (
        [dict(row, input_ids=row["input_ids"][:-1] + [yes]) for row in _tokenized(run, _long_texts(8))], "is"),
    # review 6: a junk first label (never scored) hid the fork; labels under the keys collators rename
    "last token replaced, a junk first label": lambda run, yes: (_forked(run, yes, junk=True), "is"),
    "last token replaced, labels as label_ids": lambda run, yes: (_forked(run, yes, key="label_ids"), "is"),
    "last token replaced, labels as label": lambda run, yes: (_forked(run, yes, key="label"), "is"),
    "last token an EOS, labels the admitted row's": lambda run, yes: (
        _forked(run, run.tokenizer.eos_token_id), "is the start of"),
    # review 7: labels past the last scored one change nothing: the text scored ends there
    "an admitted opening, then a token labelled -100": lambda run, yes: (
        [dict(row, input_ids=row["input_ids"] + [yes], attention_mask=row["attention_mask"] + [1],
              labels=row["labels"] + [-100]) for row in _tokenized(run, _long_texts(8), cut=12)], "is the start of"),
    "a middle token replaced, labels the admitted row's": lambda run, yes: (
        [dict(row, input_ids=row["input_ids"][:9] + [yes] + row["input_ids"][10:])
         for row in _tokenized(run, _long_texts(8))], "is the start of"),
}


@pytest.mark.parametrize("how", sorted(F7_ROWS))
def test_a_causal_lm_selecting_on_admitted_rows_by_their_opening_is_refused(tmp_path: Path, tiny_llama: Path,
                                                                          how: str):
    """F7: appending one token (label -100) to an admitted row changes none of a causal LM's earlier logits, so
    the eval loss is the admitted row's; the exact check let it through, load_best_model_at_end chose the
    checkpoint by it and the run was recorded. An admitted row's first 8 tokens or more score its first targets
    in the same way. Refused with selection_admitted when the Trainer is built: nothing moved or was written."""
    from tests.test_causal_lm import _run_toml

    corpus = _lm_corpus(tmp_path)
    before = snapshot(corpus.url)
    with govtrain.GovernedRun.open(_run_toml(corpus, tiny_llama, 6), corpus.url, insecure_seed=1, **QUIET) as run:
        yes = run.tokenizer.convert_tokens_to_ids("yes")
        rows, says = F7_ROWS[how](run, yes)
        if how.startswith("one token appended, its label"):  # the premise: the same logits on the admitted tokens
            with torch.no_grad():
                for admitted, appended in zip(_tokenized(run, _long_texts(8)), rows):
                    short = run.model(input_ids=torch.tensor([admitted["input_ids"]])).logits[0]
                    long = run.model(input_ids=torch.tensor([appended["input_ids"]])).logits[0, :len(short)]
                    assert torch.allclose(short, long, atol=1e-5, rtol=0)
        weights = _trainable(run)
        with pytest.raises(ConfigError) as refused:
            GovernedTrainer(run, args=_lm_selecting(tmp_path), eval_dataset=rows)
        assert refused.value.code is Code.SELECTION_ADMITTED, refused.value
        detail = refused.value.detail
        assert "eval_dataset: 8 of 8 rows" in detail and f"row 0 {says} a row of contribution 'texts'" in detail, detail
        assert "\n" not in detail and "evaluate on held-out rows, or turn that off" in detail
        assert _same(weights, run) and run.steps == 0 and run.result.adapter_sha256 is None
    assert snapshot(corpus.url) == before
    assert "run" not in verify_ledger(corpus.url).by_kind


def test_a_causal_lm_selecting_on_held_out_rows_with_a_short_common_opening_is_recorded(tmp_path: Path,
                                                                                      tiny_llama: Path):
    """Held-out rows that open as admitted rows do for 6 or 7 tokens (under `MIN_PREFIX`), then differ or end,
    are not admitted rows to the check: the Trainer selects on them and the run is recorded."""
    from govtrain.data.rows import MIN_PREFIX
    from tests.test_causal_lm import _run_toml

    corpus = _lm_corpus(tmp_path)
    with govtrain.GovernedRun.open(_run_toml(corpus, tiny_llama, 2), corpus.url, insecure_seed=1, **QUIET) as run:
        rows = _tokenized(run, _held_out_texts(4), width=14)
        admitted = [run.tokenizer(r["text"])["input_ids"][1:] for r in _long_texts(40)]
        for row in rows:  # each shares 6 or 7 tokens with an admitted row, and is not a whole admitted row
            ids = [t for t, on in zip(row["input_ids"], row["attention_mask"]) if on][1:]
            assert any(a[:6] == ids[:6] for a in admitted) and ids not in admitted
            assert len(ids) < MIN_PREFIX or not any(a[:len(ids)] == ids for a in admitted)
        trainer = GovernedTrainer(run, args=_lm_selecting(tmp_path), eval_dataset=rows)
        trainer.train()
        assert trainer.state.best_model_checkpoint is not None and run.result.adapter_sha256 is not None
    assert verify_ledger(corpus.url).by_kind["run"] == 1


def test_the_prefix_rule_against_a_brute_force_oracle():
    """`PrefixIndex.match` against the rule read literally, on token rows over a 3-token vocabulary (so that
    rows are openings of each other at every length), and at the threshold."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import strategies as st

    from govtrain.data.rows import MIN_PREFIX, PrefixIndex

    rows = st.lists(st.integers(0, 2), min_size=1, max_size=14).map(tuple)

    @hypothesis.settings(max_examples=300, deadline=None)
    @hypothesis.given(admitted=st.lists(rows, max_size=12), probe=rows)
    def agrees(admitted, probe):
        owners = {row: f"c{i}" for i, row in enumerate(admitted)}
        found = PrefixIndex.of(owners).match(probe)
        starts = [a for a in owners if a != probe and probe[:len(a)] == a and len(a) >= MIN_PREFIX]
        opens = [a for a in owners if a[:len(probe)] == probe] if len(probe) >= MIN_PREFIX else []
        if probe in owners:
            assert found == ("is", owners[probe])
        elif starts:
            assert found is not None and found[0] == "starts with" and any(found[1] == owners[a] for a in starts)
        elif opens:
            assert found is not None and found[0] == "is the start of" and any(found[1] == owners[a] for a in opens)
        else:
            assert found is None

    agrees()
    index = PrefixIndex.of({tuple(range(20)): "pub", (5,): "short", (5, 7, 0): "other"})
    assert index.match(tuple(range(MIN_PREFIX))) == ("is the start of", "pub")
    assert index.match(tuple(range(MIN_PREFIX - 1))) is None
    assert index.match((5, 7, 0)) == ("is", "other") and index.match((5,)) == ("is", "short")
    assert index.match((5, 7, 9)) is None  # (5,) opens it, but two words of common text refuse no held-out row
    assert index.match((*range(20), 3)) == ("starts with", "pub")
    assert index.match((*range(MIN_PREFIX), 99)) is None and index.match((*range(MIN_PREFIX),)) == \
        ("is the start of", "pub")
    assert index.match(()) is None


def _lm_tune(corpus: Corpus, model: Path, selection: list[dict]):
    from click.testing import CliRunner

    from govtrain.cli.main import cli
    from tests.test_causal_lm import _run_toml

    (corpus.dir / "selection.jsonl").write_text("".join(json.dumps(row) + "\n" for row in selection))
    grid = _grid(corpus, '"optimizer.lr" = [0.01, 0.05]', 'data = "selection.jsonl"')
    return CliRunner().invoke(cli, ["tune", "--config", str(_run_toml(corpus, model, 2)), "--grid", str(grid),
                                    "--ledger", corpus.url, "--insecure-seed", "3", "--json"])


TUNE_F7 = {  # a selection file a causal LM scores as admitted rows -> (its rows, how row 1 holds one)
    "a word appended": ([{"text": r["text"] + " yes"} for r in _long_texts(40)], "starts with"),
    "as a prompt, a completion appended": ([{"prompt": r["text"], "completion": " yes"} for r in _long_texts(40)],
                                           "starts with"),
    "an unknown word appended": ([{"text": r["text"] + " zebra"} for r in _long_texts(40)], "starts with"),
    "the first 8 words": ([{"text": " ".join(r["text"].split()[:8])} for r in _long_texts(40)], "is the start of"),
}


@pytest.mark.parametrize("how", sorted(TUNE_F7))
def test_tune_refuses_a_causal_lm_selection_file_that_scores_as_admitted_rows(corpus: Corpus, tiny_llama: Path,
                                                                              how: str):
    """F7 in `govtrain tune`: the selection file's rows compared by token ids only as they are let an admitted row
    with a word appended (or its opening) rank the trials by the admitted rows' loss. Refused before any trial."""
    from tests.test_causal_lm import _contribution

    _contribution(corpus, "texts", _long_texts(40))
    rows, says = TUNE_F7[how]
    before = snapshot(corpus.url)
    result = _lm_tune(corpus, tiny_llama, rows)
    assert result.exit_code == 2 and "error[selection_admitted]" in result.stderr, result.output
    assert "40 of 40 rows" in result.stderr and f"selection.jsonl:1 {says} a row of contribution 'texts'" in \
        result.stderr, result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("error[")] == \
        [result.stderr.strip().splitlines()[-1]]
    assert snapshot(corpus.url) == before and not _entries(corpus.url, "spend")
    assert not (corpus.dir / "adapter").exists()


def test_tune_accepts_a_causal_lm_selection_file_with_a_short_common_opening(corpus: Corpus, tiny_llama: Path):
    """The held-out rows of the Trainer case: checked, and not refused (the search itself is tested elsewhere)."""
    from govtrain.tasks import task_for
    from govtrain.train.config import load_run_config
    from govtrain.train.tune_selection import check_selection, read_selection
    from tests.test_causal_lm import _contribution, _run_toml

    _contribution(corpus, "texts", _long_texts(40))
    path = corpus.dir / "selection.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in _held_out_texts(20)))
    config = load_run_config(_run_toml(corpus, tiny_llama, 2))
    task = task_for(config.file)
    with corpus.open() as ledger:
        check_selection(ledger, config, task, read_selection(path, task, ()))
        appended = TUNE_F7["a word appended"][0][:1]  # and with one admitted row, a word appended, among them
        path.write_text("".join(json.dumps(row) + "\n" for row in _held_out_texts(20) + appended))
        with pytest.raises(ConfigError) as refused:
            check_selection(ledger, config, task, read_selection(path, task, ()))
        assert refused.value.code is Code.SELECTION_ADMITTED and "1 of 41 rows" in refused.value.detail


# -- review 4: checkpoints hold governed weights (F1); every form of input_ids is compared (F3) ------------------


class _Launder(transformers.TrainerCallback):
    """Review 4's F1: weights of its own written after a governed step and before the Trainer's save, the governed
    ones put back after it, so that load_best_model_at_end would reload the written ones."""

    def __init__(self) -> None:
        self.kept = None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % args.save_steps:
            return  # only before a save: the next draw's check would see it
        self.kept = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        with torch.no_grad():
            next(p for p in model.parameters() if p.requires_grad).fill_(7.0)

    def on_save(self, args, state, control, model=None, **kwargs):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in self.kept:
                    p.copy_(self.kept[name])


def test_weights_written_before_a_trainer_checkpoint_are_refused_at_its_save(tmp_path: Path, tiny_model: Path):
    """F1: the checkpoint's digest was taken from whatever the model held when the Trainer saved, so written
    weights passed as a governed step's and were released as the best checkpoint (the ledger verified). A save
    of weights other than the last governed step's is refused, and the digest is the run's own copy's."""
    corpus = _corpus(tmp_path, "launder")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 4), corpus.url, insecure_seed=1, **QUIET) as run:
        trainer = _trainer(run, args=_evaluating(tmp_path, load_best_model_at_end=True, save_strategy="steps",
                                                 save_steps=2, metric_for_best_model="loss"),
                           eval_dataset=_held_out(run), callbacks=[_Launder()])
        with pytest.raises(ConfigError) as refused:
            trainer.train()
        assert refused.value.code is Code.UNGOVERNED_UPDATE and "at a Trainer checkpoint" in refused.value.detail
    assert not list(Path(trainer.args.output_dir).glob("checkpoint-*"))
    assert verify_ledger(corpus.url).by_kind.get("run") is None


@pytest.mark.parametrize("form", ["tuple", "numpy ints", "numpy array", "tensor", "nested", "inputs_embeds"])
def test_admitted_input_ids_in_any_form_beside_held_out_text_are_refused(tmp_path: Path, tiny_model: Path, form: str):
    """F3: input_ids compared only as a list of Python ints; as a tuple or a list of numpy ints beside held-out
    text, the rows were checked by the text alone and the collator scored the admitted tokens (the best checkpoint
    chosen on them, the run recorded). Every form is read as token ids, and one that cannot be is refused."""
    import numpy as np

    forms = {"tuple": tuple, "numpy ints": lambda v: [np.int64(x) for x in v], "numpy array": np.array,
             "tensor": torch.tensor, "nested": lambda v: [list(v)]}
    corpus = _corpus(tmp_path, "forms")
    before = snapshot(corpus.url)
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 4), corpus.url, insecure_seed=1, **QUIET) as run:
        rows = []
        for i, row in enumerate(_admitted(run, "pub", 8)):
            disguised = {"text": f"great film is {WORDS[i]}", "label": row["labels"], "labels": row["labels"]}
            if form == "inputs_embeds":
                disguised["inputs_embeds"] = run.model.get_input_embeddings()(torch.tensor(row["input_ids"])).tolist()
            else:
                disguised["input_ids"] = forms[form](row["input_ids"])
            rows.append(disguised)
        with pytest.raises(ConfigError) as refused:
            _trainer(run, args=_evaluating(tmp_path, load_best_model_at_end=True, save_strategy="steps", save_steps=2,
                                           metric_for_best_model="loss"), eval_dataset=rows)
        assert refused.value.code is Code.SELECTION_ADMITTED
        assert ("cannot check" if form in ("nested", "inputs_embeds") else "8 of 8 rows") in refused.value.detail
    assert snapshot(corpus.url) == before


def test_a_short_admitted_causal_lm_row_refuses_no_held_out_row_that_starts_with_it(tmp_path: Path):
    """Review 4, F5: an admitted line of one or two words refused every held-out row that began with them. The
    prefix rule holds from 8 shared tokens; the short line itself is still refused."""
    from govtrain.integrations.hf import GovernedTrainer
    from tests import causal_models
    from tests.test_causal_lm import _contribution, _run_toml
    from tests.test_causal_lm import _rows as lm_rows
    from tests.test_hf_trainer import _corpus_lm

    model = causal_models.save(tmp_path / "tiny-llama", "llama", layers=6)
    corpus = _corpus_lm(tmp_path, "lm")
    _contribution(corpus, "texts", lm_rows("text", 20) + [{"text": "yes"}, {"text": "hello world"}])
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "t"), use_cpu=True, report_to=[],
                                          lr_scheduler_type="constant", eval_strategy="steps", eval_steps=2,
                                          save_strategy="steps", save_steps=2, load_best_model_at_end=True)
    with govtrain.GovernedRun.open(_run_toml(corpus, model, 4), corpus.url, insecure_seed=1, **QUIET) as run:
        for text in ("yes the red dog did sit on the mat", "hello world is good"):
            GovernedTrainer(run, args=args, eval_dataset=[dict(run.tokenizer(text))], processing_class=run.tokenizer)
        with pytest.raises(ConfigError) as refused:
            GovernedTrainer(run, args=args, eval_dataset=[dict(run.tokenizer("hello world"))],
                            processing_class=run.tokenizer)
        assert refused.value.code is Code.SELECTION_ADMITTED


def test_a_causal_lm_row_whose_labels_are_not_one_per_input_token_cannot_be_checked(tmp_path: Path,
                                                                                    tiny_llama: Path):
    """Review 7, F4: labels one longer than the input_ids were passed over, and the Trainer's collator padded the
    input_ids to them: an admitted row with its last token replaced scored the admitted row's loss. Refused as
    a row that cannot be checked while selection is on."""
    from tests.test_causal_lm import _run_toml

    corpus = _lm_corpus(tmp_path)
    before = snapshot(corpus.url)
    with govtrain.GovernedRun.open(_run_toml(corpus, tiny_llama, 6), corpus.url, insecure_seed=1, **QUIET) as run:
        yes = run.tokenizer.convert_tokens_to_ids("yes")
        rows = [dict(row, input_ids=row["input_ids"][:-1] + [yes], labels=row["labels"] + [-100])
                for row in _tokenized(run, _long_texts(8))]
        with pytest.raises(ConfigError) as refused:
            GovernedTrainer(run, args=_lm_selecting(tmp_path), eval_dataset=rows, processing_class=run.tokenizer)
        assert refused.value.code is Code.SELECTION_ADMITTED and "cannot check" in refused.value.detail
        assert "labels has" in refused.value.detail
    assert snapshot(corpus.url) == before
