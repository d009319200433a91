"""Parameters of one shape moved as one batch.

A model's LoRA pairs come in a few shapes (in a BERT layer: the four attention projections, the
intermediate and the output dense), so an update that stacks every pair of a shape into one [P, m, r]
tensor runs each operation as one batched kernel (torch.bmm, a batched QR, SVD or eigh) per shape instead
of a Python loop over dozens of pairs, each launching its own small kernels. On a GPU the loop costs a launch
and, for every linalg call, a host synchronization per pair; batched, it costs them per shape.

`shape_groups` makes the partition; `write` copies a stacked result back into the parameters with one
foreach call. The optimizers keep each key's state as views into the stacked buffers (so their in-place
moment updates are one kernel per group) while `state_dict()` keeps one entry per key, the format the
checkpoints have always had.
"""

from __future__ import annotations

from typing import Callable, Hashable, Mapping, Sequence, TypeVar

import torch
from torch import Tensor

__all__ = ["shape_groups", "write"]

T = TypeVar("T")


def shape_groups(items: Mapping[str, T], signature: Callable[[T], Hashable]) -> list[tuple[str, ...]]:
    """The keys of `items` partitioned by `signature` (shapes, dtype, device: whatever must agree for the
    values to stack), each group in the mapping's order, the groups in order of first appearance."""
    groups: dict[Hashable, list[str]] = {}
    for key, value in items.items():
        groups.setdefault(signature(value), []).append(key)
    return [tuple(keys) for keys in groups.values()]


def write(targets: Sequence[Tensor], stacked: Tensor) -> None:
    """targets[i].copy_(stacked[i]) for every i, as one foreach call (one fused launch on a GPU)."""
    if len(targets) != stacked.shape[0]:
        raise RuntimeError(f"{len(targets)} targets for a stack of {stacked.shape[0]}")
    torch._foreach_copy_(list(targets), list(stacked.unbind(0)))
