"""Conditional randomised rounding onto the integer lattice (docs/privatizers.md, "Noise families").

Each clipping unit's clipped gradient, already divided by its lattice spacing, is a real vector y with
‖y‖ ≤ c (L2, or L1 for the Laplace privatizer). Each coordinate rounds to ⌊y_j⌋ + Bern(y_j − ⌊y_j⌋): unbiased,
E[q] = y. The rounded vector is kept only if its norm is within the family's bound Δ(c)
(`accounting.families.l2_bound`, `l1_bound`); otherwise the whole vector is rounded again. The bound holds for
every output by construction, so the quantised sensitivity is Δ(c) always; a re-draw is needed with probability at
most β = 2^-beta_exp, so the conditioning moves the mean by at most about β·Δ.
"""

from __future__ import annotations

import torch
from torch import Tensor

from govtrain.accounting.families import l1_bound, l2_bound

__all__ = ["randomized_round", "bounds", "conditional_round"]

MAX_ROUNDS = 10_000  # a bound that held with probability ≥ 1/2 fails this often with probability < 2^-10000


def randomized_round(y: Tensor, generator: torch.Generator) -> Tensor:
    """⌊y⌋ + Bern(y − ⌊y⌋) per coordinate, in float64 (integers held exactly up to 2^53)."""
    y = y.to(torch.float64)
    low = torch.floor(y)
    u = torch.rand(y.shape, generator=generator, dtype=torch.float64, device=y.device)
    return low + (u < y - low).to(torch.float64)


def bounds(span: Tensor, norm: str, dimension: int, beta_exp: int) -> Tensor:
    """Δ(c) for each unit's span c (the accountant's own function, so both agree to the bit)."""
    bound = l2_bound if norm == "l2" else l1_bound
    return torch.tensor([bound(float(c), dimension, beta_exp) for c in span.tolist()], dtype=torch.float64,
                        device=span.device)


def _norms(q: Tensor, norm: str) -> Tensor:
    return q.pow(2).sum(1) if norm == "l2" else q.abs().sum(1)


def conditional_round(y: Tensor, span: Tensor, *, norm: str, dimension: int, beta_exp: int,
                      generator: torch.Generator) -> Tensor:
    """The rows of `y` ([units, d], row i of norm ≤ span[i]) rounded to integer vectors (float64) of norm ≤
    Δ(span[i]), each row re-rounded until it is. A non-finite row, or a non-finite or negative span, is refused
    (ValueError) before anything is drawn."""
    if norm not in ("l1", "l2"):
        raise ValueError(f"unknown norm {norm!r}: l1 or l2")
    if y.dim() != 2 or span.shape != (y.shape[0],):
        raise ValueError("need y as [units, d] and one span per unit")
    if y.shape[1] > dimension:
        raise ValueError(f"a unit of {y.shape[1]} coordinates is more than the {dimension} the accountant charges for")
    # a NaN compares False against any bound (never re-drawn), and a negative span reads as a positive bound
    if not bool(torch.isfinite(y).all()):
        raise ValueError("a row holds NaN or infinity (a non-finite loss or gradient): it has no bound to round within")
    if not bool((torch.isfinite(span) & (span >= 0)).all()):
        raise ValueError("each unit's span is a finite, non-negative number of lattice steps")
    limit = bounds(span.to(torch.float64), norm, dimension, beta_exp)
    limit = limit * limit if norm == "l2" else limit  # L2 compared squared: integer sums of squares are exact
    q = randomized_round(y, generator)
    pending = torch.nonzero(_norms(q, norm) > limit).flatten()
    for _ in range(MAX_ROUNDS):
        if pending.numel() == 0:
            return q
        again = randomized_round(y.index_select(0, pending), generator)
        q[pending] = again
        pending = pending[_norms(again, norm) > limit[pending]]
    raise RuntimeError("randomised rounding kept exceeding its bound: the rows are not within their spans")
