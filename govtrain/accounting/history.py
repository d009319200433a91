"""A contribution's history, as the accountants compose it (no torch): one (q_u, sigma_eff_u, steps) bucket per ledger
epoch, in micro-units, in epoch order; its canonical key; and the i.i.d. Gaussian's epsilon of it.

Below `families` (which charges a history of gaussian charges alone exactly as this does) and `spend` (which caches
per key at corpus scale): both compose the same function of the same key, so their numbers are the same bits.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from govtrain import units
from govtrain.accounting.accountants import Bucket, EpsilonResult, get_accountant

History = tuple[tuple[int, int, int], ...]  # (sampling_rate_u, noise_multiplier_u, steps), epoch order

SIGMA_DIGITS = 3  # sigma_eff is recorded to 3 significant digits, rounded down (<= 1% below the true value)


def bucket_sigma_u(sigma_eff_u: int, signed_u: int) -> int:
    """sigma_eff rounded down to `SIGMA_DIGITS` significant digits, but never below the signed sigma.

    Rounding down over-charges (more epsilon for less noise claimed); the floor at the signed value
    keeps the recorded multiplier admissible, and it is still <= the true sigma_eff because the
    true sigma_eff is at least the signed one (docs/design.md §5).
    """
    if sigma_eff_u < signed_u:
        raise ValueError(f"sigma_eff {sigma_eff_u} is below the signed noise multiplier {signed_u}")
    quantum = 10 ** max(0, len(str(sigma_eff_u)) - SIGMA_DIGITS)
    return max(sigma_eff_u // quantum * quantum, signed_u)


def canonical(history: Iterable[tuple[int, int, int]], ordered: bool = False) -> History:
    paying = []
    for q_u, sigma_u, steps in history:
        if q_u < 0 or q_u > units.MICRO or sigma_u <= 0 or steps < 0:
            raise ValueError(f"invalid spend bucket (q_u={q_u}, sigma_u={sigma_u}, steps={steps})")
        if q_u and steps:
            paying.append((q_u, sigma_u, steps))
    if ordered:
        return tuple(paying)
    merged: dict[tuple[int, int], int] = {}
    for q_u, sigma_u, steps in paying:
        merged[(q_u, sigma_u)] = merged.get((q_u, sigma_u), 0) + steps
    return tuple((q, s, t) for (q, s), t in sorted(merged.items()))


def gaussian_epsilon_u(accountant: str, delta_p: int, history: Iterable[tuple[int, int, int]]) -> int:
    """Epsilon (micro-units, rounded up) of a history of i.i.d. Gaussian buckets under the named accountant at
    delta_p / 10^12: the accountant's answer on the history's canonical key, shared per key in this process."""
    key = canonical(history, get_accountant(accountant).ordered)
    found = shared_result(accountant, delta_p, key)
    if found is None:
        found = get_accountant(accountant).epsilon([Bucket.from_micro(*b) for b in key], delta_p / units.PICO)
        share_result(accountant, delta_p, key, found)
    return found.epsilon_u


# Every answer of an accountant on a canonical key, in this process: epsilon is a pure function of (accountant,
# delta, key), so a run's plan, its GovernedRun, the verifier and the next run in the same process account each
# key once. Bounded: the oldest answers go first.
_SHARED: OrderedDict[tuple[str, int, History], EpsilonResult] = OrderedDict()
SHARED_MAX = 100_000


def shared_result(accountant: str, delta_p: int, key: History) -> EpsilonResult | None:
    return _SHARED.get((accountant, delta_p, key))


def share_result(accountant: str, delta_p: int, key: History, result: EpsilonResult) -> None:
    _SHARED[(accountant, delta_p, key)] = result
    while len(_SHARED) > SHARED_MAX:
        _SHARED.popitem(last=False)
