"""Review item 1: a second run in the same ledger epoch trained without writing its spend.

The adversary is a second or restarted run on the same ledger: an operator who moves a killed run's
state file away and starts afresh, or two runs at once. Neither may train on another run's
write-ahead spend: every contribution a run draws is charged by that run's own spend entry."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import forkserver

torch = pytest.importorskip("torch")

from govtrain.errors import ConfigError, GovtrainError  # noqa: E402
from govtrain.ledger.entries import decode_entry  # noqa: E402
from govtrain.train.config import load_run_config  # noqa: E402
from govtrain.train.loop import STATE_FILE, train  # noqa: E402
from govtrain.verify.verifier import verify_ledger  # noqa: E402
from tests.conftest import REPO, Corpus, snapshot  # noqa: E402
from tests.test_train import _admit, _config, tiny_model  # noqa: E402,F401


def _spends(corpus: Corpus) -> list[dict]:
    with corpus.open() as ledger:
        return [decode_entry(e.body, seq=e.seq, kind="spend") for e in ledger.store.entries(kinds=("spend",))]


def _second_config(corpus: Corpus, model: Path, steps: int, run_id: str, output: str):
    path = _config(corpus, model, steps)
    text = path.read_text().replace('run_id = "test-run"', f'run_id = "{run_id}"').replace(
        'output = "adapter"', f'output = "{output}"')
    second = corpus.dir / f"{run_id}.toml"
    second.write_text(text)
    return load_run_config(second)


def _assert_every_draw_charged_by_its_run(corpus: Corpus, draws: dict[str, set[str]]) -> None:
    charged: dict[str, set[str]] = {}
    holders: dict[int, set[str]] = {}
    for spend in _spends(corpus):
        charged.setdefault(spend["run_id"], set()).add(spend["contribution_id"])
        holders.setdefault(spend["epoch"], set()).add(spend["run_id"])
    assert all(len(runs) == 1 for runs in holders.values()), holders  # one run per ledger epoch
    for run_id, drawn in draws.items():
        assert drawn and drawn <= charged.get(run_id, set()), (run_id, drawn, charged)
    report = verify_ledger(corpus.url)  # and every spend recomputes
    assert report.ok and report.spend_recomputed


def test_a_restarted_run_never_trains_on_the_killed_runs_write_ahead(corpus: Corpus, tiny_model: Path):
    _admit(corpus, "pub")
    config = load_run_config(_config(corpus, tiny_model, 25))
    with pytest.raises(KeyboardInterrupt):
        train(config, corpus.url, insecure_seed=3, log=lambda line: None, checkpoint_every=4,
              interrupt_after_steps=14)  # killed in ledger epoch 1, after its spend was written
    _admit(corpus, "late")  # admitted after run A's write-ahead for epoch 1
    moved = corpus.dir / "moved-away.pt"
    shutil.move(corpus.dir / "adapter" / STATE_FILE, moved)  # "move the file away to start afresh"

    before = snapshot(corpus.url)
    with pytest.raises(ConfigError) as info:  # the same run id, without its state: refused, nothing written
        train(config, corpus.url, insecure_seed=4, log=lambda line: None)
    assert info.value.code.value == "run_config_invalid" and "already wrote spend" in info.value.detail
    assert snapshot(corpus.url) == before

    draws: dict[str, set[str]] = {"run-b": set()}
    lines: list[str] = []
    second = _second_config(corpus, tiny_model, 20, "run-b", "adapter-b")
    train(second, corpus.url, insecure_seed=4, log=lines.append, confirm=True,  # run A charged "pub" before
          observe=lambda step, ids: draws["run-b"].update(ids))
    assert any("ledger epoch 1 is held by test-run" in line for line in lines), lines
    assert "late" in draws["run-b"]
    epochs_b = {s["epoch"] for s in _spends(corpus) if s["run_id"] == "run-b"}
    assert epochs_b == {2, 3}  # run A's epoch 1 was closed, never reused
    _assert_every_draw_charged_by_its_run(corpus, draws)


def test_two_concurrent_runs_each_charge_their_own_epochs(corpus: Corpus, tiny_model: Path):
    _admit(corpus, "pub")
    _admit(corpus, "sens", data_class="sensitive", clip_norm_u=500_000, eps_budget_u=3_000_000)
    first = _second_config(corpus, tiny_model, 20, "run-a", "adapter-a")
    second = _second_config(corpus, tiny_model, 10, "run-b", "adapter-b")
    draws: dict[str, set[str]] = {"run-a": set(), "run-b": set()}
    started = []

    def observe_a(step: int, ids: list[str]) -> None:
        draws["run-a"].update(ids)
        if step == 3 and not started:  # run B starts while run A is inside its first ledger epoch
            started.append(True)
            train(second, corpus.url, insecure_seed=6, log=lambda line: None, confirm=True,  # run A charged both
                  observe=lambda s, i: draws["run-b"].update(i))

    # confirmed: run B charges what run A charges while A is open, and A's next write-ahead charges them again
    # (unconfirmed, it is refused there: test_attacks_rehearsal)
    result = train(first, corpus.url, insecure_seed=5, log=lambda line: None, observe=observe_a, confirm=True)
    assert started and result.steps == 20
    holders = {s["epoch"]: s["run_id"] for s in _spends(corpus)}
    assert holders == {0: "run-a", 1: "run-b", 2: "run-a"}
    _assert_every_draw_charged_by_its_run(corpus, draws)
    assert verify_ledger(corpus.url).by_kind["run"] == 2


# -- issue 20, item 1: a run id is a one-time lease -----------------------------------------------------------
#
# Two runs opened at once with one `training.run_id` once both passed `prepare` (neither had spent yet) and then
# both trained every epoch on the first one's write-ahead: `_write_ahead` took an epoch held by the same id for
# "this run, before a kill". Now every spend and the run entry carry the run's random lease nonce, the run state
# is locked by the process that owns it, and write-ahead accepts an epoch only for the same (id, nonce). These
# tests run truly concurrent processes.

API_RUN = """
import pathlib, sys, time
import govtrain
from govtrain.errors import GovtrainError
config, url, ready, go = sys.argv[1:5]
try:
    with govtrain.GovernedRun.open(config, url, log=lambda line: None) as run:
        pathlib.Path(ready).touch()
        while not pathlib.Path(go).exists():
            time.sleep(0.02)
        for batch in run.batches():
            run.step(run.per_example_loss(run.model(**batch.inputs), batch))
        run.save()
except GovtrainError as e:
    pathlib.Path(ready).touch()
    print(e.line(), file=sys.stderr)
    sys.exit(e.exit_code)
"""


def _config_file(corpus: Corpus, model: Path, steps: int, run_id: str, output: str) -> Path:
    text = _config(corpus, model, steps).read_text().replace('run_id = "test-run"', f'run_id = "{run_id}"').replace(
        'output = "adapter"', f'output = "{output}"')
    path = corpus.dir / f"{output}.toml"
    path.write_text(text)
    return path


def _spawn(*argv: str) -> forkserver.Child:
    """`python *argv`, forked from tests/forkserver.py's preloaded interpreter: a process of its own."""
    return forkserver.start(list(argv), cwd=REPO)


def _wait(*processes: subprocess.Popen) -> list[tuple[int, str]]:
    outcomes = []
    for process in processes:
        _, stderr = process.communicate(timeout=300)
        outcomes.append((process.returncode, stderr))
    return outcomes


def _runs(corpus: Corpus) -> list[dict]:
    with corpus.open() as ledger:
        return [decode_entry(e.body, seq=e.seq, kind="run") for e in ledger.store.entries(kinds=("run",))]


def _assert_one_lease(corpus: Corpus, run_id: str) -> None:
    """Every spend of `run_id` and its one run entry carry one nonce, and the ledger verifies."""
    spends = [s for s in _spends(corpus) if s["run_id"] == run_id]
    runs = [r for r in _runs(corpus) if r["run_id"] == run_id]
    assert spends and len(runs) == 1, (len(spends), runs)
    assert {s["run_nonce"] for s in spends} == {runs[0]["run_nonce"]}
    assert verify_ledger(corpus.url).spend_recomputed


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_1_two_api_processes_with_one_run_id_train_once(store: str, tiny_model: Path, tmp_path: Path, request):
    """Both processes open (prepare passes for both: nothing is spent yet), then both iterate at once. One
    trains and records the run; the other is refused with `run_id_taken` before any step of its own. On
    SQLite and on a PostgreSQL server, where a team's runs share a ledger."""
    corpus = request.getfixturevalue("corpus" if store == "sqlite" else "pg_corpus")
    _admit(corpus, "pub")
    configs = [_config_file(corpus, tiny_model, 12, "shared", f"adapter-{k}") for k in (0, 1)]
    ready, go = [tmp_path / f"ready-{k}" for k in (0, 1)], tmp_path / "go"
    processes = [_spawn("-c", API_RUN, str(configs[k]), corpus.url, str(ready[k]), str(go)) for k in (0, 1)]
    deadline = time.monotonic() + 240
    while not all(r.exists() for r in ready) and time.monotonic() < deadline:
        time.sleep(0.05)
    go.touch()
    outcomes = _wait(*processes)
    codes = sorted(code for code, _ in outcomes)
    assert codes == [0, 3], outcomes
    loser = next(stderr for code, stderr in outcomes if code == 3)
    assert "error[run_id_taken]" in loser
    assert sum((corpus.dir / f"adapter-{k}" / "adapter_model.safetensors").exists() for k in (0, 1)) == 1
    _assert_one_lease(corpus, "shared")


def test_1_a_second_process_of_the_same_config_is_refused_while_the_first_holds_its_state(corpus: Corpus,
                                                                                           tiny_model: Path,
                                                                                           tmp_path: Path):
    _admit(corpus, "pub")
    config = _config(corpus, tiny_model, 12)
    first = _spawn("-c", API_RUN, str(config), corpus.url, str(tmp_path / "ready-0"), str(tmp_path / "go"))
    deadline = time.monotonic() + 240
    while not (tmp_path / "ready-0").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    second = _spawn("-c", API_RUN, str(config), corpus.url, str(tmp_path / "ready-1"), str(tmp_path / "never"))
    (code, stderr), = _wait(second)
    assert code == 3 and "error[run_id_taken]" in stderr and "another process holds" in stderr, stderr
    (tmp_path / "go").touch()
    assert _wait(first)[0][0] == 0
    _assert_one_lease(corpus, "test-run")
    assert not (corpus.dir / "adapter" / "run-state.lock").exists()  # the finished run leaves no lock behind


def test_1_two_cli_processes_with_one_run_id_leave_one_run(corpus: Corpus, tiny_model: Path):
    """The review's second case: two `govtrain train` processes, started together, with one run id. Whichever
    wins the race, exactly one trains and records a run; the other exits 2 (its id already spent when it
    started) or 3 (`run_id_taken` at write-ahead), and the ledger holds one lease for the id."""
    _admit(corpus, "pub")
    configs = [_config_file(corpus, tiny_model, 12, "shared", f"adapter-{k}") for k in (0, 1)]
    processes = [_spawn("-m", "govtrain.cli.main", "train", "--config", str(c), "--ledger", corpus.url)
                 for c in configs]
    outcomes = _wait(*processes)
    codes = sorted(code for code, _ in outcomes)
    assert codes in ([0, 2], [0, 3]), outcomes
    assert any(f"error[{name}]" in stderr for _, stderr in outcomes for name in ("run_id_taken", "run_config_invalid"))
    _assert_one_lease(corpus, "shared")


def test_1_a_run_opened_later_under_its_id_but_another_lease_takes_nothing_from_the_run_that_holds_it(
        corpus: Corpus, tiny_model: Path):
    """The interleaving CI met in the test above, made deterministic: run A opens; run B opens with A's id from
    another folder (another lease) before A has spent, so B's open passes; A writes ahead. B used to take A's
    ownership record (it was keyed by the id alone), so A stopped at its next step with `run_id_taken` and B was
    refused at its write-ahead: neither trained. The owner record is now one per lease: B is refused, changes
    nothing, and A trains on and records the run."""
    import govtrain
    from tests.test_api import past_rehearsal

    _admit(corpus, "pub")
    configs = [_config_file(corpus, tiny_model, 12, "shared", f"adapter-{k}") for k in (0, 1)]
    first = govtrain.GovernedRun.open(configs[0], corpus.url, log=lambda line: None, insecure_seed=1)
    second = govtrain.GovernedRun.open(configs[1], corpus.url, log=lambda line: None, insecure_seed=2)
    batches = first.batches()
    batch = past_rehearsal(first, batches)  # the first real batch: its epoch is written ahead under A's lease
    first.step(first.per_example_loss(first.model(**batch.inputs), batch))
    before = snapshot(corpus.url)
    with pytest.raises(GovtrainError) as refused:
        past_rehearsal(second)
    assert refused.value.code.value == "run_id_taken" and "another lease" in refused.value.detail
    second.close()
    assert snapshot(corpus.url) == before
    for batch in batches:  # A is not stopped: it still owns its run
        first.step(first.per_example_loss(first.model(**batch.inputs), batch))
    first.save()
    first.close()
    assert not (corpus.dir / "adapter-1" / "adapter_model.safetensors").exists()
    _assert_one_lease(corpus, "shared")


def test_1_a_run_killed_with_sigkill_resumes_under_its_lease(corpus: Corpus, tiny_model: Path):
    """The lock dies with its process and the lease is in the run state: the same command again resumes the run
    (its written-ahead epoch is not written twice) and records it once."""
    _admit(corpus, "pub")
    config = _config(corpus, tiny_model, 30)
    process = _spawn("-m", "govtrain.cli.main", "train", "--config", str(config), "--ledger", corpus.url)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not any(s["epoch"] == 1 for s in _spends(corpus)):
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=60)
    written = _spends(corpus)
    assert written and not _runs(corpus)
    again = subprocess.run([sys.executable, "-m", "govtrain.cli.main", "train", "--config", str(config), "--ledger",
                            corpus.url], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "resuming test-run" in again.stdout + again.stderr
    spends = _spends(corpus)
    assert spends[:len(written)] == written and len({(s["epoch"], s["contribution_id"]) for s in spends}) == len(spends)
    _assert_one_lease(corpus, "test-run")


def test_1_review_f4_a_copied_run_folder_takes_the_run_over_and_the_first_stops(corpus: Corpus, tiny_model: Path):
    """Review finding F4: a copy of a run's folder (`cp -r exp exp2`) resumes under the same id and lease with a
    lock of its own, and both copies used to train every step on the one write-ahead (31 steps trained, 20
    charged, the ledger verified). The last process to open the run owns it (the ledger store records it):
    the other stops at its next step with `run_id_taken`, as a kill would stop it."""
    import govtrain
    from tests.test_api import past_rehearsal

    _admit(corpus, "pub")
    config = _config(corpus, tiny_model, 20)
    with govtrain.GovernedRun.open(config, corpus.url, log=lambda line: None, insecure_seed=1) as run:
        batches = run.batches()
        while run.steps < 3:  # past the rehearsal's chunks
            batch = next(batches)
            run.step(run.per_example_loss(run.model(**batch.inputs), batch))
        batches.close()
    copy = corpus.dir.parent / "copy-of-the-experiment"
    shutil.copytree(corpus.dir, copy)
    first = govtrain.GovernedRun.open(config, corpus.url, log=lambda line: None, insecure_seed=2)
    second = govtrain.GovernedRun.open(copy / "run.toml", corpus.url, log=lambda line: None, insecure_seed=3)
    assert first.run_id == second.run_id and first._run.run_nonce == second._run.run_nonce  # the same lease
    resumed_at, weights = first.steps, {n: p.detach().clone() for n, p in first.model.named_parameters()}
    with pytest.raises(GovtrainError) as refused:  # the first no longer owns the run: refused at its first step
        past_rehearsal(first)  # (the rehearsal spends and moves nothing)
    assert refused.value.code.value == "run_id_taken" and first.steps == resumed_at
    assert all(torch.equal(weights[n], p) for n, p in first.model.named_parameters())
    first.close()
    with second:
        for batch in second.batches():
            second.step(second.per_example_loss(second.model(**batch.inputs), batch))
        second.save()
    spends = _spends(corpus)
    assert sum(s["steps"] for s in spends) == 20 and second.steps == 20
    _assert_one_lease(corpus, "test-run")


def test_1_review_h1_a_stale_copy_trains_a_written_epoch_exactly_as_the_ledger_charged_it(corpus: Corpus,
                                                                                         tiny_model: Path):
    """Second review, H1: a run state older than the ledger's record of its own lease (a copied folder, a restored
    backup) found its epoch "written by this run before a kill" and trained it under a plan of its own: with a
    contribution admitted since, which that epoch never charged, drawn 47 times. The epoch is now trained as the
    ledger wrote it: every draw is charged in the ledger epoch it was drawn in."""
    import govtrain

    _admit(corpus, "pub")
    config = _config(corpus, tiny_model, 20)
    quiet = {"log": lambda line: None}

    def steps(run, until) -> None:
        for batch in run.batches():
            run.step(run.per_example_loss(run.model(**batch.inputs), batch))
            if until(run):
                return

    with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=1, **quiet) as run:
        steps(run, lambda r: r.steps >= 3)
    copy = corpus.dir.parent / "backup-of-the-experiment"
    shutil.copytree(corpus.dir, copy)
    with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=2, **quiet) as run:  # writes epoch 1, then stops
        steps(run, lambda r: r._run.pending is not None and r._run.pending["epoch"] == 1 and r._run._written)
    _admit(corpus, "late", records=400)
    shutil.copy(corpus.dir / "data" / "late.jsonl", copy / "data" / "late.jsonl")
    drawn: list[tuple[int, set[str]]] = []
    with govtrain.GovernedRun.open(copy / "run.toml", corpus.url, insecure_seed=3, **quiet) as stale:
        stale._run.observe = lambda step, ids: drawn.append((stale._run.pending["epoch"], set(ids)))
        steps(stale, lambda r: False)
        stale.save()
    charged: dict[int, set[str]] = {}
    for spend in _spends(corpus):
        charged.setdefault(spend["epoch"], set()).add(spend["contribution_id"])
    assert drawn and all(ids <= charged[epoch] for epoch, ids in drawn), (charged, drawn)
    assert "late" not in charged[1] and any("late" in ids for _, ids in drawn)  # drawn only once charged
    _assert_one_lease(corpus, "test-run")
