"""One physical chunk's arguments checked, its per-example losses differentiated to the tapped outputs, and its
report (`Router.accumulate`, `StepReport`): a loss per example, a unit per example with at least one example per
unit, resolved classes routed as captured, a positive clipping norm per clipping unit, and no backward through the
forward before the router's own.

Every refusal here comes before anything per-sample is formed, summed or drawn, so a programmer's mistake leaves
the step as it was (a ValueError; a backward the router did not run is `ungoverned_batch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from govtrain.errors import Code, ConfigError
from govtrain.routing import release
from govtrain.routing.adapters import AdapterRoutes
from govtrain.routing.taps import Tap


@dataclass(frozen=True)
class StepReport:
    batch_size: int
    clipped: int  # samples whose gradient norm exceeded their C_i
    max_norm: float  # largest finite per-sample norm before clipping (not released: for diagnostics in tests)
    nonfinite: int = 0  # units whose per-sample norm was not finite (inf or nan): each contributed exactly zero


def report(batch: int, clipped: int, norms: Tensor) -> StepReport:
    """One chunk's report: its clipping units, how many were clipped, the largest finite norm, the non-finite."""
    finite = torch.isfinite(norms)
    bad = int((~finite).sum())
    largest = float(norms[finite].max()) if bad < batch else 0.0
    return StepReport(batch, clipped, largest, bad)


def unit_losses(losses: Tensor, batch: int, units: Tensor | Sequence[int] | None
                ) -> tuple[Tensor, Tensor | None, int]:
    """(the losses a clipping unit's gradient is taken of, the units as a tensor, the number of examples): each
    example's own loss, or with `units` a unit's examples' mean (`batch` is the number of clipping units)."""
    examples = batch if units is None else len(units)
    if losses.dim() != 1 or losses.shape[0] != examples:  # before anything is formed, summed or drawn
        raise ValueError(f"need one loss per example, shape ({examples},): got {tuple(losses.shape)}. Take the "
                         "loss with reduction='none' and reduce each example's tokens alone (a mean over the "
                         "batch couples examples, so their gradients cannot be clipped one by one)")
    if units is not None:
        units = torch.as_tensor(units, dtype=torch.long, device=losses.device)
        counts = torch.bincount(units, minlength=batch) if examples else torch.zeros(batch, dtype=torch.long)
        if units.dim() != 1 or (examples and (int(units.min()) < 0 or int(units.max()) >= batch)) \
                or counts.shape[0] != batch or not bool((counts > 0).all()):
            raise ValueError(f"need one unit in [0, {batch}) per example, and at least one example per unit")
        losses = losses / counts[units].to(losses.dtype)  # a unit's gradient is its examples' mean
    return losses, units, examples


def check_classes(classes: Sequence[str], units: Tensor | None, masks: Mapping[str, Any], routes: AdapterRoutes,
                  routed: tuple[str, ...] | None) -> None:
    """Refuse a class with no resolved profile, and a chunk whose captured forward (`routed`: its examples' classes
    as `capture` routed them) went through the adapters of other classes than these examples are clipped as."""
    unknown = sorted(set(classes) - masks.keys())
    if unknown:
        raise ValueError(f"class {unknown[0]!r} has no resolved profile")
    if routes.adapters and routed != tuple(routes.examples(classes, units)):
        raise ValueError("the captured forward was routed through the adapters of other classes than these "
                         "examples are clipped as (or of none): capture(classes, units) with the classes and "
                         "units given here")


def clip_norms_of(clip_norms: Tensor | Sequence[float], losses: Tensor, batch: int) -> tuple[Tensor, torch.dtype]:
    """Each clipping unit's C_i, in the dtype norms, clipping and sums are computed in (never below fp32, whatever
    autocast ran in), and that dtype; refuses a count other than one per unit or a norm that is not positive."""
    dtype = release.accumulator(losses.dtype)
    clip = torch.as_tensor(clip_norms, dtype=dtype, device=losses.device)
    if clip.shape != (batch,) or not bool((clip > 0).all()):
        raise ValueError("need one positive clipping norm per clipping unit (example or contribution)")
    return clip, dtype


def within(clip: Tensor) -> Tensor:
    """Rounding favours privacy: clip to a hair under C_i, so that a norm computed in floating point (fp32
    rounds at ~1e-7) never lets a released per-sample gradient exceed the C_i the accountant charges; and
    `Router._clip` widens each unit's norm by its rounding allowance (`persample.Calls.bounded`), for the rounding
    that grows with the size of a unit's terms rather than with its norm (terms that cancel)."""
    return clip * (1 - 8 * torch.finfo(clip.dtype).eps)


def check_undifferentiated(active: list[Tap]) -> None:
    """Refuse a chunk whose forward a backward already ran through: its per-sample gradients would be formed from
    another loss's gradient."""
    if any(t.received for t in active):
        raise ConfigError(Code.UNGOVERNED_BATCH, "a backward through the governed forward ran before run.step(): "
                                                 "the step differentiates the per-example losses itself; do not "
                                                 "call backward() or autograd.grad on the model's output")


def differentiate(active: list[Tap], losses: Tensor) -> None:
    """Differentiate sum(losses) to the tapped calls' outputs, whose hooks form or keep each call's per-sample
    gradients (`taps.receive`).

    Gradients flow to the recorded outputs (autograd stops at the deepest, and never forms a weight's gradient:
    the router forms its own). Outputs, not parameters: under FSDP the parameters are shards the forward never used
    (`distributed/fsdp.py`). What autograd returns is dropped."""
    requested = [edge for t in active for edge in t.edges]
    if requested:
        torch.autograd.grad(losses.sum(), requested, allow_unused=True)
        if losses.requires_grad and not any(t.received for t in active):
            raise RuntimeError("no output gradient reached a tapped module: nothing would be clipped")
