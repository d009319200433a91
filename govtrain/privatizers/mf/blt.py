"""Buffered linear Toeplitz noise ("blt"; Dvijotham et al. 2024, McKenna 2024): correlated noise from a Toeplitz
strategy whose column is a sum of d geometric sequences, streamed with d buffers per slot.

Strategy: C's column is c_0 = 1, c_k = Σ_j ω_j θ_j^{k-1} (k ≥ 1), with θ_j ∈ (0, 1), ω_j ≥ 0 and Σω ≤ 1, so it is
positive and non-increasing; (θ, ω) are optimised for the horizon T and min separation b (`optimize.blt_parameters`)
and recorded in pico-units. C is the output of the linear system s_{t+1} = diag(θ)·s_t + x_t, y_t = x_t + ωᵀs_t, so
w = C⁻¹z̃ streams by inverting it: w_t = z̃_t - ωᵀs_t, then s_{t+1} = diag(θ)·s_t + w_t (d buffers per slot, O(d)
work per step). The stream is scaled by n = √r(0), C's infinite-horizon column norm, so the released strategy
C/n has every column of norm ≤ 1.

Sensitivity and charge (unamplified: no amplification theorem covers BLT under Poisson sampling). Participation is
cyclic with the public cycle b = `min_separation` (the sampler keeps a unit's participations ≥ b steps apart).
Let r(L) = Σ_{k≥0} c_k c_{k+L} (infinite horizon, c of C/n) and m = r(0) + 2·Σ_{i≥1} r(i·b) (`participation_factor`,
in closed form). For participations u at b-separated steps with weights v_t = C_i / s_t (the query C·S⁻¹·x of
`stream.py`), G = (C/n)ᵀ(C/n) is entrywise ≥ 0 with G_{st} ≤ r(|s-t|) and r non-increasing (c ≥ 0, non-increasing),
so by 2·v_s·v_t ≤ v_s² + v_t²:

    ‖(C/n)·v‖² = Σ_{s,t} v_s v_t G_{st} ≤ Σ_t v_t² · Σ_{s∈u} G_{st}
               ≤ Σ_t v_t² · (r(0) + 2·Σ_{i≥1} r(i·b)) = m · Σ_t 1/σ_t²,

whatever the steps' σ_t = s_t / C_i. The whole release is one Gaussian mechanism with that squared sensitivity,
which is exactly the composition of one unsampled Gaussian per participation at multiplier σ_t / √m. So `charge`
is family gaussian, rate 1, multiplier ⌊σ/√m⌋ (m rounded up), ⌈steps/b⌉ rounds per epoch (the banded module's
argument for the ceiling). For many participations it is tight: the largest ‖(C/n)·u‖² over k participations
(`toeplitz.min_sep_sensitivity`, the earliest pattern for a non-increasing column) is ≤ k·m and tends to k·m.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, ClassVar, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from govtrain import units
from govtrain.privatizers.base import Charge, Participation
from govtrain.privatizers.mf.optimize import blt_parameters
from govtrain.privatizers.mf.stream import StreamingPrivatizer

_FIELDS = ("name", "buffers", "horizon", "min_separation", "theta_p", "omega_p")
_MARGIN = 1e-9  # relative slack on m over float64 rounding in its closed form


def _power(x: float, n: int) -> float:
    """x**n by squaring: IEEE multiplications only, the same on every platform (libm's pow need not be)."""
    out = 1.0
    while n:
        if n & 1:
            out *= x
        x *= x
        n >>= 1
    return out


def column_norm_sq(theta: Sequence[float], omega: Sequence[float]) -> float:
    """r(0) = 1 + Σ_{j,l} ω_j ω_l / (1 - θ_j θ_l) of the raw column (c_0 = 1)."""
    return 1.0 + math.fsum(wj * wl / (1.0 - tj * tl) for tj, wj in zip(theta, omega) for tl, wl in zip(theta, omega))


def participation_factor(theta: Sequence[float], omega: Sequence[float], separation: int) -> float:
    """m of the normalised strategy C/n at min separation b: (r(0) + 2·Σ_{i≥1} r(i·b)) / r(0), with, for L ≥ 1,
    r(L) = Σ_j ω_j θ_j^{L-1} + Σ_{j,l} ω_j ω_l θ_l^L / (1 - θ_j θ_l), summed over L = i·b as geometric series."""
    tb = [_power(t, separation) for t in theta]
    lagged = math.fsum(
        [w * _power(t, separation - 1) / (1.0 - p) for t, w, p in zip(theta, omega, tb)]
        + [wj * wl * pl / ((1.0 - tj * tl) * (1.0 - pl))
           for tj, wj in zip(theta, omega) for tl, wl, pl in zip(theta, omega, tb)])
    r0 = column_norm_sq(theta, omega)
    return (r0 + 2.0 * lagged) / r0


def factor_p(theta: Sequence[float], omega: Sequence[float], separation: int) -> int:
    """m in pico-units, rounded up after a relative margin for float64 error: the charge's sensitivity factor."""
    return math.ceil(participation_factor(theta, omega, separation) * (1 + _MARGIN) * units.PICO)


def unamplified_multiplier_u(noise_multiplier_u: int, m_p: int) -> int:
    """⌊σ / √m⌋ in micro-units, exactly in integers: the largest y with y² · m ≤ σ² (rounding favours privacy)."""
    return math.isqrt(noise_multiplier_u * noise_multiplier_u * units.PICO // m_p)


def _int(value: Any) -> bool:
    return type(value) is int


class BLT(StreamingPrivatizer):
    name: ClassVar[str] = "blt"

    def __init__(self, *, buffers: int, horizon: int, min_separation: int, theta_p: Sequence[int] | None = None,
                 omega_p: Sequence[int] | None = None, insecure_seed: int | None = None,
                 entropy: Callable[[int], bytes] = os.urandom) -> None:
        """d = `buffers`, the run's `horizon` T, the sampler's cycle `min_separation` b; (θ, ω) in pico-units as
        recorded, or None to optimise them for (d, T, b). `insecure_seed`: a fixed noise key, for tests only."""
        super().__init__(insecure_seed=insecure_seed, entropy=entropy)
        if not (_int(buffers) and _int(horizon) and _int(min_separation) and buffers >= 1
                and 1 <= min_separation <= horizon):
            raise ValueError("a BLT needs int buffers ≥ 1 and a min_separation in [1, horizon]")
        if (theta_p is None) != (omega_p is None):
            raise ValueError("give both theta_p and omega_p, or neither")
        if theta_p is None:
            theta, omega = blt_parameters(buffers, horizon, min_separation)
            theta_p = [math.floor(t * units.PICO) for t in theta]  # down: a smaller decay, a smaller column
            omega_p = [math.floor(w * units.PICO) for w in omega]
        theta_p, omega_p = tuple(theta_p), tuple(omega_p)
        if len(theta_p) != buffers or len(omega_p) != buffers or not all(_int(v) for v in theta_p + omega_p):
            raise ValueError(f"expected {buffers} integer decays and {buffers} integer weights")
        if not all(0 < t < units.PICO for t in theta_p) or not all(w >= 0 for w in omega_p) \
                or sum(omega_p) > units.PICO:
            raise ValueError("a BLT needs 0 < θ < 1, ω ≥ 0 and Σω ≤ 1 (a positive, non-increasing column)")
        self.buffers, self.horizon, self.min_separation = buffers, horizon, min_separation
        self.theta_p, self.omega_p = theta_p, omega_p
        self.theta = [t / units.PICO for t in theta_p]
        self.omega = [w / units.PICO for w in omega_p]
        system = np.diag(self.theta) - np.outer(np.ones(buffers), self.omega)
        if float(np.max(np.abs(np.linalg.eigvals(system)))) >= 1:
            raise ValueError("this BLT's inverse is unstable: its noise would grow without bound")
        self.scale = math.sqrt(column_norm_sq(self.theta, self.omega))
        self.factor_p = factor_p(self.theta, self.omega, min_separation)

    @property
    def depth(self) -> int:
        return self.buffers

    def record(self) -> dict[str, Any]:
        return {"name": self.name, "buffers": self.buffers, "horizon": self.horizon,
                "min_separation": self.min_separation, "theta_p": list(self.theta_p), "omega_p": list(self.omega_p)}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "BLT":
        if set(record) != set(_FIELDS) or record["name"] != cls.name:
            raise ValueError(f"not a {cls.name} record: expected the fields {', '.join(_FIELDS)}")
        if not all(isinstance(record[f], (list, tuple)) for f in ("theta_p", "omega_p")):
            raise ValueError("theta_p and omega_p must be lists of ints")
        return cls(buffers=record["buffers"], horizon=record["horizon"], min_separation=record["min_separation"],
                   theta_p=record["theta_p"], omega_p=record["omega_p"])

    def participation(self) -> Participation:
        return Participation(scheme="cyclic", cycle=self.min_separation)

    def charge(self, *, sampling_rate_u: int, noise_multiplier_u: int, steps: int) -> Charge:
        """An unsampled Gaussian per participation at ⌊σ/√m⌋, ⌈steps/b⌉ participations (module docstring)."""
        return Charge(family=self.family, sampling_rate_u=units.MICRO,
                      noise_multiplier_u=unamplified_multiplier_u(noise_multiplier_u, self.factor_p),
                      rounds=-(-steps // self.min_separation))

    def column(self, horizon: int) -> np.ndarray:
        """The first `horizon` coefficients of the normalised C/n (float64), for checks and reports."""
        k = np.arange(horizon - 1, dtype=np.float64)
        tail = sum(w * np.power(t, k) for t, w in zip(self.theta, self.omega))
        return np.concatenate([[1.0], tail]) / self.scale

    def _advance(self, buffer: Tensor, z: Tensor, step: int) -> Tensor:
        omega = torch.tensor(self.omega, dtype=z.dtype).to(z.device)
        theta = torch.tensor(self.theta, dtype=z.dtype).to(z.device).reshape(-1, *([1] * z.dim()))
        u = z - torch.tensordot(omega, buffer, dims=1)
        buffer.mul_(theta).add_(u)
        return u * self.scale
