"""A run's state (`train/run.py`): saved, and read back to resume.

The run state (`state_file`: safetensors and typed JSON under the ledger key's MAC) is what lets a killed run go on
without under-counting: `snapshot` is what the lead saves, `load_state` / `save_state` read and write the file, and
`start` takes the run's id and lease from it (or makes them, for a fresh run) and puts back the weights, the update's
and the privatizer's state, and where the run stands, after refusing a state no run of this config and ledger saves
(`check_ledger`, `check_plan`). Several processes: the lead starts, and the others take what it `shared` (`follow`).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from govtrain import units
from govtrain.errors import Code, ConfigError, RejectedError
from govtrain.train import corpus, state_file
from govtrain.train.config import RunConfig
from govtrain.train.lease import owner_setting, trial_of_recorded_tune
from govtrain.train.preflight import Plan, consent_error
from govtrain.train.prepare import partition
from govtrain.train.resume import check_recorded_entry, check_state_shapes, recorded_entry
from govtrain.train.state_key import StateKey


@dataclass
class RunResult:
    run_id: str
    steps: int
    epochs: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    eps_by_class: dict[str, list[float]] = field(default_factory=dict)  # max cumulative eps per class, per epoch
    adapter_sha256: bytes | None = None
    exhausted: bool = False
    nonfinite: int = 0  # units whose gradient was not finite (each contributed zero), over the run's steps
    plan: "Plan | None" = None  # a check's plan (`govtrain train --check`); None for a run that trained


def save_state(path: Path, state: dict, key: StateKey) -> None:
    # 0600 from its creation, never through a link planted at its temporary: it holds the sampling key, which decides
    # every step's draw (`routing/sampler.py`). Tensors and plain data only, never a pickle (`state_file`), under a
    # MAC of the ledger's key (`state_key`): the folder's writer holds no key, so cannot write a state a run trusts.
    state_file.write(path, state, key)


def load_state(path: Path, config: RunConfig, key: StateKey) -> dict | None:
    # refused unread unless ours and 0600, and undecoded unless written by this ledger's key; nothing in it runs code
    state = state_file.read(path, key)
    if state is None:
        return None
    if state["config_sha256"] != config.sha256:
        raise ConfigError(Code.OUTPUT_TAKEN, f"{path} holds the state of a run with another config: training.output "
                                             "is that run's; restore its config to resume it, or give this run "
                                             "another training.output")
    named = config.file.training.run_id
    if named is not None and state["run_id"] != named:  # a state of this ledger's, for another run of this config
        raise ConfigError(Code.OUTPUT_TAKEN, f"{path} holds the state of run {state['run_id']!r}, not of "
                                             f"training.run_id {named!r}: training.output is that run's; give this "
                                             "run another training.output")
    return state


def snapshot(run) -> dict:
    """The run state `Run._save` writes: trainable weights (a sharded model's as gathered after the last step), the
    update's state, the pending epoch with its plan, and the privatizer's noise state."""
    result = run.result
    return {
        "run_id": result.run_id, "run_nonce": run.run_nonce, "sampling_key": run.sampler.key,
        "config_sha256": run.config.sha256, "ledger": run.ledger.identity, "confirmed": run.confirmed,
        "step": result.steps, "nonfinite": result.nonfinite,
        "losses": result.losses, "epochs": result.epochs, "eps_by_class": result.eps_by_class,
        "pending": run.pending,
        "corpus": run.corpus,  # what each unit's identity names (train/corpus.py): plain JSON data
        "schedule": run.update.hyperparameters.schedule.record(),  # what the steps so far were taken under
        "trainable": dict(run._whole["trainable"]) if run.sharded else
        {n: p.detach().clone() for n, p in run.model.named_parameters() if p.requires_grad},
        "update": run._whole["update"] if run.sharded else run.update.state_dict(),
        # the privatizer's state: as secret as the noise it determines (whoever holds it can subtract it)
        "noise": {"privatizer": run.privatizer.record(),
                  "state": run.privatizer.state_dict(run.router.noise_state)}}


def start(run, state: dict | None) -> dict:
    """(The lead's.) The run's id and lease: resumed from its state, or new; consent; the claim. Returns what the
    other ranks take from it (`_follow`)."""
    import torch

    config, ledger, log, policy = run.config, run.ledger, run.log, run.policy
    training, present, records = config.file.training, run.present, run._records
    expected_batch, q_u = run.expected_batch, run._q_u
    run_id = training.run_id or f"run-{run.now()}-{os.urandom(4).hex()}"
    run.result = result = RunResult(run_id, 0)
    book = ledger.spend_book()
    run.resumed = state is not None
    if state is not None:
        run_id = result.run_id = state["run_id"]
        run.run_nonce, run.sampler.key = state.get("run_nonce"), state.get("sampling_key")
        partition(run.sampler, run_id)
        run._check_ledger(state, book)
        run._check_plan(state)
        if run.sampler.key is None:
            raise ConfigError(Code.RUN_CONFIG_INVALID, f"{run.state_path} was written by an earlier govtrain (no "
                                                       "lease or sampling key): finish that run with it, or move "
                                                       "the file away and start afresh")
        if run.run_nonce is None or book.leases.get(run_id, run.run_nonce) != run.run_nonce:
            raise RejectedError(Code.RUN_ID_TAKEN, f"run {run_id!r}'s spend was written under another lease than "
                                                   f"{run.state_path} holds: another run took this id; move the "
                                                   "state file away and give this run another training.run_id")
        if run_id in book.finished:  # a kill came after the run entry: finish() completes the rest, if it is ours
            run._entry = recorded_entry(ledger, run_id)  # as a checkpoint signs it, never an unsigned row
            check_recorded_entry(run._entry, config=config, base_sha256=run.base_sha256,
                                 run_nonce=run.run_nonce, state_path=run.state_path)
        run.recorded = run._entry is not None
        if not run.recorded:  # it draws again: its surviving units must keep their identities
            corpus.check(state.get("corpus"), run.corpus, run.state_path)
        run.corpus = corpus.merge(state.get("corpus"), run.corpus)
        # kept from the first state on: every state is saved after the schedule was fixed (at an epoch's
        # write-ahead, or a pause), and a kill before the first checkpoint may come after steps that showed their
        # loss, so a schedule chosen again then would follow the data (issue 34, review of item 8)
        run.schedule = state["schedule"]
        check_state_shapes(state, run.model, run.update, run.state_path)  # before anything is put back
        result.steps, result.losses = state["step"], state["losses"]
        result.nonfinite = state["nonfinite"]
        result.epochs, result.eps_by_class = state["epochs"], state["eps_by_class"]
        if run.sharded:  # every rank puts back its shards of them (`_share_weights`)
            run._resume = (state["trainable"], state["update"])
        else:
            with torch.no_grad():
                for name, value in state["trainable"].items():
                    run.model.get_parameter(name).copy_(value)
            try:
                run.update.load_state_dict(state["update"])
            except (KeyError, TypeError, ValueError, IndexError) as e:  # no update of this run's saved it
                raise ConfigError(Code.RUN_STATE_INVALID, f"{run.state_path}: its optimizer state does not fit "
                                                          f"this run's update ({type(e).__name__}: {e}): restore "
                                                          "the file the run saved, or move it away") from None
        run._load_noise_state(state.get("noise"))
        run.pending = state["pending"]
        if run.pending is not None and ledger.epoch() > run.pending["epoch"]:
            run.pending = None  # the epoch was closed just before the kill
        run.confirmed = run.confirm or bool(state.get("confirmed"))
        if run.recorded:
            result.exhausted = result.steps < run.total
            log(f"{run_id} recorded its run entry before it was stopped: finishing it")
        else:
            log(f"resuming {run_id} at step {result.steps}")
    elif book.used(run_id):
        raise ConfigError(Code.RUN_CONFIG_INVALID, f"training.run_id: run {run_id!r} already wrote spend or a run "
                                                   "entry to this ledger; resume it from its state file, or give "
                                                   "this run another id")
    elif (tune := trial_of_recorded_tune(ledger, run_id)) is not None:
        raise ConfigError(Code.RUN_CONFIG_INVALID, f"training.run_id: {run_id!r} names a trial of tune {tune!r}, "
                                                   "which the ledger records: its total would no longer hold; "
                                                   "give this run another id")
    else:
        run.run_nonce = os.urandom(16)  # a one-time lease on the id: every spend and the run entry carry it
        # The sampling key fixes each step's draw (`PoissonSampler.at_step`): secret, in the run state only.
        run.sampler.key = (os.urandom(32) if run.insecure_seed is None
                            else hashlib.sha256(b"govtrain insecure sampling key %d" % run.insecure_seed).digest())
        partition(run.sampler, run_id)
    # Consent: contributions runs other than this one (and its siblings) charged. A run that started confirmed
    # keeps its consent in its state; an unconfirmed one is asked again here, and at each write-ahead (under the
    # ledger's write lock: another run may charge them between this read and that write).
    mine = {run_id, *run.siblings}
    run.charged_before = {c for c in present if book.charged_by.get(c, set()) - mine}
    run.export = run._release(run._artifact_record(run_id))
    if run.check or run.charged_before:
        run.plan = run.projection()
    if run.charged_before and not run.check and not run.recorded:  # a recorded run charges nothing more
        if not run.confirmed:
            raise consent_error(run.plan)
        log(f"note: {len(run.charged_before)} contribution(s) were charged by other runs before; charging them "
            f"again as confirmed ({run.plan.epsilons()})")
    if not run.check:
        run._claim()
    drawn = (f"{expected_batch:g} of {records} examples from {len(present)} contributions" if
             run.per_contribution is None else f"{expected_batch:g} of {len(present)} contributions, at most "
             f"{run.per_contribution} examples each: ε per contribution")
    log(f"{run_id}: {run.total} {training.mechanism} steps, q = {q_u / units.MICRO:g} (expected batch {drawn}), "
        f"{policy.accountant} at δ = {policy.delta_p / 1e12:g}"
        + (f", {run.world.size} processes" if run.world.many else ""))
    return run._shared() if run.world.many else {}


def shared(run) -> dict:
    """What the other ranks take from the lead's `_start`: the run's id and lease, and where it stands. Never
    the sampling key or the noise state: only the lead draws."""
    result = run.result
    return {"run_id": result.run_id, "run_nonce": run.run_nonce, "resumed": run.resumed,
            "recorded": run.recorded, "steps": result.steps, "losses": list(result.losses),
            "nonfinite": result.nonfinite, "schedule": run.schedule,
            "epochs": list(result.epochs), "eps_by_class": result.eps_by_class, "exhausted": result.exhausted,
            "pending": run.pending, "confirmed": run.confirmed, "charged_before": sorted(run.charged_before),
            "plan": run.plan, "owner": run._owner}


def follow(run, shared: dict) -> None:
    """A follower takes the lead's run id, lease and place (`_shared`), once it reads the lead's claim on the run in
    its own view of the ledger store: a rank opened on another store (a copy of the ledger file) is refused here,
    before any spend is written."""
    lease = (shared["run_id"], shared["run_nonce"])
    if not run.check and run.ledger.store.setting(owner_setting(lease)) != shared["owner"]:
        raise ConfigError(Code.RANK_MISMATCH, f"rank {run.world.rank} does not read the lead's claim on run "
                                              f"{shared['run_id']!r} in its ledger: it opened another store (a "
                                              "copy of the ledger?); give every rank the lead's ledger URL")

    run.result = result = RunResult(shared["run_id"], shared["steps"])
    result.losses, result.epochs, result.eps_by_class = shared["losses"], shared["epochs"], shared["eps_by_class"]
    result.exhausted, result.nonfinite = shared["exhausted"], shared["nonfinite"]
    run.schedule = shared["schedule"]
    run.run_nonce, run.resumed, run.recorded = shared["run_nonce"], shared["resumed"], shared["recorded"]
    run.pending, run.confirmed, run.plan = shared["pending"], shared["confirmed"], shared["plan"]
    run.charged_before = set(shared["charged_before"])
    run.export = run._release(run._artifact_record(result.run_id))


def check_ledger(run, state: dict, book) -> None:  # type: ignore[no-untyped-def]
    """Refuse (`output_taken`) a run state written against another ledger, or one that took steps under a
    lease this ledger never recorded: its steps were charged there (or nowhere), and this ledger's run
    entry would name an adapter that carries them while it charged only the steps taken here."""
    recorded = state.get("ledger")
    if recorded is not None and tuple(recorded) != run.ledger.identity:
        origin = recorded[0] if recorded else "?"
        raise ConfigError(Code.OUTPUT_TAKEN, f"{run.state_path} holds the state of run {state['run_id']!r} on "
                                             f"another ledger ({origin!r}, another header): its steps were "
                                             "charged there; resume it against that ledger, or give this run "
                                             "another training.output")
    if state["step"] > 0 and state["run_id"] not in book.leases:
        raise ConfigError(Code.OUTPUT_TAKEN, f"{run.state_path} holds run {state['run_id']!r} at step "
                                             f"{state['step']}, but this ledger records no spend under its "
                                             "lease: its steps were charged elsewhere or not at all; resume it "
                                             "against the ledger that charged them, or give this run another "
                                             "training.output")


def check_plan(run, state: dict) -> None:
    """Refuse (`run_state_invalid`) a state whose place or plan no run of this config saves: a step past the
    run's, a plan whose steps leave the run's or do not hold its step, or one that lets units be drawn with no
    spend to charge them (a plan with no spend allows nothing). The MAC already keeps such a state out; this keeps
    a held epoch's noise and steps the ledger's even if a defect elsewhere wrote one."""
    pending, step = state["pending"], state["step"]
    wrong = None
    if step > run.total:
        wrong = f"it stands at step {step} of a run of {run.total}"
    elif pending is not None:
        first, steps = pending["first_step"], pending["steps"]
        if first + steps > run.total or not first <= step <= first + steps:
            wrong = f"its plan's steps {first}..{first + steps} leave the run's {run.total} or miss its step {step}"
        elif not pending["spend"] and any(pending["allowed"].values()):
            wrong = "its plan lets units be drawn with no spend that charges them"
    if wrong is not None:
        raise ConfigError(Code.RUN_STATE_INVALID, f"{run.state_path} is not a state a run saves ({wrong}): "
                                                  "restore the file the run saved, or move it away")


def load_noise_state(run, saved: dict | None) -> None:
    """The privatizer's state as the run state saved it, so the noise stream goes on exactly where it was
    (a state with none, written before privatizers or by the i.i.d. Gaussian, starts it afresh)."""
    if saved is None:
        if run.privatizer.correlated:
            raise ConfigError(Code.OUTPUT_TAKEN, f"{run.state_path} holds no noise state, and privatizer "
                                                 f"{run.privatizer.name!r} correlates its noise across steps: "
                                                 "it cannot go on from there; give this run another "
                                                 "training.output")
        return
    if saved.get("privatizer") != run.privatizer.record():
        raise ConfigError(Code.OUTPUT_TAKEN, f"{run.state_path} holds the noise state of another privatizer "
                                             f"({saved.get('privatizer')!r}): training.output is that run's")
    try:
        run.router.noise_state = run.privatizer.load_state(run.router.noise_slots.slots, saved["state"])
    except ValueError as e:
        raise ConfigError(Code.OUTPUT_TAKEN, f"{run.state_path}: its noise state does not fit this run's "
                                             f"slots ({e}): training.output is another run's") from e
