"""Calibration: the noise a target (epsilon, delta) needs.

- `noise_multiplier_for` — the smallest sigma (rounded **up** to micro-units) at which T steps of
  the Poisson-subsampled Gaussian mechanism at rate q cost at most epsilon under the chosen
  accountant, by bisection. RDP (cheap, never tighter than PLD or PRV) brackets it first.
- `analytic_gaussian_sigma` — Balle & Wang (ICML 2018), Theorem 8 / Algorithm 1: the exact
  smallest sigma for one release of a query with L2 sensitivity Delta,
      delta >= Phi(Delta/(2 sigma) - eps sigma/Delta) - e^eps Phi(-Delta/(2 sigma) - eps sigma/Delta),
  valid for every eps > 0.
- `classical_gaussian_sigma` — Dwork & Roth (2014), Theorem A.1: sigma = Delta sqrt(2 ln(1.25/delta)) / eps,
  proved only for eps < 1 and always larger than the analytic answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from govtrain import units
from govtrain.accounting import gaussian
from govtrain.accounting.accountants import Bucket, get_accountant

MAX_SIGMA = 10_000.0


@dataclass(frozen=True, slots=True)
class Calibration:
    noise_multiplier_u: int  # rounded up
    epsilon_u: int  # what the accountant charges at that multiplier (<= the target)
    accountant: str
    evaluations: int
    fallback: str | None = None

    @property
    def noise_multiplier(self) -> float:
        return self.noise_multiplier_u / units.MICRO


def noise_multiplier_for(epsilon: float, delta: float, sampling_rate: float, steps: int, accountant: str,
                         *, tolerance_u: int = 100) -> Calibration:
    """Smallest sigma (to `tolerance_u` micro-units, rounded up) with epsilon(q, sigma, T) <= `epsilon`."""
    if not epsilon > 0 or not 0 < delta < 1 or not 0 < sampling_rate <= 1 or steps < 1:
        raise ValueError("need epsilon > 0, 0 < delta < 1, 0 < q <= 1 and steps >= 1")
    target_u = units.eps_budget_u(epsilon)
    if target_u < 1:
        raise ValueError("ε must be at least 1e-6")
    chosen = get_accountant(accountant)
    evaluations = 0

    def charge(sigma_u: int, using) -> int:
        nonlocal evaluations
        evaluations += 1
        return using.epsilon([Bucket(sampling_rate, sigma_u / units.MICRO, steps)], delta).epsilon_u

    # RDP is cheap and never tighter than PLD or PRV: its answer, to 1%, brackets the chosen one from above.
    rdp = get_accountant("rdp")
    low, high = _bracket(lambda s: charge(s, rdp), target_u, units.MICRO)
    high = _solve(lambda s: charge(s, rdp), target_u, low, high, max(tolerance_u, high // 100))
    low, high = _bracket(lambda s: charge(s, chosen), target_u, high)
    high = _solve(lambda s: charge(s, chosen), target_u, low, high, tolerance_u)
    final = chosen.epsilon([Bucket(sampling_rate, high / units.MICRO, steps)], delta)
    return Calibration(high, final.epsilon_u, chosen.name, evaluations + 1, final.fallback)


def _bracket(charge, target_u: int, start_u: int) -> tuple[int, int]:
    """(low, high) with charge(low) > target >= charge(high), moving by factors of 1.25 from `start_u`."""
    high = start_u
    while charge(high) > target_u:
        high = high * 5 // 4 + 1
        if high > MAX_SIGMA * units.MICRO:
            raise ValueError(f"that ε needs a noise multiplier above {MAX_SIGMA:g}: ask for a larger ε, fewer steps or a "
                             "smaller q")
    low = high * 4 // 5
    while low > 0 and charge(low) <= target_u:
        high, low = low, low * 4 // 5
    return low, high


def _solve(charge, target_u: int, low: int, high: int, tolerance_u: int) -> int:
    """Shrink the bracket to `tolerance_u` and return its upper end (which satisfies the target).

    log epsilon is nearly linear in log sigma, so each guess is the secant root through the two latest
    points (in log-log), kept strictly inside the bracket; once a guess lands, the next probe sits one
    tolerance to the other side to close the bracket. A round that fails to halve the bracket is
    followed by a bisection, so the worst case is bisection's.
    """
    points: list[tuple[float, float]] = []  # (log sigma, log(epsilon / target)), latest last

    def probe(sigma_u: int) -> bool:
        nonlocal low, high
        eps_u = charge(sigma_u)
        points.append((math.log(sigma_u), math.log(max(eps_u, 1) / target_u)))
        if eps_u <= target_u:
            high = sigma_u
            return True
        low = sigma_u
        return False

    bisect = True
    while high - low > tolerance_u:
        width = high - low
        if bisect or len(points) < 2 or points[-1][1] == points[-2][1]:
            probe((low + high) // 2)
        else:
            (x0, f0), (x1, f1) = points[-2], points[-1]
            guess = int(math.exp(x1 - f1 * (x1 - x0) / (f1 - f0)))
            satisfied = probe(min(max(guess, low + 1), high - 1))
            if high - low > tolerance_u:
                probe(max(high - tolerance_u, low + 1) if satisfied else min(low + tolerance_u, high - 1))
        bisect = high - low > width // 2
    return high


def gaussian_delta(sigma: float, epsilon: float, sensitivity: float = 1.0) -> float:
    """Exact delta(eps) of one Gaussian release with std `sigma` (Balle & Wang 2018, Theorem 8; `gaussian.py`)."""
    return gaussian.gaussian_delta(epsilon, sensitivity / sigma)


def analytic_gaussian_sigma(epsilon: float, delta: float, sensitivity: float = 1.0) -> float:
    """Smallest sigma with `gaussian_delta(sigma, epsilon) <= delta`, by bisection to 1e-12 relative,
    returning the upper end of the final bracket (so the guarantee holds): `gaussian.analytic_sigma`."""
    if not epsilon > 0 or not 0 < delta < 1 or not sensitivity > 0:
        raise ValueError("need epsilon > 0, 0 < delta < 1 and sensitivity > 0")
    return gaussian.analytic_sigma(epsilon, delta, sensitivity)


def classical_gaussian_sigma(epsilon: float, delta: float, sensitivity: float = 1.0) -> float:
    """sigma = Delta sqrt(2 ln(1.25/delta)) / eps; the theorem behind it requires eps < 1."""
    if not epsilon > 0 or not 0 < delta < 1 or not sensitivity > 0:
        raise ValueError("need epsilon > 0, 0 < delta < 1 and sensitivity > 0")
    return sensitivity * math.sqrt(2 * math.log(1.25 / delta)) / epsilon
