"""Review of issue 34 item 3's fix (the run state as safetensors and typed canonical JSON): what a VALID run state
can still do.

Adversary: someone who can write the run's output folder between a kill and the resume, as the run's user (a
shared volume, a sync job, a second container with the same uid: the only writer whose file `state_file.read`
accepts at all, since it must be this user's and 0600). They hold no key. They can read the killed run's state and
write back any state `state_file.write` would write: the format is canonical, not authenticated, so "exactly what
govtrain writes" is a property of the bytes, never of who wrote them.

The resume trusts most of the state's fields (docs/threat-model.md: "a state is no proof of whose it is, so it is
checked against this config, this ledger and the lease the ledger records"). Checked: config hash, run id, the
ledger's identity, the lease, the corpus record, the trainable and optimizer shapes, the privatizer record, and a
held epoch's plan (`lease.written_plan`) -- but only when the state's plan lists some spend. Trusted as written:
`step`, `pending.first_step`, the whole plan (`steps`, `allowed`, `group_std`) when its `spend` is empty,
`confirmed` (consent), `nonfinite`, `sampling_key`, the values of `trainable` and `update` (non-finite ones are
caught, by accident, as `ungoverned_update`: NaN != NaN), and the keys of the `dict`-typed fields.

Each test below FAILS on the code under review and passes once the defect is fixed; each docstring says the attack,
its impact and the behaviour expected.

The fix authenticates the run state (`govtrain/train/state_key.py`: HMAC-SHA256 under a key derived from the ledger's
signing key), so the adversary's states here are written with govtrain's own writer under a key of their own
(`tests/run_state_keys.py`), and each is refused (`run_state_invalid`) before anything in it is used. The checks
behind the MAC (a plan with no spend, a held epoch's plan from the ledger, fields no run saves) are tested with
states sealed under the ledger's own key in tests/test_attacks_run_state_mac.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from govtrain.errors import GovtrainError  # noqa: E402
from tests.conftest import Corpus, snapshot  # noqa: E402
from tests.test_attacks_run_state import QUIET, _killed  # noqa: E402
from tests.test_train import _config, tiny_model  # noqa: E402,F401

CHARGED_STD = 1.0  # the group noise the ledger's spend for epoch 0 records (s_pu 1e12 / PICO): `_killed`'s run
CHARGED_STEPS = 4  # the steps the ledger's spend for epoch 0 charges (training.steps = 4, one epoch)
TAKEN = 2  # the steps `_killed`'s run took before the kill


def _craft(config, edit, corpus: Corpus) -> None:  # type: ignore[no-untyped-def]
    """Read the killed run's state (the folder's writer can read it: it is their user's), `edit` it in place, write it
    back with govtrain's own writer: a state file `state_file.read` accepts in every respect (0600, ours, canonical,
    typed) but one, since the run state is authenticated: its MAC is under a key of the writer's, who holds no
    ledger key (`tests/run_state_keys.py`)."""
    from govtrain.train import state_file
    from tests.run_state_keys import attacker_key, ledger_key, write_unchecked

    path = config.output_dir / state_file.STATE_FILE
    state = state_file.read(path, ledger_key(corpus))
    edit(state)
    write_unchecked(path, state, attacker_key(corpus))  # their own writer: govtrain's, without its field checks


def _spend_of(corpus: Corpus, run_id: str) -> list[dict]:
    from govtrain.ledger.ledger import Ledger
    from govtrain.ledger.verified import verified_entries

    with Ledger.open(corpus.url) as ledger:
        return [e.entry for e in verified_entries(ledger.store)
                if e.kind == "spend" and e.entry is not None and e.entry["run_id"] == run_id]


def _recorded(corpus: Corpus, run_id: str) -> bool:
    with corpus.open() as ledger:
        return run_id in ledger.spend_book().finished


def _resume_recording_steps(corpus: Corpus, config,  # type: ignore[no-untyped-def]
                            monkeypatch) -> tuple[list[tuple[int, dict]], Exception | None]:
    """Resume `config` with `train()`; every governed step's (step, group noise std) as `Run.move` released it."""
    from govtrain.train import run as run_module
    from govtrain.train.loop import train

    moved: list[tuple[int, dict]] = []
    original = run_module.Run.move

    def move(self):  # type: ignore[no-untyped-def]
        moved.append((self.result.steps, {tuple(sorted(g)): s for g, s in self._group_std.items()}))
        return original(self)

    monkeypatch.setattr(run_module.Run, "move", move)
    try:
        train(config, corpus.url, insecure_seed=1, **QUIET)
    except GovtrainError as e:
        return moved, e
    return moved, None


# -- 1. a plan without spend is trusted whole: its noise, its steps, its contributions -----------------------------

def test_a_state_plan_without_spend_trains_uncharged_steps_below_the_charged_noise(corpus: Corpus, tiny_model: Path,
                                                                                   monkeypatch):
    """Attack: between the kill and the resume, set the state's `pending.spend` to [] and keep (or widen) its
    `allowed`, `steps` and `group_std`: here group_std 1e-9 (the ledger charged 1.0) and 40 steps (the ledger
    charged 4, and training.steps is 4).

    Why it works: `Run._write_ahead` writes and cross-checks the plan against the ledger only `if pending["spend"]`
    (`lease.written_plan` replaces allowed, q, steps and group_std with what the ledger charged). An empty spend list
    skips both, `_charged_rates` stays None (no `sampling_mismatch`), and `_epoch_written` takes `allowed` and
    `group_std` from the state as they are; `GovernedRun.batches` then steps until `pending.steps` (not
    `training.steps`).

    Impact (privacy, HIGH): admitted rows are trained on with noise a billionth of the charged noise, for ten times
    the charged steps, and the ledger records nothing for them: epsilon is unbounded while the ledger and the card
    show the epoch's original charge.

    Expected: the resume refuses a plan whose spend is empty but which allows any step (`run_state_invalid` or
    `output_taken`), or the plan of every epoch the ledger holds under this lease is always taken from the ledger
    (`written_plan`), and a plan with no spend allows nothing. Either way no governed step releases noise below
    what the ledger charged, and no more steps run in the epoch than it charged."""
    config = _killed(corpus, tiny_model)

    def edit(state: dict) -> None:
        pending = state["pending"]
        pending["spend"] = []
        pending["steps"] = 40
        pending["allowed"] = {c: 40 for c in pending["allowed"]}
        pending["group_std"] = {g: 1e-9 for g in pending["group_std"]}

    _craft(config, edit, corpus)
    moved, refused = _resume_recording_steps(corpus, config, monkeypatch)
    below = [(step, std) for step, std in moved if min(std.values()) < CHARGED_STD]
    spend = _spend_of(corpus, "test-run")
    assert not below, (f"{len(below)} governed steps released noise below the charged {CHARGED_STD} "
                       f"(e.g. step {below[0][0]}: {below[0][1]}); the ledger's spend for the run: "
                       f"{[(e['epoch'], e['steps'], e['noise_multiplier_u']) for e in spend]}; run entry recorded: "
                       f"{_recorded(corpus, 'test-run')}; refused: {refused!r}")
    assert TAKEN + len(moved) <= CHARGED_STEPS, f"{TAKEN + len(moved)} steps in an epoch charged for {CHARGED_STEPS}"


def test_a_state_planted_in_an_empty_folder_trains_a_whole_run_with_no_spend_that_verifies(
        corpus: Corpus, tiny_model: Path, monkeypatch):
    """Attack: the same hole, without any earlier run of this config. The attacker plants, in a fresh run's empty
    output folder, a state for its `training.run_id` with a lease of their own (no spend under it yet: the lease
    check `book.leases.get(run_id, nonce) != nonce` passes), `step` 0 (so `_check_ledger` asks for no lease in the
    ledger), `confirmed` true (consent is read from the state: no `charged_before`), this config's hash, the
    ledger's identity and the corpus record (public, or copied from any earlier state of theirs), and a plan with
    `spend` [], 40 allowed steps and group_std 1e-9.

    Impact (privacy, HIGH): `govtrain train` trains 40 steps (training.steps is 4) on the admitted rows with noise
    1e-9, writes no spend at all, and records a run entry: `verify_ledger` passes and `verify_adapter` accepts the
    adapter ("no spend"), with its model card. The released adapter is a nearly noiseless model of the data that the
    ledger says cost nothing.

    Expected: refused before any step (`run_state_invalid` or `output_taken`): a resume needs a state the run
    itself saved against this ledger store, and a plan that allows steps needs the ledger's spend for them."""
    from govtrain.release.verify import verify_adapter
    from govtrain.train import state_file
    from govtrain.train.config import load_run_config
    from govtrain.verify.verifier import verify_ledger

    from tests.run_state_keys import attacker_key, ledger_key

    template = state_file.read(_killed(corpus, tiny_model).output_dir / state_file.STATE_FILE,  # any state of theirs
                               ledger_key(corpus))
    path = _config(corpus, tiny_model, 4)
    path.write_text(path.read_text().replace('run_id = "test-run"', 'run_id = "fresh-run"')
                    .replace('output = "adapter"', 'output = "fresh"'))
    config = load_run_config(path)
    with corpus.open() as ledger:
        epoch = ledger.epoch()
    planted = dict(template, run_id="fresh-run", run_nonce=os.urandom(16), sampling_key=os.urandom(32),
                   config_sha256=config.sha256, confirmed=True, step=0, losses=[], epochs=[], eps_by_class={})
    planted["pending"] = dict(template["pending"], epoch=epoch, first_step=0, steps=40, spend=[],
                              allowed={c: 40 for c in template["pending"]["allowed"]},
                              group_std={g: 1e-9 for g in template["pending"]["group_std"]})
    state_file.write(config.output_dir / state_file.STATE_FILE, planted, attacker_key(corpus))  # they hold no key

    moved, refused = _resume_recording_steps(corpus, config, monkeypatch)
    below = [step for step, std in moved if min(std.values()) < CHARGED_STD]
    spend, recorded = _spend_of(corpus, "fresh-run"), _recorded(corpus, "fresh-run")
    assert not (recorded and not spend), (f"run fresh-run is recorded with no spend at all after {len(moved)} steps, "
                                          f"{len(below)} of them at noise 1e-9; the ledger verifies: "
                                          f"{verify_ledger(corpus.url).error is None}; verify_adapter: "
                                          f"{verify_adapter(config.output_dir, corpus.url)}; refused: {refused!r}")
    assert not below, f"{len(below)} steps at noise below the policy's; spend {spend}; refused: {refused!r}"


# -- 2. `step` is trusted: steps the epoch already paid for are taken again on weights that took them -------------

def test_a_state_with_its_step_lowered_trains_more_steps_than_the_epoch_charged(corpus: Corpus, tiny_model: Path,
                                                                                 monkeypatch):
    """Attack: between the kill (after 2 of the epoch's 4 charged steps) and the resume, set the state's `step` to 0
    and keep its `trainable` weights, `update` (optimizer) state and plan.

    Why it works: `step` is never checked against anything. The epoch's plan is the ledger's (its spend is not
    empty), but the place in it is `result.steps - pending["first_step"]`, both from the state; the resumed run
    takes steps 0..3 again on weights that already moved by steps 0 and 1, drawing the same rows (same key, same
    step) with fresh noise. (Raising `pending.first_step` does the same where training.steps leaves room; a new
    `sampling_key` makes the re-taken steps draw other rows.) A kill alone re-runs steps too, but with the weights
    of the state it resumes from, so only one noised copy of each step is ever in the released weights; here two
    are.

    Impact (privacy, MEDIUM): the released adapter carries 6 noised steps over an epoch the ledger charged for 4;
    repeated at every resume, each step's rows are released any number of times while charged once.

    Expected: a state is bound to the ledger store it was saved against (e.g. its sha256 recorded under the lease
    at each save, like the owner claim, and compared on resume), so an edited `step`/`first_step` is refused
    (`run_state_invalid`) and no step is trained; or at least no more governed steps run in an epoch than it
    charged."""
    config = _killed(corpus, tiny_model)
    _craft(config, lambda state: state.update(step=0, losses=[]), corpus)
    moved, refused = _resume_recording_steps(corpus, config, monkeypatch)
    assert TAKEN + len(moved) <= CHARGED_STEPS, (f"the epoch charged {CHARGED_STEPS} steps; {TAKEN} were taken "
                                                 f"before the kill and {len(moved)} more after the resume (steps "
                                                 f"{[s for s, _ in moved]}); refused: {refused!r}")


# -- 3. the reader reads the whole file before it looks at the header's length ------------------------------------

_READ = textwrap.dedent("""
    import resource, sys
    from pathlib import Path
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))  # the test's memory, not the machine's
    from govtrain.errors import GovtrainError
    from govtrain.train import state_file
    try:
        state_file.read(Path(sys.argv[1]), None)  # refused before any key is used
    except GovtrainError as e:
        print(e.line())
""")


def test_a_state_file_declaring_a_huge_header_is_refused_in_one_line_without_reading_it(tmp_path: Path):
    """Attack: at the run state's name, a 0600 file of this user's that is 1 TiB long (sparse: it costs nothing on
    disk) and whose first 8 bytes declare a header of all of it.

    Why it works: `state_file.read` checks the file's kind, owner and mode, then `handle.read()`s all of it, and only
    `decode` looks at the header's length. Python asks for a 1 TiB buffer: MemoryError (a traceback, not a refusal)
    where the allocation is refused, and where memory is overcommitted the zeros are read into it until the kernel
    kills the process (or another on the machine). safetensors itself refuses a header over 100 MB before reading it.

    Impact (availability, LOW-MEDIUM): `govtrain train` resuming from the folder dies with a traceback or takes the
    machine's memory, instead of the documented one-line refusal.

    Expected: the 8-byte length is read first and a header longer than safetensors' limit (or a file larger than any
    state this run can write) is refused, `error[run_state_invalid]: ...` in one line, before the rest is read.
    Run in a child process held to 8 GiB of address space."""
    path = tmp_path / "run-state.safetensors"
    size = 1 << 40
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as handle:
        handle.write((size - 8).to_bytes(8, "little") + b'{"__metadata__":')
        handle.truncate(size)
    done = subprocess.run([sys.executable, "-c", _READ, str(path)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = done.stdout.strip()
    assert done.returncode == 0 and out.startswith("error[run_state_invalid]: ") and "\n" not in out, \
        f"exit {done.returncode}: {(done.stderr or out).strip().splitlines()[-1:]}"


# -- 4. fields whose values no run saves are used as they are ----------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("pending", {}),
    ("pending", {"epoch": "0"}),
    ("noise", {"privatizer": {"name": "gaussian"}}),
    ("update", {}),
    ("step", -40),
    ("nonfinite", -10**9),
])
def test_a_state_whose_fields_hold_what_no_run_saves_is_refused_in_one_line(corpus: Corpus, tiny_model: Path,
                                                                            field: str, value: object):
    """Attack: a valid state file whose `pending`, `noise` or `update` is a map without the keys the run reads
    (FIELDS types them `dict` only: "plain data checked where it is used"), or whose `step` or `nonfinite` is
    negative (FIELDS: `int`, any).

    Impact (availability, LOW): the resume dies with a Python traceback from inside `Run._start` or the first draw
    (KeyError, TypeError, ValueError from `Update.load_state_dict`, OverflowError from `PoissonSampler.at_step` for
    a negative step) instead of the documented one-line refusal. A negative `nonfinite` is resumed silently: it
    lifts training.max_nonfinite_units (`diverged`) by that much for the rest of the run.

    Expected: `error[run_state_invalid]` (or `output_taken`), one line, the ledger and the folder unchanged: the
    state's plan and noise records are checked for their keys and types when read (`state_file`), as `corpus` is
    (`corpus_changed`), counts are not negative, and `Update.load_state_dict` raises a coded error."""
    from govtrain.train.loop import train
    from tests.test_attacks_run_state import _files

    config = _killed(corpus, tiny_model)
    _craft(config, lambda state: state.update({field: value}), corpus)
    before, files = snapshot(corpus.url), _files(config.output_dir)
    try:
        train(config, corpus.url, insecure_seed=1, **QUIET)
    except GovtrainError as e:
        assert e.code.value in ("run_state_invalid", "output_taken") and "\n" not in e.line(), e.line()
    except Exception as e:  # noqa: BLE001 - the defect: anything but a coded refusal
        pytest.fail(f"the resume crashed with {type(e).__name__}: {e!r}, not a one-line refusal")
    else:
        pytest.fail(f"a state with {field} = {value!r} was resumed")
    assert snapshot(corpus.url) == before and _files(config.output_dir) == files


# -- 5. consent is read from the state -----------------------------------------------------------------------------

def test_a_state_with_confirmed_set_charges_contributions_other_runs_charged_without_consent(corpus: Corpus,
                                                                                             tiny_model: Path):
    """Attack: run test-run, started without --yes, is killed; another run then charges the same contribution. Before
    the resume, set the state's `confirmed` to true.

    Why it works: `Run._start` takes `self.confirmed = self.confirm or bool(state["confirmed"])`, and a confirmed
    run is asked nothing (`charged_before`) at the start nor at its write-ahead (`consent=None`).

    Impact (budget, LOW): the operator's run spends more of contributions' budgets that other runs already charged,
    which the operator never consented to (`docs/budget-safety.md`: "an unconfirmed one is asked again here, and at
    each write-ahead"); the budgets' caps still hold.

    Expected: `charged_before` (exit 2), nothing written: consent given at the start of a run is bound to the run's
    ledger store (or asked again), not taken from a file anyone who writes the folder can edit."""
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import train

    config = _killed(corpus, tiny_model)
    other = _config(corpus, tiny_model, 4)
    other.write_text(other.read_text().replace('run_id = "test-run"', 'run_id = "other-run"')
                     .replace('output = "adapter"', 'output = "other"'))
    train(load_run_config(other), corpus.url, insecure_seed=2, confirm=True, **QUIET)  # charges pub again
    before = len(_spend_of(corpus, "test-run"))
    with pytest.raises(GovtrainError) as unconfirmed:  # the control: as saved, the resume asks for consent
        train(config, corpus.url, insecure_seed=1, **QUIET)
    assert unconfirmed.value.code.value == "charged_before", unconfirmed.value.line()

    _craft(config, lambda state: state.update(confirmed=True), corpus)
    try:
        train(config, corpus.url, insecure_seed=1, **QUIET)
    except GovtrainError as e:
        refused: GovtrainError | None = e
    else:
        refused = None
    charged = len(_spend_of(corpus, "test-run")) - before
    # the edit is refused before consent is read (its MAC is not the ledger key's), or consent is asked
    assert refused is not None and refused.code.value in ("charged_before", "run_state_invalid") and charged == 0, \
        f"the resume charged {charged} more spend entries without consent; refused: {refused!r}"
