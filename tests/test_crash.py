"""Crash tests of training (issue 23, item 2): `govtrain train`, `govtrain tune` and the documented `GovernedRun`
loop (examples/custom_loop.py) SIGKILLed inside the write-ahead spend, inside the run-state checkpoint write, inside
the adapter save (and, for tune, inside a trial config's write), and at uniformly random times; each run again until
it completes; then checked (tests/crash_setup.py, tests/crash_checks.py).

The kills inside an operation come from the child process itself (tests/crash_child.py wraps the production
functions in that process only: production code has no switch for it); the random ones from a timer here. The kill
plan is drawn from a seeded RNG (`GOVTRAIN_CRASH_SEED`, default 2323; each campaign prints its seed and the table).
The runs are forked from tests/forkserver.py's server, which imported torch and govtrain once (`ForkServer`);
`bench/crash.py --fresh` runs each in a fresh `python -m` process instead, and kills `govtrain train` 20 times.

**Under-counted** means: a step that moved a model ran where the ledger's write-ahead spend does not cover it, so a
contribution's charged ε is less than the ε of the steps that touched the model. The steps that ran are read from the
child's journal, written by the test's wrapper before each update (`Run.move`), never from what the run reports; what
was charged, from the verified ledger. `crash_checks.spend_problems` states the rule; a kill may over-count (a step
lost and redone under a later epoch's spend), never under-count.

Three defects these tests found, each kept as a test named for it:
1. a kill after the run entry and before the run state was removed left a run that `govtrain train` run again
   refused (`run_id_taken`, "remove it"), with no model card;
2. a kill inside the write of a search's `trial-<k>.json` left part of it, which the search run again refused as
   another search's file (`output_taken`): the search could never resume;
3. a search run again kept a trial recorded before such a kill as it was: its run state (its sampling key) left in
   the adapter folder, and no model card.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from govtrain.verify.verifier import verify_ledger  # noqa: E402
from tests.conftest import snapshot  # noqa: E402
from tests.crash_checks import hash_problems, spend_problems  # noqa: E402
from tests.crash_setup import (  # noqa: E402
    CATEGORIES,
    ForkServer,
    Kill,
    Reference,
    campaign,
    episode,
    journal_events,
    launch,
    reference,
    scene,
    table,
)

SEED = int(os.environ.get("GOVTRAIN_CRASH_SEED", "2323"))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from tests.test_train import save_tiny_bert

    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="module")
def runner():
    server = ForkServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def references(tmp_path_factory, model: Path, runner):  # type: ignore[no-untyped-def]
    """An uninterrupted run of each tool, made once: its time, its calls of each kill point and what it charges."""
    made: dict[str, Reference] = {}

    def get(tool: str) -> Reference:
        if tool not in made:
            made[tool] = reference(tmp_path_factory.mktemp("reference") / tool, tool, model, runner)
        return made[tool]

    return get


def _shown(outcomes) -> str:  # type: ignore[no-untyped-def]
    return "\n".join([table(outcomes), *(f"{o.tool}: {o.problems}" for o in outcomes if not o.ok)])


@pytest.mark.slow
@pytest.mark.parametrize("tool,kills", [("train", 8), ("GovernedRun", 4),
                                        # long tier: a search's trials are `govtrain train` runs (the same write-ahead,
                                        # checkpoint and adapter save as the train campaign's), and its own kill points
                                        # are in the default tier as the defect tests 2 and 3 below
                                        pytest.param("tune", 5, marks=pytest.mark.long)])
def test_kills_at_every_point_lose_nothing(tool: str, kills: int, tmp_path: Path, model: Path, runner, references):
    """Every kill point of the tool at least once (train: all seven; tune and the loop: one of each category) and a
    random kill: after each, the same command resumes to completion, the ledger verifies, nothing is under-counted
    and every adapter is what its run entry records."""
    print(f"crash seed {SEED} ({tool}, {kills} kills)")
    outcomes = campaign(tool, kills, SEED, tmp_path, model, runner, ref=references(tool))
    print(_shown(outcomes))
    assert all(o.ok for o in outcomes), _shown(outcomes)
    landed = [category for o in outcomes for category, _ in o.kills]
    assert len(landed) >= kills, _shown(outcomes)
    wanted = {"mid-spend", "mid-checkpoint", "mid-adapter-save", "random"} | ({"mid-trial-config"} if tool == "tune"
                                                                              else set())
    assert wanted <= set(landed) and set(landed) <= {*CATEGORIES, "random"}, _shown(outcomes)


def test_a_kill_after_the_run_entry_leaves_a_run_the_same_command_finishes(tmp_path: Path, model: Path, runner,
                                                                            references):
    """Defect 1: killed once its run entry is recorded, before its state is removed, `govtrain train` run again
    finishes the run (exit 0): the model card written, the run state removed, nothing recorded twice."""
    out = episode(tmp_path / "killed", "train", model, [Kill("entry-recorded")], references("train"), runner)
    assert out.ok and out.invocations == 2 and out.kills[0][0] == "mid-adapter-save", out.problems
    assert verify_ledger(f"sqlite:///{tmp_path / 'killed' / 'ledger.db'}").by_kind["run"] == 1


def test_a_kill_inside_the_run_state_write_resumes_from_the_last_state_written_whole(tmp_path: Path, model: Path,
                                                                                    runner, references):
    """Killed with half of `run-state.safetensors.tmp` written (the state is written whole by `state_file.write`),
    `govtrain train` run again resumes from the last state written whole and completes, nothing under-counted."""
    out = episode(tmp_path / "killed", "train", model, [Kill("state-partial", nth=3, fraction=0.5)],
                  references("train"), runner)
    assert out.ok and out.kills[0][0] == "mid-checkpoint", out.problems


def test_a_run_recorded_before_a_kill_whose_adapter_changed_is_refused(tmp_path: Path, model: Path, runner):
    """The other side of defect 1's fix: run again, a run recorded before a kill whose folder no longer holds the
    recorded adapter is refused (`adapter_mismatch`, exit 4), and the ledger, the folder and the state are unchanged."""
    s = scene(tmp_path / "s", "train", model)
    journal = tmp_path / "s" / "journal.jsonl"
    code, _, _ = launch(s, journal, Kill("entry-recorded"), runner)
    assert code == -9 and journal_events(journal)[-1]["where"] == "entry-recorded"
    output = s.runs["test-run"]
    weights = output / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b" ")  # one byte of the recorded adapter changed
    before, files = snapshot(s.url), sorted(p.name for p in output.iterdir())
    code, stderr, _ = launch(s, journal, None, runner)
    assert code == 4 and "error[adapter_mismatch]" in stderr, stderr
    assert snapshot(s.url) == before and sorted(p.name for p in output.iterdir()) == files
    assert (output / "run-state.safetensors").exists() and not (output / "README.md").exists()


def test_a_kill_inside_a_trial_config_write_does_not_stop_the_search_resuming(tmp_path: Path, model: Path, runner,
                                                                              references):
    """Defect 2: killed with half of `trial-1.json` written, `govtrain tune` run again with the same id resumes and
    completes the search (the file is written whole or not at all)."""
    out = episode(tmp_path / "killed", "tune", model, [Kill("trial-config-partial", nth=2, fraction=0.5)],
                  references("tune"), runner)
    assert out.ok and out.kills[0][0] == "mid-trial-config", out.problems


def test_a_trial_recorded_before_a_kill_is_finished_by_the_resumed_search(tmp_path: Path, model: Path, runner,
                                                                          references):
    """Defect 3: trial 0 killed once its run entry is recorded; the search run again finishes that trial (card
    written, run state removed), trains trial 1 and records the tune entry."""
    out = episode(tmp_path / "killed", "tune", model, [Kill("entry-recorded", nth=1)], references("tune"), runner)
    assert out.ok and out.invocations == 2, out.problems


def test_the_checks_see_an_under_count_a_changed_adapter_and_a_leftover_state(tmp_path: Path, model: Path, runner):
    """The checks can fail: against an uninterrupted run (its own: this test changes its folder), a journalled step
    past what its epoch charged, a step with less noise than charged, a missing step, a charge below an uninterrupted
    run's, a missing model card, a run state left behind and a changed adapter byte are each reported."""
    ref = reference(tmp_path / "reference", "train", model, runner)
    s, events = ref.scene, journal_events(ref.journal)
    assert spend_problems(s, events, ref.eps) == [] and hash_problems(s) == []

    steps = [e for e in events if e["event"] == "step"]
    last_in_0 = max((e for e in steps if e["epoch"] == 0), key=lambda e: e["step"])
    extra = {**last_in_0, "step": last_in_0["step"] + 1}  # a fifth step in a ledger epoch charged for four
    assert any("charged 4 steps there" in p for p in spend_problems(s, [*events, extra], ref.eps))
    quiet = {**steps[0], "noise": {k: v / 2 for k, v in steps[0]["noise"].items()}}
    assert any("used noise std" in p for p in spend_problems(s, [quiet if e is steps[0] else e for e in events],
                                                            ref.eps))
    assert any("an uninterrupted run's" in p for p in spend_problems(s, events, {"pub": ref.eps["pub"] + 1}))
    assert any("the steps journalled are" in p for p in spend_problems(s, [e for e in events if e is not steps[3]],
                                                                        ref.eps))

    output = s.runs["test-run"]
    (output / "README.md").unlink()
    assert hash_problems(s) == ["test-run: the model card absent"]
    shutil.copy(output / "adapter_config.json", output / "run-state.safetensors")
    assert any("its run state" in p for p in hash_problems(s))
    weights = output / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b" ")
    assert any("the run entry records" in p for p in hash_problems(s))
