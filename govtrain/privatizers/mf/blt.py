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
Let r(L) = Σ_{k≥0} c_k c_{k+L} (infinite horizon, c of C/n) and m = r(0) + 2·Σ_{i≥1} r(i·b)
(`charge.participation_factor`, in closed form). For participations u at b-separated steps with weights v_t = C_i / s_t (the query C·S⁻¹·x of
`stream.py`), G = (C/n)ᵀ(C/n) is entrywise ≥ 0 with G_{st} ≤ r(|s-t|) and r non-increasing (c ≥ 0, non-increasing),
so by 2·v_s·v_t ≤ v_s² + v_t²:

    ‖(C/n)·v‖² = Σ_{s,t} v_s v_t G_{st} ≤ Σ_t v_t² · Σ_{s∈u} G_{st}
               ≤ Σ_t v_t² · (r(0) + 2·Σ_{i≥1} r(i·b)) = m · Σ_t 1/σ_t²,

whatever the steps' σ_t = s_t / C_i. The whole release is one Gaussian mechanism with that squared sensitivity,
which is exactly the composition of one unsampled Gaussian per participation at multiplier σ_t / √m. So `charge`
is family gaussian, rate 1, multiplier ⌊σ/√m⌋ (m computed exactly and rounded up, `charge.factor_p`), ⌈steps/b⌉
rounds per epoch (the banded module's argument for the ceiling). For many participations it is tight: the largest ‖(C/n)·u‖² over k participations
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
from govtrain.accounting.records import Charge
from govtrain.privatizers.base import Participation
from govtrain.privatizers.mf.charge import applied_parameters, blt_charge, check_blt, factor_p
from govtrain.privatizers.mf.optimize import blt_parameters
from govtrain.privatizers.mf.stream import StreamingPrivatizer
from govtrain.privatizers.mf.toeplitz import no_root_in_closed_unit_disc


def _product(polynomials: Sequence[Sequence[int]]) -> list[int]:
    out = [1]
    for p in polynomials:
        out = [sum(out[i] * p[k - i] for i in range(len(out)) if 0 <= k - i < len(p))
               for k in range(len(out) + len(p) - 1)]
    return out


def inverse_is_stable(theta_p: Sequence[int], omega_p: Sequence[int]) -> bool:
    """Whether the inverse recurrence s_{t+1} = (diag(θ) - 1ωᵀ)·s_t + z̃_t is stable (every eigenvalue |λ| < 1), in
    exact integers. With μ = 10¹²·λ, the characteristic polynomial is, by the matrix determinant lemma,
    Q(μ) = Π_j (μ - θ_p_j) + Σ_j ω_p_j·Π_{l≠j} (μ - θ_p_l); its roots lie in |μ| < 10¹² exactly when
    y^d·Q(10¹²/y) = Σ_k q_k·10¹²ᵏ·y^{d-k} has none in |y| ≤ 1."""
    factors = [[-t, 1] for t in theta_p]
    q = _product(factors)
    for j, w in enumerate(omega_p):
        others = _product(factors[:j] + factors[j + 1:])
        q = [a + w * (others[k] if k < len(others) else 0) for k, a in enumerate(q)]
    degree = len(q) - 1
    return no_root_in_closed_unit_disc([q[degree - i] * units.PICO ** (degree - i) for i in range(degree + 1)])

class BLT(StreamingPrivatizer):
    name: ClassVar[str] = "blt"

    def __init__(self, *, buffers: int, horizon: int, min_separation: int, theta_p: Sequence[int] | None = None,
                 omega_p: Sequence[int] | None = None, insecure_seed: int | None = None,
                 entropy: Callable[[int], bytes] = os.urandom) -> None:
        """d = `buffers`, the run's `horizon` T, the sampler's cycle `min_separation` b; (θ, ω) in pico-units as
        recorded, or None to optimise them for (d, T, b). `insecure_seed`: a fixed noise key, for tests only."""
        super().__init__(insecure_seed=insecure_seed, entropy=entropy)
        if (theta_p is None) != (omega_p is None):
            raise ValueError("give both theta_p and omega_p, or neither")

        def record(theta, omega):
            return {"name": self.name, "buffers": buffers, "horizon": horizon, "min_separation": min_separation,
                    "theta_p": list(theta), "omega_p": list(omega)}

        if theta_p is None:
            check_blt(record([units.PICO // 2] * buffers, [0] * buffers))  # the shape, before optimising
            theta, omega = blt_parameters(buffers, horizon, min_separation)
            theta_p = [math.floor(t * units.PICO) for t in theta]  # down: Σω ≤ 1 stays true
            omega_p = [math.floor(w * units.PICO) for w in omega]
        self.buffers, self.horizon, self.min_separation, self.theta_p, self.omega_p = check_blt(
            record(theta_p, omega_p))
        if not inverse_is_stable(self.theta_p, self.omega_p):
            raise ValueError("this BLT's inverse is unstable: its noise would grow without bound")
        # what the float64 stream multiplies by, exactly as the charge (factor_p) reads them from the record
        self.theta, self.omega, self.scale = applied_parameters(self.theta_p, self.omega_p)
        self.factor_p = factor_p(self.theta_p, self.omega_p, min_separation)

    @property
    def depth(self) -> int:
        return self.buffers

    def record(self) -> dict[str, Any]:
        return {"name": self.name, "buffers": self.buffers, "horizon": self.horizon,
                "min_separation": self.min_separation, "theta_p": list(self.theta_p), "omega_p": list(self.omega_p)}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "BLT":
        buffers, horizon, separation, theta_p, omega_p = check_blt(record)
        return cls(buffers=buffers, horizon=horizon, min_separation=separation, theta_p=theta_p, omega_p=omega_p)

    def participation(self) -> Participation:
        return Participation(scheme="cyclic", cycle=self.min_separation)

    def charge(self, *, sampling_rate_u: int, noise_multiplier_u: int, steps: int) -> Charge:
        """An unsampled Gaussian per participation at ⌊σ/√m⌋, ⌈steps/b⌉ participations (module docstring)."""
        rate_u, multiplier_u, rounds = blt_charge(self.record(), sampling_rate_u=sampling_rate_u,
                                                  noise_multiplier_u=noise_multiplier_u, steps=steps)
        return Charge(family=self.family, sampling_rate_u=rate_u, noise_multiplier_u=multiplier_u, rounds=rounds)

    def column(self, horizon: int) -> np.ndarray:
        """The first `horizon` coefficients of the normalised C/n (float64), for checks and reports."""
        k = np.arange(horizon - 1, dtype=np.float64)
        tail = sum(w * np.power(t, k) for t, w in zip(self.theta, self.omega))
        return np.concatenate([[1.0], tail]) / self.scale

    def _advance(self, buffer: Tensor, z: Tensor, step: int) -> tuple[Tensor, Tensor]:
        omega = torch.tensor(self.omega, dtype=torch.float64).to(z.device)
        theta = torch.tensor(self.theta, dtype=torch.float64).to(z.device).reshape(-1, *([1] * z.dim()))
        u = z - torch.tensordot(omega, buffer, dims=1)
        return u * self.scale, buffer * theta + u
