"""Preparing a run (`train/run.py`): everything that can refuse it, before any spend is written.

`load` matches the data to the admitted, not withdrawn contributions and loads the model onto its device at its
precision, and resolves every class's profile; `build` makes the privatizer (a resumed run's as its state recorded
it), the router (probed), the update, the sampler and the scheduler, and indexes the contributions by their stable
identities. A sharded model (`training.fsdp`) is sharded here (`shard`). Each function takes the `Run` it prepares;
the run takes each step on every rank and gathers the outcomes, so a refusal on one rank stops all of them.
"""

from __future__ import annotations

import contextlib

from govtrain import units
from govtrain.errors import Code, ConfigError
from govtrain.release.tree import tree_sha256
from govtrain.routing import microbatch
from govtrain.train import corpus, state_file
from govtrain.train.config import RunConfig
from govtrain.train.lease import LOCK_FILE, lock_state
from govtrain.train.preflight import check_output
from govtrain.train.resume import TEMPORARY


def load(run) -> None:
    """The data matched to the admitted contributions, the model on its device and its resolution (`Run._load` then
    reads the lead's run state)."""
    import torch

    from govtrain.release.export import tokenizer_files
    from govtrain.resolver.model import describe
    from govtrain.resolver.plan import read_corpus, sampling_rate_for
    from govtrain.resolver.profile import resolve
    from govtrain.tasks import task_for
    from govtrain.train.data import load_examples
    from govtrain.train.model import check_weight_decay, load_model, resolve_device

    config, ledger, log = run.config, run.ledger, run.log
    training = config.file.training
    if not run.check and run.world.lead:  # a check writes nothing, the lock file and the output folder included
        run._lock = lock_state(config.output_dir)
    if run.world.lead:  # an earlier govtrain's pickled run state is never read
        state_file.refuse_legacy(config.output_dir)
    if run.world.lead and not state_file.present(run.state_path):  # a fresh run starts in an empty folder
        check_output(config.output_dir, (LOCK_FILE, state_file.STATE_FILE + TEMPORARY))
    if run.insecure_seed is not None:
        torch.manual_seed(run.insecure_seed)
    run.policy = policy = ledger.policy
    admitted, withdrawn, _ = read_corpus(ledger)
    admitted = {cid: a for cid, a in admitted.items() if cid not in withdrawn}
    run.task = task_for(config.file)
    run.examples = examples = load_examples(
        config.data_dir, {a.data_sha256: cid for cid, a in admitted.items()}, run.task,
        records={cid: a.records for cid, a in admitted.items()}, integer_columns=(config.file.data.label_column,))
    if examples.unmatched_files:
        shown = [n for n in examples.unmatched_files if not n.endswith(".cose")][:5]
        others = len(examples.unmatched_files) - len(shown)
        log(f"note: {len(examples.unmatched_files)} file(s) match no admitted contribution and are not trained on"
            f" ({', '.join(shown)}{f' and {others} more' if others else ''})")
    for cid in examples.missing:
        log(f"note: no data file for admitted contribution {cid}; it is not eligible")
    run.present = present = set(examples.owner)
    if not present:
        raise ConfigError(Code.RUN_CONFIG_INVALID, f"training.data: no file in {config.data_dir} matches an "
                                                   "admitted, not withdrawn contribution")
    records = sum(admitted[c].records for c in present)
    q_u, expected_batch = sampling_rate_for(policy, training.expected_batch_size,
                                            sum(policy.sampling_units(admitted[c].records) for c in present),
                                            option="training.expected_batch_size", code=Code.RUN_CONFIG_INVALID)
    run.expected_batch = expected_batch  # in sampling units, at open (the rehearsal's full chunk reads it)
    run.per_contribution = policy.examples_per_contribution  # None: the privacy unit is the example
    if run.per_contribution is not None and training.physical_batch is not None \
            and training.physical_batch < run.per_contribution:
        raise ConfigError(Code.RUN_CONFIG_INVALID, f"training.physical_batch = {training.physical_batch} is less "
                                                   "than the policy's examples_per_contribution "
                                                   f"({run.per_contribution}): a contribution's examples are "
                                                   "clipped together and must fit in one chunk")

    # The model, on its device and at its precision: how the step is computed, never what it releases.
    adapters = sorted({c.profile.adapter for c in policy.classes.values() if c.profile.kind == "adapter"})
    run.device = resolve_device(training.device)
    run.precision, run.chunk = training.precision, training.physical_batch
    run._autocast = ((lambda: torch.autocast(run.device.type, dtype=torch.bfloat16)) if run.precision == "bf16"
                      else contextlib.nullcontext)
    run.model, run.tokenizer, base = load_model(config, adapters)
    tokenizer = tokenizer_files(run.tokenizer)  # as loaded: encoding leaves its settings in a fast tokenizer
    run.task.check(examples.items, run.tokenizer, config.file.model.max_length)  # e.g. no target token left
    run.base_sha256 = tree_sha256(base)
    if run.sharded and not run.world.many:
        raise ConfigError(Code.RUN_CONFIG_INVALID, "training.fsdp shards the model over the run's processes, and "
                                                   "this is one: start it with govtrain train --nproc N or "
                                                   "torchrun, or set fsdp = false")
    if not run.sharded:  # a sharded model's shards are moved to the device by `fsdp.shard`, never the whole
        run.model.to(run.device)  # before the router: its noise generator lives on the parameters' device
    run._resolution = resolution = resolve(policy.classes, describe(run.model, name=config.model_spec))
    check_weight_decay(resolution, config.file.optimizer.weight_decay)
    run._admitted, run._base, run._tokenizer_files, run._q_u = admitted, base, tokenizer, q_u
    run._records = records


def build(run, saved: dict | None) -> None:
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

    config, policy, resolution, admitted = run.config, run.policy, run._resolution, run._admitted
    training, present, q_u = config.file.training, run.present, run._q_u
    if run.sharded:  # the batch-independence check on the whole model (autograd sees no sharded parameter)
        check_batch_independence(run.model, run.task, run.tokenizer, config.file.model.max_length,
                                 next(run.model.parameters()).device)
        run._shard()
    run.privatizer = privatizer_for(config, saved, run.insecure_seed)
    run.microbatches = config.file.noise.microbatches  # a privacy parameter: the privatizer records it
    run.router = Router(run.model, resolution, mechanism=training.mechanism, insecure_seed=run.insecure_seed,
                         privatizer=run.privatizer, microbatches=run.microbatches, compiled=training.compiled)
    run.router.world = run.world  # the ranks' clipped sums summed, noised once by the lead
    # the family's floor, before any spend: a spend records σ_eff at least the contribution's signed multiplier
    check_family_floor(policy, run.privatizer.family,
                       [(c, admitted[c].member.noise_multiplier_u) for c in sorted(present)])
    run.router.probe(probe_batches(run.tokenizer, config.file.model.max_length))  # batch-first calls only
    if run.sharded:  # the probe's forwards had no backward: the shards back in place
        from govtrain.distributed import fsdp

        fsdp.reshard(run.model)
    else:
        check_batch_independence(run.model, run.task, run.tokenizer, config.file.model.max_length, run.device)
    run.update = Update.build(run.model, config.file)
    # its rate set again per epoch; a resumed run (a saved noise state) draws at the rates its spend charged
    run.sampler = sampler_for(run.privatizer, q_u, run.insecure_seed, resumed=saved is not None)
    run.epoch_steps = training.epoch_steps or policy.steps_per_epoch
    if run.epoch_steps > policy.steps_per_epoch:
        raise ConfigError(Code.RUN_CONFIG_INVALID, f"training.epoch_steps: {run.epoch_steps} is more than the "
                                                   f"policy's steps_per_epoch ({policy.steps_per_epoch})")
    run.scheduler = Scheduler(SpendCalculator(policy.accountant, policy.delta_p), resolution.class_groups(),
                               sampling_rate_u=q_u, steps_per_epoch=run.epoch_steps, privatizer=run.privatizer)

    # Contributions by index: the sampler draws example indices, `owner` maps each to its contribution. An index
    # is only where a unit sits in this process's corpus: every per-unit decision is keyed by its identity.
    run.ids = ids = sorted(present)
    position = {c: i for i, c in enumerate(ids)}
    members = [admitted[c].member for c in ids]
    run.owner = np.array([position[c] for c in run.examples.owner], dtype=np.int64)
    run.members = [np.flatnonzero(run.owner == k) for k in range(len(ids))]  # each contribution's examples
    run.rank = np.zeros(len(run.owner), dtype=np.int64)  # each example's index within its contribution
    for member in run.members:
        run.rank[member] = np.arange(len(member))
    run.identities = unit_identities(  # each unit's stable identity (routing/sampler.py), once per run
        ids if run.per_contribution is not None else
        (microbatch.example_id(ids[k], int(r)) for k, r in zip(run.owner.tolist(), run.rank.tolist())))
    run.corpus = corpus.record("example" if run.per_contribution is None else "contribution", ids,
                                run.examples.items, run.examples.owner,
                                {c: admitted[c].data_sha256 for c in ids})
    run.signed_clip = {m.contribution_id: m.clip_norm_u / units.MICRO for m in members}
    run.classes = {m.contribution_id: m.data_class for m in members}


def shard(run) -> None:
    """Every rank starts from the lead's initial weights (a fresh LoRA's random factors), then the model is
    sharded; the router and the update are built on the shards after this. The filler's public example."""
    import torch

    from govtrain.distributed import fsdp
    from govtrain.train.rehearsal import synthetic_examples

    with torch.no_grad():
        run.world.share_([p for p in run.model.parameters() if p.requires_grad])
    fsdp.shard(run.model, run.world, run.device)
    run._filler = synthetic_examples(run.task, run.tokenizer, run.config.file.model.max_length, 1,
                                      seed=b"govtrain fsdp filler", admitted=run.examples.items)



def share_shards(run) -> None:
    """A resumed run's weights and update state, from the lead's run state, as every rank's shards; then the
    first gathered copy (`Run._gather`)."""
    from govtrain.distributed import fsdp

    if run.resumed:
        fsdp.share_resumed(run.world, run.model, run.update, run._resume)
        run._resume = None
    run._gather()

def warn_unsafe(run) -> None:
    """Each time a run opens with `training.unsafe_stop_after_nonfinite_units` set, say what it weakens."""
    limit = run.config.file.training.unsafe_stop_after_nonfinite_units
    if limit is not None:
        run.log(f"warning: training.unsafe_stop_after_nonfinite_units = {limit} weakens the guarantee: whether "
                 "the run stops depends on whether private units' gradients are finite, and the ledger shows "
                 "the stop (no later epoch, no run entry) without charging for it; unset it for real data")


def artifact_record(run, run_id: str):  # type: ignore[no-untyped-def]
    """The run's `govtrain.json` (`release.export.artifact_record`), from what RUN.toml and the ledger say."""
    from govtrain.release import export

    config = run.config
    return export.artifact_record(config.file.model, run.model, model_spec=config.model_spec,
                                  config_sha256=config.sha256, mechanism=config.file.training.mechanism,
                                  base=run._base, base_sha256=run.base_sha256, run_id=run_id, origin=run.policy.origin)


def release_for(run, record):  # type: ignore[no-untyped-def]
    """What finish() will write (`release.Release`); a sharded model's files as its shards would be saved."""
    from govtrain.release.export import Release

    shards = {n: p.detach().to_local() for n, p in run.model.named_parameters() if p.requires_grad} \
        if run.sharded else None
    return Release(run.model, record, run._tokenizer_files, state_dict=shards)


def privatizer_for(config: RunConfig, saved: dict | None, insecure_seed: int | None):  # type: ignore[no-untyped-def]
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


def sampler_for(privatizer, q_u: int, insecure_seed: int | None, *, resumed: bool = False):  # type: ignore[no-untyped-def]
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


def partition(sampler, run_id: str) -> None:  # type: ignore[no-untyped-def]
    """A cyclic sampler's parts are a keyed hash of each unit's identity under the run's public id: the same id and
    identities on resume (`train/corpus.py` refuses a corpus whose survivors moved), so no unit changes part."""
    if hasattr(sampler, "partition_key"):
        sampler.partition_key = run_id.encode()
