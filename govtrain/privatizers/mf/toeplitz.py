"""Lower-triangular Toeplitz strategies, described by their first column alone (never a T×T matrix).

A strategy is the encoder C of the matrix mechanism for prefix sums: the released noise is C⁻¹z, so the T noisy
prefix sums A·(x + C⁻¹z) err by A C⁻¹ z, where A is the all-ones lower triangle. C is lower-triangular Toeplitz with
first column c (C[i, j] = c[i-j]), so C⁻¹ and A C⁻¹ are too: C⁻¹'s column is the power-series inverse r of c, and
A C⁻¹'s is the running sum p of r. The error used throughout is the **mean squared error of the T prefix sums** at
unit noise, ‖A C⁻¹‖_F² / T = Σ_k (T-k) p_k² / T, to be multiplied by the sensitivity² of C (its max column norm²
for one participation; `participation_factor` for several).

Two versions of each computation: exact recurrences in numpy float64 for what is reported and checked, and a
differentiable torch one (power-series inversion by Newton's iteration with FFT products, O(T log T)) for the
optimisers in `optimize.py`.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
from torch import Tensor


def inverse_column(numerator: np.ndarray, denominator: np.ndarray, horizon: int) -> np.ndarray:
    """The first `horizon` coefficients of the power series numerator(x) / denominator(x) (float64): the first
    column of C⁻¹ for C = denominator / numerator, by forward substitution: D·r = N, so
    r_k = (N_k - Σ_{i=1}^{min(k, deg D)} D_i r_{k-i}) / D_0 (O(T·deg D))."""
    numerator = np.asarray(numerator, dtype=np.float64)
    denominator = np.asarray(denominator, dtype=np.float64)[:horizon]
    out = np.zeros(horizon)
    out[: min(horizon, numerator.shape[0])] = numerator[:horizon]
    reversed_tail = denominator[1:][::-1]  # D_{deg}, …, D_1
    for k in range(horizon):
        width = min(k, reversed_tail.shape[0])
        if width:
            out[k] -= np.dot(reversed_tail[reversed_tail.shape[0] - width:], out[k - width:k])
        out[k] /= denominator[0]
    return out


def prefix_error(inverse: np.ndarray) -> float:
    """Mean squared error of the prefix sums at unit noise, ‖A C⁻¹‖_F² / T, from C⁻¹'s first column (length T)."""
    horizon = inverse.shape[0]
    p = np.cumsum(inverse)
    return float(np.dot(np.arange(horizon, 0, -1, dtype=np.float64), p * p) / horizon)


def identity_error(horizon: int) -> float:
    """DP-SGD's (C = I): every prefix sum t has t+1 unit-variance terms, so the mean is (T+1)/2."""
    return (horizon + 1) / 2


def min_sep_sensitivity(column: np.ndarray, separation: int, participations: int) -> float:
    """‖C u‖ for u = e_0 + e_sep + … + e_{(k-1)·sep} over the horizon len(column): for a column that is
    non-negative and non-increasing, the largest ‖C u‖ over every 0/1 pattern u of at most k participations that
    are `separation` apart or more (each shift of a participation later or further apart cannot increase any
    inner product ⟨C e_s, C e_t⟩ = Σ_i c_i c_{i+|s-t|} truncated by the horizon). tests/test_mf.py checks it
    against the dense maximum over all patterns."""
    horizon = column.shape[0]
    out = np.zeros(horizon)
    for i in range(participations):
        start = i * separation
        if start >= horizon:
            break
        out[start:] += column[: horizon - start]
    return float(np.sqrt(np.dot(out, out)))


# The differentiable side: power series as 1-D float64 tensors.

def _product(a: Tensor, b: Tensor, length: int) -> Tensor:
    """(a·b) mod x^length by FFT."""
    size = 1 << (a.shape[0] + b.shape[0] - 2).bit_length()
    return torch.fft.irfft(torch.fft.rfft(a, size) * torch.fft.rfft(b, size), size)[:length]


def series_inverse(column: Tensor, horizon: int) -> Tensor:
    """The first `horizon` coefficients of 1/c(x) (c[0] ≠ 0) by Newton's iteration r ← r(2 - c·r), which doubles
    the number of correct coefficients per round: O(T log T), differentiable."""
    inverse = (1.0 / column[0]).reshape(1)
    have = 1
    while have < horizon:
        have = min(2 * have, horizon)
        head = column[:have]
        residual = _product(head, inverse, have)
        inverse = 2 * torch.nn.functional.pad(inverse, (0, have - inverse.shape[0])) - _product(inverse, residual, have)
    return inverse


def prefix_error_t(column: Tensor, horizon: int) -> Tensor:
    """`prefix_error` of the strategy with first column `column` (zero-padded to the horizon), differentiably."""
    column = torch.nn.functional.pad(column, (0, max(0, horizon - column.shape[0])))[:horizon]
    p = torch.cumsum(series_inverse(column, horizon), 0)
    weights = torch.arange(horizon, 0, -1, dtype=column.dtype)
    return torch.dot(weights, p * p) / horizon


# Stability, exactly: whether a recurrence's noise stays bounded, decided in integers (the same on every machine).

def no_root_in_closed_unit_disc(coefficients: Sequence[int]) -> bool:
    """Whether the integer polynomial p(x) = Σ_k a_k x^k (ascending powers) has no root with |x| ≤ 1, exactly.

    Positive, strictly decreasing coefficients (what the optimiser writes) settle it in O(n) (Eneström–Kakeya:
    |(1-x)·p(x) - a_0| ≤ a_0 on |x| ≤ 1, with equality only at x = 1, where p(1) > 0). Otherwise the Schur–Cohn
    reduction in integers: if |a_0| ≤ |a_n|, the roots' product |a_0/a_n| is ≤ 1, so one lies in the closed disc;
    else q = a_0·p - a_n·p* (p* the reversed polynomial; degree < n) has as many roots in the closed disc as p
    (on |x| = 1, |p*| = |p| and |a_n·p*| < |a_0·p|: Rouché's theorem, and a root of p on the circle is one of q).
    Each q is divided by the gcd of its coefficients, which keeps the integers' growth linear."""
    p = [int(v) for v in coefficients]
    while p and p[-1] == 0:
        p.pop()
    if p and p[-1] > 0 and all(a > b for a, b in zip(p, p[1:])):
        return True
    while True:
        while p and p[-1] == 0:
            p.pop()
        if not p:
            raise ValueError("the zero polynomial has roots everywhere")
        if len(p) == 1:
            return True
        lead, last = p[0], p[-1]
        if abs(lead) <= abs(last):
            return False
        n = len(p) - 1
        q = [lead * p[k] - last * p[n - k] for k in range(n)]
        divisor = math.gcd(*q)
        p = [v // divisor for v in q]
