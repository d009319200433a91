"""The Gaussian mechanism, exactly: calibration of one release and composition of many (no torch).

One release of a query with L2 sensitivity Delta plus N(0, sigma^2 I) is (eps, delta)-DP for every eps > 0 with

    delta(eps) = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu),      mu = Delta / sigma

(Balle & Wang, ICML 2018, "Improving the Gaussian Mechanism for Differential Privacy", Theorem 8), and no smaller
delta holds: the bound is tight. The same curve is mu-GDP (Dong, Roth & Su 2022, Corollary 2.13), so k releases
with mu_1..mu_k compose *exactly* into one Gaussian release with mu^2 = sum mu_i^2 (their Corollary 3.3): the
privacy loss of a Gaussian is itself Gaussian, and Gaussians add. That is what a session of split-inference
requests spends (`govtrain.inference.budget`).

- `gaussian_delta(eps, mu)`: the curve above, in log space, so e^eps never overflows: with a = mu/2 - eps/mu and
  b = a - mu, delta = Phi(a) (1 - e^(eps - D)), D = log Phi(a) - log Phi(b). D is not the difference of two
  rounded logs: where mu is small (small eps) a and b agree in most of their digits, and that difference (and
  a - b itself) would lose them all; D is the integral of phi/Phi over [b, a] instead, by Gauss-Legendre around
  the midpoint -eps/mu with phi/Phi = sqrt(2/pi) / erfcx(-t/sqrt 2) (no cancellation anywhere).
- `analytic_sigma(eps, delta, Delta)`: the smallest sigma with delta(eps) <= delta, by bisection until the bracket
  is narrower than `SIGMA_TOLERANCE` (relative), returning its upper end: the guarantee holds at what is returned.
- `calibrate_sigma_u`: that sigma for integer inputs (micro- and pico-units, docs/design.md §2) as the **smallest
  micro-unit sigma whose delta, in `EXACT_DIGITS`-digit arithmetic (mpmath), meets delta**: the float answer only
  starts the search, so no float rounding (e.g. near eps = 0, where delta is a small difference of near-equal
  terms) can hand out a sigma that misses delta.
- `gdp_epsilon(mu, delta)`: the smallest eps with delta(eps) <= delta for a composed mu, bisection to
  `EPSILON_TOLERANCE` (relative), the upper end; `gdp_epsilon_u` rounds it up to micro-units.
- `classical_sigma` (Dwork & Roth 2014, Theorem A.1: proved for eps < 1 only) and `advanced_composition_epsilon`
  (Dwork, Rothblum & Vadhan 2010, the bound seed 002's tracker sums requests with) are here for comparison: govtrain
  calibrates and composes with neither.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

from govtrain import units

SIGMA_TOLERANCE = 1e-12  # relative width of the final bracket on sigma, before rounding up to micro-units
EPSILON_TOLERANCE = 1e-10  # relative width of the final bracket on a composed epsilon, before rounding up
MU_SQ_SCALE = 10**12  # a session's sum of (Delta/sigma)^2 is kept as an integer in these units, rounded up
EXACT_DIGITS = 60  # the decimal digits calibration checks delta in; it loses at most ~20 of them to cancellation
_QUADRATURE_MU = 1.0  # below this mu, D = log Phi(a) - log Phi(b) is integrated, not subtracted
_LOG_SMALLEST = math.log(math.ulp(0.0))  # log Phi(a) below this: Phi(a), and so delta, is below every float


def _log_ndtr(x: float) -> float:
    from scipy.special import log_ndtr

    return float(log_ndtr(x))


@functools.lru_cache(maxsize=1)
def _legendre() -> tuple:
    import numpy as np

    return np.polynomial.legendre.leggauss(24)  # exact for polynomials of degree 47: phi/Phi is smooth


def _log_ratio(epsilon: float, mu: float) -> float:
    """D = log Phi(a) - log Phi(b) for a = mu/2 - eps/mu, b = a - mu. For mu <= `_QUADRATURE_MU` it is the integral
    of d/dt log Phi(t) = phi(t)/Phi(t) over [b, a], taken around the midpoint -eps/mu with the half-width mu/2 as
    given (a - b in floats would keep only the digits a and b do not share); phi/Phi = sqrt(2/pi)/erfcx(-t/sqrt 2).
    phi/Phi is analytic within ~2.8 of the real line (the zeros of erfc), so 24 nodes over a width <= 1 are exact
    to the float's precision."""
    if mu > _QUADRATURE_MU:
        return _log_ndtr(mu / 2 - epsilon / mu) - _log_ndtr(-mu / 2 - epsilon / mu)
    from scipy.special import erfcx

    nodes, weights = _legendre()
    t = -epsilon / mu + (mu / 2) * nodes
    return float((mu / 2) * (weights @ (math.sqrt(2 / math.pi) / erfcx(-t / math.sqrt(2)))))


def gaussian_delta(epsilon: float, mu: float) -> float:
    """delta(eps) of a Gaussian release with Delta/sigma = `mu` (equivalently, of mu-GDP): Balle & Wang, Theorem 8,
    as Phi(a) (1 - e^(eps - D)) (the module's docstring)."""
    if not epsilon >= 0 or not mu >= 0 or math.isinf(mu):
        raise ValueError("need epsilon >= 0 and a finite mu >= 0")
    if mu == 0:
        return 0.0
    log_a = _log_ndtr(mu / 2 - epsilon / mu)
    if log_a < _LOG_SMALLEST:  # Phi(a) >= delta is itself below the smallest float
        return 0.0
    gap = epsilon - _log_ratio(epsilon, mu)  # log(e^eps Phi(b) / Phi(a)) < 0
    if gap >= 0:  # the difference is below the float resolution of its terms
        return 0.0
    return math.exp(log_a) * -math.expm1(gap)


def _check(epsilon: float, delta: float, sensitivity: float) -> None:
    if not (epsilon > 0 and math.isfinite(epsilon)) or not 0 < delta < 1 or not (sensitivity > 0
                                                                                  and math.isfinite(sensitivity)):
        raise ValueError("need a finite epsilon > 0, 0 < delta < 1 and a finite sensitivity > 0")


def analytic_sigma(epsilon: float, delta: float, sensitivity: float = 1.0) -> float:
    """The smallest sigma at which one release of sensitivity `sensitivity` is (epsilon, delta)-DP, for every
    epsilon > 0 (Balle & Wang 2018): bisection on sigma to `SIGMA_TOLERANCE`, the bracket's upper end."""
    _check(epsilon, delta, sensitivity)

    def meets(sigma: float) -> bool:
        return gaussian_delta(epsilon, sensitivity / sigma) <= delta

    low, high = 0.0, sensitivity
    while not meets(high):
        low, high = high, high * 2
    while low < high / 2 and meets(high / 2):  # the answer may lie far below sensitivity (large epsilon)
        high /= 2
    low = max(low, high / 2)
    while high - low > SIGMA_TOLERANCE * high:
        middle = (low + high) / 2
        if meets(middle):
            high = middle
        else:
            low = middle
    return high


@functools.lru_cache(maxsize=4096)  # a pure function of integers, asked again for every request of a session
def calibrate_sigma_u(epsilon_u: int, delta_p: int, sensitivity_u: int) -> int:
    """The smallest sigma in micro-units at which one release of sensitivity `sensitivity_u` (micro-units) is
    (epsilon_u micro-units, delta_p pico-units)-DP, decided in `EXACT_DIGITS`-digit arithmetic; `analytic_sigma`'s
    float answer is where the search starts. Client and server compute it alike from the same integers."""
    if epsilon_u < 1 or not 0 < delta_p < units.PICO or sensitivity_u < 1:
        raise ValueError("need epsilon_u >= 1, 0 < delta_p < 10^12 and sensitivity_u >= 1")
    epsilon, delta, sensitivity = epsilon_u / units.MICRO, delta_p / units.PICO, sensitivity_u / units.MICRO
    start = units.noise_multiplier_u(analytic_sigma(epsilon, delta, sensitivity))

    def meets(sigma_u: int) -> bool:
        return sigma_u >= 1 and _meets_exactly(epsilon_u, delta_p, sensitivity_u, sigma_u)

    # A bracket (fails, meets) around the start, widened by doubling steps (delta falls as sigma grows), then halved.
    step = 1
    if meets(start):
        low, high = start - 1, start
        while meets(low):
            low, high, step = max(low - 2 * step, 0), low, 2 * step
    else:
        low, high = start, start + 1
        while not meets(high):
            low, high, step = high, high + 2 * step, 2 * step
    while high - low > 1:
        middle = (low + high) // 2
        if meets(middle):
            high = middle
        else:
            low = middle
    return high


def _meets_exactly(epsilon_u: int, delta_p: int, sensitivity_u: int, sigma_u: int) -> bool:
    """Whether delta(eps) at mu = Delta/sigma is at most delta, from the integers, in `EXACT_DIGITS` digits."""
    import mpmath

    with mpmath.workdps(EXACT_DIGITS):
        eps, mu = mpmath.mpf(epsilon_u) / units.MICRO, mpmath.mpf(sensitivity_u) / sigma_u
        exact = mpmath.ncdf(mu / 2 - eps / mu) - mpmath.exp(eps) * mpmath.ncdf(-mu / 2 - eps / mu)
        return bool(exact <= mpmath.mpf(delta_p) / units.PICO)


def calibrate_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """sigma for one release at (epsilon, delta) and L2 sensitivity `sensitivity`, by the analytic Gaussian
    mechanism, rounded up to micro-units. The inputs are rounded the way that favours privacy first: epsilon and
    delta down, the sensitivity up."""
    _check(epsilon, delta, sensitivity)
    return calibrate_sigma_u(units.to_micro(epsilon, "down"), units.delta_p(delta),
                             units.to_micro(sensitivity, "up")) / units.MICRO


def mu_sq_units(sensitivity_u: int, sigma_u: int) -> int:
    """(Delta/sigma)^2 of one release, exactly from its integers, in `MU_SQ_SCALE` units rounded up."""
    if sensitivity_u < 1 or sigma_u < 1:
        raise ValueError("need sensitivity_u >= 1 and sigma_u >= 1")
    exact = Fraction(sensitivity_u * sensitivity_u * MU_SQ_SCALE, sigma_u * sigma_u)
    return math.ceil(exact)


def gdp_epsilon(mu: float, delta: float) -> float:
    """The smallest epsilon at which a Gaussian release with Delta/sigma = `mu` (or mu-GDP, e.g. a composition
    with mu^2 = sum mu_i^2) is (epsilon, delta)-DP: bisection to `EPSILON_TOLERANCE`, the bracket's upper end."""
    if not mu >= 0 or math.isinf(mu) or not 0 < delta < 1:
        raise ValueError("need a finite mu >= 0 and 0 < delta < 1")
    if gaussian_delta(0.0, mu) <= delta:
        return 0.0
    low, high = 0.0, max(1.0, mu * mu)
    while gaussian_delta(high, mu) > delta:
        low, high = high, high * 2
    while high - low > EPSILON_TOLERANCE * high:
        middle = (low + high) / 2
        if gaussian_delta(middle, mu) <= delta:
            high = middle
        else:
            low = middle
    return high


def gdp_epsilon_u(mu_sq: int, delta_p: int) -> int:
    """`gdp_epsilon` of a composition whose sum of (Delta/sigma)^2 is `mu_sq` (`MU_SQ_SCALE` units), at delta in
    pico-units, rounded up to micro-units (spent epsilon rounds up)."""
    if mu_sq < 0 or not 0 < delta_p < units.PICO:
        raise ValueError("need mu_sq >= 0 and 0 < delta_p < 10^12")
    mu = math.nextafter(math.sqrt(mu_sq / MU_SQ_SCALE), math.inf) if mu_sq else 0.0  # sqrt's rounding, upward
    return units.spent_eps_u(gdp_epsilon(mu, delta_p / units.PICO))


def classical_sigma(epsilon: float, delta: float, sensitivity: float = 1.0) -> float:
    """sigma = Delta sqrt(2 ln(1.25/delta)) / epsilon (Dwork & Roth 2014, Theorem A.1): a guarantee only for
    epsilon < 1, and larger than `analytic_sigma` wherever it is one."""
    _check(epsilon, delta, sensitivity)
    return sensitivity * math.sqrt(2 * math.log(1.25 / delta)) / epsilon


def advanced_composition_epsilon(epsilon: float, k: int, delta_prime: float) -> float:
    """Dwork, Rothblum & Vadhan (2010): k (epsilon, delta)-DP releases are (eps', k delta + delta')-DP with
    eps' = sqrt(2k ln(1/delta')) epsilon + k epsilon (e^epsilon - 1). Seed 002's tracker sums requests with it."""
    if not epsilon > 0 or k < 1 or not 0 < delta_prime < 1:
        raise ValueError("need epsilon > 0, k >= 1 and 0 < delta' < 1")
    return math.sqrt(2 * k * math.log(1 / delta_prime)) * epsilon + k * epsilon * math.expm1(epsilon)
