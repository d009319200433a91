"""What a banded-mf or blt record charges, from the record alone, without torch or numpy: the verifier's path
(the audit path never imports torch). `BandedMF.charge` and `BLT.charge` are these functions; the arguments are
why in banded.py and blt.py. Every value is an int or is computed with IEEE-exact arithmetic (+, -, ×, /, fsum,
powers by squaring), so the writer and the verifier get the same integers on any platform.

    banded_charge(record, sampling_rate_u=, noise_multiplier_u=, steps=)  -> (rate_u, multiplier_u, rounds)
    blt_charge(record, sampling_rate_u=, noise_multiplier_u=, steps=)     -> (rate_u, multiplier_u, rounds)
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from govtrain import units

BANDED_FIELDS = ("name", "bands", "horizon", "coefficients_p")
BLT_FIELDS = ("name", "buffers", "horizon", "min_separation", "theta_p", "omega_p")


def _int(value: Any) -> bool:
    return type(value) is int


def _ints(value: Any, count: int, what: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or len(value) != count or not all(_int(v) for v in value):
        raise ValueError(f"{what} must be a list of {count} ints")
    return tuple(value)


def check_banded(record: Mapping[str, Any]) -> tuple[int, int, tuple[int, ...]]:
    """(bands, horizon, coefficients_p) of a banded-mf record, or ValueError: a column whose norm exceeds 1 in the
    recorded integers would have a sensitivity above the charge's."""
    if set(record) != set(BANDED_FIELDS) or record["name"] != "banded-mf":
        raise ValueError(f"not a banded-mf record: expected the fields {', '.join(BANDED_FIELDS)}")
    bands, horizon = record["bands"], record["horizon"]
    if not (_int(bands) and _int(horizon) and 1 <= bands <= horizon):
        raise ValueError(f"bands must be an int in [1, horizon], got bands={bands!r}, horizon={horizon!r}")
    coefficients = _ints(record["coefficients_p"], bands, "coefficients_p")
    if coefficients[0] <= 0:
        raise ValueError("the leading coefficient must be positive")
    if sum(v * v for v in coefficients) > units.PICO ** 2:
        raise ValueError("the coefficients' norm exceeds 1: the sensitivity would exceed the charge's")
    return bands, horizon, coefficients


def check_blt(record: Mapping[str, Any]) -> tuple[int, int, int, tuple[int, ...], tuple[int, ...]]:
    """(buffers, horizon, min_separation, theta_p, omega_p) of a blt record, or ValueError: the bound behind the
    charge needs a positive, non-increasing column (0 < θ < 1, ω ≥ 0, Σω ≤ 1)."""
    if set(record) != set(BLT_FIELDS) or record["name"] != "blt":
        raise ValueError(f"not a blt record: expected the fields {', '.join(BLT_FIELDS)}")
    buffers, horizon, separation = record["buffers"], record["horizon"], record["min_separation"]
    if not (_int(buffers) and _int(horizon) and _int(separation) and buffers >= 1 and 1 <= separation <= horizon):
        raise ValueError("a BLT needs int buffers ≥ 1 and a min_separation in [1, horizon]")
    theta = _ints(record["theta_p"], buffers, "theta_p")
    omega = _ints(record["omega_p"], buffers, "omega_p")
    if not all(0 < t < units.PICO for t in theta) or not all(w >= 0 for w in omega) or sum(omega) > units.PICO:
        raise ValueError("a BLT needs 0 < θ < 1, ω ≥ 0 and Σω ≤ 1 (a positive, non-increasing column)")
    return buffers, horizon, separation, theta, omega


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
    """r(0) = 1 + Σ_{j,l} ω_j ω_l / (1 - θ_j θ_l) of the raw BLT column (c_0 = 1), over the infinite horizon."""
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


def factor_p(theta_p: Sequence[int], omega_p: Sequence[int], separation: int) -> int:
    """m in pico-units from the recorded integers, rounded up: `participation_factor`'s closed form in integers, at
    a fixed point of 2^-256 with every rounding toward a larger m (float64 cancels in 1 - θ_j·θ_l near θ = 1)."""
    one, pico = 1 << 256, units.PICO

    def power_up(t_p: int, n: int) -> int:  # ≥ (t_p / pico)^n · one, by squaring; every value stays ≤ one
        out, x = one, -(-t_p * one // pico)
        while n:
            if n & 1:
                out = -(-out * x // one)
            x = -(-x * x // one)
            n >>= 1
        return out

    lead = [power_up(t, separation - 1) for t in theta_p]  # θ^(b-1), θ^b: upper bounds (b ≥ 1; 1 - θ^b > 2^-200)
    tail = [power_up(t, separation) for t in theta_p]
    pairs = [(wj * wl, pico * pico - tj * tl) for tj, wj in zip(theta_p, omega_p) for tl, wl in zip(theta_p, omega_p)]
    # r(0) - 1 = Σ ω_j ω_l / (1 - θ_j θ_l), rounded down (m falls as r(0) grows); Σ_{i≥1} r(i·b) rounded up:
    # ω θ^(b-1) / (1 - θ^b) = W·Y / (pico·(one - X)), ω_j ω_l θ_l^b / ((1 - θ_j θ_l)(1 - θ_l^b)) = WW·X / (D·(one - X))
    r0 = one + sum(ww * one // d for ww, d in pairs)
    lagged = sum(-(-w * y * one // (pico * (one - x))) for w, y, x in zip(omega_p, lead, tail)) + sum(
        -(-ww * x * one // (d * (one - x))) for (ww, d), x in zip(pairs, tail * len(theta_p)))
    return -(-(r0 + 2 * lagged) * pico // r0)


def unamplified_multiplier_u(noise_multiplier_u: int, m_p: int) -> int:
    """⌊σ / √m⌋ in micro-units, exactly in integers: the largest y with y² · m ≤ σ² (rounding favours privacy)."""
    return math.isqrt(noise_multiplier_u * noise_multiplier_u * units.PICO // m_p)


def _rounds(steps: int, cycle: int) -> int:
    if not _int(steps) or steps < 0:
        raise ValueError("steps must be a non-negative int")
    return -(-steps // cycle)


def banded_charge(record: Mapping[str, Any], *, sampling_rate_u: int, noise_multiplier_u: int,
                  steps: int) -> tuple[int, int, int]:
    """DP-SGD at rate min(1, b·q) over ⌈steps/b⌉ rounds at σ (banded.py: why the per-epoch ceiling over-counts)."""
    bands, _, _ = check_banded(record)
    return min(units.MICRO, bands * sampling_rate_u), noise_multiplier_u, _rounds(steps, bands)


def blt_charge(record: Mapping[str, Any], *, sampling_rate_u: int, noise_multiplier_u: int,
               steps: int) -> tuple[int, int, int]:
    """Unsampled (rate 1) Gaussians at ⌊σ/√m⌋, one per possible participation: ⌈steps/b⌉ (blt.py: the bound)."""
    _, _, separation, theta, omega = check_blt(record)
    return (units.MICRO, unamplified_multiplier_u(noise_multiplier_u, factor_p(theta, omega, separation)),
            _rounds(steps, separation))
