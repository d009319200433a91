"""The router's materialized path (docs/privatizers.md, "Noise families"): the clipped sum formed from each
clipping unit's per-sample gradient itself, for a privatizer the ghost/weighted-sum path cannot serve, one that
clips in the L1 norm (`norm == "l1"`: Laplace) or quantises each clipped gradient before the sum (`quantized`:
the lattice families).

Per class, for the units of that class (docs/design.md §5):

1. form each reached parameter's per-sample gradients (`Calls.per_sample`, or `Shared` for tied weights),
   masked to the class's rows or columns, flattened side by side: one row [units, D_class] per unit;
2. the joint norm of the row in the privatizer's norm (L2 or L1), and the coefficient min(1, C_i / norm) with
   the C_i the router gives (already a hair under the signed C_i, as on its own path);
3. if quantized: divide each coordinate by its noise group's lattice spacing (`spacing`, from the step's group
   noise: `set_std`) and hand the rows to `privatizer.quantize` with each unit's span c_i = C_i / (the
   smallest spacing the class reaches), which rounds them to integer vectors of norm ≤ Δ(c_i);
4. sum over the units, per parameter.

The sums are the router's totals (float64 integers when quantized: exact to 2^53), noised by the privatizer's
`update`. Nothing per-sample outlives the call. It costs a [units, D_class] tensor per class per chunk (and a few
float64 copies of it when quantising), which is why the router keeps its ghost path for the Gaussian. A chunk whose
[units, D_class] would exceed `MAX_ELEMENTS` (2^28 elements: 2 GiB in float64 per copy) is refused before
anything is formed (`materialized_too_large`): split the batch into smaller physical chunks.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from govtrain.errors import Code, ConfigError
from govtrain.resolver.profile import Resolution

__all__ = ["Path", "needs_materialized", "MAX_ELEMENTS"]

MAX_ELEMENTS = 1 << 28  # the most elements one class's [units, D_class] rows may hold in one chunk


def needs_materialized(privatizer: Any) -> bool:
    """Whether the privatizer's clipped sum must come from materialized per-sample gradients."""
    return bool(getattr(privatizer, "quantized", False)) or getattr(privatizer, "norm", "l2") != "l2"


def _masked(per: Tensor, mask) -> Tensor:  # type: ignore[no-untyped-def]
    """A per-sample gradient [n, *shape] restricted to a class's part (dim, index) of the parameter."""
    if mask is None:
        return per
    dim, index = mask
    keep = torch.zeros(per.shape[dim + 1], dtype=per.dtype, device=per.device)
    keep[index] = 1
    return per * keep.reshape([-1 if d == dim + 1 else 1 for d in range(per.dim())])


class Path:
    def __init__(self, privatizer: Any, resolution: Resolution, params: Mapping[str, Tensor], mechanism: str) -> None:
        """Refuses (`mechanism_unsupported`) prism and dp-muon: their per-parameter or tangent clipping is
        an L2 Gaussian's; the families clip each unit's joint gradient."""
        if mechanism != "dpsgd":
            raise ConfigError(Code.MECHANISM_UNSUPPORTED,
                              f"privatizer {getattr(privatizer, 'name', privatizer)!r} clips each unit's joint "
                              f"per-sample gradient in the {privatizer.norm} norm"
                              f"{' and quantises it' if privatizer.quantized else ''}; mechanism {mechanism!r} "
                              "clips otherwise: use mechanism = 'dpsgd' with it")
        if privatizer.norm not in ("l1", "l2"):
            raise ValueError(f"unknown clipping norm {privatizer.norm!r}")
        self.privatizer = privatizer
        self.resolution = resolution
        self.params = params
        self.spacing: dict[str, Tensor] | None = None  # quantized: parameter -> per-coordinate lattice spacing
        self.max_elements = MAX_ELEMENTS

    def set_std(self, group_std: Mapping[frozenset, float] | None) -> None:
        """The step's noise per group (s_g, fixed before the step from public information): each coordinate's
        lattice spacing γ_g = privatizer.spacing(s_g); 0 where no group with noise reaches it."""
        if not self.privatizer.quantized:
            return
        if group_std is None:
            self.spacing = None
            return
        spacing = {name: torch.zeros(p.shape, dtype=torch.float64, device=p.device) for name, p in self.params.items()}
        for group in self.resolution.groups:
            std = float(group_std.get(group.classes, 0.0)) if group.classes else 0.0
            if std <= 0:
                continue
            step = self.privatizer.spacing(std)
            for part in group.parts:
                target = spacing[part.name]
                if part.dim is None:
                    target.fill_(step)
                else:
                    index = torch.tensor(list(part.index), dtype=torch.long, device=target.device)
                    target.index_fill_(part.dim, index, step)
        self.spacing = spacing

    def clipped_sum(self, calls: Mapping[str, tuple[Any, str]], masks: Mapping[str, Mapping[str, Any]],
                    rows: Mapping[str, Tensor], clip: Tensor, batch: int, generator: torch.Generator,
                    dtype: torch.dtype, *, diracs: Sequence[tuple[int, Any, float]] | None = None
                    ) -> tuple[dict[str, Tensor], Tensor, int]:
        """(totals per parameter, each unit's norm before clipping, how many were clipped). `calls`, `masks`,
        `rows`, `clip` are the router's own (`Router._clipped_sum`). `diracs`: AUDIT ONLY, the white-box canaries'
        (unit row, coordinate, value), as the router hands them, each added to its unit's vector
        before the norm, in a parameter its class reaches whole (the router checked it when they were injected)."""
        quantized = self.privatizer.quantized
        if quantized and self.spacing is None:
            raise RuntimeError("a quantising privatizer needs the step's group noise before the sum: "
                               "router.begin(group_std)")
        for data_class, index in rows.items():  # every class's size, before any per-sample gradient is formed
            width = sum(self.params[name].numel() for name in masks[data_class] if name in calls)
            if index.numel() * width > self.max_elements:
                raise ConfigError(Code.MATERIALIZED_TOO_LARGE,
                                  f"class {data_class!r}: {index.numel()} clipping units × {width} coordinates is "
                                  f"{index.numel() * width} per-sample elements, over the materialized path's limit "
                                  f"of {self.max_elements}: run smaller physical chunks (at most "
                                  f"{max(1, self.max_elements // max(width, 1))} units of this class each)")
        out_dtype = torch.float64 if quantized else dtype
        totals = {name: torch.zeros(p.shape, dtype=out_dtype, device=p.device) for name, p in self.params.items()}
        norms = torch.zeros(batch, dtype=dtype, device=clip.device)
        for data_class, index in rows.items():
            take = None if len(rows) == 1 else index
            reached = [(name, mask) for name, mask in masks[data_class].items() if name in calls]
            if not reached or index.numel() == 0:
                continue
            pieces = []
            for name, mask in reached:
                source, leaf = calls[name]
                per = _masked(source.per_sample(leaf, take).to(dtype), mask)
                pieces.append(per.reshape(per.shape[0], -1))
            flat = torch.cat(pieces, 1)
            if diracs:
                self._add_diracs(flat, index, reached, diracs)
            norm = flat.pow(2).sum(1).sqrt() if self.privatizer.norm == "l2" else flat.abs().sum(1)
            bound = clip.index_select(0, index)
            coefficient = torch.where(norm > bound, bound / norm.clamp(min=torch.finfo(norm.dtype).tiny),
                                      torch.ones_like(norm))
            norms.index_copy_(0, index, norm)
            # a unit whose norm is not finite contributes exactly zero: its row replaced, not scaled (0 * nan is nan)
            flat = torch.where(torch.isfinite(norm)[:, None], flat * coefficient[:, None], 0.0)
            if quantized:
                flat = self._quantize(reached, flat, bound, generator)
            offset = 0
            for name, _ in reached:
                size = self.params[name].numel()
                totals[name] += flat[:, offset:offset + size].sum(0).reshape(self.params[name].shape).to(out_dtype)
                offset += size
        return totals, norms, int((norms > clip).sum())

    def _add_diracs(self, flat: Tensor, index: Tensor, reached: Sequence[tuple[str, Any]],
                    diracs: Sequence[tuple[int, Any, float]]) -> None:
        """Add each canary Dirac whose unit is among this class's rows to its row of `flat`, in place."""
        local = {int(row): k for k, row in enumerate(index.tolist())}
        offsets, offset = {}, 0
        for name, mask in reached:
            offsets[name] = (offset, mask)
            offset += self.params[name].numel()
        for row, coordinate, value in diracs:
            if row not in local:
                continue
            if coordinate.name not in offsets or offsets[coordinate.name][1] is not None:
                raise RuntimeError(f"{coordinate.name}: a canary's coordinate outside what its class reaches whole")
            flat[local[row], offsets[coordinate.name][0] + coordinate.index] += value

    def _quantize(self, reached: Sequence[tuple[str, Any]], flat: Tensor, bound: Tensor,
                  generator: torch.Generator) -> Tensor:
        """The clipped rows on the lattice: each coordinate over its spacing, rounded by the privatizer."""
        assert self.spacing is not None
        steps = torch.cat([_masked(self.spacing[name].unsqueeze(0), mask).reshape(-1) for name, mask in reached])
        reach = torch.cat([_masked(torch.ones((1, *self.params[name].shape), dtype=torch.float64,
                                              device=steps.device), mask).reshape(-1) for name, mask in reached]) > 0
        if bool((steps[reach] <= 0).any()):
            raise RuntimeError("a unit reaches a noise group with no noise: nothing of it may be released")
        scaled = torch.where(reach, flat.to(torch.float64) / steps.clamp(min=torch.finfo(torch.float64).tiny), 0.0)
        span = bound.to(torch.float64) / steps[reach].min()
        out = torch.zeros_like(scaled)  # coordinates the class does not reach are zero, and stay so
        out[:, reach] = self.privatizer.quantize(scaled[:, reach], span, generator)
        return out
