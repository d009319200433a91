"""The rounding allowance of a unit's clip (`persample.Calls.bounded`, docs/training.md "Rounding allowance").

A unit's clip coefficient comes from one floating-point evaluation of its gradient's norm, and what is released
is another (the weighted contraction over every unit's tokens at once). Each differs from the exact gradient by
at most γ_n · Σ|terms| (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., §3.1, eq. (3.4)-(3.5)
and Lemma 3.1: an inner product or sum of n terms, in any order, errs by at most γ_n = n·u/(1 - n·u) times the sum
of the terms' magnitudes, u the unit roundoff; §3.5, eq. (3.13), for matrix products). That bound is the size of
the TERMS, not of their sum: a unit whose terms cancel (examples weighted +H and -H) has a tiny exact gradient
and a rounding residual of size u·H in each evaluation, and two evaluations' residuals differ. So each unit's
norm is widened by an allowance: a magnitude M_u ≥ Σ|terms| (for a Linear weight, Σ_t ‖a_t‖·‖g_t‖, which bounds
‖Σ_t g_t a_tᵀ‖ and every partial sum of it by the triangle inequality), times γ for the longest chain either
evaluation sums. Clipping to C / (‖ĝ_u‖ + allowance) then bounds the released part of the unit, rounding
included, by C. Without cancellation M_u is of the order of ‖g_u‖ and the allowance costs about γ (1e-7 to 1e-4
relative in fp32, ~1e-13 in fp64); with cancellation the unit is clipped harder, as it must be. A ghost norm
⟨AAᵀ, GGᵀ⟩ errs by γ·M² in the square (its terms' magnitudes sum to at most M²): it is taken in float64.

Not covered here, as before: the rounding of the final sum over units and ranks, relative to the clipped terms'
own sizes (γ_B·Σ_u C_u at worst, the general floating-point sensitivity of a sum: Casacuberta et al., "Widespread
Underestimation of Sensitivity in Differentially Private Libraries", CCS 2022), which the clip's 8-ulp margin
does not bound either.
"""

from __future__ import annotations

import torch

SAFETY = 2.0  # over γ_n: the few roundings not counted one by one (the weights' products, squares, square roots)


def roundoff(dtype: torch.dtype, precision: str = "highest") -> tuple[float, float]:
    """(u of a product's inputs, u of the accumulation) of a contraction in `dtype`. float32 matrix products that
    `torch.set_float32_matmul_precision` (`precision`, read eagerly by `Calls`) lets round their inputs to TF32
    ("high", 2^-11) or bfloat16 ("medium", 2^-8) accumulate in float32: their inputs round once per product, their
    sums as float32's."""
    u = torch.finfo(dtype).eps / 2
    if dtype == torch.float32:
        return {"high": 2.0 ** -11, "medium": 2.0 ** -8}.get(precision, u), u
    return u, u


def gamma(n: int, units: tuple[float, float]) -> float:
    """SAFETY · (2·u_in + γ_n(u)): the relative bound of an n-term contraction, against the sum of its terms'
    magnitudes (Higham §3.1); infinite where n·u reaches 1/2 (no bound: such a unit's widened norm is infinite, so it
    contributes zero and is counted as non-finite)."""
    u_in, u = units
    if n * u >= 0.5:
        return float("inf")
    return SAFETY * (2 * u_in + n * u / (1 - n * u))
