"""A logical step of a run (`train/run.py`): draw, chunk, accumulate, apply.

`draw` takes the step's Poisson draw over the units still eligible (the lead draws; every rank takes its share) and
cuts it into physical chunks (`Chunk`) of a contribution's whole; the caller runs each chunk's forward and hands its
per-example losses to `accumulate`, which clips them into the router's sums; `move` draws the noise once per group
and updates the weights, and `record` counts the step and saves the run state at a checkpoint. Each function takes
the `Run` whose step it is, and calls the run's own methods for the other phases, so a step reads the same whether
the run is one process or several.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from govtrain import units
from govtrain.errors import Code, ConfigError
from govtrain.routing import microbatch


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


def draw(run) -> list[Chunk]:
    """The next logical step's Poisson draw over the units (examples, or whole contributions) still
    eligible at this step (withdrawals take effect here), as physical chunks; starts the router's step.
    The caller encodes each chunk, runs the forward under `forward()`, hands its per-example losses to
    `accumulate`, and then calls `apply` once (also when the draw is empty: the noise is still drawn).
    Several processes: the lead draws, every rank takes its share of the drawn units (`distributed.shares`)."""
    from govtrain.distributed import fsdp
    from govtrain.distributed.shares import share

    if not run._written or run.epoch_done:
        raise RuntimeError("a step outside a written-ahead epoch: its spend must be in the ledger first")
    world, examples = run.world, run.examples
    drawn = world.from_lead(run._lead_draw)
    if world.many:
        drawn = [share(units_, world.size, world.rank) for units_ in drawn]
    chunks = []
    for part, unit, m in run._chunks(drawn):
        owners = [examples.owner[i] for i in part]
        if unit is None:  # each example is clipped on its own
            who = owners
        else:  # each contribution's examples are averaged, then clipped together
            who = [owners[i] for i in range(len(part)) if i == 0 or unit[i] != unit[i - 1]]
        chunks.append(Chunk(part, unit, owners, [run.classes[c] for c in who], [run.signed_clip[c] for c in who], m))
    if run.sharded:  # as many forwards and backwards on every rank: FSDP all-gathers in each
        chunks += [run._filler_chunk()] * (world.guarded(lambda: fsdp.chunks(len(chunks))) - len(chunks))
    run.router.begin(run._group_std)  # a quantising privatizer's lattice follows the step's group noise
    run._loss_sum, run._drawn = 0.0, 0
    return chunks


def lead_draw(run) -> list[list[list[int]]]:
    """(The lead's.) The step's draw over the units still eligible at this step (withdrawals take effect here)."""
    import numpy as np

    run._check_owner()
    run._check_rate()
    step = run.result.steps - run.pending["first_step"]
    gone = run._withdrawn.read()  # from the entries, never the `withdrawals` index table (withdrawals.py)
    live = np.array([run._allowed[i] > step and run.ids[i] not in gone for i in range(len(run.ids))], dtype=bool)
    return run._draw(live)


def draw_units(run, live) -> list[list[list[int]]]:  # type: ignore[no-untyped-def]
    """One step's Poisson draw over the live units, by microbatch, each drawn unit as its example indices. Example
    unit: q over the live examples, one index each. Contribution unit: q over the live contributions, each drawn one
    using at most examples_per_contribution of its examples (uniformly). With microbatches > 1 the drawn units are
    split (`_microbatches`); otherwise one microbatch holds them all. Every per-unit decision is keyed by the unit's
    identity (`run.identities`; docs/privatizers.md#sampling-by-identity), and the drawn units are in identity
    order (contribution id, then row index), so a resume that rebuilt the corpus draws and orders them alike."""
    import numpy as np

    step = run.result.steps
    run.sampler.at_step(step)  # the step's draw is fixed by the run's key and the step
    if run.per_contribution is None:
        chosen = run.sampler.sample(np.flatnonzero(live[run.owner]) if len(run.owner) else np.zeros(0, int),
                                     identities=run.identities)
        chosen = chosen[np.lexsort((run.rank[chosen], run.owner[chosen]))]  # by identity, not by file order

        def names() -> list[str]:  # an example's id: its contribution's and its index there, never its position
            return [microbatch.example_id(run.ids[run.owner[i]], int(run.rank[i])) for i in chosen]

        return [[[int(i)] for i in chosen[positions]] for positions in run._microbatches(step, len(chosen), names)]
    drawn = [(k, run.sampler.take(run.members[k], run.per_contribution, identity=run.identities[k]).tolist())
             for k in run.sampler.sample(np.flatnonzero(live), identities=run.identities)]
    return [[drawn[p][1] for p in positions]
            for positions in run._microbatches(step, len(drawn), lambda: [run.ids[k] for k, _ in drawn])]


def chunks(run, drawn: list[list[list[int]]]) -> list[tuple[list[int], list[int] | None, int]]:
    """Drawn units (`_draw`, or a rank's share of them) as physical chunks of (example indices, the unit of each
    example or None, the microbatch): at most physical_batch examples each, a contribution's whole."""
    chunk, chunks = run.chunk, []
    for m, drawn_units in enumerate(drawn):
        if run.per_contribution is None:  # each example is its own unit
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


def microbatches(run, step: int, count: int, names: Callable[[], list[str]]) -> list[list[int]]:
    """The positions among a step's `count` drawn units of each microbatch's units: `routing.microbatch`'s public
    rule on their ids (`names()`) under the run's sampling key; one microbatch of every position when
    microbatches = 1 (no id formed)."""
    if run.microbatches == 1:
        return [list(range(count))]
    return microbatch.split(run.sampler.key, step, names(), run.microbatches)


def filler_chunk(run) -> Chunk:
    classes = sorted(set(run.classes.values()))[:1]
    return Chunk([0], None if run.per_contribution is None else [0], [], classes, [1.0], filler=True)


def rehearsal_std(run) -> dict[frozenset, float]:
    """The group noise the rehearsal's steps begin with: the pending epoch's if one is written, else a unit
    scale per group. Its clipped sums are dropped, so the scale only sets the lattice a quantising
    privatizer rounds to (`routing/materialized.py`), which the rehearsal must exercise like a step."""
    if run._group_std:
        return dict(run._group_std)
    return {group.classes: 1.0 for group in run.router.resolution.groups if group.classes}


def accumulate(run, chunk: Chunk, losses, total: float | None = None) -> None:  # type: ignore[no-untyped-def]
    """Add `chunk`'s clipped gradients (per example, or per contribution's mean) from its per-example
    `losses`, computed from the forward just run under `forward()`; `total` is their sum, for the log
    (`GovernedRun` reads it before anything is summed)."""
    if chunk.filler:  # weighted zero: its per-sample gradient, norm and clipped contribution are exactly zero
        run.router.accumulate(losses * 0.0, chunk.classes, chunk.clips, units=chunk.units)
        return
    total = float(losses.detach().sum()) if total is None else total
    run.router.accumulate(losses, chunk.classes, chunk.clips, units=chunk.units, microbatch=chunk.microbatch)
    run._loss_sum += total
    run._drawn += len(chunk.indices)


def move(run) -> float:
    """The router's noise once per group, then the update; the step's mean loss per example drawn. A step that
    would pass the opt-in `training.unsafe_stop_after_nonfinite_units` stops the run first (`diverged`), with
    nothing released."""
    run._count_nonfinite()
    run.router.finish(run._group_std, run.pending["expected_batch"])
    if run.world.many:  # the step's loss over every rank's share
        import torch

        seen = torch.tensor([run._loss_sum, float(run._drawn)], dtype=torch.float64)
        run.world.sum_([seen])
        run._loss_sum, run._drawn = float(seen[0]), int(seen[1])
    loss = run._loss_sum / run._drawn if run._drawn else float("nan")
    run.update.step(run.router.noise_std)
    run.update.zero_grad()
    if run.sharded:
        run._gather()
    return loss



def gather(run) -> None:
    """(Every rank; a sharded model.) The trainable weights and the update's state gathered whole, for the lead's run
    state and adapter (`fsdp.gathered`): a step's last collective, so that the lead writes them with no other rank in
    a collective."""
    from govtrain.distributed import fsdp

    run._whole = fsdp.gathered(run.world, run.model, run.update)

def count_nonfinite(run) -> None:
    """The step's units with a non-finite gradient (each contributed zero: `Router._clip`), over every rank's
    share, into the run's count and the operator's step log. The count is a statistic of private data (whether a
    unit's gradient is finite), so by default nothing public depends on it: the run goes on. Only the opt-in
    `training.unsafe_stop_after_nonfinite_units` stops it (`diverged`), here, before the noise is drawn or
    `.grad` written, so this step releases nothing and no later epoch is written ahead; but that stop is a
    data-dependent event the ledger shows (no later epoch, no run entry) and no spend charges, hence its name
    and its warning (`_warn_unsafe`)."""
    count = run.router.nonfinite
    if run.world.many:  # every rank decides alike, on the sum of the ranks' counts
        import torch

        seen = torch.tensor([float(count)], dtype=torch.float64)
        run.world.sum_([seen])
        count = int(seen[0])
    if not count:
        return
    total, limit = run.result.nonfinite + count, run.config.file.training.unsafe_stop_after_nonfinite_units
    step = run.result.steps
    if limit is not None and total > limit:
        raise ConfigError(Code.DIVERGED, f"step {step}: {count} more unit(s) with a non-finite gradient make "
                                         f"{total}, over training.unsafe_stop_after_nonfinite_units = {limit}: "
                                         "the run stops before this step releases anything (nothing more is "
                                         "charged); withdraw the contribution whose gradients are not finite, "
                                         "or fix the loss, then resume with the same config (or start a new run "
                                         "with another training.output)")
    run.result.nonfinite = total
    bound = "" if limit is None else f", at most {limit}"
    run.log(f"step {step}: {count} unit(s) with a non-finite gradient contributed zero ({total} in the run"
             f"{bound})")


def record(run, loss: float) -> None:
    """Count the step moved by `move`, and save the run state at a checkpoint."""
    result = run.result
    result.steps += 1
    result.losses.append(loss)
    if result.steps % run.checkpoint_every == 0:
        run._save()


def check_rate(run) -> None:
    """The sampler draws at the rate the ledger's spend for this epoch charged, or the step does not run."""
    charged = run._charged_rates
    used = round(run.sampler.sampling_rate * units.MICRO)
    if charged is not None and charged != {used}:
        raise ConfigError(Code.SAMPLING_MISMATCH, f"the sampler draws at q = {used / units.MICRO:g}, but the "
                                                  f"ledger charged epoch {run.pending['epoch']} at q = "
                                                  f"{', '.join(f'{q / units.MICRO:g}' for q in sorted(charged))}: "
                                                  "the sampling rate is the run's, never set it by hand")
