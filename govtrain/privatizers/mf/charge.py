"""What a banded-mf or blt record charges, from the record alone, without torch or numpy: the verifier's path
(the audit path never imports torch). `BandedMF.charge` and `BLT.charge` are these functions; the arguments are
why in banded.py and blt.py. Every value is an int, an exact rational (`fractions`), or is computed with IEEE-exact
arithmetic (correctly rounded int division, fsum, sqrt), so the writer and the verifier get the same integers on any
platform.

    banded_charge(record, sampling_rate_u=, noise_multiplier_u=, steps=)  -> (rate_u, multiplier_u, rounds)
    blt_charge(record, sampling_rate_u=, noise_multiplier_u=, steps=)     -> (rate_u, multiplier_u, rounds)
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from typing import Any, Mapping, Sequence

from govtrain import units

BANDED_FIELDS = ("name", "bands", "horizon", "coefficients_p")
BLT_FIELDS = ("name", "buffers", "horizon", "min_separation", "theta_p", "omega_p")
# BLT's m costs O(buffers²) exact rational terms per charge; strategies in use have a handful of buffers. A bound
# keeps a forged record from making the auditor's verifier spend minutes per spend (`check_blt`).
BLT_MAX_BUFFERS = 64
_BITS = 256  # θ^b is bounded above by a dyadic rational of this precision (exact powers have b times θ's digits)


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
    charge needs a positive, non-increasing column (0 < θ < 1, ω ≥ 0, Σω ≤ 1), of at most `BLT_MAX_BUFFERS`."""
    if set(record) != set(BLT_FIELDS) or record["name"] != "blt":
        raise ValueError(f"not a blt record: expected the fields {', '.join(BLT_FIELDS)}")
    buffers, horizon, separation = record["buffers"], record["horizon"], record["min_separation"]
    if not (_int(buffers) and _int(horizon) and _int(separation) and buffers >= 1 and 1 <= separation <= horizon):
        raise ValueError("a BLT needs int buffers ≥ 1 and a min_separation in [1, horizon]")
    if buffers > BLT_MAX_BUFFERS:
        raise ValueError(f"a BLT of {buffers} buffers: at most {BLT_MAX_BUFFERS} are charged")
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


def applied_parameters(theta_p: Sequence[int], omega_p: Sequence[int]) -> tuple[list[float], list[float], float]:
    """(θ, ω, n): the float64 decays, weights and column norm n = √r(0) that the stream multiplies by (BLT._advance),
    from the recorded integers: correctly rounded divisions, fsum and sqrt, the same on every platform."""
    theta = [t / units.PICO for t in theta_p]
    omega = [w / units.PICO for w in omega_p]
    return theta, omega, math.sqrt(column_norm_sq(theta, omega))


def _up(value: Fraction) -> Fraction:
    """`value` rounded up to a multiple of 2^-_BITS."""
    return Fraction(-((-value.numerator << _BITS) // value.denominator), 1 << _BITS)


def _power_up(x: Fraction, n: int) -> Fraction:
    """An upper bound on x^n (0 ≤ x < 1, n ≥ 0) by squaring, each product rounded up: within n·2^-_BITS of it."""
    out = Fraction(1)
    while n:
        if n & 1:
            out = _up(out * x)
        x = _up(x * x)
        n >>= 1
    return out


def _raw_factor_up(theta: Sequence[Fraction], omega: Sequence[Fraction], separation: int) -> tuple[Fraction, Fraction]:
    """(r(0), an upper bound on r(0) + 2·Σ_{i≥1} r(i·b)) of the raw column (c_0 = 1) in exact rationals, the closed
    form of `participation_factor`; the lagged sum increases with θ^b and θ^(b-1), so their upper bounds bound it."""
    pairs = [(tj, wj, tl, wl) for tj, wj in zip(theta, omega) for tl, wl in zip(theta, omega)]
    r0 = 1 + sum((wj * wl / (1 - tj * tl) for tj, wj, tl, wl in pairs), Fraction(0))
    powers = {t: (_power_up(t, separation - 1), _power_up(t, separation)) for t in theta}
    if any(pb >= 1 for _, pb in powers.values()):
        raise ValueError("a BLT needs θ < 1")
    lagged = sum((w * powers[t][0] / (1 - powers[t][1]) for t, w in zip(theta, omega)), Fraction(0))
    lagged += sum((wj * wl * powers[tl][1] / ((1 - tj * tl) * (1 - powers[tl][1])) for tj, wj, tl, wl in pairs),
                  Fraction(0))
    return r0, r0 + 2 * lagged


@functools.lru_cache(maxsize=64)
def _factor_p(theta_p: tuple[int, ...], omega_p: tuple[int, ...], separation: int) -> int:
    recorded = _raw_factor_up([Fraction(t, units.PICO) for t in theta_p], [Fraction(w, units.PICO) for w in omega_p],
                              separation)
    theta, omega, scale = applied_parameters(theta_p, omega_p)
    applied = _raw_factor_up([Fraction(t) for t in theta], [Fraction(w) for w in omega], separation)
    m = max(recorded[1] / recorded[0], applied[1] / Fraction(scale) ** 2)
    return -((-m.numerator * units.PICO) // m.denominator)


def factor_p(theta_p: Sequence[int], omega_p: Sequence[int], separation: int) -> int:
    """m in pico-units, rounded up, computed in exact rationals from the recorded integers: the larger of m of the
    recorded strategy (θ_p/10¹², ω_p/10¹², normalised by its exact r(0)) and m of the one the float64 stream applies
    (`applied_parameters`: θ, ω as float64, normalised by the float64 n). No float error margin is needed: near
    θ → 1 (1 - θ^b ≈ b·(1-θ), as small as 10⁻¹²) a float64 closed form loses digits that no fixed margin covers."""
    return _factor_p(tuple(theta_p), tuple(omega_p), separation)


def unamplified_multiplier_u(noise_multiplier_u: int, m_p: int) -> int:
    """⌊σ / √m⌋ in micro-units, exactly in integers: the largest y with y² · m ≤ σ² (rounding favours privacy)."""
    return math.isqrt(noise_multiplier_u * noise_multiplier_u * units.PICO // m_p)


def _rounds(steps: int, cycle: int) -> int:
    if not _int(steps) or steps < 0:
        raise ValueError("steps must be a non-negative int")
    return -(-steps // cycle)


def _check_spend(sampling_rate_u: Any, noise_multiplier_u: Any) -> None:
    """q in (0, 1] and σ > 0, in micro-units: a negative σ must not be charged as its magnitude (nor as no noise)."""
    if not _int(sampling_rate_u) or not 0 < sampling_rate_u <= units.MICRO:
        raise ValueError(f"the sampling rate must be an int in (0, {units.MICRO}] micro-units, got {sampling_rate_u!r}")
    if not _int(noise_multiplier_u) or noise_multiplier_u <= 0:
        raise ValueError(f"the noise multiplier must be a positive int of micro-units, got {noise_multiplier_u!r}")


def banded_charge(record: Mapping[str, Any], *, sampling_rate_u: int, noise_multiplier_u: int,
                  steps: int) -> tuple[int, int, int]:
    """DP-SGD at rate min(1, b·q) over ⌈steps/b⌉ rounds at σ (banded.py: why the per-epoch ceiling over-counts)."""
    bands, _, _ = check_banded(record)
    _check_spend(sampling_rate_u, noise_multiplier_u)
    return min(units.MICRO, bands * sampling_rate_u), noise_multiplier_u, _rounds(steps, bands)


def blt_charge(record: Mapping[str, Any], *, sampling_rate_u: int, noise_multiplier_u: int,
               steps: int) -> tuple[int, int, int]:
    """Unsampled (rate 1) Gaussians at ⌊σ/√m⌋, one per possible participation: ⌈steps/b⌉ (blt.py: the bound)."""
    _, _, separation, theta, omega = check_blt(record)
    _check_spend(sampling_rate_u, noise_multiplier_u)
    return (units.MICRO, unamplified_multiplier_u(noise_multiplier_u, factor_p(theta, omega, separation)),
            _rounds(steps, separation))
