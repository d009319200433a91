"""The Gaussian mechanism, exactly: calibration of one release and composition of many (no torch).

One release of a query with L2 sensitivity Delta plus N(0, sigma^2 I) is (eps, delta)-DP for every eps > 0 with

    delta(eps) = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu),      mu = Delta / sigma

(Balle & Wang, ICML 2018, "Improving the Gaussian Mechanism for Differential Privacy", Theorem 8), and no smaller
delta holds: the bound is tight. The same curve is mu-GDP (Dong, Roth & Su 2022, Corollary 2.13), so k releases
with mu_1..mu_k compose *exactly* into one Gaussian release with mu^2 = sum mu_i^2 (their Corollary 3.3): the
privacy loss of a Gaussian is itself Gaussian, and Gaussians add. That is what a session of split-inference
requests spends (`govtrain.inference.budget`).

- `gaussian_delta(eps, mu)`: the curve above, in log space (`log_ndtr`), so e^eps never overflows: delta =
  A (1 - e^(log B - log A)) with log A = log Phi(mu/2 - eps/mu), log B = eps + log Phi(-mu/2 - eps/mu).
- `analytic_sigma(eps, delta, Delta)`: the smallest sigma with delta(eps) <= delta, by bisection until the bracket
  is narrower than `SIGMA_TOLERANCE` (relative), returning its upper end: the guarantee holds at what is returned.
- `calibrate_sigma_u`: that sigma for integer inputs (micro- and pico-units, docs/design.md §2), rounded **up** to
  micro-units, and checked to meet delta at the rounded value.
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


def _log_ndtr(x: float) -> float:
    from scipy.special import log_ndtr

    return float(log_ndtr(x))


def gaussian_delta(epsilon: float, mu: float) -> float:
    """delta(eps) of a Gaussian release with Delta/sigma = `mu` (equivalently, of mu-GDP): Balle & Wang, Theorem 8."""
    if not epsilon >= 0 or not mu >= 0 or math.isinf(mu):
        raise ValueError("need epsilon >= 0 and a finite mu >= 0")
    if mu == 0:
        return 0.0
    log_a = _log_ndtr(mu / 2 - epsilon / mu)
    log_b = epsilon + _log_ndtr(-mu / 2 - epsilon / mu)
    if log_b >= log_a:  # the difference is below A's float resolution: delta < 1e-16 A
        return 0.0
    return math.exp(log_a) * -math.expm1(log_b - log_a)


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
    """`analytic_sigma` for integer inputs (epsilon and Delta in micro-units, delta in pico-units), rounded up to
    micro-units. Client and server compute it alike from the same integers."""
    if epsilon_u < 1 or not 0 < delta_p < units.PICO or sensitivity_u < 1:
        raise ValueError("need epsilon_u >= 1, 0 < delta_p < 10^12 and sensitivity_u >= 1")
    epsilon, delta, sensitivity = epsilon_u / units.MICRO, delta_p / units.PICO, sensitivity_u / units.MICRO
    sigma_u = units.noise_multiplier_u(analytic_sigma(epsilon, delta, sensitivity))
    # Rounding up only adds noise; check it anyway against the inputs as given, so a float surprise cannot pass.
    if gaussian_delta(epsilon, sensitivity / (sigma_u / units.MICRO)) > delta:
        raise RuntimeError(f"calibration failed its own check at epsilon_u={epsilon_u}, delta_p={delta_p}, "
                           f"sensitivity_u={sensitivity_u}")
    return sigma_u


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
