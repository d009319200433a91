"""Issue 21, item 2: budget spent by accident. A rehearsal of synthetic rows runs the loop (`govtrain train`'s, a
user's own over `run.batches()`, the Trainer's training step) before the first write-ahead, moving nothing and
writing nothing; `--check` (`check=True`) stops there with the plan; charging contributions other runs charged
needs consent (`--yes`, `confirm=True`); a fresh run starts in an empty output folder; a scratch ledger costs
the real one nothing.

The adversary of the rehearsal is the user's loop: it may tell the rehearsal apart (`batch.rehearsal`) and do
anything with it. What each test proves: the rehearsal's rows are never a contribution's, and nothing it computes
reaches the weights, the update's state, the ledger or the output folder; a loop that fails on it has spent
nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402

import govtrain  # noqa: E402
from govtrain.cli.main import cli  # noqa: E402
from govtrain.errors import Code, ConfigError  # noqa: E402
from govtrain.release.artifact import adapter_sha256  # noqa: E402
from govtrain.train.config import load_run_config  # noqa: E402
from govtrain.release.tree import tree_sha256  # noqa: E402
from govtrain.train.run import STATE_FILE  # noqa: E402
from govtrain.verify.verifier import verify_ledger  # noqa: E402
from tests.conftest import Corpus, snapshot  # noqa: E402
from tests.test_api import QUIET, _corpus, _same, _spend, _trainable, past_rehearsal  # noqa: E402
from tests.test_train import _admit, _config, tiny_model  # noqa: E402,F401

ROOT = Path(__file__).resolve().parents[1]


def _stored(corpus: Corpus) -> dict[str, bytes]:
    """The ledger's database and its write-ahead log, byte for byte (SQLite's shared-memory index, `-shm`, changes
    on reads too)."""
    path = Path(corpus.url.removeprefix("sqlite:///"))
    files = {p.name: p.read_bytes() for p in sorted(path.parent.glob(path.name + "*")) if not p.name.endswith("-shm")}
    assert files
    return files


def _folder(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()} \
        if path.exists() else {}


def _honest(run, batch) -> float | None:
    return run.step(run.per_example_loss(run.model(**batch.inputs), batch))


def _run_all(run) -> None:
    for batch in run.batches():
        _honest(run, batch)
    run.save()


def _optimizer_state(run) -> dict:
    import copy

    return copy.deepcopy(run._run.update.state_dict())


def _same_state(a, b) -> bool:
    from govtrain.train.weights import same_state

    return same_state(a, b)


# -- the rehearsal ---------------------------------------------------------------------------------------------


def test_the_rehearsal_comes_first_moves_nothing_and_writes_nothing(tmp_path: Path, tiny_model: Path):
    """The first logical step a loop is handed is the rehearsal: synthetic rows (none an admitted row), of several
    widths, marked `batch.rehearsal`; stepping it leaves the weights, the update's state, torch's random state,
    every `.grad`, the ledger's bytes and the output folder exactly as they were. The first epoch's spend is written
    only when the loop asks for the batch after it."""
    corpus = _corpus(tmp_path, "first")
    config = _config(corpus, tiny_model, 3, extra="physical_batch = 2")
    with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=1, **QUIET) as run:
        admitted = {e.text for e in run.admitted_rows.examples}
        weights, state, stored = _trainable(run), _optimizer_state(run), _stored(corpus)
        output, random = _folder(corpus.dir / "adapter"), torch.get_rng_state()
        batches = run.batches()
        widths, seen = set(), []
        batch = next(batches)
        while batch.rehearsal:
            assert run.sampling_rate is None and not run.rehearsed  # nothing charged, nothing written ahead
            texts = run.tokenizer.batch_decode(batch.inputs["input_ids"], skip_special_tokens=True)
            assert not admitted & set(texts)
            widths.add(int(batch.inputs["input_ids"].shape[1]))
            seen.append((batch.chunk, batch.chunks, len(batch)))
            torch.rand(3)  # the loop's own use of torch's random state is put back too
            assert _honest(run, batch) is None  # nothing stepped: no loss to report
            assert _same(weights, run) and run.steps == 0
            batch = next(batches)
        assert run.rehearsed and len(widths) > 1  # padding ran
        assert seen[-1][2] == 1 and [c for c, _, _ in seen] == list(range(seen[0][1]))  # last: one row alone
        # what the rehearsal left, checked at the first real batch, after the first epoch's write-ahead
        assert _same(weights, run) and _same_state(_optimizer_state(run), state)
        assert torch.equal(torch.get_rng_state(), random) and all(p.grad is None for p in run.model.parameters())
        assert _folder(corpus.dir / "adapter").keys() - output.keys() == {STATE_FILE}  # the epoch's plan, saved
        assert _stored(corpus) != stored and _spend(corpus.url)  # now the spend is written: not before
        _honest(run, batch)
        batches.close()


@pytest.mark.parametrize("mechanism", ["dpsgd", "prism", "dp-muon"])
def test_the_rehearsal_moves_no_weight_or_update_state_under_any_mechanism(tmp_path: Path, tiny_model: Path,
                                                                          mechanism: str):
    """On a run resumed after a step (the update's moments, PRISM's and DP-Muon's state exist), the rehearsal
    leaves the weights, the whole update state and the ledger's bytes as they were, under every mechanism."""
    from tests.test_hf_trainer import MECHANISMS

    corpus = _corpus(tmp_path, "bytes")
    config = _config(corpus, tiny_model, 3, mechanism, MECHANISMS[mechanism])
    with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=1, **QUIET) as run:
        for batch in run.batches():
            if _honest(run, batch) is not None:
                break  # one step taken; leaving the block keeps the state
    with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=1, **QUIET) as run:
        assert run.steps == 1
        weights, state = _trainable(run), _optimizer_state(run)
        stored, output = _stored(corpus), _folder(corpus.dir / "adapter")
        batches = run.batches()
        for batch in batches:
            assert batch.rehearsal
            _honest(run, batch)
            if run.rehearsed:
                break
        batches.close()
        assert _same(weights, run) and _same_state(_optimizer_state(run), state)
        assert _stored(corpus) == stored and _folder(corpus.dir / "adapter") == output


def _mean_loss(run, batch):
    return run.step(run.per_example_loss(run.model(**batch.inputs), batch).mean())


def _double_forward(run, batch):
    run.model(**batch.inputs)
    return _honest(run, batch)


def _own_exception(run, batch):
    out = run.model(**batch.inputs)
    raise KeyError("labels")  # a bug of the loop's own, after its forward


def _normalised_over_the_batch(run, batch):
    losses = run.per_example_loss(run.model(**batch.inputs), batch)
    return run.step(losses / losses.detach().sum())  # "a weighted mean": each loss depends on the others


def _summed_not_averaged(run, batch):
    import torch.nn.functional as F

    out = run.model(**batch.inputs)
    return run.step(F.cross_entropy(out.logits, batch.targets, reduction="none") * len(batch))


def _backward_in_the_loop(run, batch):
    losses = run.per_example_loss(run.model(**batch.inputs), batch)
    losses.sum().backward()
    return run.step(losses)


def _squeezed(run, batch):
    import torch.nn.functional as F

    out = run.model(**batch.inputs)
    losses = F.cross_entropy(out.logits, batch.targets, reduction="none")[:, None]  # [B, 1]
    return run.step(losses.squeeze())  # a scalar for a chunk of one row


BUGS = {"a mean loss": (_mean_loss, ValueError, None),
        "a double forward": (_double_forward, ConfigError, Code.UNGOVERNED_BATCH),
        "an exception of the loop's": (_own_exception, KeyError, None),
        "a loss normalised over the batch": (_normalised_over_the_batch, ConfigError, Code.BATCH_COUPLED),
        "a loss scaled by the batch size": (_summed_not_averaged, ConfigError, Code.BATCH_COUPLED),
        "a backward in the loop": (_backward_in_the_loop, ConfigError, Code.UNGOVERNED_BATCH),
        "a scalar loss for a batch of one": (_squeezed, ValueError, None)}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_a_loop_that_crashes_at_its_first_step_charges_nothing(tmp_path: Path, tiny_model: Path, bug: str):
    """The issue's two scripts (a mean loss, a double forward) each charged a full ledger epoch before they
    crashed at step 1. Each ordinary bug now fails on the rehearsal: the ledger holds no spend for the run, the
    output folder no state or adapter, and the weights are as loaded."""
    step, error, code = BUGS[bug]
    corpus = _corpus(tmp_path, "bug")
    before = snapshot(corpus.url)
    with pytest.raises(error) as raised:
        with govtrain.GovernedRun.open(_config(corpus, tiny_model, 4), corpus.url, insecure_seed=1, **QUIET) as run:
            weights = _trainable(run)
            for batch in run.batches():  # the user's loop
                step(run, batch)
    assert code is None or raised.value.code is code, raised.value
    assert snapshot(corpus.url) == before and not _spend(corpus.url)
    assert not (corpus.dir / "adapter" / STATE_FILE).exists()
    assert not (corpus.dir / "adapter" / "adapter_config.json").exists()
    assert _same(weights, run)
    # fixed, the same config trains: the run that failed never took its id
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 4), corpus.url, insecure_seed=1, **QUIET) as run:
        _run_all(run)
    assert {row[0] for row in _spend(corpus.url)} == {"test-run"}


def test_an_honest_loop_that_branches_on_the_rehearsal_trains_as_before(tmp_path: Path, tiny_model: Path):
    """A loop that needs to know (`batch.rehearsal`, e.g. to skip its own logging) may tell; the run it trains is
    the run `govtrain train` trains on the same seed, rehearsal included."""
    from govtrain.train.loop import train

    cli_corpus, api = _corpus(tmp_path, "cli"), _corpus(tmp_path, "api")
    train(load_run_config(_config(cli_corpus, tiny_model, 4)), cli_corpus.url, insecure_seed=3, **QUIET)
    logged = []
    with govtrain.GovernedRun.open(_config(api, tiny_model, 4), api.url, insecure_seed=3, **QUIET) as run:
        for batch in run.batches():
            loss = _honest(run, batch)
            if not batch.rehearsal and loss is not None:
                logged.append(run.steps)
        run.save()
    assert logged and _spend(api.url) == _spend(cli_corpus.url)
    assert adapter_sha256(api.dir / "adapter") == adapter_sha256(cli_corpus.dir / "adapter")  # the cards differ


# -- the rehearsal as a surface: the loop cannot use it to leak or to move weights ------------------------------


def test_weights_moved_during_the_rehearsal_are_refused_before_any_spend(tmp_path: Path, tiny_model: Path):
    corpus = _corpus(tmp_path, "move")
    before = snapshot(corpus.url)
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 4), corpus.url, insecure_seed=1, **QUIET) as run:
        batches = run.batches()
        batch = next(batches)
        assert batch.rehearsal
        losses = run.per_example_loss(run.model(**batch.inputs), batch)
        with torch.no_grad():
            next(p for p in run.model.parameters() if p.requires_grad).add_(0.5)
        with pytest.raises(ConfigError) as refused:
            run.step(losses)
            for batch in batches:
                _honest(run, batch)
        assert refused.value.code is Code.UNGOVERNED_UPDATE
        batches.close()
        with pytest.raises(ConfigError) as refused:
            next(run.batches())
        assert refused.value.code in (Code.UNGOVERNED_UPDATE, Code.STEP_FAILED)
    assert snapshot(corpus.url) == before and not _spend(corpus.url)


def test_a_real_batch_marked_as_a_rehearsal_is_charged_and_trained_as_drawn(tmp_path: Path, tiny_model: Path):
    """The marker is read-only, and the run's own record of the draw decides: a real batch written to say it is
    the rehearsal is still clipped, noised, charged and counted; the rehearsal's gradients never leave it."""
    corpus = _corpus(tmp_path, "marker")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 2), corpus.url, insecure_seed=1, **QUIET) as run:
        batches = run.batches()
        batch = past_rehearsal(run, batches)
        with pytest.raises(AttributeError):
            batch.rehearsal = True  # type: ignore[misc]
        object.__setattr__(batch, "_rehearsal", True)
        weights = _trainable(run)
        loss = _honest(run, batch)
        assert loss is not None and run.steps == 1 and not _same(weights, run)
        batches.close()
    assert _spend(corpus.url)


def test_the_rehearsal_rows_are_drawn_again_where_they_equal_an_admitted_example(tiny_model: Path):
    import transformers

    from govtrain.tasks import Classification
    from govtrain.train.rehearsal import synthetic_examples

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model)
    task = Classification(num_labels=2)
    first = synthetic_examples(task, tokenizer, 16, 3, seed=b"fixed")
    again = synthetic_examples(task, tokenizer, 16, 3, seed=b"fixed", admitted=first)
    assert first == synthetic_examples(task, tokenizer, 16, 3, seed=b"fixed")  # the seed fixes the draw
    assert not set(first) & set(again) and len({len(e.text.split()) for e in again}) > 1


# -- the Trainer ----------------------------------------------------------------------------------------------


def test_the_trainers_training_step_runs_the_rehearsal_first(tmp_path: Path, tiny_model: Path):
    """A Trainer subclass's own per_example_loss (here a mean: the bug) fails on the rehearsal, before any spend;
    an honest one sees the rehearsal first and trains."""
    import transformers

    from govtrain.integrations.hf import GovernedTrainer

    class Mean(GovernedTrainer):
        def per_example_loss(self, outputs, batch):
            return super().per_example_loss(outputs, batch).mean()

    class Seeing(GovernedTrainer):
        seen: list = []

        def per_example_loss(self, outputs, batch):
            Seeing.seen.append(batch.rehearsal)
            return super().per_example_loss(outputs, batch)

    arguments = dict(output_dir=str(tmp_path / "trainer"), use_cpu=True, save_strategy="no", report_to=[],
                     disable_tqdm=True)
    corpus = _corpus(tmp_path, "trainer")
    before = snapshot(corpus.url)
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 3), corpus.url, insecure_seed=1, **QUIET) as run:
        with pytest.raises(ValueError, match="one loss per example"):
            Mean(run, args=transformers.TrainingArguments(**arguments)).train()
    assert snapshot(corpus.url) == before and not _spend(corpus.url)
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 3), corpus.url, insecure_seed=1, **QUIET) as run:
        Seeing(run, args=transformers.TrainingArguments(**arguments)).train()
        assert run.steps == 3 and run.result.adapter_sha256 is not None
    assert Seeing.seen[0] is True and Seeing.seen[-1] is False and Seeing.seen.count(True) >= 2


# -- --check and check=True -----------------------------------------------------------------------------------


def test_check_runs_the_rehearsal_prints_the_plan_and_writes_nothing(tmp_path: Path, tiny_model: Path):
    corpus = _corpus(tmp_path, "check")
    config = _config(corpus, tiny_model, 12)
    stored = _stored(corpus)
    result = CliRunner().invoke(cli, ["train", "--config", str(config), "--ledger", corpus.url, "--check",
                                      "--insecure-seed", "1"])
    assert result.exit_code == 0, result.output
    assert "rehearsal passed" in result.stdout and "check passed; nothing was spent or written" in result.stdout
    for words in ("12 of 12 steps", "q = ", "ε before", "ε after", "public", "sensitive"):
        assert words in result.stdout, result.stdout
    assert _stored(corpus) == stored and not (corpus.dir / "adapter").exists()

    as_json = CliRunner().invoke(cli, ["train", "--config", str(config), "--ledger", corpus.url, "--check", "--json"])
    assert as_json.exit_code == 0, as_json.output
    plan = json.loads(as_json.stdout)["plan"]
    assert plan["steps"] == 12 and plan["classes"]["public"]["eps_before"] == 0
    assert 0 < plan["classes"]["public"]["eps_after"] and plan["charged_before"] == 0
    assert _stored(corpus) == stored and not (corpus.dir / "adapter").exists()

    # the API: the rehearsal only, then the plan; save() saves and records nothing
    lines: list[str] = []
    with govtrain.GovernedRun.open(config, corpus.url, check=True, log=lines.append) as run:
        handed = [batch.rehearsal for batch in run.batches() if _honest(run, batch) is None]
        assert handed and all(handed) and run.steps == 0
        assert run.save().steps == 0 and run.plan.classes["public"].eps_after == plan["classes"]["public"]["eps_after"]
    assert any("check passed" in line for line in lines)
    assert _stored(corpus) == stored and not (corpus.dir / "adapter").exists()

    # a loop bug found by the check, as training would find it: exit as the error says, nothing written
    with pytest.raises(ValueError):
        with govtrain.GovernedRun.open(config, corpus.url, check=True, **QUIET) as run:
            for batch in run.batches():
                _mean_loss(run, batch)
    assert _stored(corpus) == stored and not (corpus.dir / "adapter").exists()

    # and the real run afterwards charges what the plan said
    train = CliRunner().invoke(cli, ["train", "--config", str(config), "--ledger", corpus.url, "--insecure-seed", "1",
                                     "--json"])
    assert train.exit_code == 0, train.output
    assert json.loads(train.stdout)["eps_by_class"]["public"][-1] == pytest.approx(
        plan["classes"]["public"]["eps_after"], abs=1e-6)


def test_the_trainer_checks_with_the_run(tmp_path: Path, tiny_model: Path):
    import transformers

    from govtrain.integrations.hf import GovernedTrainer

    corpus = _corpus(tmp_path, "trainer-check")
    stored = _stored(corpus)
    lines: list[str] = []
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 3), corpus.url, check=True, log=lines.append) as run:
        trainer = GovernedTrainer(run, args=transformers.TrainingArguments(
            output_dir=str(tmp_path / "trainer"), use_cpu=True, save_strategy="no", report_to=[]))
        assert trainer.train() is None and run.steps == 0 and run.rehearsed
    assert any("check passed" in line for line in lines) and any("rehearsal passed" in line for line in lines)
    assert _stored(corpus) == stored and not (corpus.dir / "adapter").exists()


# -- consent to charge contributions other runs charged -------------------------------------------------------


def _other(corpus: Corpus, model: Path, steps: int, run_id: str, output: str) -> Path:
    text = _config(corpus, model, steps).read_text().replace('run_id = "test-run"', f'run_id = "{run_id}"')
    path = corpus.dir / f"{run_id}.toml"
    path.write_text(text.replace('output = "adapter"', f'output = "{output}"'))
    return path


def test_charging_contributions_another_run_charged_needs_consent(tmp_path: Path, tiny_model: Path):
    corpus = _corpus(tmp_path, "consent")
    first = _other(corpus, tiny_model, 12, "first", "first")
    result = CliRunner().invoke(cli, ["train", "--config", str(first), "--ledger", corpus.url, "--insecure-seed", "1"])
    assert result.exit_code == 0, result.output  # a fresh ledger: nothing charged before, nothing to confirm

    second = _other(corpus, tiny_model, 4, "second", "second")
    before, stored = snapshot(corpus.url), _stored(corpus)
    refused = CliRunner().invoke(cli, ["train", "--config", str(second), "--ledger", corpus.url])
    assert refused.exit_code == 2, refused.output
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith("error[charged_before]: 2 contribution(s)") and "--yes" in line
    assert "public ε " in line and "sensitive ε " in line and " -> " in line  # ε before and after, per class
    assert snapshot(corpus.url) == before and not (corpus.dir / "second" / STATE_FILE).exists()
    with pytest.raises(ConfigError) as api:
        govtrain.GovernedRun.open(second, corpus.url, **QUIET)
    assert api.value.code is Code.CHARGED_BEFORE and snapshot(corpus.url) == before

    check = CliRunner().invoke(cli, ["train", "--config", str(second), "--ledger", corpus.url, "--check"])
    assert check.exit_code == 0 and "training needs --yes" in check.stdout, check.output  # a check spends nothing
    assert _stored(corpus) == stored

    confirmed = CliRunner().invoke(cli, ["train", "--config", str(second), "--ledger", corpus.url, "--yes"])
    assert confirmed.exit_code == 0, confirmed.output
    assert "charged by other runs before; charging them again as confirmed" in confirmed.stdout
    assert {row[0] for row in _spend(corpus.url)} == {"first", "second"}
    verify_ledger(corpus.url)


def test_a_run_resuming_its_own_id_keeps_the_consent_it_started_with(tmp_path: Path, tiny_model: Path):
    """Run A stops with its state kept; run B (confirmed) charges the same contributions; A, which needed no
    consent when it started, needs it to resume (what it would charge grew while it was paused), and B, confirmed
    when it started, resumes without a new one: the run state keeps the consent."""
    from tests.conftest import snapshot

    corpus = _corpus(tmp_path, "resume")
    first = _other(corpus, tiny_model, 14, "first", "first")
    with govtrain.GovernedRun.open(first, corpus.url, insecure_seed=1, **QUIET) as run:
        for batch in run.batches():
            _honest(run, batch)
            if run.steps == 3:  # after the step's last chunk (an empty draw's step returns no loss, and counts)
                break
    second = _other(corpus, tiny_model, 4, "second", "second")
    with govtrain.GovernedRun.open(second, corpus.url, confirm=True, **QUIET) as run:
        for batch in run.batches():
            _honest(run, batch)
            if run.steps == 2:
                break
    before = snapshot(corpus.url)
    with pytest.raises(ConfigError) as refused:
        govtrain.GovernedRun.open(first, corpus.url, insecure_seed=1, **QUIET)
    assert refused.value.code.value == "charged_before" and snapshot(corpus.url) == before
    with govtrain.GovernedRun.open(first, corpus.url, insecure_seed=1, confirm=True, **QUIET) as run:
        assert run.steps == 3
        _run_all(run)
    with govtrain.GovernedRun.open(second, corpus.url, **QUIET) as run:  # confirmed when it started
        assert run.steps == 2
        _run_all(run)
    assert verify_ledger(corpus.url).by_kind["run"] == 2


def test_a_tune_asks_consent_for_what_runs_outside_it_charged(tmp_path: Path, tiny_model: Path):
    """A search's trials charge the same contributions by design (starting it consents to that); contributions
    runs outside it charged before need --yes, asked once, before its first trial."""
    from tests.test_tune import _grid, _valid

    corpus = _corpus(tmp_path, "tune")
    _valid(corpus)
    grid = _grid(corpus, '"optimizer.lr" = [0.01, 0.05]')
    config = _config(corpus, tiny_model, 2)
    arguments = ["tune", "--config", str(config), "--grid", str(grid), "--ledger", corpus.url, "--insecure-seed", "3"]
    first = CliRunner().invoke(cli, [*arguments, "--id", "first"])
    assert first.exit_code == 0, first.output  # nothing charged before it; trial 1 charges what trial 0 did
    second = _other(corpus, tiny_model, 2, "unused", "adapter-2")  # its trials' folders: adapter-2/trial-k
    arguments[2] = str(second)
    before = snapshot(corpus.url)
    refused = CliRunner().invoke(cli, [*arguments, "--id", "second"])
    assert refused.exit_code == 2 and "error[charged_before]" in refused.stderr and "--yes" in refused.stderr
    assert snapshot(corpus.url) == before and not (corpus.dir / "adapter-2").exists()
    confirmed = CliRunner().invoke(cli, [*arguments, "--id", "second", "--yes"])
    assert confirmed.exit_code == 0, confirmed.output
    assert verify_ledger(corpus.url).by_kind["tune"] == 2


# -- the output folder is the run's ---------------------------------------------------------------------------


def test_an_output_folder_holding_another_runs_adapter_or_state_is_refused(tmp_path: Path, tiny_model: Path):
    """The issue's case: examples/custom_loop.py's docstring command, run on the demo's ledger with the demo's
    config, started a second run in the demo's adapter folder. A fresh run in a folder that holds an adapter, a
    run state of another config, or any other file is refused (`output_taken`), before anything is written."""
    corpus = _corpus(tmp_path, "output")
    config = _config(corpus, tiny_model, 2)
    with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=1, **QUIET) as run:
        _run_all(run)
    adapter = tree_sha256(corpus.dir / "adapter")
    again = _other(corpus, tiny_model, 2, "again", "adapter")  # another id, the first run's folder
    before = snapshot(corpus.url)
    for confirm in (False, True):
        with pytest.raises(ConfigError) as refused:
            govtrain.GovernedRun.open(again, corpus.url, confirm=confirm, **QUIET)
        assert refused.value.code is Code.OUTPUT_TAKEN and "another run's adapter" in refused.value.detail
    cli_refused = CliRunner().invoke(cli, ["train", "--config", str(again), "--ledger", corpus.url, "--yes"])
    assert cli_refused.exit_code == 2 and "error[output_taken]" in cli_refused.stderr
    assert snapshot(corpus.url) == before and tree_sha256(corpus.dir / "adapter") == adapter
    assert not (corpus.dir / "adapter" / STATE_FILE).exists()

    stranger = corpus.dir / "notes"
    stranger.mkdir()
    (stranger / "todo.txt").write_text("x")
    with pytest.raises(ConfigError) as refused:
        govtrain.GovernedRun.open(_other(corpus, tiny_model, 2, "notes", "notes"), corpus.url, confirm=True, **QUIET)
    assert refused.value.code is Code.OUTPUT_TAKEN and "todo.txt" in refused.value.detail

    # another config's run state: its folder is that run's
    stopped = _other(corpus, tiny_model, 4, "stopped", "stopped")
    with govtrain.GovernedRun.open(stopped, corpus.url, insecure_seed=1, confirm=True, **QUIET) as run:
        past_rehearsal(run)
    state = (corpus.dir / "stopped" / STATE_FILE).read_bytes()
    intruder = _other(corpus, tiny_model, 2, "intruder", "stopped")
    before = snapshot(corpus.url)
    with pytest.raises(ConfigError) as refused:
        govtrain.GovernedRun.open(intruder, corpus.url, confirm=True, **QUIET)
    assert refused.value.code is Code.OUTPUT_TAKEN and "another config" in refused.value.detail
    assert snapshot(corpus.url) == before and (corpus.dir / "stopped" / STATE_FILE).read_bytes() == state
    with govtrain.GovernedRun.open(stopped, corpus.url, insecure_seed=1, **QUIET) as run:  # its own run resumes
        _run_all(run)


# -- the scratch workspace -----------------------------------------------------------------------------------


def test_the_custom_loop_example_points_at_a_scratch_ledger(tmp_path: Path, tiny_model: Path, capsys):
    """examples/custom_loop.py's docstring makes a scratch workspace (examples/scratch.py) and trains into an output
    of its own; run on a ledger whose config's output holds an adapter without --output, it is refused before any
    spend, and with --output on a ledger of its own it trains there, the first ledger untouched."""
    import runpy

    doc = (ROOT / "examples" / "custom_loop.py").read_text()
    assert "examples/scratch.py" in doc and "--output scratch/custom-adapter" in doc and "demo-out" not in doc

    corpus = _corpus(tmp_path, "demo")
    config = _config(corpus, tiny_model, 2)
    with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=1, **QUIET) as run:
        _run_all(run)
    main = runpy.run_path(str(ROOT / "examples" / "custom_loop.py"))["main"]
    before = snapshot(corpus.url)
    with pytest.raises(ConfigError) as refused:
        main(["--config", str(config), "--ledger", corpus.url])
    assert refused.value.code in (Code.OUTPUT_TAKEN, Code.CHARGED_BEFORE) and snapshot(corpus.url) == before

    scratch = _corpus(tmp_path, "scratch")  # a ledger of its own, as examples/scratch.py makes one
    out = tmp_path / "scratch-out"
    assert main(["--config", str(config), "--ledger", scratch.url, "--output", str(out / "adapter")]) == 0
    assert (out / "adapter" / "adapter_model.safetensors").is_file() and snapshot(corpus.url) == before


def test_the_budget_safety_pages_snippets_run_on_a_tiny_model(tmp_path: Path, tiny_model: Path, capsys):
    """docs/budget-safety.md's Python blocks, run as written, then the functions they define called on a tiny
    model: the check first (nothing written), then the loop."""
    import re

    namespace: dict = {}
    for block in re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "budget-safety.md").read_text(), re.S):
        exec(compile(block, "docs/budget-safety.md", "exec"), namespace)
    corpus = _corpus(tmp_path, "docs")
    config = _config(corpus, tiny_model, 3)
    stored = _stored(corpus)
    planned = namespace["check_my_loop"](str(config), corpus.url)
    assert set(planned) == {"public", "sensitive", "restricted"} and planned["public"][1] > planned["public"][0] == 0
    assert _stored(corpus) == stored and not (corpus.dir / "adapter").exists()
    result = namespace["train_with_my_loop"](str(config), corpus.url)
    assert result.steps == 3 and ": loss " in capsys.readouterr().out
