"""The router's release of a logical step (`routing/router.py` `finish`): the ranks' clipped sums summed, each
group's noise drawn once by the lead (per microbatch where there are several), the release shared bitwise,
checked finite, divided by the expected batch size and written to `.grad`.

The noise a group gets, and so what the accountant charges, is decided here and nowhere else in the router:
`noise` draws every slot from the privatizer in slot order (`routing/slots.py`), and a parameter no class
reaches gets `.grad = None`. Functions of the router, kept apart from its per-sample stages.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import Tensor

from govtrain.distributed import fsdp
from govtrain.errors import Code, ConfigError

# `router` below is a `routing.router.Router` (not imported: the router imports this module).


def check_releaser(router: Any, group_std: Mapping[frozenset, float]) -> None:
    """Refuse to release sums the materialized path clipped or quantised for another privatizer than the router's."""
    if router.materialized is not None and router.materialized.privatizer is not router.privatizer \
            and any(std > 0 for std in group_std.values()):  # its sums are another privatizer's to release
        raise RuntimeError(f"the materialized path clips or quantises for {router.materialized.privatizer.name!r}, "
                           f"but {router.privatizer.name!r} releases: build the router with that privatizer")


def noise_once(router: Any, totals: dict[str, Tensor], group_std: Mapping[frozenset, float],
               expected_batch_size: float) -> None:
    """The noise, drawn once for all the ranks: by the lead, whose release `share_` then copies to the others;
    a follower only sets `noise_std`, which the update reads (its `totals` are overwritten by the lead's)."""
    if router.world.lead:
        noise(router, totals, group_std, expected_batch_size)
    else:
        router.noise_std = stds(router, group_std, expected_batch_size)


def noise(router: Any, totals: dict[str, Tensor], group_std: Mapping[frozenset, float],
          expected_batch_size: float) -> None:
    """Add each group's noise to `totals` in place (prism: the pairs' sums lifted, with their tangent noise);
    `noise_std` then holds each reached parameter's noise std over the expected batch size."""
    reached = groups(router, group_std)
    router.noise_std = stds(router, group_std, expected_batch_size)
    pair_std: dict[str, float] = {}
    if router.tangent is not None:  # prism: the pairs' clipped sums lifted, each with its group's tangent noise
        for group, std in reached:
            for part in group.parts:
                if part.name in router._paired:
                    if part.dim is not None:
                        raise RuntimeError(f"{part.name} is reached in part: check_reach should have refused it")
                    pair_std[part.name] = std
    # every draw is the privatizer's, in slot order: the tangent Gaussians first, then each group's parts
    sums, std, keep = router.noise_slots.step(totals, reached, pair_std)
    noisy, router.noise_state = router.privatizer.update(sums, router.noise_state, std=std, keep=keep)
    router.noise_slots.released(totals, noisy)
    if router.tangent is not None:
        router.tangent.release(totals, pair_std, router.noise_slots.omega(noisy))


def groups(router: Any, group_std: Mapping[frozenset, float]) -> list:
    """Each resolved group some class reaches, with its noise std (0 where `group_std` has none)."""
    return [(group, float(group_std.get(group.classes, 0.0))) for group in router.resolution.groups if group.classes]


def stds(router: Any, group_std: Mapping[frozenset, float], expected_batch_size: float) -> dict[str, float]:
    """Each reached parameter's noise std over the expected batch size."""
    if not expected_batch_size > 0:
        raise ValueError("the expected batch size must be positive")
    return {part.name: std / expected_batch_size for group, std in groups(router, group_std) for part in group.parts}


def finish_microbatches(router: Any, parts: list[dict[str, Tensor]], group_std: Mapping[frozenset, float],
                        expected_batch_size: float) -> None:
    """Per-microbatch noise: each microbatch's clipped sum gets the group noise on its own, in microbatch
    order, and the step releases their sum over the expected batch size (k times the variance of one)."""
    router.world.sum_([total for part in parts for total in part.values()])
    for part in parts:
        noise_once(router, part, group_std, expected_batch_size)
    totals = parts[0]
    for part in parts[1:]:
        for name, total in part.items():
            totals[name] += total
    router.noise_std = {name: std * math.sqrt(len(parts)) for name, std in router.noise_std.items()}
    router.world.share_(list(totals.values()))
    check_release(totals)
    write(router, totals, expected_batch_size)


def write(router: Any, totals: dict[str, Tensor], expected_batch_size: float) -> None:
    """Each reached parameter's `.grad`: its noised sum over the expected batch size; `.grad = None` for a parameter
    no class reaches, so the optimizer leaves it and its state untouched."""
    for name, param in router.params.items():
        param.grad = fsdp.local((totals[name] / expected_batch_size).to(param.dtype), param) \
            if name in router.noise_std else None  # a sharded parameter gets its own shard


def zeros(router: Any) -> dict[str, Tensor]:
    """The sum of no clipped gradient: full-size, also for a sharded parameter, in the dtype a sum takes (float64
    on the quantising path), so ranks with and without examples sum tensors of one layout."""
    quantized = router.materialized is not None and router.materialized.privatizer.quantized
    return {name: torch.zeros(p.shape, dtype=torch.float64 if quantized else accumulator(p.dtype), device=p.device)
            for name, p in router.params.items()}


def check_release(totals: Mapping[str, Tensor]) -> None:
    """Refuse a noised sum with a non-finite coordinate before it reaches `.grad`: a unit with a non-finite norm
    contributes zero (`Router._clip`), so this cannot happen; if it does, a release that a neighbouring batch could
    not produce would leave under a finite charge, so nothing is written and nothing moves."""
    if not totals or bool(torch.stack([torch.isfinite(total).all() for total in totals.values()]).all()):
        return  # one read of the device per step; the names only when it fails
    bad = [name for name, total in totals.items() if not bool(torch.isfinite(total).all())]
    if bad:
        raise ConfigError(Code.NONFINITE_RELEASE,
                          f"the step's noised gradient of {', '.join(bad[:3])}{' and more' if len(bad) > 3 else ''} "
                          "is not finite: nothing was released or updated; this is a defect in govtrain, report it")


def accumulator(dtype: torch.dtype) -> torch.dtype:
    """The dtype per-sample norms, clipping, sums and noise are computed in: float32, or wider if given."""
    return torch.promote_types(dtype, torch.float32)
