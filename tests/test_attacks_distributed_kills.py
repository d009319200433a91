"""Second adversarial review of training as several processes (issue 25): the lead killed at chosen points, runs
that race on one ledger, ranks that lie about who leads, resumes with another number of processes, followers killed
before the first spend. Each test is an attack on the guarantee that N ranks keep exactly the single process's; a
test marked `held` documents an attack that failed (kept as a regression test).

Ranks are real processes (gloo on the CPU): `govtrain train --nproc N` itself, with tests/distributed_kill_hook.py
loaded into each rank through a `sitecustomize.py` on PYTHONPATH, so a rank SIGKILLs itself at a precise point.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from govtrain.ledger.entries import decode_entry  # noqa: E402
from govtrain.ledger.ledger import Ledger  # noqa: E402
from govtrain.verify.verifier import verify_ledger  # noqa: E402
from tests.test_distributed import clean_env, make_world, run_entries  # noqa: E402
from tests.test_train import save_tiny_bert  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6  # three ledger epochs of two steps
EPOCHS = "epoch_steps = 2\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


def hooked(folder: Path, *, at: str | None = None, rank: int = 0, nth: int = 1) -> dict[str, str]:
    """The environment of a `govtrain train` whose ranks load tests/distributed_kill_hook.py (journals in `folder`)."""
    site = folder / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text("from tests.distributed_kill_hook import install\ninstall()\n")
    env = clean_env()
    env.update(PYTHONPATH=f"{site}{os.pathsep}{ROOT}", KILLS_DIR=str(folder), KILLS_RANK=str(rank), KILLS_NTH=str(nth),
               KILLS_AT=at or "")
    return env


def train(corpus, config: Path, env: dict[str, str] | None, *extra: str, timeout: float = 240) -> tuple[int, str, str]:
    process = subprocess.Popen([sys.executable, "-m", "govtrain", "train", "--config", str(config), "--ledger",
                                corpus.url, "--insecure-seed", "3", "--json", *extra], cwd=corpus.dir,
                               env=env or clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = process.communicate(timeout=timeout)
    return process.returncode, stdout, stderr


def spend_entries(url: str) -> list[dict]:
    with Ledger.open(url) as ledger:
        return [decode_entry(e.body, seq=e.seq, kind="spend") for e in ledger.store.entries(kinds=("spend",))]


def steps_taken(folder: Path) -> list[dict]:
    """Every step the ranks of one launch moved the model in (tests/crash_child.py's journals), in order: its run, ledger
    epoch, and the contributions every rank's share of its draw held."""
    steps: dict[int, dict] = {}
    for path in sorted(folder.glob("journal-*.jsonl")):
        for event in map(json.loads, path.read_text().splitlines()):
            if event["event"] == "step":
                step = steps.setdefault(event["step"], {**event, "drawn": []})
                assert (step["epoch"], step["run_id"]) == (event["epoch"], event["run_id"]), (step, event)
                step["drawn"] = sorted(set(step["drawn"]) | set(event["drawn"]))
    return [steps[k] for k in sorted(steps)]


def assert_whole(corpus, *journals: Path) -> None:
    """The ledger after a completed run: each (contribution, epoch) charged once, every step the lead took charged in
    the epoch it trained in, one run entry, and the verifier's recomputation passes."""
    charged = spend_entries(corpus.url)
    pairs = [(s["contribution_id"], s["epoch"]) for s in charged]
    assert charged and len(pairs) == len(set(pairs)), f"an epoch was charged twice: {sorted(pairs)}"
    for folder in journals:
        for step in steps_taken(folder):
            for contribution in step["drawn"]:
                assert (contribution, step["epoch"]) in pairs, (f"step {step['step']} trained {contribution} in ledger "
                                                                f"epoch {step['epoch']}, which charged it nothing")
    assert run_entries(corpus.url) == 1
    assert verify_ledger(corpus.url).spend_recomputed


def alive(pid: int) -> bool:
    try:
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False


# -- 1. the lead killed at chosen points, then the same command again ---------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("at,nth", [("spend-rows", 2)] + [pytest.param(*point, marks=pytest.mark.long) for point in [
    ("spend-unseen", 2), ("epoch-closed", 1), ("extras-pending", 1), ("before-record-run", 1), ("entry-recorded", 1)]])
def test_held_the_lead_killed_at_a_chosen_point_resumes_whole(tmp_path, tiny, at, nth):
    """(held) The lead SIGKILLs itself mid write-ahead (spend rows inserted, not committed; committed, not yet seen),
    mid close_epoch (closed in the ledger, the run state not saved) or mid finish (peft's files written; the adapter
    saved, no run entry; the run entry recorded, the state not removed). The launcher stops the follower and says
    `rank_lost`; the same command again completes the run: nothing under-counted, no epoch charged twice, one run
    entry, the verifier passes."""
    corpus, config = make_world(tmp_path / "w", tiny, steps=STEPS, extra=EPOCHS)
    killed, again = tmp_path / "killed", tmp_path / "again"
    code, _, stderr = train(corpus, config, hooked(killed, at=at, nth=nth), "--nproc", "2")
    assert code == 2 and "error[rank_lost]" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    for pid in (int((killed / f"pid-{r}").read_text()) for r in range(2)):
        assert not alive(pid), "a rank outlived the launcher"
    verify_ledger(corpus.url)  # consistent at the kill
    code, stdout, stderr = train(corpus, config, hooked(again), "--nproc", "2")
    assert code == 0, stderr[-3000:]
    assert json.loads(stdout.splitlines()[-1])["steps"] == STEPS
    assert_whole(corpus, killed, again)
    assert not (corpus.dir / "adapter" / "run-state.safetensors").exists()


# -- 5. a follower killed before the first spend -------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.long
def test_held_a_follower_killed_while_preparing_leaves_nothing_and_the_rerun_works(tmp_path, tiny):
    """(held) The follower dies inside prepare (loading its data and model), before the lead's claim on the run: every
    rank stops, no spend, no run state; the same command again completes the run."""
    corpus, config = make_world(tmp_path / "w", tiny, steps=STEPS, extra=EPOCHS)
    code, _, stderr = train(corpus, config, hooked(tmp_path / "killed", at="prepare", rank=1), "--nproc", "2")
    assert code == 2 and "error[rank_lost]" in stderr, stderr[-3000:]
    assert spend_entries(corpus.url) == [] and not (corpus.dir / "adapter" / "run-state.safetensors").exists()
    code, _, stderr = train(corpus, config, hooked(tmp_path / "again"), "--nproc", "2")
    assert code == 0, stderr[-3000:]
    assert_whole(corpus, tmp_path / "again")


@pytest.mark.slow
def test_a_follower_killed_during_its_rehearsal_changes_nothing(tmp_path, tiny):
    """A follower slower than the lead through the rehearsal (6 s at its first rehearsal chunk), then killed before its
    rehearsal passed (its GPU ran out of memory at the rehearsal's full-size chunk, say). The rehearsal exists so
    that the loop's failures cost nothing: in one process it runs before the first plan, and a failure there leaves
    the output folder as it was, so the user may change RUN.toml and run again. With several processes nothing
    gathers the ranks after the rehearsal: the lead's passes, it plans the first epoch and saves that plan to
    run-state.safetensors (`Run._plan_epoch` saves before `from_lead`'s broadcast), then waits in the broadcast for the
    follower, which dies. No spend is written (held: gloo's broadcast waits for the follower), but the run state
    left behind pins the folder to the old config: the fixed RUN.toml (a smaller physical_batch) is refused,
    `output_taken`. A failed rehearsal on any rank must leave the folder as a failed rehearsal in one process does."""
    corpus, config = make_world(tmp_path / "w", tiny, steps=STEPS, extra=EPOCHS)
    killed = tmp_path / "killed"
    env = hooked(killed, at="rehearsal-sleep", rank=1)
    env["KILLS_SLEEP"] = "6"
    code, _, stderr = train(corpus, config, env, "--nproc", "2")
    assert code == 2 and "error[rank_lost]" in stderr, stderr[-3000:]
    assert steps_taken(killed) == [] and spend_entries(corpus.url) == []  # held: no step, no spend
    left = corpus.dir / "adapter" / "run-state.safetensors"
    config.write_text(config.read_text().replace("physical_batch = 4", "physical_batch = 2"))  # the user's fix
    code, _, stderr = train(corpus, config, hooked(tmp_path / "fixed"), "--nproc", "2")
    assert code == 0, (f"the fixed config is refused after a failed rehearsal (run state left: {left.exists()}):\n"
                       + stderr[-1500:])
    assert_whole(corpus, tmp_path / "fixed")


# -- 2. a second multi-process run on the same ledger --------------------------------------------------------------


def second_config(config: Path, output: str, run_id: str | None = None) -> Path:
    text = config.read_text().replace('output = "adapter"', f'output = "{output}"')
    if run_id is not None:
        text = text.replace('run_id = "test-run"', f'run_id = "{run_id}"')
    path = config.with_name(f"{output}.toml")
    path.write_text(text)
    return path


def start(corpus, config: Path, env: dict[str, str], *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "govtrain", "train", "--config", str(config), "--ledger", corpus.url,
                             "--insecure-seed", "3", "--json", *extra], cwd=corpus.dir, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def ended(*processes: subprocess.Popen, timeout: float = 300) -> list[tuple[int, str, str]]:
    return [(p.wait(timeout=timeout), *p.communicate()) for p in processes]


def assert_each_step_charged_by_its_run(corpus, runs: dict[str, list[Path]]) -> None:
    """Every ledger epoch held by one lease; every step a run's lead took charged, in its epoch, to that run."""
    charged = spend_entries(corpus.url)
    holders: dict[int, set] = {}
    for s in charged:
        holders.setdefault(s["epoch"], set()).add((s["run_id"], bytes(s["run_nonce"])))
    assert all(len(h) == 1 for h in holders.values()), f"an epoch charged to two leases: {holders}"
    pairs = {(s["contribution_id"], s["epoch"], s["run_id"]) for s in charged}
    for run_id, folders in runs.items():
        for folder in folders:
            for step in steps_taken(folder):
                assert step["run_id"] == run_id
                for contribution in step["drawn"]:
                    assert (contribution, step["epoch"], run_id) in pairs, (f"{run_id} trained {contribution} in "
                                                                            f"epoch {step['epoch']} uncharged")
    assert verify_ledger(corpus.url).spend_recomputed


@pytest.mark.slow
@pytest.mark.long
def test_held_two_nproc_2_runs_with_one_run_id_in_two_folders_train_once(tmp_path, tiny):
    """(held) `govtrain train --nproc 2` twice at once, one run id, two output folders (two nodes' copies of a RUN.toml):
    one run trains and records its entry; the other is refused (`run_id_taken`, or the id already spent) having taken
    no step; every step trained is charged to the run that took it."""
    corpus, config = make_world(tmp_path / "w", tiny, steps=STEPS, extra=EPOCHS)
    other = second_config(config, "adapter-b")
    a, b = tmp_path / "a", tmp_path / "b"
    done = ended(start(corpus, config, hooked(a), "--nproc", "2"), start(corpus, other, hooked(b), "--nproc", "2"))
    codes = [code for code, _, _ in done]
    assert sorted(codes) == [0, 2] or sorted(codes) == [0, 3], [err[-1500:] for _, _, err in done]
    lost = [a, b][codes.index(0) ^ 1]
    refused = done[codes.index(0) ^ 1][2]
    assert "error[run_id_taken]" in refused or "error[run_config_invalid]" in refused, refused[-2000:]
    assert steps_taken(lost) == []
    assert run_entries(corpus.url) == 1
    assert_each_step_charged_by_its_run(corpus, {"test-run": [a, b]})


@pytest.mark.slow
@pytest.mark.long
def test_held_two_nproc_2_runs_under_two_ids_each_hold_their_own_epochs(tmp_path, tiny):
    """(held) Two `--nproc 2` runs of two ids on one ledger at once (both consenting, `--yes`): each ledger epoch is held
    by one lease, and every step either lead took is charged to its own run in the epoch it trained in."""
    corpus, config = make_world(tmp_path / "w", tiny, steps=4, extra=EPOCHS)
    other = second_config(config, "adapter-b", "other-run")
    a, b = tmp_path / "a", tmp_path / "b"
    done = ended(start(corpus, config, hooked(a), "--nproc", "2", "--yes"),
                 start(corpus, other, hooked(b), "--nproc", "2", "--yes"))
    assert all(code in (0, 5) for code, _, _ in done), [err[-1500:] for _, _, err in done]
    assert_each_step_charged_by_its_run(corpus, {"test-run": [a], "other-run": [b]})
    assert run_entries(corpus.url) == 2


# -- 3. ranks that lie about who leads -----------------------------------------------------------------------------


def rank_env(folder: Path, rank: int, size: int, port: int) -> dict[str, str]:
    env = hooked(folder)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), GOVTRAIN_DIST_TIMEOUT_S="30")
    return env


@pytest.mark.slow
def test_rank_1_of_a_world_of_1_reports_the_run_it_trained(tmp_path, tiny):
    """RANK=1 with WORLD_SIZE=1 (a launcher's variables half set, or a lie): `World.from_env` makes it a single process,
    which leads: it takes the lock, claims the run, writes the spend and the run entry. But `govtrain train` and
    `train()` decide who reports by RANK alone, so this lead trains and records the run in silence: exit 0, no
    `--json` report, no log line (not even a consent note or the run id). The process that writes must be the one
    that reports (or the mismatch refused, nothing written)."""
    from govtrain.distributed.launch import free_port

    corpus, config = make_world(tmp_path / "w", tiny, steps=2)
    code, stdout, stderr = ended(start(corpus, config, rank_env(tmp_path / "r", 1, 1, free_port())), timeout=180)[0]
    wrote = bool(spend_entries(corpus.url))
    if code != 0:  # refused: one line, nothing written
        assert "error[" in stderr and not wrote, stderr[-2000:]
        return
    assert wrote and run_entries(corpus.url) == 1
    reports = [line for line in stdout.splitlines() if line.startswith("{")]
    assert reports, f"the process that trained and recorded run test-run printed nothing: stdout {stdout!r}"


@pytest.mark.slow
@pytest.mark.long
def test_held_a_second_rank_0_in_one_process_group_trains_nothing(tmp_path, tiny):
    """(held) Three processes under torchrun's variables, two of them RANK=0 of WORLD_SIZE=2, one RANK=1, one port: one
    group forms; the extra rank 0 stops with one error line, having written nothing; the ledger holds one run whose
    every step was charged."""
    from govtrain.distributed.launch import free_port

    corpus, config = make_world(tmp_path / "w", tiny, steps=STEPS, extra=EPOCHS)
    port = free_port()
    folders = [tmp_path / "lead", tmp_path / "dup", tmp_path / "one"]
    processes = [start(corpus, config, rank_env(folders[0], 0, 2, port))]
    time.sleep(1.0)
    processes += [start(corpus, config, rank_env(folders[1], 0, 2, port)),
                  start(corpus, config, rank_env(folders[2], 1, 2, port))]
    done = ended(*processes)
    codes = [code for code, _, _ in done]
    assert codes.count(0) >= 1, [err[-1500:] for _, _, err in done]
    for code, _, err in done:
        if code:
            assert "error[" in err and "Traceback" not in err, err[-2000:]
    assert run_entries(corpus.url) == 1
    assert_each_step_charged_by_its_run(corpus, {"test-run": folders[:2]})


@pytest.mark.slow
@pytest.mark.long
def test_held_ranks_that_disagree_on_world_size_write_nothing(tmp_path, tiny):
    """(held) RANK=0 says WORLD_SIZE=2, RANK=1 says WORLD_SIZE=3: no group forms (or the fingerprint refuses it); both
    stop with one error line and nothing is written."""
    from govtrain.distributed.launch import free_port

    corpus, config = make_world(tmp_path / "w", tiny, steps=2)
    port = free_port()
    done = ended(start(corpus, config, rank_env(tmp_path / "a", 0, 2, port)),
                 start(corpus, config, rank_env(tmp_path / "b", 1, 3, port)), timeout=200)
    assert all(code != 0 and "error[" in err for code, _, err in done), [err[-1500:] for _, _, err in done]
    assert spend_entries(corpus.url) == [] and run_entries(corpus.url) == 0


# -- 4. resumed with another number of processes -------------------------------------------------------------------


def processes_env(folder: Path, nproc: int, **kill) -> tuple[dict[str, str], tuple[str, ...]]:
    env = hooked(folder, **kill)
    if nproc == 1:
        env["RANK"] = "0"  # the hook journals a single process as rank 0 (no WORLD_SIZE: one process)
    return env, ("--nproc", str(nproc))


def episode(root: Path, tiny: Path, first: int, then: int) -> dict:
    """A run of `first` processes killed (the lead, once its second epoch's spend is committed and before it saw it),
    then the same command with `then` processes: what was charged, each step's draw, the adapter saved."""
    from safetensors.torch import load_file

    corpus, config = make_world(root / "w", tiny, steps=STEPS, extra=EPOCHS)
    env, extra = processes_env(root / "killed", first, at="spend-unseen", nth=2)
    code, _, stderr = train(corpus, config, env, *extra)
    assert code != 0 and "rank_lost" in stderr or first == 1 and code == -9, (code, stderr[-2000:])
    env, extra = processes_env(root / "again", then)
    code, stdout, stderr = train(corpus, config, env, *extra)
    if code:
        return {"refused": (code, stderr), "spend": spend_entries(corpus.url)}
    assert_whole(corpus, root / "killed", root / "again")
    return {"spend": sorted((s["contribution_id"], s["epoch"], s["steps"], s["sampling_rate_u"],
                             s["noise_multiplier_u"]) for s in spend_entries(corpus.url)),
            "steps": [(s["step"], s["epoch"], s["drawn"]) for folder in ("killed", "again")
                      for s in steps_taken(root / folder)],
            "adapter": load_file(corpus.dir / "adapter" / "adapter_model.safetensors"),
            "report": json.loads(stdout.splitlines()[-1])}


@pytest.fixture(scope="module")
def single(tmp_path_factory, tiny) -> dict:
    return episode(tmp_path_factory.mktemp("single"), tiny, 1, 1)


@pytest.mark.slow
@pytest.mark.parametrize("first,then", [(2, 1), pytest.param(1, 2, marks=pytest.mark.long),
                                        pytest.param(2, 3, marks=pytest.mark.long)])
def test_held_a_resume_with_another_number_of_processes_is_the_single_process_run(tmp_path, tiny, single, first, then):
    """(held) Killed under `first` processes, resumed under `then` through the CLI: the same spend, the same draws at the
    same steps and epochs, and the same adapter (to 1e-5) as one process killed at the same point and resumed."""
    got = episode(tmp_path, tiny, first, then)
    assert "refused" not in got, got.get("refused")
    assert got["spend"] == single["spend"]
    assert got["steps"] == single["steps"]
    assert got["report"]["steps"] == single["report"]["steps"] == STEPS
    assert got["adapter"].keys() == single["adapter"].keys()
    for name, value in single["adapter"].items():
        torch.testing.assert_close(got["adapter"][name], value, rtol=0, atol=1e-5, msg=name)


# -- the launcher itself killed ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_ranks_do_not_outlive_a_killed_launcher(tmp_path, tiny):
    """`govtrain train --nproc 2` SIGKILLed itself (an OOM killer, `kill -9` on the command the user started), mid-run.
    In one process that stops the training; here the ranks are the launcher's children with nothing tying them to it
    (no parent-death signal, their own stdin), so both go on training, charging and writing in the background, and
    the same command run again meets their lock (`run_id_taken`). The ranks must stop when their launcher is gone."""
    corpus, config = make_world(tmp_path / "w", tiny, steps=40, rate=0.05)  # budgets last the 40 steps
    folder = tmp_path / "ranks"
    launcher = start(corpus, config, hooked(folder), "--nproc", "2")
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not spend_entries(corpus.url):
            time.sleep(0.2)
        pids = [int((folder / f"pid-{r}").read_text()) for r in range(2)]
        launcher.kill()
        launcher.wait()
        at_kill = len(steps_taken(folder))
        time.sleep(3)  # more than a rank needs to notice; the run's 40 steps take about as long
        later = len(steps_taken(folder))
        assert later <= at_kill + 1, (f"the ranks went on training after their launcher was killed: {at_kill} steps "
                                      f"at the kill, {later} 3 s later (ranks alive: {[alive(p) for p in pids]})")
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, 9)
