"""A training run as named phases (docs/design.md §5): prepare, then per ledger epoch plan → write ahead →
step … → close, then finish.

`prepare` reads the corpus from the ledger, matches the data, loads the model onto its device, resolves
every class's profile and probes the router: everything that can refuse the run does so before any spend
is written. `plan_epoch` fixes an epoch's noise schedule from what the ledger says then (other runs'
spend, withdrawals, retirements) and saves the plan; `write_ahead` puts this run's spend for it in the
ledger before its steps run; `step` is one logical Poisson batch, computed in physical chunks under the
run's precision and privatized once by the router; `close_epoch` and `finish` close the ledger epoch and
record the run. The run state saved along the way lets a killed run resume without under-counting.

`Run` holds the run's state and strings the phases together; each phase's work is a module beside it, taking the
run: `prepare.py`, `state.py` (save and resume), `epoch.py`, `step.py`, `finish.py`. Which rank does what is said
here, through `World` (`distributed/world.py`), the same on one process as on N: the lead plans, writes and draws;
the others take its outcome.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Callable, Collection

from govtrain.distributed.world import World
from govtrain.errors import GovtrainError
from govtrain.ledger.ledger import Ledger
from govtrain.train import epoch, finish, prepare, state, state_file, step
from govtrain.train.config import RunConfig
from govtrain.train.lease import LOCK_FILE, check_owner, claim
from govtrain.train.preflight import Plan
# the run state's reader and writer, looked up here at each call (a test may stand in for either)
from govtrain.train.state import RunResult
from govtrain.train.state import load_state as _load_state
from govtrain.train.state import save_state as _save_state
from govtrain.train.state_key import StateKey
from govtrain.train.step import Chunk
from govtrain.train.withdrawals import Withdrawn

LOG = Callable[[str], None]
STATE_FILE = state_file.STATE_FILE


class BudgetExhausted(GovtrainError):
    """No contribution is eligible any more: every one is withdrawn or has spent its budget (exit 5)."""

    exit_code = 5


class Run:
    """One run of `config` against an open ledger. Drive it as `train()` does:

        run.prepare()
        while not run.done:
            if run.pending is None and not run.plan_epoch():
                break                   # nothing eligible: result.exhausted
            if not run.write_ahead():
                continue                # another run holds the epoch: plan the next one
            while not run.epoch_done:
                chunks = run.draw()         # the logical step's Poisson draw, in physical chunks
                for chunk in chunks:
                    batch = run.encode(chunk)
                    with run.forward(chunk):
                        output = run.model(**batch.inputs)
                    run.accumulate(chunk, run.task.per_example_loss(output, batch))
                run.apply()                 # noise once, then the update
            run.close_epoch()
        run.finish()

    `GovernedRun` (`governed.py`) is that loop as a library API: its `batches()` runs these phases and hands
    out the chunks, so a user's own loop, the Hugging Face Trainer and `govtrain train` take one path.

    Every phase reads the ledger it needs at that moment, so each can be interrupted (a kill) and the
    next call with the same config resumes from the saved state. `observe(step, ids)`, called by
    `GovernedRun` once a draw is recorded, sees the contributions drawn at each step (for tests and audits of
    the sampler).
    """

    def __init__(self, config: RunConfig, ledger: Ledger, *, insecure_seed: int | None = None, log: LOG = print,
                 now: Callable[[], int] = lambda: int(time.time()), checkpoint_every: int = 10,
                 observe: Callable[[int, list[str]], None] | None = None, confirm: bool = False,
                 check: bool = False, siblings: Collection[str] = (), world: World | None = None) -> None:
        # `world`: this process's place among the run's processes (`govtrain.distributed`; one process by default).
        # Only its lead writes (run state, ledger, adapter) and logs; the others follow it (docs/distributed.md).
        self.world = world = world or World.single()
        self.config, self.ledger, self.now = config, ledger, now
        self.log: LOG = log if world.lead else (lambda line: None)
        # `confirm`: charging contributions other runs charged is consented to; `check`: everything up to the first
        # write-ahead, then stop, writing nothing (no lock, no claim, no run state, no spend); `siblings`: the runs
        # whose charges need no consent besides this one (a search's other trials)
        self.confirm, self.check, self.siblings = confirm, check, frozenset(siblings)
        self.confirmed = confirm  # this run's consent, kept in its run state: set again by prepare
        self.plan: Plan | None = None  # what the run would charge, projected at prepare (check, or charged before)
        self.charged_before: set[str] = set()  # the run's contributions other runs (not its siblings) charged
        self.resumed = False  # prepare found the run's own state
        self.recorded = False  # prepare found the run's state and its run entry (a kill came between the two)
        # the learning rates' schedule the run's steps so far were taken under (its state's), which a resumed run keeps
        self.schedule: dict | None = None
        self._entry: dict | None = None  # that run entry, as a checkpoint signs it
        self.insecure_seed, self.checkpoint_every, self.observe = insecure_seed, checkpoint_every, observe
        self.total = config.file.training.steps
        self.state_path = config.output_dir / STATE_FILE
        self.result: RunResult | None = None  # set by prepare
        self.run_nonce: bytes | None = None  # the run's lease on its id, set by prepare (kept in the run state)
        self._lock = None  # the run state's lock, held from prepare to release
        self._owner: str | None = None  # this process's claim on the run in the ledger store, set by prepare
        self.pending: dict | None = None  # the epoch in progress and its plan, as the run state saves it
        self._group_std: dict[frozenset, float] = {}  # the epoch's noise per group, from its written plan
        self._retired_here: set[str] = set()  # retired by this run's written plans (affording no step leaves no spend)
        self._written = False  # the pending epoch's spend is in the ledger: its steps may run
        self._charged_rates: set[int] | None = None  # the sampling rates the pending epoch's spend charged
        self._loss_sum, self._drawn = 0.0, 0  # the logical step in progress
        self._withdrawn = Withdrawn(ledger.store, policy=ledger.policy)  # each step's withdrawals, from signed entries
        self.sharded = config.file.training.fsdp  # the model is sharded over the ranks (FSDP2, `distributed.fsdp`)
        self._whole: dict | None = None  # sharded: the trainable weights and update state, gathered after each step
        self._resume: tuple[dict, dict] | None = None  # sharded: the lead's run state weights, put back by every rank
        self._state_key: StateKey | None = None  # the run state's MAC key (`state_key`), derived when first needed

    @property
    def run_id(self) -> str:
        return self.result.run_id

    @property
    def state_key(self) -> StateKey:
        """(The lead's.) The run state's MAC key, from the ledger's signing key (`state_key`): never written or
        logged."""
        if self._state_key is None:
            self._state_key = StateKey.of(self.ledger)
        return self._state_key

    @property
    def done(self) -> bool:
        return self.result.steps >= self.total or self.recorded

    @property
    def epoch_done(self) -> bool:
        return self.result.steps >= self.pending["first_step"] + self.pending["steps"]

    # -- prepare: everything that can refuse the run, before any spend ---------------------------------

    def prepare(self) -> None:
        """Match the data to the admitted, not withdrawn contributions; load the model onto its device;
        resolve the profiles, probe the router and build the update, sampler and scheduler; then resume
        from the run state, or refuse a fresh run whose id already wrote spend. A refusal leaves no lock file
        it made."""
        lock = self.config.output_dir / LOCK_FILE
        made = not self.check and self.world.lead and not os.path.lexists(lock)
        try:
            self._prepare()
        except GovtrainError:
            if made:
                lock.unlink(missing_ok=True)  # held until `release`: a process that opened it first is refused
            raise

    def _prepare(self) -> None:
        from govtrain.distributed.agree import check_agreement, fingerprint, share_weights
        from govtrain.privatizers import check_microbatches

        config = self.config
        check_microbatches(config.file.noise)  # before anything is made: a refusal changes nothing
        self._warn_unsafe()
        world = self.world
        # Several processes (docs/distributed.md): each step of preparing is taken on every rank and its outcome
        # gathered (`together`), so a refusal on one rank stops all of them, before any spend is written.
        state = world.together(self._load)  # the lead's run state (the others read none)
        if world.many:  # every rank trains what the lead trains, or none does
            check_agreement(world, fingerprint(
                config_sha256=config.sha256, ledger=self.ledger.identity, base_sha256=self.base_sha256,
                owners=self.examples.owner, items=self.examples.items, model=self.model, reach=self._resolution.reach,
                processes=world.size, device=self.device.type, precision=self.precision,
                insecure_seed=self.insecure_seed, check=self.check))
        saved = world.broadcast((state or {}).get("noise") and {"privatizer": state["noise"].get("privatizer")})
        world.together(lambda: self._build(state.get("noise") if state is not None else saved))
        shared = world.from_lead(lambda: self._start(state))
        world.together(lambda: None if world.lead else self._follow(shared))
        if self.sharded:
            self._share_shards()
        else:
            share_weights(world, self.model, self.update, resumed=self.resumed)

    def _load(self) -> dict | None:
        """The data matched to the admitted contributions, the model on its device and its resolution
        (`prepare.load`); the lead's run state (None on the other ranks, and for a fresh run)."""
        prepare.load(self)
        if not self.world.lead or not state_file.present(self.state_path):
            return None
        return _load_state(self.state_path, self.config, self.state_key)

    def _build(self, saved: dict | None) -> None:
        prepare.build(self, saved)

    def _shard(self) -> None:
        prepare.shard(self)

    def _warn_unsafe(self) -> None:
        prepare.warn_unsafe(self)

    def _artifact_record(self, run_id: str):
        return prepare.artifact_record(self, run_id)

    def _release(self, record):
        return prepare.release_for(self, record)

    # -- the run's id, lease and state (`train/state.py`) ----------------------------------------------

    def _start(self, saved: dict | None) -> dict:
        return state.start(self, saved)

    def _shared(self) -> dict:
        return state.shared(self)

    def _follow(self, shared: dict) -> None:
        state.follow(self, shared)

    def _check_ledger(self, saved: dict, book) -> None:
        state.check_ledger(self, saved, book)

    def _check_plan(self, saved: dict) -> None:
        state.check_plan(self, saved)

    def _load_noise_state(self, saved: dict | None) -> None:
        state.load_noise_state(self, saved)

    def _save(self) -> None:
        """The run state (`state.snapshot`): trainable weights, the update's state and the pending epoch with its
        plan."""
        if self.check:
            raise RuntimeError("a check writes no run state")
        if not self.world.lead:  # the lead's state is the run's: the others hold what it holds
            return
        key = self.state_key
        _save_state(self.state_path, state.snapshot(self), key)

    # -- per ledger epoch (`train/epoch.py`) -----------------------------------------------------------

    def plan_epoch(self) -> bool:
        """Fix the next ledger epoch's schedule from what the ledger says now (q over the live records,
        s_g, sigma_eff, retirement) and save it to the run state before any of its spend is written, so a
        kill between the two cannot lose it. False, with `result.exhausted` set, when no contribution is
        eligible any more. Several processes: the lead plans, and the others take its plan."""
        planned, pending, exhausted = self.world.from_lead(
            lambda: (self._plan_epoch(), self.pending, self.result.exhausted))
        self.pending, self.result.exhausted = pending, exhausted
        return planned

    def write_ahead(self) -> bool:
        """Make sure this run's spend for the pending epoch is in the ledger (written now, or by this run
        before a kill) and set the epoch's sampling rate, steps per contribution and noise. False when
        another run holds the epoch: the plan is dropped and the caller plans the next epoch. Several processes: the
        lead writes, and every other rank reads the written spend back from the ledger before it takes a step."""
        if not self.world.many:
            return self._write_ahead()
        written, pending = self.world.from_lead(lambda: (self._write_ahead(), self.pending))
        if not self.world.lead:
            self.pending = pending
            if written:
                self._take_written()
        return written

    def projection(self) -> Plan:
        """What the run's remaining steps would charge, projected from what the ledger says now."""
        return epoch.projection(self)

    def close_epoch(self) -> None:
        """Close the ledger epoch (unless another run already did), record each class's epsilon and save."""
        epoch.close(self)

    def epsilons(self) -> dict[str, float]:
        """Each policy class's epsilon as charged so far (`epoch.epsilons`)."""
        return epoch.epsilons(self)

    def _plan_epoch(self) -> bool:
        return epoch.plan(self)

    def _write_ahead(self) -> bool:
        return epoch.write_ahead(self)

    def _epoch_written(self) -> None:
        epoch.written(self)

    def _take_written(self) -> None:
        epoch.take_written(self)

    def _drop_plan(self) -> None:
        epoch.drop_plan(self)

    def _corpus_now(self, corpus):
        return epoch.corpus_now(self, corpus)

    # -- a logical step (`train/step.py`) --------------------------------------------------------------

    def draw(self) -> list[Chunk]:
        """The next logical step's Poisson draw, as physical chunks; starts the router's step (`step.draw`)."""
        return step.draw(self)

    def encode(self, chunk: Chunk):  # type: ignore[no-untyped-def]
        """The task's batch of `chunk`'s examples, on the run's device."""
        return self.task.encode([self.items(chunk)[i] for i in chunk.indices], self.tokenizer,
                                self.config.file.model.max_length, self.device)

    def items(self, chunk: Chunk) -> list:
        """The examples `chunk.indices` index: the run's, or a filler's public one."""
        return self._filler if chunk.filler else self.examples.items

    @contextlib.contextmanager
    def forward(self, chunk: Chunk):  # type: ignore[no-untyped-def]
        """Where `chunk`'s forward runs: the router records the tapped calls, each example routed through the
        default adapter and its own class's adapter only (`routing/adapters.py`), under the run's precision."""
        with self.router.capture(chunk.classes, chunk.units), self._autocast():
            yield

    def accumulate(self, chunk: Chunk, losses, total: float | None = None) -> None:  # type: ignore[no-untyped-def]
        """Add `chunk`'s clipped gradients from its per-example `losses` (`step.accumulate`)."""
        step.accumulate(self, chunk, losses, total)

    @property
    def drawn_examples(self) -> int:
        """The examples of the logical step in progress that were stepped; once it has moved, of every rank's share."""
        return self._drawn

    def apply(self) -> float:
        """Close the logical step: the router's noise once per group, then the update (`move`), then the
        step's record (`record`). Returns the mean loss per example drawn (nan: empty batch)."""
        loss = self.move()
        self.record(loss)
        return loss

    def move(self) -> float:
        """The router's noise once per group, then the update; the step's mean loss (`step.move`)."""
        return step.move(self)

    def record(self, loss: float) -> None:
        """Count the step moved by `move`, and save the run state at a checkpoint."""
        step.record(self, loss)

    def rehearsal_std(self) -> dict[frozenset, float]:
        """The group noise the rehearsal's steps begin with (`step.rehearsal_std`)."""
        return step.rehearsal_std(self)

    def _lead_draw(self) -> list[list[list[int]]]:
        return step.lead_draw(self)

    def _draw(self, live) -> list[list[list[int]]]:
        return step.draw_units(self, live)

    def _chunks(self, drawn: list[list[list[int]]]) -> list[tuple[list[int], list[int] | None, int]]:
        return step.chunks(self, drawn)

    def _microbatches(self, at: int, count: int, names: Callable[[], list[str]]) -> list[list[int]]:
        return step.microbatches(self, at, count, names)

    def _filler_chunk(self) -> Chunk:
        return step.filler_chunk(self)

    def _count_nonfinite(self) -> None:
        step.count_nonfinite(self)

    def _check_rate(self) -> None:
        step.check_rate(self)

    # -- a sharded model (`training.fsdp`; `distributed.fsdp`) -----------------------------------------

    def _share_shards(self) -> None:
        prepare.share_shards(self)

    def _gather(self) -> None:
        step.gather(self)

    # -- finish (`train/finish.py`) --------------------------------------------------------------------

    def finish(self, check: Callable[[Path], None] | None = None) -> RunResult:
        """Save the adapter (`self.export`, a `release.Release`: peft's files, then govtrain's record and
        tokenizer), record the run entry (mechanism, config, base model, adapter, device, precision), write the model
        card from what the ledger then says, and remove the run state. Called also when the budgets ran out
        (`result.exhausted`). `check(output)` reads what was written before it is hashed and recorded. A run that
        recorded its entry before a kill (`recorded`: a signed entry of this config and base model, `prepare`) saves
        and records nothing again: its folder must still hash to the recorded adapter, and the card (from the
        govtrain.json that was hashed) and the state's removal are done now."""
        if self.check:
            raise RuntimeError("a check saves nothing and records no run")
        self.router.close()
        if not self.world.many:
            return self._finish(check)
        adapter = self.world.from_lead(lambda: self._finish(check).adapter_sha256)  # the lead writes and records
        self.result.adapter_sha256 = adapter
        return self.result

    def _finish(self, check: Callable[[Path], None] | None) -> RunResult:
        return finish.finish(self, check)

    def _write_card(self, output: Path, record) -> None:
        finish.write_card(self, output, record)

    def _claim(self) -> None:
        self._owner = claim(self.ledger, (self.run_id, self.run_nonce))

    def _check_owner(self) -> None:
        if self.world.lead:  # the lead holds the claim; the others follow it
            check_owner(self.ledger, (self.run_id, self.run_nonce), self._owner)

    def release(self) -> None:
        """Give up the run state's lock (the run's process stops owning it)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None
