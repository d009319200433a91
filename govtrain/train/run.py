"""A training run as named phases (docs/design.md §5): prepare, then per ledger epoch plan → write ahead →
step … → close, then finish.

`prepare` reads the corpus from the ledger, matches the data, loads the model onto its device, resolves
every class's profile and probes the router: everything that can refuse the run does so before any spend
is written. `plan_epoch` fixes an epoch's noise schedule from what the ledger says then (other runs'
spend, withdrawals, retirements) and saves the plan; `write_ahead` puts this run's spend for it in the
ledger before its steps run; `step` is one logical Poisson batch, computed in physical chunks under the
run's precision and privatized once by the router; `close_epoch` and `finish` close the ledger epoch and
record the run. The run state saved along the way lets a killed run resume without under-counting.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Collection

from govtrain import units
from govtrain.distributed.world import World
from govtrain.errors import Code, ConfigError, GovtrainError, RejectedError
from govtrain.ledger.ledger import Ledger
from govtrain.ledger.spend_rules import noise_groups_record
from govtrain.release.tree import tree_sha256
from govtrain.routing import microbatch
from govtrain.train import corpus
from govtrain.train.config import RunConfig
from govtrain.train.preflight import Plan, check_output, consent_error, project
from govtrain.train.resume import (
    TEMPORARY,
    check_recorded_entry,
    check_state_shapes,
    read_recorded_adapter,
    recorded_entry,
)
from govtrain.train import state_file
from govtrain.train.state_key import StateKey
from govtrain.train.withdrawals import Withdrawn
from govtrain.train.lease import (
    LOCK_FILE,
    Replan,
    check_owner,
    claim,
    lock_state,
    owner_setting,
    trial_of_recorded_tune,
    write_ahead,
    written_plan,
)

LOG = Callable[[str], None]
STATE_FILE = state_file.STATE_FILE


class BudgetExhausted(GovtrainError):
    """No contribution is eligible any more: every one is withdrawn or has spent its budget (exit 5)."""

    exit_code = 5


@dataclass
class Chunk:
    """One physical chunk of a logical step: its examples (indices into the run's examples), the unit of
    each (None: each example is its own unit), each example's contribution, and per unit its class and
    signed clipping norm; `microbatch`: the microbatch its units are in (RUN.toml [noise] microbatches; 0 when 1).
    `filler`: a sharded model's stand-in chunk (`training.fsdp`): one public synthetic example whose loss is weighted
    zero, so that every rank runs as many forwards and backwards (FSDP's all-gathers) in a step; it adds exactly
    nothing and counts as no example."""

    indices: list[int]
    units: list[int] | None
    owners: list[str]
    classes: list[str]
    clips: list[float]
    microbatch: int = 0
    filler: bool = False


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


def _save_state(path: Path, state: dict, key: StateKey) -> None:
    # 0600 from its creation, never through a link planted at its temporary: it holds the sampling key, which decides
    # every step's draw (`routing/sampler.py`). Tensors and plain data only, never a pickle (`state_file`), under a
    # MAC of the ledger's key (`state_key`): the folder's writer holds no key, so cannot write a state a run trusts.
    state_file.write(path, state, key)


def _load_state(path: Path, config: RunConfig, key: StateKey) -> dict | None:
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


def _sampler(privatizer, q_u: int, insecure_seed: int | None, *, resumed: bool = False):  # type: ignore[no-untyped-def]
    """The sampling the privatizer's accounting assumes (`Privatizer.participation`): Poisson, or cyclic Poisson
    (`routing.sampler.CyclicPoissonSampler`) for a correlated privatizer amplified over its cycle. A fresh run whose
    cycle·q exceeds 1 is refused (`run_config_invalid`); a `resumed` one draws its pending epoch at the q its spend
    charged (`Run._write_ahead` sets it) and caps a later epoch's part rate at 1, as a run that was never stopped does
    when withdrawals raise q (its charge composes at min(1, cycle·q))."""
    participation = privatizer.participation()
    if participation.scheme == "poisson":
        from govtrain.routing.sampler import PoissonSampler

        return PoissonSampler(q_u / units.MICRO, insecure_seed=insecure_seed)
    if participation.scheme == "cyclic":
        from govtrain.routing import sampler

        cyclic = getattr(sampler, "CyclicPoissonSampler", None)
        if cyclic is None:
            raise ConfigError(Code.PRIVATIZER_UNKNOWN, f"privatizer {privatizer.name!r} needs cyclic Poisson sampling, "
                                                       "which this installation of govtrain lacks: upgrade it")
        # its partition key is the run's public id, set once the id is known (`Run._prepare`)
        if not resumed and participation.cycle * q_u > units.MICRO:
            raise ConfigError(Code.RUN_CONFIG_INVALID, f"privatizer {privatizer.name!r} draws each of its "
                                                       f"{participation.cycle} parts at rate cycle·q = "
                                                       f"{participation.cycle}·{q_u / units.MICRO:g} > 1: lower the "
                                                       "expected batch (training.expected_batch_size, or the "
                                                       "policy's) or the bands")
        return cyclic(q_u / units.MICRO, cycle=participation.cycle, partition_key=None, insecure_seed=insecure_seed,
                      allow_rate_cap=resumed)
    raise RuntimeError(f"privatizer {privatizer.name!r} asks for unknown participation {participation.scheme!r}")


def _partition(sampler, run_id: str) -> None:  # type: ignore[no-untyped-def]
    """A cyclic sampler's parts are a keyed hash of each unit's identity under the run's public id: the same id and
    identities on resume (`train/corpus.py` refuses a corpus whose survivors moved), so no unit changes part."""
    if hasattr(sampler, "partition_key"):
        sampler.partition_key = run_id.encode()


def _privatizer(config: RunConfig, saved: dict | None, insecure_seed: int | None):  # type: ignore[no-untyped-def]
    """RUN.toml [noise]'s privatizer for the run's horizon (training.steps). A resumed correlated run takes the
    strategy its run state recorded (the one its spend charged), if it has the parameters [noise] gives: an
    optimiser run again elsewhere need not give the same last bits."""
    from govtrain.privatizers import build, from_record

    built = build(config.file.noise, horizon=config.file.training.steps, insecure_seed=insecure_seed)
    record = (saved or {}).get("privatizer")
    if not built.correlated or record is None or record == built.record():
        return built

    def given(r: dict) -> dict:  # the parameters [noise] and the horizon set, not the optimised strategy
        return {k: v for k, v in r.items() if not isinstance(v, list)}

    if not isinstance(record, dict) or given(record) != given(built.record()):
        return built  # another privatizer's state: `_load_noise_state` refuses it
    return from_record(record)  # its noise key comes from the run state


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
        """The data matched to the admitted contributions, the model on its device and its resolution; the lead's run
        state (None on the other ranks, and for a fresh run)."""
        import torch

        from govtrain.release.export import tokenizer_files
        from govtrain.resolver.model import describe
        from govtrain.resolver.plan import read_corpus, sampling_rate_for
        from govtrain.resolver.profile import resolve
        from govtrain.tasks import task_for
        from govtrain.train.data import load_examples
        from govtrain.train.model import check_weight_decay, load_model, resolve_device

        config, ledger, log = self.config, self.ledger, self.log
        training = config.file.training
        if not self.check and self.world.lead:  # a check writes nothing, the lock file and the output folder included
            self._lock = lock_state(config.output_dir)
        if self.world.lead:  # an earlier govtrain's pickled run state is never read
            state_file.refuse_legacy(config.output_dir)
        if self.world.lead and not state_file.present(self.state_path):  # a fresh run starts in an empty folder
            check_output(config.output_dir, (LOCK_FILE, STATE_FILE + TEMPORARY))
        if self.insecure_seed is not None:
            torch.manual_seed(self.insecure_seed)
        self.policy = policy = ledger.policy
        admitted, withdrawn, _ = read_corpus(ledger)
        admitted = {cid: a for cid, a in admitted.items() if cid not in withdrawn}
        self.task = task_for(config.file)
        self.examples = examples = load_examples(
            config.data_dir, {a.data_sha256: cid for cid, a in admitted.items()}, self.task,
            records={cid: a.records for cid, a in admitted.items()}, integer_columns=(config.file.data.label_column,))
        if examples.unmatched_files:
            shown = [n for n in examples.unmatched_files if not n.endswith(".cose")][:5]
            others = len(examples.unmatched_files) - len(shown)
            log(f"note: {len(examples.unmatched_files)} file(s) match no admitted contribution and are not trained on"
                f" ({', '.join(shown)}{f' and {others} more' if others else ''})")
        for cid in examples.missing:
            log(f"note: no data file for admitted contribution {cid}; it is not eligible")
        self.present = present = set(examples.owner)
        if not present:
            raise ConfigError(Code.RUN_CONFIG_INVALID, f"training.data: no file in {config.data_dir} matches an "
                                                       "admitted, not withdrawn contribution")
        records = sum(admitted[c].records for c in present)
        q_u, expected_batch = sampling_rate_for(policy, training.expected_batch_size,
                                                sum(policy.sampling_units(admitted[c].records) for c in present),
                                                option="training.expected_batch_size", code=Code.RUN_CONFIG_INVALID)
        self.expected_batch = expected_batch  # in sampling units, at open (the rehearsal's full chunk reads it)
        self.per_contribution = policy.examples_per_contribution  # None: the privacy unit is the example
        if self.per_contribution is not None and training.physical_batch is not None \
                and training.physical_batch < self.per_contribution:
            raise ConfigError(Code.RUN_CONFIG_INVALID, f"training.physical_batch = {training.physical_batch} is less "
                                                       "than the policy's examples_per_contribution "
                                                       f"({self.per_contribution}): a contribution's examples are "
                                                       "clipped together and must fit in one chunk")

        # The model, on its device and at its precision: how the step is computed, never what it releases.
        adapters = sorted({c.profile.adapter for c in policy.classes.values() if c.profile.kind == "adapter"})
        self.device = resolve_device(training.device)
        self.precision, self.chunk = training.precision, training.physical_batch
        self._autocast = ((lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)) if self.precision == "bf16"
                          else contextlib.nullcontext)
        self.model, self.tokenizer, base = load_model(config, adapters)
        tokenizer = tokenizer_files(self.tokenizer)  # as loaded: encoding leaves its settings in a fast tokenizer
        self.task.check(examples.items, self.tokenizer, config.file.model.max_length)  # e.g. no target token left
        self.base_sha256 = tree_sha256(base)
        if self.sharded and not self.world.many:
            raise ConfigError(Code.RUN_CONFIG_INVALID, "training.fsdp shards the model over the run's processes, and "
                                                       "this is one: start it with govtrain train --nproc N or "
                                                       "torchrun, or set fsdp = false")
        if not self.sharded:  # a sharded model's shards are moved to the device by `fsdp.shard`, never the whole
            self.model.to(self.device)  # before the router: its noise generator lives on the parameters' device
        self._resolution = resolution = resolve(policy.classes, describe(self.model, name=config.model_spec))
        check_weight_decay(resolution, config.file.optimizer.weight_decay)
        self._admitted, self._base, self._tokenizer_files, self._q_u = admitted, base, tokenizer, q_u
        self._records = records
        if not self.world.lead or not state_file.present(self.state_path):
            return None
        return _load_state(self.state_path, config, self.state_key)

    def _build(self, saved: dict | None) -> None:
        """The privatizer (a resumed run's as its state `saved` it), router, update, sampler and scheduler; the
        contributions by index."""
        import numpy as np

        from govtrain.accounting.spend import SpendCalculator
        from govtrain.mechanisms.update import Update
        from govtrain.privatizers.families.floors import check_family_floor
        from govtrain.resolver.schedule import Scheduler
        from govtrain.routing.independence import check_batch_independence
        from govtrain.routing.layout import probe_batches
        from govtrain.routing.router import Router
        from govtrain.routing.sampler import unit_identities

        config, policy, resolution, admitted = self.config, self.policy, self._resolution, self._admitted
        training, present, q_u = config.file.training, self.present, self._q_u
        if self.sharded:  # the batch-independence check on the whole model (autograd sees no sharded parameter)
            check_batch_independence(self.model, self.task, self.tokenizer, config.file.model.max_length,
                                     next(self.model.parameters()).device)
            self._shard()
        self.privatizer = _privatizer(config, saved, self.insecure_seed)
        self.microbatches = config.file.noise.microbatches  # a privacy parameter: the privatizer records it
        self.router = Router(self.model, resolution, mechanism=training.mechanism, insecure_seed=self.insecure_seed,
                             privatizer=self.privatizer, microbatches=self.microbatches, compiled=training.compiled)
        self.router.world = self.world  # the ranks' clipped sums summed, noised once by the lead
        # the family's floor, before any spend: a spend records σ_eff at least the contribution's signed multiplier
        check_family_floor(policy, self.privatizer.family,
                           [(c, admitted[c].member.noise_multiplier_u) for c in sorted(present)])
        self.router.probe(probe_batches(self.tokenizer, config.file.model.max_length))  # batch-first calls only
        if self.sharded:  # the probe's forwards had no backward: the shards back in place
            from govtrain.distributed import fsdp

            fsdp.reshard(self.model)
        else:
            check_batch_independence(self.model, self.task, self.tokenizer, config.file.model.max_length, self.device)
        self.update = Update.build(self.model, config.file)
        # its rate set again per epoch; a resumed run (a saved noise state) draws at the rates its spend charged
        self.sampler = _sampler(self.privatizer, q_u, self.insecure_seed, resumed=saved is not None)
        self.epoch_steps = training.epoch_steps or policy.steps_per_epoch
        if self.epoch_steps > policy.steps_per_epoch:
            raise ConfigError(Code.RUN_CONFIG_INVALID, f"training.epoch_steps: {self.epoch_steps} is more than the "
                                                       f"policy's steps_per_epoch ({policy.steps_per_epoch})")
        self.scheduler = Scheduler(SpendCalculator(policy.accountant, policy.delta_p), resolution.class_groups(),
                                   sampling_rate_u=q_u, steps_per_epoch=self.epoch_steps, privatizer=self.privatizer)

        # Contributions by index: the sampler draws example indices, `owner` maps each to its contribution. An index
        # is only where a unit sits in this process's corpus: every per-unit decision is keyed by its identity.
        self.ids = ids = sorted(present)
        position = {c: i for i, c in enumerate(ids)}
        members = [admitted[c].member for c in ids]
        self.owner = np.array([position[c] for c in self.examples.owner], dtype=np.int64)
        self.members = [np.flatnonzero(self.owner == k) for k in range(len(ids))]  # each contribution's examples
        self.rank = np.zeros(len(self.owner), dtype=np.int64)  # each example's index within its contribution
        for member in self.members:
            self.rank[member] = np.arange(len(member))
        self.identities = unit_identities(  # each unit's stable identity (routing/sampler.py), once per run
            ids if self.per_contribution is not None else
            (microbatch.example_id(ids[k], int(r)) for k, r in zip(self.owner.tolist(), self.rank.tolist())))
        self.corpus = corpus.record("example" if self.per_contribution is None else "contribution", ids,
                                    self.examples.items, self.examples.owner,
                                    {c: admitted[c].data_sha256 for c in ids})
        self.signed_clip = {m.contribution_id: m.clip_norm_u / units.MICRO for m in members}
        self.classes = {m.contribution_id: m.data_class for m in members}

    def _start(self, state: dict | None) -> dict:
        """(The lead's.) The run's id and lease: resumed from its state, or new; consent; the claim. Returns what the
        other ranks take from it (`_follow`)."""
        import torch

        config, ledger, log, policy = self.config, self.ledger, self.log, self.policy
        training, present, base, records = config.file.training, self.present, self._base, self._records
        expected_batch, q_u = self.expected_batch, self._q_u
        run_id = training.run_id or f"run-{self.now()}-{os.urandom(4).hex()}"
        self.result = result = RunResult(run_id, 0)
        book = ledger.spend_book()
        self.resumed = state is not None
        if state is not None:
            run_id = result.run_id = state["run_id"]
            self.run_nonce, self.sampler.key = state.get("run_nonce"), state.get("sampling_key")
            _partition(self.sampler, run_id)
            self._check_ledger(state, book)
            self._check_plan(state)
            if self.sampler.key is None:
                raise ConfigError(Code.RUN_CONFIG_INVALID, f"{self.state_path} was written by an earlier govtrain (no "
                                                           "lease or sampling key): finish that run with it, or move "
                                                           "the file away and start afresh")
            if self.run_nonce is None or book.leases.get(run_id, self.run_nonce) != self.run_nonce:
                raise RejectedError(Code.RUN_ID_TAKEN, f"run {run_id!r}'s spend was written under another lease than "
                                                       f"{self.state_path} holds: another run took this id; move the "
                                                       "state file away and give this run another training.run_id")
            if run_id in book.finished:  # a kill came after the run entry: finish() completes the rest, if it is ours
                self._entry = recorded_entry(ledger, run_id)  # as a checkpoint signs it, never an unsigned row
                check_recorded_entry(self._entry, config=config, base_sha256=self.base_sha256,
                                     run_nonce=self.run_nonce, state_path=self.state_path)
            self.recorded = self._entry is not None
            if not self.recorded:  # it draws again: its surviving units must keep their identities
                corpus.check(state.get("corpus"), self.corpus, self.state_path)
            self.corpus = corpus.merge(state.get("corpus"), self.corpus)
            # kept from the first state on: every state is saved after the schedule was fixed (at an epoch's
            # write-ahead, or a pause), and a kill before the first checkpoint may come after steps that showed their
            # loss, so a schedule chosen again then would follow the data (issue 34, review of item 8)
            self.schedule = state["schedule"]
            check_state_shapes(state, self.model, self.update, self.state_path)  # before anything is put back
            result.steps, result.losses = state["step"], state["losses"]
            result.nonfinite = state["nonfinite"]
            result.epochs, result.eps_by_class = state["epochs"], state["eps_by_class"]
            if self.sharded:  # every rank puts back its shards of them (`_share_weights`)
                self._resume = (state["trainable"], state["update"])
            else:
                with torch.no_grad():
                    for name, value in state["trainable"].items():
                        self.model.get_parameter(name).copy_(value)
                try:
                    self.update.load_state_dict(state["update"])
                except (KeyError, TypeError, ValueError, IndexError) as e:  # no update of this run's saved it
                    raise ConfigError(Code.RUN_STATE_INVALID, f"{self.state_path}: its optimizer state does not fit "
                                                              f"this run's update ({type(e).__name__}: {e}): restore "
                                                              "the file the run saved, or move it away") from None
            self._load_noise_state(state.get("noise"))
            self.pending = state["pending"]
            if self.pending is not None and ledger.epoch() > self.pending["epoch"]:
                self.pending = None  # the epoch was closed just before the kill
            self.confirmed = self.confirm or bool(state.get("confirmed"))
            if self.recorded:
                result.exhausted = result.steps < self.total
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
            self.run_nonce = os.urandom(16)  # a one-time lease on the id: every spend and the run entry carry it
            # The sampling key fixes each step's draw (`PoissonSampler.at_step`): secret, in the run state only.
            self.sampler.key = (os.urandom(32) if self.insecure_seed is None
                                else hashlib.sha256(b"govtrain insecure sampling key %d" % self.insecure_seed).digest())
            _partition(self.sampler, run_id)
        # Consent: contributions runs other than this one (and its siblings) charged. A run that started confirmed
        # keeps its consent in its state; an unconfirmed one is asked again here, and at each write-ahead (under the
        # ledger's write lock: another run may charge them between this read and that write).
        mine = {run_id, *self.siblings}
        self.charged_before = {c for c in present if book.charged_by.get(c, set()) - mine}
        self.export = self._release(self._artifact_record(run_id))
        if self.check or self.charged_before:
            self.plan = self.projection()
        if self.charged_before and not self.check and not self.recorded:  # a recorded run charges nothing more
            if not self.confirmed:
                raise consent_error(self.plan)
            log(f"note: {len(self.charged_before)} contribution(s) were charged by other runs before; charging them "
                f"again as confirmed ({self.plan.epsilons()})")
        if not self.check:
            self._claim()
        drawn = (f"{expected_batch:g} of {records} examples from {len(present)} contributions" if
                 self.per_contribution is None else f"{expected_batch:g} of {len(present)} contributions, at most "
                 f"{self.per_contribution} examples each: ε per contribution")
        log(f"{run_id}: {self.total} {training.mechanism} steps, q = {q_u / units.MICRO:g} (expected batch {drawn}), "
            f"{policy.accountant} at δ = {policy.delta_p / 1e12:g}"
            + (f", {self.world.size} processes" if self.world.many else ""))
        return self._shared() if self.world.many else {}

    def _artifact_record(self, run_id: str):  # type: ignore[no-untyped-def]
        """The run's `govtrain.json` (`release.export.artifact_record`), from what RUN.toml and the ledger say."""
        from govtrain.release.export import artifact_record

        config = self.config
        return artifact_record(config.file.model, self.model, model_spec=config.model_spec, config_sha256=config.sha256,
                               mechanism=config.file.training.mechanism, base=self._base, base_sha256=self.base_sha256,
                               run_id=run_id, origin=self.policy.origin)

    def _release(self, record):  # type: ignore[no-untyped-def]
        """What finish() will write (`release.Release`); a sharded model's files as its shards would be saved."""
        from govtrain.release.export import Release

        shards = {n: p.detach().to_local() for n, p in self.model.named_parameters() if p.requires_grad} \
            if self.sharded else None
        return Release(self.model, record, self._tokenizer_files, state_dict=shards)

    def _shared(self) -> dict:
        """What the other ranks take from the lead's `_start`: the run's id and lease, and where it stands. Never
        the sampling key or the noise state: only the lead draws."""
        result = self.result
        return {"run_id": result.run_id, "run_nonce": self.run_nonce, "resumed": self.resumed,
                "recorded": self.recorded, "steps": result.steps, "losses": list(result.losses),
                "nonfinite": result.nonfinite, "schedule": self.schedule,
                "epochs": list(result.epochs), "eps_by_class": result.eps_by_class, "exhausted": result.exhausted,
                "pending": self.pending, "confirmed": self.confirmed, "charged_before": sorted(self.charged_before),
                "plan": self.plan, "owner": self._owner}

    def _follow(self, shared: dict) -> None:
        """A follower takes the lead's run id, lease and place (`_shared`), once it reads the lead's claim on the run in
        its own view of the ledger store: a rank opened on another store (a copy of the ledger file) is refused here,
        before any spend is written."""
        lease = (shared["run_id"], shared["run_nonce"])
        if not self.check and self.ledger.store.setting(owner_setting(lease)) != shared["owner"]:
            raise ConfigError(Code.RANK_MISMATCH, f"rank {self.world.rank} does not read the lead's claim on run "
                                                  f"{shared['run_id']!r} in its ledger: it opened another store (a "
                                                  "copy of the ledger?); give every rank the lead's ledger URL")

        self.result = result = RunResult(shared["run_id"], shared["steps"])
        result.losses, result.epochs, result.eps_by_class = shared["losses"], shared["epochs"], shared["eps_by_class"]
        result.exhausted, result.nonfinite = shared["exhausted"], shared["nonfinite"]
        self.schedule = shared["schedule"]
        self.run_nonce, self.resumed, self.recorded = shared["run_nonce"], shared["resumed"], shared["recorded"]
        self.pending, self.confirmed, self.plan = shared["pending"], shared["confirmed"], shared["plan"]
        self.charged_before = set(shared["charged_before"])
        self.export = self._release(self._artifact_record(result.run_id))

    def _check_ledger(self, state: dict, book) -> None:  # type: ignore[no-untyped-def]
        """Refuse (`output_taken`) a run state written against another ledger, or one that took steps under a
        lease this ledger never recorded: its steps were charged there (or nowhere), and this ledger's run
        entry would name an adapter that carries them while it charged only the steps taken here."""
        recorded = state.get("ledger")
        if recorded is not None and tuple(recorded) != self.ledger.identity:
            origin = recorded[0] if recorded else "?"
            raise ConfigError(Code.OUTPUT_TAKEN, f"{self.state_path} holds the state of run {state['run_id']!r} on "
                                                 f"another ledger ({origin!r}, another header): its steps were "
                                                 "charged there; resume it against that ledger, or give this run "
                                                 "another training.output")
        if state["step"] > 0 and state["run_id"] not in book.leases:
            raise ConfigError(Code.OUTPUT_TAKEN, f"{self.state_path} holds run {state['run_id']!r} at step "
                                                 f"{state['step']}, but this ledger records no spend under its "
                                                 "lease: its steps were charged elsewhere or not at all; resume it "
                                                 "against the ledger that charged them, or give this run another "
                                                 "training.output")

    def _check_plan(self, state: dict) -> None:
        """Refuse (`run_state_invalid`) a state whose place or plan no run of this config saves: a step past the
        run's, a plan whose steps leave the run's or do not hold its step, or one that lets units be drawn with no
        spend to charge them (a plan with no spend allows nothing). The MAC already keeps such a state out; this keeps
        a held epoch's noise and steps the ledger's even if a defect elsewhere wrote one."""
        pending, step = state["pending"], state["step"]
        wrong = None
        if step > self.total:
            wrong = f"it stands at step {step} of a run of {self.total}"
        elif pending is not None:
            first, steps = pending["first_step"], pending["steps"]
            if first + steps > self.total or not first <= step <= first + steps:
                wrong = f"its plan's steps {first}..{first + steps} leave the run's {self.total} or miss its step {step}"
            elif not pending["spend"] and any(pending["allowed"].values()):
                wrong = "its plan lets units be drawn with no spend that charges them"
        if wrong is not None:
            raise ConfigError(Code.RUN_STATE_INVALID, f"{self.state_path} is not a state a run saves ({wrong}): "
                                                      "restore the file the run saved, or move it away")

    def projection(self) -> Plan:
        """What the run's remaining steps would charge, projected from what the ledger says now."""
        from govtrain.resolver.plan import read_state

        state = read_state(self.ledger)  # one verified pass: the corpus, the epoch and who holds it
        cohorts, q_u, expected_batch = self._corpus_now(state.corpus)
        first, epoch = self.result.steps, state.book.ledger_epoch
        if self.pending is not None:  # resumed inside an epoch planned (or written) before: from the next one
            first, epoch = self.pending["first_step"] + self.pending["steps"], max(epoch, self.pending["epoch"] + 1)
        elif state.book.holder(epoch) is not None:  # another run holds this one
            epoch += 1
        return project(run_id=self.run_id, cohorts=cohorts, classes=self.classes, scheduler=self.scheduler, q_u=q_u,
                       expected_batch=expected_batch, first_epoch=epoch, steps=max(self.total - first, 0),
                       total_steps=self.total, policy=self.policy, resumed=self.resumed,
                       charged_before=self.charged_before)

    # -- per ledger epoch ------------------------------------------------------------------------------

    def plan_epoch(self) -> bool:
        """Fix the next ledger epoch's schedule from what the ledger says now (q over the live records,
        s_g, sigma_eff, retirement) and save it to the run state before any of its spend is written, so a
        kill between the two cannot lose it. False, with `result.exhausted` set, when no contribution is
        eligible any more. Several processes: the lead plans, and the others take its plan."""
        planned, pending, exhausted = self.world.from_lead(
            lambda: (self._plan_epoch(), self.pending, self.result.exhausted))
        self.pending, self.result.exhausted = pending, exhausted
        return planned

    def _plan_epoch(self) -> bool:
        if self.pending is not None:
            raise RuntimeError("plan_epoch() with an epoch pending: its written-ahead plan would be replaced")
        if self.check:
            raise RuntimeError("a check stops before the first epoch is planned: it writes nothing")
        from govtrain.resolver.plan import corpus_of

        corpus = corpus_of(self.ledger)  # one verified pass: the corpus and the epoch
        cohorts, q_u, expected_batch = self._corpus_now(corpus)
        if not any(c.eligible for c in cohorts):
            self.result.exhausted = True
            return False
        epoch = corpus.epoch
        first = self.result.steps
        steps = min(self.epoch_steps, self.total - first)
        self.scheduler.sampling_rate_u = q_u
        plan = self.scheduler.plan_epoch(cohorts, epoch, first, steps)
        pending = {"epoch": epoch, "first_step": first, "steps": steps, "q_u": q_u, "expected_batch": expected_batch,
                   "allowed": {m: s.steps for s in plan.spends for m in s.cohort.members},
                   "group_std": {tuple(sorted(g)): plan.group_std(g) for g in plan.group_noise_pu},
                   "noise_groups": noise_groups_record(plan.group_noise_pu),
                   "spend": plan.spend_records(), "eps": {s.cohort.data_class: 0 for s in plan.spends},
                   "retiring": sorted(m for c in cohorts if c.retired_at is not None for m in c.members),
                   "privatizer": self.privatizer.record()}
        for spend in plan.spends:
            pending["eps"][spend.cohort.data_class] = max(pending["eps"][spend.cohort.data_class], spend.eps_u)
        self.pending = pending
        self._save()
        return True

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

    def _write_ahead(self) -> bool:
        if self.pending is None:
            raise RuntimeError("write_ahead() with no epoch planned: call plan_epoch() first")
        self._check_owner()
        pending, self._written = self.pending, False
        if not pending["spend"] and any(pending["allowed"].values()):  # `_check_plan`: never drawn uncharged
            raise RuntimeError("a plan that allows steps without spend")
        lease = (self.run_id, self.run_nonce)
        # an epoch the ledger holds under this lease is trained as it charged it, whatever plan the state holds
        held = bool(pending["spend"]) or self.ledger.spend_book().holder(pending["epoch"]) == lease
        try:
            if pending["spend"] and not write_ahead(self.ledger, pending, (self.run_id, self.run_nonce), self.now,
                                                    self.log, consent=None if self.confirmed else self.siblings):
                self.pending = None
                self._save()
                return False
        except ConfigError as e:
            if e.code is Code.CHARGED_BEFORE:  # unconfirmed, and another run charged its contributions meanwhile
                self._drop_plan()
            raise
        except Replan:
            # Its sigma*C set the plan's noise, and the ledger justifies s_g only by the contributions the spend
            # charges (spend rule 7): plan the epoch again without it, rather than drop it from the write-ahead.
            self.log(f"a contribution planned for ledger epoch {pending['epoch']} withdrew before its spend was "
                     "written: planning the epoch again")
            self.pending = None
            self._save()
            return False
        if held:  # train the epoch exactly as the ledger charged it
            written = written_plan(self.ledger, pending["epoch"], lease)
            if written.pop("privatizer") != self.privatizer.record():  # its charge is that privatizer's
                raise ConfigError(Code.PRIVATIZER_INVALID, f"ledger epoch {pending['epoch']} was written ahead under "
                                                           "this run's lease with another privatizer than RUN.toml "
                                                           "[noise] names: restore the run's config to resume it")
            steps = min(written.pop("epoch_steps"), self.total - pending["first_step"])
            if (written["spend"], written["q_u"], steps) != (pending["spend"], pending["q_u"], pending["steps"]):
                self.log(f"ledger epoch {pending['epoch']} was written ahead under this run's lease by an earlier "
                         "state of it: training the epoch as written")
            pending.update(written, steps=steps)
            self._save()
        self._retired_here |= set(pending.get("retiring", ()))  # a plan dropped before its write retires nobody
        self.sampler.sampling_rate = pending["q_u"] / units.MICRO
        self._epoch_written()
        self._charged_rates = self.ledger.spend_book().rates.get(pending["epoch"]) if held else None
        return True

    def _epoch_written(self) -> None:
        import numpy as np

        pending = self.pending
        self._allowed = np.array([pending["allowed"].get(c, 0) for c in self.ids], dtype=np.int64)
        self._group_std = {frozenset(k): v for k, v in pending["group_std"].items()}
        self._written = True

    def _take_written(self) -> None:
        """(A follower.) The lead's written-ahead epoch, once this rank has read its spend in the ledger itself: no
        rank steps on a spend the store does not hold."""
        pending = self.pending
        if pending["spend"]:
            written = written_plan(self.ledger, pending["epoch"], (self.run_id, self.run_nonce))
            written.pop("epoch_steps")
            if written.pop("privatizer") != pending["privatizer"] or \
                    (written["spend"], written["q_u"]) != (pending["spend"], pending["q_u"]):
                raise ConfigError(Code.RANK_MISMATCH, f"rank {self.world.rank} reads another spend for ledger epoch "
                                                      f"{pending['epoch']} than the lead wrote: start every rank "
                                                      "against the same ledger")
        self._epoch_written()

    def _drop_plan(self) -> None:
        """Forget the pending plan, not written: a run that never wrote spend leaves no run state (its folder is
        as a refusal at open leaves it), one that did keeps its state without the plan."""
        self.pending = None
        if self.result.steps == 0 and not self.ledger.spend_book().used(self.run_id):
            self.state_path.unlink(missing_ok=True)
        else:
            self._save()

    def draw(self) -> list[Chunk]:
        """The next logical step's Poisson draw over the units (examples, or whole contributions) still
        eligible at this step (withdrawals take effect here), as physical chunks; starts the router's step.
        The caller encodes each chunk, runs the forward under `forward()`, hands its per-example losses to
        `accumulate`, and then calls `apply` once (also when the draw is empty: the noise is still drawn).
        Several processes: the lead draws, every rank takes its share of the drawn units (`distributed.shares`)."""
        from govtrain.distributed import fsdp
        from govtrain.distributed.shares import share

        if not self._written or self.epoch_done:
            raise RuntimeError("a step outside a written-ahead epoch: its spend must be in the ledger first")
        world, examples = self.world, self.examples
        drawn = world.from_lead(self._lead_draw)
        if world.many:
            drawn = [share(units_, world.size, world.rank) for units_ in drawn]
        chunks = []
        for part, unit, m in self._chunks(drawn):
            owners = [examples.owner[i] for i in part]
            if unit is None:  # each example is clipped on its own
                who = owners
            else:  # each contribution's examples are averaged, then clipped together
                who = [owners[i] for i in range(len(part)) if i == 0 or unit[i] != unit[i - 1]]
            chunks.append(Chunk(part, unit, owners, [self.classes[c] for c in who], [self.signed_clip[c] for c in who], m))
        if self.sharded:  # as many forwards and backwards on every rank: FSDP all-gathers in each
            chunks += [self._filler_chunk()] * (world.guarded(lambda: fsdp.chunks(len(chunks))) - len(chunks))
        self.router.begin(self._group_std)  # a quantising privatizer's lattice follows the step's group noise
        self._loss_sum, self._drawn = 0.0, 0
        return chunks

    def _lead_draw(self) -> list[list[list[int]]]:
        """(The lead's.) The step's draw over the units still eligible at this step (withdrawals take effect here)."""
        import numpy as np

        self._check_owner()
        self._check_rate()
        step = self.result.steps - self.pending["first_step"]
        gone = self._withdrawn.read()  # from the entries, never the `withdrawals` index table (withdrawals.py)
        live = np.array([self._allowed[i] > step and self.ids[i] not in gone for i in range(len(self.ids))], dtype=bool)
        return self._draw(live)

    def rehearsal_std(self) -> dict[frozenset, float]:
        """The group noise the rehearsal's steps begin with: the pending epoch's if one is written, else a unit
        scale per group. Its clipped sums are dropped, so the scale only sets the lattice a quantising
        privatizer rounds to (`routing/materialized.py`), which the rehearsal must exercise like a step."""
        if self._group_std:
            return dict(self._group_std)
        return {group.classes: 1.0 for group in self.router.resolution.groups if group.classes}

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
        """Add `chunk`'s clipped gradients (per example, or per contribution's mean) from its per-example
        `losses`, computed from the forward just run under `forward()`; `total` is their sum, for the log
        (`GovernedRun` reads it before anything is summed)."""
        if chunk.filler:  # weighted zero: its per-sample gradient, norm and clipped contribution are exactly zero
            self.router.accumulate(losses * 0.0, chunk.classes, chunk.clips, units=chunk.units)
            return
        total = float(losses.detach().sum()) if total is None else total
        self.router.accumulate(losses, chunk.classes, chunk.clips, units=chunk.units, microbatch=chunk.microbatch)
        self._loss_sum += total
        self._drawn += len(chunk.indices)

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
        """The router's noise once per group, then the update; the step's mean loss per example drawn. A step that
        would pass the opt-in `training.unsafe_stop_after_nonfinite_units` stops the run first (`diverged`), with
        nothing released."""
        self._count_nonfinite()
        self.router.finish(self._group_std, self.pending["expected_batch"])
        if self.world.many:  # the step's loss over every rank's share
            import torch

            seen = torch.tensor([self._loss_sum, float(self._drawn)], dtype=torch.float64)
            self.world.sum_([seen])
            self._loss_sum, self._drawn = float(seen[0]), int(seen[1])
        loss = self._loss_sum / self._drawn if self._drawn else float("nan")
        self.update.step(self.router.noise_std)
        self.update.zero_grad()
        if self.sharded:
            self._gather()
        return loss

    def _count_nonfinite(self) -> None:
        """The step's units with a non-finite gradient (each contributed zero: `Router._clip`), over every rank's
        share, into the run's count and the operator's step log. The count is a statistic of private data (whether a
        unit's gradient is finite), so by default nothing public depends on it: the run goes on. Only the opt-in
        `training.unsafe_stop_after_nonfinite_units` stops it (`diverged`), here, before the noise is drawn or
        `.grad` written, so this step releases nothing and no later epoch is written ahead; but that stop is a
        data-dependent event the ledger shows (no later epoch, no run entry) and no spend charges, hence its name
        and its warning (`_warn_unsafe`)."""
        count = self.router.nonfinite
        if self.world.many:  # every rank decides alike, on the sum of the ranks' counts
            import torch

            seen = torch.tensor([float(count)], dtype=torch.float64)
            self.world.sum_([seen])
            count = int(seen[0])
        if not count:
            return
        total, limit = self.result.nonfinite + count, self.config.file.training.unsafe_stop_after_nonfinite_units
        step = self.result.steps
        if limit is not None and total > limit:
            raise ConfigError(Code.DIVERGED, f"step {step}: {count} more unit(s) with a non-finite gradient make "
                                             f"{total}, over training.unsafe_stop_after_nonfinite_units = {limit}: "
                                             "the run stops before this step releases anything (nothing more is "
                                             "charged); withdraw the contribution whose gradients are not finite, "
                                             "or fix the loss, then resume with the same config (or start a new run "
                                             "with another training.output)")
        self.result.nonfinite = total
        bound = "" if limit is None else f", at most {limit}"
        self.log(f"step {step}: {count} unit(s) with a non-finite gradient contributed zero ({total} in the run"
                 f"{bound})")

    def _warn_unsafe(self) -> None:
        """Each time a run opens with `training.unsafe_stop_after_nonfinite_units` set, say what it weakens."""
        limit = self.config.file.training.unsafe_stop_after_nonfinite_units
        if limit is not None:
            self.log(f"warning: training.unsafe_stop_after_nonfinite_units = {limit} weakens the guarantee: whether "
                     "the run stops depends on whether private units' gradients are finite, and the ledger shows "
                     "the stop (no later epoch, no run entry) without charging for it; unset it for real data")

    def record(self, loss: float) -> None:
        """Count the step moved by `move`, and save the run state at a checkpoint."""
        result = self.result
        result.steps += 1
        result.losses.append(loss)
        if result.steps % self.checkpoint_every == 0:
            self._save()

    def _check_rate(self) -> None:
        """The sampler draws at the rate the ledger's spend for this epoch charged, or the step does not run."""
        charged = self._charged_rates
        used = round(self.sampler.sampling_rate * units.MICRO)
        if charged is not None and charged != {used}:
            raise ConfigError(Code.SAMPLING_MISMATCH, f"the sampler draws at q = {used / units.MICRO:g}, but the "
                                                      f"ledger charged epoch {self.pending['epoch']} at q = "
                                                      f"{', '.join(f'{q / units.MICRO:g}' for q in sorted(charged))}: "
                                                      "the sampling rate is the run's, never set it by hand")

    def _draw(self, live) -> list[list[list[int]]]:  # type: ignore[no-untyped-def]
        """One step's Poisson draw over the live units, by microbatch, each drawn unit as its example indices. Example
        unit: q over the live examples, one index each. Contribution unit: q over the live contributions, each drawn one
        using at most examples_per_contribution of its examples (uniformly). With microbatches > 1 the drawn units are
        split (`_microbatches`); otherwise one microbatch holds them all. Every per-unit decision is keyed by the unit's
        identity (`self.identities`; docs/privatizers.md#sampling-by-identity), and the drawn units are in identity
        order (contribution id, then row index), so a resume that rebuilt the corpus draws and orders them alike."""
        import numpy as np

        step = self.result.steps
        self.sampler.at_step(step)  # the step's draw is fixed by the run's key and the step
        if self.per_contribution is None:
            chosen = self.sampler.sample(np.flatnonzero(live[self.owner]) if len(self.owner) else np.zeros(0, int),
                                         identities=self.identities)
            chosen = chosen[np.lexsort((self.rank[chosen], self.owner[chosen]))]  # by identity, not by file order

            def names() -> list[str]:  # an example's id: its contribution's and its index there, never its position
                return [microbatch.example_id(self.ids[self.owner[i]], int(self.rank[i])) for i in chosen]

            return [[[int(i)] for i in chosen[positions]] for positions in self._microbatches(step, len(chosen), names)]
        drawn = [(k, self.sampler.take(self.members[k], self.per_contribution, identity=self.identities[k]).tolist())
                 for k in self.sampler.sample(np.flatnonzero(live), identities=self.identities)]
        return [[drawn[p][1] for p in positions]
                for positions in self._microbatches(step, len(drawn), lambda: [self.ids[k] for k, _ in drawn])]

    def _chunks(self, drawn: list[list[list[int]]]) -> list[tuple[list[int], list[int] | None, int]]:
        """Drawn units (`_draw`, or a rank's share of them) as physical chunks of (example indices, the unit of each
        example or None, the microbatch): at most physical_batch examples each, a contribution's whole."""
        chunk, chunks = self.chunk, []
        for m, drawn_units in enumerate(drawn):
            if self.per_contribution is None:  # each example is its own unit
                picked = [i for unit_ in drawn_units for i in unit_]
                size = chunk or max(len(picked), 1)
                chunks += [(picked[i:i + size], None, m) for i in range(0, len(picked), size)]
                continue
            part: list[int] = []
            units_: list[int] = []
            for taken in drawn_units:
                if part and chunk is not None and len(part) + len(taken) > chunk:
                    chunks.append((part, units_, m))
                    part, units_ = [], []
                units_ += [units_[-1] + 1 if units_ else 0] * len(taken)
                part += taken
            if part:
                chunks.append((part, units_, m))
        return chunks

    def _microbatches(self, step: int, count: int, names: Callable[[], list[str]]) -> list[list[int]]:
        """The positions among a step's `count` drawn units of each microbatch's units: `routing.microbatch`'s public
        rule on their ids (`names()`) under the run's sampling key; one microbatch of every position when
        microbatches = 1 (no id formed)."""
        if self.microbatches == 1:
            return [list(range(count))]
        return microbatch.split(self.sampler.key, step, names(), self.microbatches)

    def close_epoch(self) -> None:
        """Close the ledger epoch (unless another run already did), record each class's epsilon and save."""
        epoch, steps = self.pending["epoch"], self.pending["steps"]
        self.world.from_lead(lambda: self.ledger.close_epoch(now=self.now(), epoch=epoch))
        result = self.result
        result.epochs.append(epoch)
        for name, eps in self.epsilons().items():
            result.eps_by_class.setdefault(name, []).append(eps)
        self.pending, self._written = None, False
        self._save()
        seen = [x for x in result.losses[-steps:] if x == x]  # empty batches have no loss
        self.log(f"epoch {epoch}: steps {result.steps}/{self.total}, "
                 f"loss {sum(seen) / len(seen) if seen else float('nan'):.4f}, "
                 + ", ".join(f"{n} ε {v[-1]:.3f}" for n, v in sorted(result.eps_by_class.items())))

    def epsilons(self) -> dict[str, float]:
        """Each policy class's epsilon as charged so far: its contributions' largest cumulative epsilon once
        the pending epoch's written-ahead spend is counted, else as the last closed epoch left it."""
        planned = self.pending["eps"] if self.pending is not None else {}
        closed = self.result.eps_by_class
        return {name: planned.get(name, 0) / units.MICRO or max(closed.get(name, [])[-1:], default=0.0)
                for name in self.policy.classes}

    # -- finish ----------------------------------------------------------------------------------------

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
        from govtrain.release.artifact import adapter_sha256

        self._check_owner()
        output = self.config.output_dir
        result = self.result
        if not self.recorded:  # the schedule the steps followed, which RUN.toml's hash does not cover
            self.export.fix_schedule(self.update.hyperparameters.schedule.record())
        record = self.export.record
        if self.recorded:  # the adapter was saved and recorded before a kill: it must still be what was recorded
            result.adapter_sha256, record = read_recorded_adapter(output, self._entry)
        else:
            output.mkdir(parents=True, exist_ok=True)
            # sharded: the weights as gathered after the last step (the lead alone writes; nothing here is a collective)
            self.model.save_pretrained(output, **({"state_dict": self._whole["trainable"]} if self.sharded else {}))
            self.export.write(output)
            if check is not None:
                check(output)
            result.adapter_sha256 = adapter_sha256(output)  # every file but the card, which cites the run entry
            device = self.device.type if self.device.type == "cpu" else str(self.device)
            self.ledger.record_run(result.run_id, self.config.file.training.mechanism, self.config.sha256,
                                   self.base_sha256, result.adapter_sha256, run_nonce=self.run_nonce, device=device,
                                   precision=self.precision, now=self.now(), privatizer=self.privatizer.record())
        # The card before the state goes: a kill until the state is removed leaves a run that the same config, run
        # again, finishes (`recorded`); after it, the run is whole.
        self._write_card(output, record)
        self.state_path.unlink(missing_ok=True)
        (output / LOCK_FILE).unlink(missing_ok=True)  # the id is spent: no later run can take this state
        return result

    def _write_card(self, output: Path, record) -> None:  # type: ignore[no-untyped-def]
        """The model card of the adapter whose govtrain.json is `record`, from the ledger as the run entry left it. The
        run is recorded whatever happens here: a card that cannot be written is said, not raised (`verify_adapter`
        checks the adapter without it)."""
        from govtrain.release.card import run_facts, write_card

        try:
            write_card(output, record, run_facts(self.ledger, self.run_id))
        except (GovtrainError, OSError) as e:
            self.log(f"note: the model card {output / 'README.md'} was not written ({e}); the adapter and its run "
                     "entry are saved")

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

    # -- helpers ---------------------------------------------------------------------------------------

    def _corpus_now(self, corpus):
        """(cohorts, q_u, expected batch) from what the ledger says now (`corpus`, `resolver.plan.Corpus`: its
        verified entries): other runs may have charged these contributions, and some may have withdrawn or
        retired, since this run started."""
        from govtrain.resolver.plan import sampling_rate_for
        from govtrain.resolver.schedule import cohorts_of

        recorded, withdrawn_now = corpus.admitted, corpus.withdrawn
        live = sorted(c for c in self.present if c not in withdrawn_now and c in recorded)
        q, batch = sampling_rate_for(self.policy, self.config.file.training.expected_batch_size,
                                     sum(self.policy.sampling_units(recorded[c].records) for c in live),
                                     option="training.expected_batch_size", code=Code.RUN_CONFIG_INVALID)
        return cohorts_of([recorded[c].member for c in live],
                          {c: (tuple(recorded[c].history), recorded[c].eps_u) for c in live},
                          [c for c in live if recorded[c].retired or c in self._retired_here]), q, batch

    def _save(self) -> None:
        """The run state: trainable weights, the update's state and the pending epoch with its plan."""
        if self.check:
            raise RuntimeError("a check writes no run state")
        if not self.world.lead:  # the lead's state is the run's: the others hold what it holds
            return
        result = self.result
        key = self.state_key
        _save_state(self.state_path, {
            "run_id": result.run_id, "run_nonce": self.run_nonce, "sampling_key": self.sampler.key,
            "config_sha256": self.config.sha256, "ledger": self.ledger.identity, "confirmed": self.confirmed,
            "step": result.steps, "nonfinite": result.nonfinite,
            "losses": result.losses, "epochs": result.epochs, "eps_by_class": result.eps_by_class,
            "pending": self.pending,
            "corpus": self.corpus,  # what each unit's identity names (train/corpus.py): plain JSON data
            "schedule": self.update.hyperparameters.schedule.record(),  # what the steps so far were taken under
            "trainable": dict(self._whole["trainable"]) if self.sharded else
            {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad},
            "update": self._whole["update"] if self.sharded else self.update.state_dict(),
            # the privatizer's state: as secret as the noise it determines (whoever holds it can subtract it)
            "noise": {"privatizer": self.privatizer.record(),
                      "state": self.privatizer.state_dict(self.router.noise_state)}}, key)

    # -- a sharded model (`training.fsdp`; `distributed.fsdp`) -----------------------------------------

    def _shard(self) -> None:
        """Every rank starts from the lead's initial weights (a fresh LoRA's random factors), then the model is
        sharded; the router and the update are built on the shards after this. The filler's public example."""
        import torch

        from govtrain.distributed import fsdp
        from govtrain.train.rehearsal import synthetic_examples

        with torch.no_grad():
            self.world.share_([p for p in self.model.parameters() if p.requires_grad])
        fsdp.shard(self.model, self.world, self.device)
        self._filler = synthetic_examples(self.task, self.tokenizer, self.config.file.model.max_length, 1,
                                          seed=b"govtrain fsdp filler", admitted=self.examples.items)

    def _filler_chunk(self) -> Chunk:
        classes = sorted(set(self.classes.values()))[:1]
        return Chunk([0], None if self.per_contribution is None else [0], [], classes, [1.0], filler=True)

    def _share_shards(self) -> None:
        """A resumed run's weights and update state, from the lead's run state, as every rank's shards; then the
        first gathered copy (`_gather`)."""
        from govtrain.distributed import fsdp

        if self.resumed:
            trainable, update = self.world.broadcast(self._resume if self.world.lead else None)
            fsdp.load_whole(self.model, self.update, trainable, update)
            self._resume = None
        self._gather()

    def _gather(self) -> None:
        """(Every rank.) The trainable weights and the update's state gathered whole, for the lead's run state and
        adapter: a step's last collective, so that the lead writes them with no other rank in a collective."""
        from govtrain.distributed import fsdp

        self._whole = self.world.guarded(lambda: {
            "trainable": {n: fsdp.full(p) for n, p in self.model.named_parameters() if p.requires_grad},
            "update": fsdp.whole(self.update.state_dict())})

    def _load_noise_state(self, saved: dict | None) -> None:
        """The privatizer's state as the run state saved it, so the noise stream goes on exactly where it was
        (a state with none, written before privatizers or by the i.i.d. Gaussian, starts it afresh)."""
        if saved is None:
            if self.privatizer.correlated:
                raise ConfigError(Code.OUTPUT_TAKEN, f"{self.state_path} holds no noise state, and privatizer "
                                                     f"{self.privatizer.name!r} correlates its noise across steps: "
                                                     "it cannot go on from there; give this run another "
                                                     "training.output")
            return
        if saved.get("privatizer") != self.privatizer.record():
            raise ConfigError(Code.OUTPUT_TAKEN, f"{self.state_path} holds the noise state of another privatizer "
                                                 f"({saved.get('privatizer')!r}): training.output is that run's")
        try:
            self.router.noise_state = self.privatizer.load_state(self.router.noise_slots.slots, saved["state"])
        except ValueError as e:
            raise ConfigError(Code.OUTPUT_TAKEN, f"{self.state_path}: its noise state does not fit this run's "
                                                 f"slots ({e}): training.output is another run's") from e
