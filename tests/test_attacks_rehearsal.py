"""Attacks on the budget-safety surface (the rehearsal, `--check`, consent, the output folder), one per defect an
adversarial review of it proved: each asserts the specific refusal and that nothing changed (ledger size, head and
admissions by `snapshot`; the files concerned)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import govtrain  # noqa: E402
from govtrain.errors import ConfigError  # noqa: E402
from govtrain.ledger.entries import decode_entry  # noqa: E402
from govtrain.ledger.ledger import Ledger  # noqa: E402
from govtrain.train.config import load_run_config  # noqa: E402
from govtrain.train.loop import train  # noqa: E402
from govtrain.release.artifact import adapter_sha256  # noqa: E402
from tests import run_state_keys  # noqa: E402
from govtrain.train.run import STATE_FILE  # noqa: E402
from tests.conftest import snapshot  # noqa: E402
from tests.test_api import _corpus  # noqa: E402
from tests.test_train import _config, tiny_model  # noqa: E402,F401

QUIET = {"log": lambda line: None}


def _spends(url: str) -> list[dict]:
    with Ledger.open(url) as ledger:
        return [decode_entry(e.body, seq=e.seq, kind="spend") for e in ledger.store.entries(kinds=("spend",))]


def _runs(url: str) -> list[dict]:
    with Ledger.open(url) as ledger:
        return [decode_entry(e.body, seq=e.seq, kind="run") for e in ledger.store.entries(kinds=("run",))]


def _named(corpus, model: Path, steps: int, name: str, *, run_id: str | None, extra: str = "") -> Path:
    """A RUN.toml of its own (`name`.toml, output `name`), with `run_id` or a generated one."""
    text = _config(corpus, model, steps, extra=extra).read_text().replace('output = "adapter"', f'output = "{name}"')
    text = text.replace('run_id = "test-run"', f'run_id = "{run_id}"' if run_id else "")
    path = corpus.dir / f"{name}.toml"
    path.write_text(text)
    return path


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# -- 1. a run paused on one ledger is not resumed on another ----------------------------------------------


def _paused_on_first_ledger(tmp_path: Path, model: Path):
    first, second = _corpus(tmp_path, "first"), _corpus(tmp_path, "second")
    config = load_run_config(_named(first, model, 6, "dev", run_id=None, extra="epoch_steps = 2"))
    with pytest.raises(KeyboardInterrupt):  # stopped (Ctrl-C) at step 4, its steps charged on the first ledger
        train(config, first.url, insecure_seed=1, checkpoint_every=1, interrupt_after_steps=4, **QUIET)
    assert (config.output_dir / STATE_FILE).exists() and _spends(first.url)
    return first, second, config


def test_a_run_state_of_another_ledger_is_refused(tmp_path: Path, tiny_model: Path):
    """HIGH (review of the rehearsal, 1): the same RUN.toml paused on one ledger resumed on another, which recorded
    the run entry of an adapter carrying steps only the first ledger charged."""
    first, second, config = _paused_on_first_ledger(tmp_path, tiny_model)
    with Ledger.open(first.url) as a, Ledger.open(second.url) as b:  # two ledgers, each initialised on its own
        assert a.store.entry(0).leaf_hash != b.store.entry(0).leaf_hash
    before, folder = snapshot(second.url), _files(config.output_dir)
    for confirm in (False, True):  # consent does not make another ledger's steps this one's
        with pytest.raises(ConfigError) as refused:
            train(config, second.url, insecure_seed=2, confirm=confirm, **QUIET)
        # its MAC is under the first ledger's identity (`state_key`): refused before anything in it is read
        assert refused.value.code.value in ("output_taken", "run_state_invalid") \
            and "another ledger" in refused.value.detail, refused.value.detail
    assert snapshot(second.url) == before and not _spends(second.url) and not _runs(second.url)
    assert _files(config.output_dir) == folder  # the state is left for the ledger that charged it
    result = train(config, first.url, insecure_seed=1, **QUIET)  # which resumes it
    assert result.steps == 6 and sum({s["epoch"]: s["epoch_steps"] for s in _spends(first.url)}.values()) >= 6


def test_a_run_state_that_took_steps_under_a_lease_this_ledger_never_saw_is_refused(tmp_path: Path,
                                                                                   tiny_model: Path):
    """A state edited to name this ledger (the name is no proof) resumed where its lease has no spend: refused."""
    first, second, config = _paused_on_first_ledger(tmp_path, tiny_model)
    path = config.output_dir / STATE_FILE
    state = run_state_keys.read(path, first)
    assert state["step"] >= 4
    with Ledger.open(second.url) as ledger:
        state["ledger"] = ledger.identity
    run_state_keys.write(path, state, second)  # under the second ledger's key: it reaches the lease check
    before, folder = snapshot(second.url), _files(config.output_dir)
    with pytest.raises(ConfigError) as refused:
        train(config, second.url, insecure_seed=2, confirm=True, **QUIET)
    assert refused.value.code.value == "output_taken" and "records no spend under its lease" in refused.value.detail
    assert snapshot(second.url) == before and _files(config.output_dir) == folder


# -- 2. consent is asked again at each write-ahead -----------------------------------------------------------


def test_a_run_opened_first_is_refused_where_another_run_charged_its_contributions_since(tmp_path: Path,
                                                                                        tiny_model: Path):
    """MEDIUM (2): consent was read once at open; a run opened while nothing was charged charged, unconfirmed, what
    another run charged before its first write-ahead."""
    corpus = _corpus(tmp_path, "toctou")
    first = load_run_config(_named(corpus, tiny_model, 2, "a", run_id="run-a"))
    second = load_run_config(_named(corpus, tiny_model, 2, "b", run_id="run-b"))
    with govtrain.GovernedRun.open(second, corpus.url, insecure_seed=2, **QUIET) as run_b:  # confirm=False
        assert not run_b._run.charged_before  # nothing charged yet: no consent asked
        train(first, corpus.url, insecure_seed=1, **QUIET)  # run A charges pub and sens, to the end
        assert {s["contribution_id"] for s in _spends(corpus.url) if s["run_id"] == "run-a"} == {"pub", "sens"}
        before = snapshot(corpus.url)
        with pytest.raises(ConfigError) as refused:
            for batch in run_b.batches():
                run_b.step(run_b.per_example_loss(run_b.model(**batch.inputs), batch))
        assert refused.value.code.value == "charged_before" and "run-a" in refused.value.detail
    assert snapshot(corpus.url) == before and not [s for s in _spends(corpus.url) if s["run_id"] == "run-b"]
    assert not (second.output_dir / STATE_FILE).exists()  # it never wrote spend: no state to resume
    result = train(second, corpus.url, insecure_seed=2, confirm=True, **QUIET)  # confirmed, it trains
    assert result.steps == 2 and {s["contribution_id"] for s in _spends(corpus.url) if s["run_id"] == "run-b"}


def test_a_search_is_refused_where_a_run_outside_it_charged_between_its_check_and_a_trial(tmp_path: Path,
                                                                                       tiny_model: Path):
    """MEDIUM (2, tune): the search's consent (`_charged_outside`) was read once; each trial now asks again."""
    from govtrain.train.tune import load_grid, tune
    from tests.test_tune import _grid, _valid

    corpus = _corpus(tmp_path, "tune-toctou")
    path = _config(corpus, tiny_model, 2)
    outside = load_run_config(_named(corpus, tiny_model, 2, "outside", run_id="outside"))
    _valid(corpus)
    grid = load_grid(_grid(corpus, '"optimizer.lr" = [0.01]'))
    seen: list[int] = []

    def log(line: str) -> None:  # the search has passed its check: a run outside it charges now
        if line.startswith("trial 0 (") and not seen:
            seen.append(1)
            train(outside, corpus.url, insecure_seed=5, **QUIET)

    config = load_run_config(path)
    with pytest.raises(ConfigError) as refused:
        tune(config, path, grid, corpus.url, tune_id="t", insecure_seed=3, log=log)
    assert seen and refused.value.code.value == "charged_before"
    assert {s["run_id"] for s in _spends(corpus.url)} == {"outside"}  # no trial charged


# -- 3. govtrain tune keeps out of another run's adapter folder ----------------------------------------------


def test_tune_refuses_another_runs_adapter_folder_as_its_output(tmp_path: Path, tiny_model: Path):
    """MEDIUM (3): the output-folder rule covered each trial's subfolder only; a search on a finished run's
    RUN.toml wrote trial-k.json and trial-k/ into its adapter folder, which no longer hashed as recorded."""
    from click.testing import CliRunner

    from govtrain.cli.main import cli
    from tests.test_tune import _grid, _valid

    corpus = _corpus(tmp_path, "tuned")
    path = _config(corpus, tiny_model, 2)
    finished = train(load_run_config(path), corpus.url, insecure_seed=1, **QUIET)
    adapter = corpus.dir / "adapter"
    (run_entry,) = [r for r in _runs(corpus.url) if r["run_id"] == finished.run_id]
    before, folder = snapshot(corpus.url), _files(adapter)
    _valid(corpus)
    grid = _grid(corpus, '"optimizer.lr" = [0.01]')
    tuned = CliRunner().invoke(cli, ["tune", "--config", str(path), "--grid", str(grid), "--ledger", corpus.url,
                                     "--insecure-seed", "3", "--json", "--yes", "--id", "t"])
    assert tuned.exit_code == 2 and "output_taken" in tuned.output + (tuned.stderr or "")
    assert snapshot(corpus.url) == before and _files(adapter) == folder
    assert adapter_sha256(adapter) == run_entry["adapter_sha256"]


def test_tune_refuses_another_searchs_trials_and_resumes_its_own(tmp_path: Path, tiny_model: Path):
    from govtrain.train.tune import load_grid, tune
    from tests.test_tune import _grid, _valid

    corpus = _corpus(tmp_path, "two-searches")
    path = _config(corpus, tiny_model, 2)
    config = load_run_config(path)
    _valid(corpus)
    grid = load_grid(_grid(corpus, '"optimizer.lr" = [0.01]'))
    tune(config, path, grid, corpus.url, tune_id="one", insecure_seed=3, **QUIET)
    before, folder = snapshot(corpus.url), _files(config.output_dir)
    with pytest.raises(ConfigError) as refused:  # another search into the first one's folder
        tune(config, path, grid, corpus.url, tune_id="two", insecure_seed=3, confirm=True, **QUIET)
    assert refused.value.code.value == "output_taken" and "trial-0.json" in refused.value.detail
    assert snapshot(corpus.url) == before and _files(config.output_dir) == folder
    with pytest.raises(ConfigError) as again:  # the same search again: recorded once (not an output refusal)
        tune(config, path, grid, corpus.url, tune_id="one", insecure_seed=3, **QUIET)
    assert again.value.code.value == "tune_exists"


# -- 4. the rehearsal runs one chunk of the real size ------------------------------------------------------


@pytest.mark.parametrize("extra, full", [("physical_batch = 7\nexpected_batch_size = 16", 7),
                                         ("expected_batch_size = 16", 32)])  # 16 + 4 * sqrt(16)
def test_a_loop_that_fails_only_at_the_real_chunk_size_fails_on_the_rehearsal(tmp_path: Path, tiny_model: Path,
                                                                              extra: str, full: int):
    """MEDIUM (4): the rehearsal had max(3, classes) rows, so a failure that depends on the chunk's size (out of
    memory on the device; here a stand-in) passed it and was raised at the first real chunk, an epoch charged."""
    corpus = _corpus(tmp_path, f"oom-{full}")
    config = load_run_config(_config(corpus, tiny_model, 4, extra=extra))
    before = snapshot(corpus.url)
    sizes: list[tuple[bool, int, int]] = []
    with pytest.raises(MemoryError):
        with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=1, **QUIET) as run:
            for batch in run.batches():
                sizes.append((batch.rehearsal, len(batch), batch.inputs["input_ids"].shape[1]))
                if len(batch) > 3:
                    raise MemoryError("stand-in for torch.OutOfMemoryError at the real chunk size")
                run.step(run.per_example_loss(run.model(**batch.inputs), batch))
    assert all(rehearsal for rehearsal, _, _ in sizes) and sizes[-1][1:] == (full, 16)  # max_length tokens
    assert not run.rehearsed and run.steps == 0
    assert snapshot(corpus.url) == before and not _spends(corpus.url)
    assert not (config.output_dir / STATE_FILE).exists()


# -- 5. the batch-coupling comparison runs on the rehearsal only, and says so ---------------------------------


def test_the_batch_coupling_check_is_documented_as_the_rehearsals_only():
    """LOW (5): rehearsal.py said every real step reruns every check, but `check_alone` (batch_coupled) runs on the
    rehearsal only: a loop that couples its losses on real batches alone is not refused by it. The claim is gone
    and the limit is stated where the rehearsal is described."""
    from govtrain.train import rehearsal

    docs = (Path(__file__).parents[1] / "docs" / "budget-safety.md").read_text()
    for text in (rehearsal.__doc__, docs):
        flat = " ".join(text.split())
        assert "runs every check again" not in flat
        assert "rehearsal only" in flat


# -- 6. a check through the Trainer writes no folder ---------------------------------------------------------


def test_a_check_through_the_trainer_writes_no_folder(tmp_path: Path, tiny_model: Path):
    """LOW (6): GovernedRun.open(..., check=True) + GovernedTrainer(run).train() created <training.output>-trainer
    (the default TrainingArguments' output_dir)."""
    from govtrain.integrations.hf import GovernedTrainer

    corpus = _corpus(tmp_path, "hfcheck")
    config = load_run_config(_config(corpus, tiny_model, 2))
    sibling = config.output_dir.with_name(config.output_dir.name + "-trainer")
    before, listing = snapshot(corpus.url), sorted(p.name for p in config.output_dir.parent.iterdir())
    with govtrain.GovernedRun.open(config, corpus.url, check=True, **QUIET) as run:
        trainer = GovernedTrainer(run)
        assert trainer.train() is None and run.rehearsed
    assert not Path(trainer.args.output_dir).exists()  # the check's temporary folder, removed
    assert snapshot(corpus.url) == before and not config.output_dir.exists() and not sibling.exists()
    assert sorted(p.name for p in config.output_dir.parent.iterdir()) == listing
