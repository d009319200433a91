"""Accountants of the noise families (no torch): epsilon of a history of `Charge`s that may mix the i.i.d.
Gaussian with Laplace, discrete Gaussian and Skellam charges (docs/privatizers.md, "Noise families").

    epsilon_u(accountant, delta_p, charges)      # micro-units, rounded up; what the ledger and the verifier charge

A history of gaussian charges alone is what the policy's accountant (`prv`, `pld`, `rdp`) has always charged,
unchanged (`history.gaussian_epsilon_u`, the function `spend.spend_epsilon_u` caches). Any other history is composed in RDP over dp-accounting's default
orders and converted once at δ by dp-accounting's own `compute_epsilon`:

- gaussian: dp-accounting's exact Poisson-subsampled Gaussian RDP;
- laplace, discrete-gaussian, skellam: their own per-step RDP curves (below), Poisson-subsampled by the general
  upper bound of Zhu & Wang (2019, "Poisson subsampled Rényi differential privacy", Theorem 6), valid for any
  mechanism given its RDP at integer orders, and never above the unsubsampled curve. At a fractional order it
  takes the next integer order (RDP does not decrease with the order).

A history of laplace charges alone also has a pure-ε bound: each step is ε₀-DP, Poisson sampling at rate q makes
it log(1 + q(e^ε₀ − 1))-DP (computed as ε₀ + log(q + (1 − q)e^-ε₀) for ε₀ > 1: no overflow at large ε₀), and
pure ε composes by summing. It charges the smaller of the two. Every curve refuses a non-positive σ (or noise)
and a sampling rate outside (0, 1] with a ValueError; a charge at rate 0 is free and never reaches them.

**The lattice.** The integer families (and the Laplace privatizer, which adds a discrete Laplace: a floating-point
Laplace leaks through its low bits, Mironov 2012) quantise each clipping unit's clipped gradient to a lattice
whose spacing in noise group g is γ_g = s_g · 2^-b (b = `granularity_bits`): the group's noise is 2^b lattice
steps wide in every group, and a unit with effective multiplier σ (= min over its groups of s_g / C_i, what its
spend records) spans at most c = 2^b / σ lattice steps. Randomised rounding, re-drawn until it holds
(`privatizers/families/rounding.py`), keeps every unit's integer vector within

- L2: Δ₂(c) = min(c + √d, √(c² + d/4 + √(2 ln(1/β)) (c + √d/2)))  (Kairouz, Liu & Steinke 2021, Theorem 1),
- L1 (Laplace, clipped in L1): Δ₁(c) = min(c + d, c + √(d ln(1/β) / 2))  (Hoeffding on the rounding errors),

β = 2^-`beta_exp`, d = `dimension`. An integer vector has ‖q‖₁ ≤ min(‖q‖₂², √d ‖q‖₂). The per-step curves:

- discrete-gaussian, N_Z(0, 4^b) per coordinate: α Δ₂² / (2 · 4^b) (Canonne, Kamath & Steinke 2020: the
  multivariate discrete Gaussian under an integer shift is at most the continuous one's; their τ term counts
  the sum of several discrete Gaussians, and here the noise is one, drawn centrally: τ = 0);
- skellam, Poisson(4^b/2) − Poisson(4^b/2), variance V = 4^b: α Δ₂²/(2V) + min(((2α−1)Δ₂² + 6Δ₁)/(4V²),
  3Δ₁/(2V)) (Agarwal, Kairouz & Liu 2021);
- laplace, discrete Laplace of scale 2^b: pure ε₀ = Δ₁ / 2^b per step, as RDP min(ε₀, α ε₀²/2) (Bun & Steinke
  2016, Proposition 3.3).

c is taken from the recorded multiplier, which the scheduler rounds down, so it is never below the c the router
rounded at; every bound is inflated by a relative 1e-9 against floating-point rounding.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Sequence

from govtrain import units

if TYPE_CHECKING:
    import numpy as np

    from govtrain.accounting.records import Charge

__all__ = ["FAMILIES", "LATTICE_FAMILIES", "SKELLAM_MAX_BITS", "check_skellam_bits", "l2_bound", "l1_bound",
           "integer_l1_bound", "Lattice", "gaussian_step_rdp", "discrete_gaussian_rdp", "skellam_rdp", "pure_rdp",
           "poisson_subsampled_rdp", "laplace_pure_epsilon", "subsampled_pure_epsilon", "step_rdp", "epsilon",
           "epsilon_u"]

FAMILIES = ("gaussian", "laplace", "discrete-gaussian", "skellam")
LATTICE_FAMILIES = ("laplace", "discrete-gaussian", "skellam")  # their Charge.params: (bits, beta_exp, dimension)
# Skellam's Poisson draws are numpy's (Hörmann's PTRS), whose acceptance test is computed in double: its log-pmf
# terms, of size λ ln λ (λ = 4^b / 2), carry an absolute error of a few ulps, which distorts the noise's pmf. At
# b ≤ 8 (λ ≤ 2^15) that error is below 4.7e-10 (8 ulps of λ(ln λ + 1) < 2^19), so every probability is within a
# factor e^(±1e-9) of the exact Skellam's; at b = 24 it is ~1.5 and the noise is not Skellam. No exact integer
# Poisson sampler at λ ~ 2^47 here: Skellam refuses b above this bound (docs/privatizers.md, "Noise families").
SKELLAM_MAX_BITS = 8
_MARGIN = 1 + 1e-9


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be positive and finite: got {value}")


def _non_negative(**values: float) -> None:
    for name, value in values.items():
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be non-negative and finite: got {value}")


# -- the quantised sensitivities -------------------------------------------------------------------------------

def l2_bound(c: float, dimension: int, beta_exp: int) -> float:
    """Δ₂: the L2 norm a randomised rounding of a vector of L2 norm ≤ c in `dimension` coordinates keeps, once
    re-drawn until it does (it does at once with probability ≥ 1 − 2^-beta_exp)."""
    log_inv_beta = beta_exp * math.log(2)
    squared = c * c + dimension / 4 + math.sqrt(2 * log_inv_beta) * (c + math.sqrt(dimension) / 2)
    return min(c + math.sqrt(dimension), math.sqrt(squared))


def l1_bound(c: float, dimension: int, beta_exp: int) -> float:
    """Δ₁ of the L1 rounding: each coordinate's |q_j| − |y_j| has mean 0 and lies in an interval of length 1,
    so ‖q‖₁ ≤ ‖y‖₁ + √(d ln(1/β)/2) with probability ≥ 1 − β (Hoeffding); and always ≤ ‖y‖₁ + d."""
    return min(c + dimension, c + math.sqrt(dimension * beta_exp * math.log(2) / 2))


def integer_l1_bound(l2: float, dimension: int) -> float:
    """‖q‖₁ of an integer vector of L2 norm ≤ l2: |q_j| ≤ q_j², and Cauchy-Schwarz."""
    return min(l2 * l2, math.sqrt(dimension) * l2)


class Lattice:
    """A lattice family's public parameters, as a charge carries them: `params` = (bits, beta_exp, dimension)."""

    def __init__(self, params: Sequence[int]) -> None:
        if len(params) != 3 or any(type(p) is not int for p in params):
            raise ValueError(f"a lattice charge's params are (granularity_bits, beta_exp, dimension): got {params}")
        self.bits, self.beta_exp, self.dimension = params
        if not (1 <= self.bits <= 24 and 1 <= self.beta_exp <= 256 and self.dimension >= 1):
            raise ValueError(f"lattice parameters out of range: bits {self.bits} (1..24), beta_exp "
                             f"{self.beta_exp} (1..256), dimension {self.dimension} (>= 1)")

    def span(self, noise_multiplier_u: int) -> float:
        """c = 2^b / σ: how many lattice steps a unit with this effective multiplier spans at most."""
        if noise_multiplier_u <= 0:
            raise ValueError("a lattice charge needs a positive noise multiplier")
        return (1 << self.bits) * units.MICRO / noise_multiplier_u * _MARGIN

    def l2(self, noise_multiplier_u: int) -> float:
        """Δ₂ in lattice steps; ‖q‖₂² is an integer, so the bound's square rounds down."""
        bound = l2_bound(self.span(noise_multiplier_u), self.dimension, self.beta_exp) * _MARGIN
        return math.sqrt(math.floor(bound * bound))

    def l1(self, noise_multiplier_u: int) -> float:
        """Δ₁ in lattice steps (the Laplace privatizer's L1 rounding); ‖q‖₁ is an integer."""
        return float(math.floor(l1_bound(self.span(noise_multiplier_u), self.dimension, self.beta_exp) * _MARGIN))


def check_skellam_bits(bits: int) -> None:
    """Refuse a Skellam granularity above `SKELLAM_MAX_BITS`, where numpy's Poisson is not the exact pmf that the
    Skellam accountant assumes."""
    if bits > SKELLAM_MAX_BITS:
        raise ValueError(f"skellam with granularity_bits {bits}: numpy's Poisson sampler matches the exact pmf (to "
                         f"1e-9) only up to granularity_bits {SKELLAM_MAX_BITS}; use at most that, or the "
                         "discrete-gaussian family (exact at any granularity)")


# -- per-step RDP curves ---------------------------------------------------------------------------------------

def discrete_gaussian_rdp(orders: "np.ndarray", l2: float, sigma: float) -> "np.ndarray":
    """N_Z(0, σ²) per coordinate under an integer shift of L2 norm ≤ l2: α l2² / (2σ²) (CKS 2020)."""
    _positive(sigma=sigma)
    _non_negative(l2=l2)
    return orders * (l2 * l2) / (2 * sigma * sigma)


def skellam_rdp(orders: "np.ndarray", l1: float, l2: float, variance: float) -> "np.ndarray":
    """Skellam noise of variance V per coordinate under an integer shift of norms ≤ (l1, l2) (AKL 2021)."""
    import numpy as np

    _positive(variance=variance)
    _non_negative(l1=l1, l2=l2)
    head = orders * (l2 * l2) / (2 * variance)
    return head + np.minimum(((2 * orders - 1) * l2 * l2 + 6 * l1) / (4 * variance * variance),
                             3 * l1 / (2 * variance))


def pure_rdp(orders: "np.ndarray", epsilon0: float) -> "np.ndarray":
    """An ε₀-DP mechanism's RDP: at most ε₀ (the max divergence) and α ε₀²/2 (Bun & Steinke, Prop. 3.3)."""
    import numpy as np

    _non_negative(epsilon0=epsilon0)
    return np.minimum(epsilon0, orders * epsilon0 * epsilon0 / 2)


def poisson_subsampled_rdp(orders: "np.ndarray", q: float, base) -> "np.ndarray":  # type: ignore[no-untyped-def]
    """Zhu & Wang (2019) Theorem 6: the RDP of a mechanism with RDP `base` (a function of an order array, valid at
    every real order > 1) run on a Poisson sample at rate q, at each order (a fractional order takes the next
    integer's bound), and never above `base` itself."""
    import numpy as np
    from scipy.special import gammaln, logsumexp

    orders = np.asarray(orders, dtype=np.float64)
    integer = np.maximum(2, np.ceil(orders)).astype(np.int64)
    top = int(integer.max())
    ells = np.arange(2, top + 1)
    eps = np.asarray(base(ells.astype(np.float64)), dtype=np.float64)  # ε(l), l = 2..top
    if not 0 < q <= 1:  # also NaN
        raise ValueError(f"a sampling rate is in (0, 1]: got {q}")
    unsampled = np.asarray(base(orders), dtype=np.float64)
    if q == 1:
        return unsampled
    log_q, log_1q = math.log(q), math.log1p(-q)
    out = np.empty(len(orders))
    cache: dict[int, float] = {}
    for i, alpha in enumerate(integer.tolist()):
        if alpha not in cache:
            ell = np.arange(2, alpha + 1)
            log_binom = gammaln(alpha + 1) - gammaln(ell + 1) - gammaln(alpha - ell + 1)
            terms = log_binom + ell * log_q + (alpha - ell) * log_1q + (ell - 1) * eps[ell - 2]
            terms[1:] += math.log(3)  # l >= 3 carries the factor 3; l = 2 does not
            first = (alpha - 1) * log_1q + math.log(alpha * q - q + 1)
            cache[alpha] = float(logsumexp(np.concatenate(([first], terms)))) / (alpha - 1)
        out[i] = min(cache[alpha], unsampled[i])
    return out


def subsampled_pure_epsilon(epsilon0: float, q: float) -> float:
    """An ε₀-DP step on a Poisson sample at rate q is log(1 + q(e^ε₀ − 1))-DP; for ε₀ > 1 computed as
    ε₀ + log(q + (1 − q) e^-ε₀), which neither overflows nor cancels."""
    _non_negative(epsilon0=epsilon0)
    if not 0 < q <= 1:
        raise ValueError(f"a sampling rate is in (0, 1]: got {q}")
    if epsilon0 <= 1:
        return math.log1p(q * math.expm1(epsilon0))
    return epsilon0 + math.log(q + (1 - q) * math.exp(-epsilon0))


def laplace_pure_epsilon(params: Sequence[int], noise_multiplier_u: int) -> float:
    """ε₀ of one step of the Laplace privatizer: the L1 sensitivity over the discrete Laplace scale 2^b."""
    lattice = Lattice(params)
    return lattice.l1(noise_multiplier_u) / (1 << lattice.bits)


@functools.lru_cache(maxsize=1)
def _orders() -> "np.ndarray":
    from govtrain.accounting.accountants import _rdp_orders

    return _rdp_orders()


def gaussian_step_rdp(sampling_rate_u: int, noise_multiplier_u: int) -> "np.ndarray":
    from govtrain.accounting.accountants import _rdp_curve

    return _rdp_curve(sampling_rate_u / units.MICRO, noise_multiplier_u / units.MICRO)


@functools.lru_cache(maxsize=1024)
def step_rdp(family: str, sampling_rate_u: int, noise_multiplier_u: int, params: tuple[int, ...]) -> "np.ndarray":
    """One step's RDP at dp-accounting's default orders (read-only; cached per charge parameters)."""
    q = sampling_rate_u / units.MICRO
    if not (0 < sampling_rate_u <= units.MICRO and noise_multiplier_u > 0):
        raise ValueError(f"a {family} charge needs a sampling rate in (0, 1] and a positive noise multiplier: got "
                         f"q = {q}, σ = {noise_multiplier_u / units.MICRO}")
    if family == "gaussian":
        if params:
            raise ValueError("a gaussian charge carries no params")
        return gaussian_step_rdp(sampling_rate_u, noise_multiplier_u)
    if family not in LATTICE_FAMILIES:
        raise ValueError(f"unknown noise family {family!r}: one of {', '.join(FAMILIES)}")
    lattice = Lattice(params)
    if family == "skellam":
        check_skellam_bits(lattice.bits)
    noise = float(1 << lattice.bits)  # 2^b: the noise's standard deviation (discrete Laplace: scale) in steps
    if family == "discrete-gaussian":
        l2 = lattice.l2(noise_multiplier_u)
        base = functools.partial(discrete_gaussian_rdp, l2=l2, sigma=noise)
    elif family == "skellam":
        l2 = lattice.l2(noise_multiplier_u)
        base = functools.partial(skellam_rdp, l1=integer_l1_bound(l2, lattice.dimension), l2=l2,
                                 variance=noise * noise)
    else:
        base = functools.partial(pure_rdp, epsilon0=lattice.l1(noise_multiplier_u) / noise)
    curve = poisson_subsampled_rdp(_orders(), q, base)
    curve.setflags(write=False)
    return curve


def _checked(charges: Sequence["Charge"]) -> list["Charge"]:
    paying = []
    for charge in charges:
        if charge.family not in FAMILIES:
            raise ValueError(f"unknown noise family {charge.family!r}: one of {', '.join(FAMILIES)}")
        if not (0 <= charge.sampling_rate_u <= units.MICRO and charge.noise_multiplier_u > 0 and charge.rounds >= 0):
            raise ValueError(f"invalid charge {charge}")
        if charge.sampling_rate_u and charge.rounds:
            paying.append(charge)
    return paying


def epsilon(charges: Sequence["Charge"], delta: float) -> float:
    """ε at δ of a history that is not all gaussian (see the module's docstring); 0.0 for a free history."""
    import numpy as np
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    paying = _checked(charges)
    if not paying:
        return 0.0
    total = np.zeros_like(_orders())
    for charge in paying:
        total = total + charge.rounds * step_rdp(charge.family, charge.sampling_rate_u, charge.noise_multiplier_u,
                                                 tuple(charge.params))
    eps, _ = rdp.compute_epsilon(_orders(), total, delta)
    if all(charge.family == "laplace" for charge in paying):
        pure = 0.0
        for charge in paying:
            eps0 = laplace_pure_epsilon(charge.params, charge.noise_multiplier_u)
            pure += charge.rounds * subsampled_pure_epsilon(eps0, charge.sampling_rate_u / units.MICRO)
        eps = min(eps, pure)
    return float(eps)


def epsilon_u(accountant: str, delta_p: int, charges: Sequence["Charge"]) -> int:
    """ε (micro-units, rounded up) of `charges` in epoch order at δ = delta_p / 10^12. All gaussian: the policy's
    `accountant` exactly as before noise families (`gaussian_epsilon_u`); otherwise RDP, as above."""
    paying = _checked(charges)
    if all(charge.family == "gaussian" for charge in paying):
        from govtrain.accounting.history import gaussian_epsilon_u

        for charge in paying:
            if charge.params:
                raise ValueError("a gaussian charge carries no params")
        return gaussian_epsilon_u(accountant, delta_p,
                               [(c.sampling_rate_u, c.noise_multiplier_u, c.rounds) for c in paying])
    return units.spent_eps_u(epsilon(paying, delta_p / units.PICO))
