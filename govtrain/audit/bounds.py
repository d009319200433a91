"""From canary guesses to lower bounds on privacy: what one training run can prove a mechanism does *not* meet.

The game (Steinke, Nasr & Jagielski, NeurIPS 2023, "Privacy auditing with one (1) training run", Algorithm 1):
m canaries, each included independently with probability 1/2; after the run the auditor guesses "in" or "out" for
r of them and abstains on the rest; v guesses are correct. Each test below bounds, for every mechanism that meets a
claim, the probability of v or more correct guesses; an observation that is too unlikely under a claim rejects it.
The reported bound is the largest claim the observation rejects, found by bisection and rounded *down* (the bracket's
lower end, always a rejected value): a lower bound that errs only towards saying less.

- `one_run_epsilon`: the (epsilon, delta) test. For an (eps, delta)-DP mechanism, with f(u) = P[Binomial(r, q) >= u]
  and q = e^eps / (1 + e^eps) (the accuracy of eps-randomized response),

      P[v or more correct] <= f(v) + 2 m delta max_{1 <= i <= v} (f(v - i) - f(v)) / i

  (the paper's Theorem 3.1 for delta = 0, and its delta > 0 form with the 2 m delta term, computed as in its
  Appendix D). The claim is rejected when this is at most 1 - confidence.
- `fdp_rejects`: the f-DP test of Mahloujifar, Melis & Chaudhuri ("Auditing f-Differential Privacy in One Run",
  ICML 2025), for any symmetric trade-off curve f: suppose v or more correct guesses had probability
  tau = 1 - confidence or more. Pick a canary J uniformly: then P[J guessed, correctly] >= tau v / m and
  P[J guessed, wrongly] >= tau (r - v) / m, and the trade-off between the two, lowered one correct guess at a time
  (i = v - 1 .. 0), forces

      h <- max(h, f(1 - c)),   c <- min(1, c + i / (r - i) (h_new - h_old))

  from c = tau v / m, h = tau (r - v) / m. If c + h exceeds r / m, the chance that J is guessed at all, the
  supposition is impossible, and f-DP is rejected. `fdp_audit` runs it against a run's *claimed* curve (the
  subsampled Gaussian at the run's q, noise multiplier and steps, `tradeoff.SubsampledGaussian`): the claim is
  rejected or not, a verdict valid for every mechanism; and it states the least private member of that family the
  guesses reject as epsilon at delta, a bound valid for mechanisms *of that family*, which is what the run claims
  to be and why it is tighter than the one-run test's (which holds for any mechanism).
- `gdp_mu`, `gdp_epsilon`: the same test against the Gaussian family G_mu, a DIAGNOSTIC only: "not mu-GDP" bounds
  the epsilon of a Gaussian-shaped mechanism, not of every (eps, delta)-DP one (randomized response at exactly
  (1, 0)-DP is "bounded" at 1.24), so it is never compared with a claim.
- `audit_scores`: scores to guesses, the paper's way: "in" on the k highest scores and "out" on the k lowest, for a
  few k fixed before the scores are seen; each test is run at (1 - confidence) / (number of k) and the best k kept
  (Bonferroni), so the search over k costs confidence rather than validity. Its `ceiling` is what it certifies
  from perfect scores at those levels and guess counts, below the unrestricted one-run ceiling (r = v = m at the
  full confidence).

Why a bisection on the claim is a valid bound (and not a test chosen after looking): a mechanism that meets a claim
meets every weaker one, and each test bounds P[V >= u] for every u, so the event "some claim weaker than the truth is
rejected" is {V >= t} for the smallest threshold t over those claims, whose probability is at most 1 - confidence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Sequence

from govtrain.accounting.gaussian import gaussian_delta
from govtrain.audit.tradeoff import SubsampledGaussian, TradeOff, perfect_privacy

TOLERANCE = 1e-6  # width of the final bracket on epsilon or mu; the lower end is reported
_LARGEST = 1024.0  # no bound is searched above this (m canaries certify at most ~ln(m / (1 - confidence)))
_DEFAULT_FRACTIONS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5)  # k / m: from a few confident guesses to guessing them all
_PHI = NormalDist()
_FAMILY_LARGEST = 4.0  # 1/σ' searched up to here: σ' = 1/4, whose ε at any δ an audit here uses is far above 100
_FAMILY_TOLERANCE = 1e-3  # width of the final bracket on 1/σ'


@dataclass(frozen=True, kw_only=True)
class FdpBound:
    """The f-DP test against a run's claimed mechanism `claim`, at the `AuditBound`'s confidence.

    `claim_rejected`: the guesses reject the claimed trade-off curve. Valid for any mechanism: one that meets its
    claim is rejected with probability at most 1 - confidence. `epsilon`: epsilon at delta of the least private
    member of the claim's family (the subsampled Gaussian at the same q and steps, noise multiplier
    `noise_multiplier`) that the guesses reject, rounded down; 0 when they reject none. It is valid for mechanisms
    of that family, which is what the run claims to be, and that is why it is tighter than `epsilon_one_run`, which
    holds for any mechanism. `guesses` and `correct` are those of the k that gave `epsilon`."""

    claim: SubsampledGaussian
    claim_rejected: bool
    epsilon: float
    noise_multiplier: float  # math.inf when even perfect privacy is not rejected
    guesses: int
    correct: int


@dataclass(frozen=True, kw_only=True)
class AuditBound:
    """What one audited run proves, at `confidence`: the mechanism is not (epsilon_one_run, delta)-DP, whatever it
    is; `fdp` (when a claim was given) whether it meets its claimed curve. `guesses` and `correct` are those of the
    choice of k that gave epsilon_one_run. `ceiling` is what perfect scores certify by `audit_scores`' one-run test
    with the same draw, guess counts and levels: no run can show more."""

    canaries: int
    guesses: int
    correct: int
    epsilon_one_run: float
    ceiling: float
    confidence: float
    delta: float
    fdp: FdpBound | None = None


def _check_counts(canaries: int, guesses: int, correct: int, confidence: float) -> None:
    for name, value in (("canaries", canaries), ("guesses", guesses), ("correct", correct)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, not {type(value).__name__}")
    if canaries < 1:
        raise ValueError(f"need at least one canary, not {canaries}")
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(f"need 0 <= correct <= guesses <= canaries, not {correct}, {guesses}, {canaries}")
    _check_confidence(confidence)


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), not {confidence}")


def _largest_rejected(rejects, *, start: float = 0.0, tolerance: float = TOLERANCE,
                      largest: float = _LARGEST) -> float:
    """The lower end of a bisection for the largest value that `rejects`, from a rejected `start` (0 by default,
    returned when even it is not rejected)."""
    if not rejects(start):
        return start
    low, high = start, min(max(1.0, 2 * start), largest)
    while rejects(high):
        if high >= largest:
            return high
        low, high = high, min(high * 2, largest)
    while high - low > tolerance:
        middle = (low + high) / 2
        if rejects(middle):
            low = middle
        else:
            high = middle
    return low


# --- 1. Steinke, Nasr & Jagielski: the (epsilon, delta) one-run test --------------------------------------------

def _one_run_p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """The bound above on P[correct or more of guesses right] for every (epsilon, delta)-DP mechanism."""
    import numpy as np
    from scipy.special import bdtrc, expit, gammaln, xlog1py, xlogy

    if correct == 0:
        return 1.0
    q = float(expit(epsilon))
    tail = float(bdtrc(correct - 1, guesses, q))  # f(v) = P[B >= v] = P[B > v - 1]
    if delta == 0:
        return min(tail, 1.0)
    # f(v - i) - f(v) = P[v - i <= B <= v - 1]: summed from the pmf, top down, so that no two near-equal tails
    # are subtracted.
    k = np.arange(correct, dtype=float)
    log_pmf = (gammaln(guesses + 1) - gammaln(k + 1) - gammaln(guesses - k + 1) + xlogy(k, q)
               + xlog1py(guesses - k, -q))
    window = np.cumsum(np.exp(log_pmf)[::-1])  # window[i - 1] = P[v - i <= B <= v - 1]
    steepest = float(np.max(window / np.arange(1, correct + 1)))
    return min(tail + 2 * canaries * delta * steepest, 1.0)


def one_run_epsilon(*, canaries: int, guesses: int, correct: int, delta: float, confidence: float = 0.95) -> float:
    """The largest epsilon whose (epsilon, delta) claim `correct` right out of `guesses` guesses on `canaries`
    canaries rejects at `confidence`: an empirical lower bound on epsilon (module docstring). 0 <= delta < 1;
    delta = 0 is the pure-epsilon binomial test."""
    _check_counts(canaries, guesses, correct, confidence)
    if not 0 <= delta < 1:
        raise ValueError(f"delta must be in [0, 1), not {delta}")
    alpha = 1 - confidence
    if _one_run_p_value(canaries, guesses, correct, 0.0, 0.0) > alpha:
        return 0.0  # not even pure 0-DP is rejected; a delta > 0 only weakens the test
    return _largest_rejected(lambda eps: _one_run_p_value(canaries, guesses, correct, eps, delta) <= alpha)


# --- 2. Mahloujifar, Melis & Chaudhuri: the f-DP one-run test -------------------------------------------------

def fdp_rejects(*, canaries: int, guesses: int, correct: int, curve, confidence: float = 0.95) -> bool:  # type: ignore[no-untyped-def]
    """Whether `correct` or more right guesses out of `guesses` on `canaries` canaries reject f-DP for the
    symmetric trade-off curve `curve` (a callable, e.g. a `tradeoff.TradeOff`) at `confidence` (module docstring)."""
    _check_counts(canaries, guesses, correct, confidence)
    return _fdp_rejects(canaries, guesses, correct, curve, 1 - confidence)


def _fdp_rejects(canaries: int, guesses: int, correct: int, curve, alpha: float) -> bool:  # type: ignore[no-untyped-def]
    if correct == 0:
        return False
    right = alpha * correct / canaries
    wrong = alpha * (guesses - correct) / canaries
    for i in range(correct - 1, -1, -1):
        # the fewest wrong guesses f allows beside `right` correct ones: f^-1(1 - right), = f(1 - right) for a
        # symmetric f
        least_wrong = curve(1.0 - right) if right < 1 else 1.0
        if least_wrong <= wrong:
            break  # nothing moves any more: neither does anything below
        right += i / (guesses - i) * (least_wrong - wrong)
        if right > 1:
            right = 1.0
        wrong = least_wrong
    return right + wrong > guesses / canaries


def _family_member(claim: SubsampledGaussian, inverse_sigma: float) -> SubsampledGaussian | None:
    return None if inverse_sigma == 0 else claim.with_noise(1 / inverse_sigma)


def fdp_audit(*, canaries: int, counts: Sequence[tuple[int, int]], claim: SubsampledGaussian, delta: float,
              confidence: float = 0.95) -> FdpBound:
    """The f-DP test of each (guesses, correct) in `counts` at (1 - confidence) / len(counts) (Bonferroni) against
    `claim`'s curve, and the least private member of its family (noise multiplier sigma' at the same q and steps,
    searched over 1/sigma' by bisection, rounded towards more noise) that some count rejects (`FdpBound`)."""
    _check_confidence(confidence)
    if not counts:
        raise ValueError("need at least one (guesses, correct)")
    for guesses, correct in counts:
        _check_counts(canaries, guesses, correct, confidence)
    alpha = (1 - confidence) / len(counts)
    claimed = claim.curve()
    rejected = any(_fdp_rejects(canaries, r, v, claimed, alpha) for r, v in counts)
    curves: dict[float, TradeOff] = {}

    def curve(inverse_sigma: float) -> TradeOff:
        if inverse_sigma not in curves:
            member = _family_member(claim, inverse_sigma)
            curves[inverse_sigma] = perfect_privacy() if member is None else member.curve()
        return curves[inverse_sigma]

    best: float | None = None  # the largest 1/sigma' some count rejects
    best_counts = counts[0]
    for r, v in counts:
        # only a k that rejects at least the best so far can raise it (each is tested at the same level)
        if not _fdp_rejects(canaries, r, v, curve(best or 0.0), alpha):
            continue
        found = _largest_rejected(lambda x: _fdp_rejects(canaries, r, v, curve(x), alpha), start=best or 0.0,
                                  tolerance=_FAMILY_TOLERANCE, largest=_FAMILY_LARGEST)
        if best is None or found > best:
            best, best_counts = found, (r, v)
    member = None if best is None else _family_member(claim, best)
    return FdpBound(claim=claim, claim_rejected=rejected, epsilon=0.0 if member is None else member.epsilon(delta),
                    noise_multiplier=math.inf if member is None else member.noise_multiplier,
                    guesses=best_counts[0], correct=best_counts[1])


def _gaussian_curve(mu: float):  # type: ignore[no-untyped-def]
    """G_mu(a) = Phi(Phi^-1(1 - a) - mu), with Phi(t) = erfc(-t / sqrt 2) / 2."""
    inverse, shift = _PHI.inv_cdf, mu / math.sqrt(2)

    def curve(a: float) -> float:
        if a <= 0:
            return 1.0
        if a >= 1:
            return 0.0
        return 0.5 * math.erfc(shift - inverse(1 - a) / math.sqrt(2))

    return curve


def gdp_mu(*, canaries: int, guesses: int, correct: int, confidence: float = 0.95) -> float:
    """DIAGNOSTIC. The largest mu whose mu-GDP claim the guesses reject at `confidence`: a lower bound on mu for a
    mechanism that is mu-GDP for some mu, not a bound on any other mechanism's epsilon (module docstring)."""
    _check_counts(canaries, guesses, correct, confidence)
    alpha = 1 - confidence
    return _largest_rejected(lambda mu: _fdp_rejects(canaries, guesses, correct, _gaussian_curve(mu), alpha))


def gdp_epsilon(mu: float, delta: float) -> float:
    """DIAGNOSTIC. epsilon of mu-GDP at delta: the eps with delta = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)
    (Dong, Roth & Su, Corollary 2.13; the ledger's own curve, `govtrain.accounting.gaussian.gaussian_delta`), by
    bisection to `TOLERANCE`, rounded *down*. Valid as a bound only for a mu-GDP mechanism: never compare it with
    an (epsilon, delta) claim."""
    if not (mu >= 0 and math.isfinite(mu)):
        raise ValueError(f"mu must be finite and >= 0, not {mu}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), not {delta}")
    return _largest_rejected(lambda eps: gaussian_delta(eps, mu) > delta)


# --- 3. scores to guesses ----------------------------------------------------------------------------------------

def default_guess_counts(canaries: int) -> tuple[int, ...]:
    """The k tried when none are given: 1%, 2.5%, 5%, 10%, 25% and 50% of the canaries guessed on each side."""
    return tuple(sorted({max(1, round(canaries * f)) for f in _DEFAULT_FRACTIONS if 2 * max(1, round(canaries * f))
                         <= canaries}))


def _guesses(order: Sequence[int], included: Sequence[bool], k: int) -> int:
    """Right guesses among "out" on the first k of `order` (lowest scores) and "in" on the last k (highest)."""
    low, high = order[:k], order[len(order) - k:]
    return sum(not included[i] for i in low) + sum(bool(included[i]) for i in high)


def audit_scores(scores: Sequence[float], included: Sequence[bool], *, delta: float, confidence: float = 0.95,
                 guess_counts: Sequence[int] | None = None, claim: SubsampledGaussian | None = None) -> AuditBound:
    """The one-run bound from canary scores (higher = more likely included) and the canaries' true inclusion, and
    with `claim` (the run's claimed mechanism) the f-DP test against it (`fdp_audit`, `FdpBound`).

    For each k in `guess_counts` (default `default_guess_counts`; each needs 1 <= k and 2k <= m) the auditor guesses
    "in" on the k highest scores and "out" on the k lowest (k+ = k- = k, r = 2k guesses). The k are fixed before the
    scores are seen, and each test is run at significance (1 - confidence) / len(guess_counts), Bonferroni, so the
    best k's bound still holds at `confidence`; the one-run bound and the f-DP result each hold at `confidence` on
    their own. Equal scores
    are ordered against the auditor (ties never help a guess), so discrete scores should get independent jitter,
    which is post-processing and costs no validity. The order of the canaries does not matter.
    """
    import numpy as np

    _check_confidence(confidence)
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), not {delta}")
    scores, included = list(scores), list(included)
    m = len(scores)
    if m < 1:
        raise ValueError("need at least one canary")
    if len(included) != m:
        raise ValueError(f"{m} scores but {len(included)} inclusion flags")
    if any(not isinstance(flag, (bool, np.bool_)) for flag in included):
        raise ValueError("inclusion flags must be booleans")
    if any(math.isnan(float(s)) for s in scores):
        raise ValueError("a score is NaN")
    counts = default_guess_counts(m) if guess_counts is None else tuple(guess_counts)
    if guess_counts is not None and not counts:
        raise ValueError("guess_counts is empty")
    for k in counts:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1 or 2 * k > m:
            raise ValueError(f"each guess count k needs 1 <= k and 2k <= {m} canaries, not {k!r}")
    # ascending score; among equal scores the included first, so that the top end's ties are the excluded (a wrong
    # "in") and the bottom end's the included (a wrong "out")
    order = sorted(range(m), key=lambda i: (float(scores[i]), not included[i]))
    level = 1 - (1 - confidence) / max(len(counts), 1)
    best = (0.0, 0, 0)
    tallies = []
    for k in counts:
        right = _guesses(order, included, k)
        tallies.append((2 * k, right))
        best = max(best, (one_run_epsilon(canaries=m, guesses=2 * k, correct=right, delta=delta, confidence=level),
                          2 * k, right))
    fdp = None if claim is None else fdp_audit(canaries=m, counts=tallies, claim=claim, delta=delta,
                                               confidence=confidence)
    return AuditBound(canaries=m, guesses=best[1], correct=best[2], epsilon_one_run=best[0],
                      ceiling=ceiling(canaries=m, delta=delta, confidence=confidence, guess_counts=counts,
                                      included=sum(bool(flag) for flag in included)),
                      confidence=confidence, delta=delta, fdp=fdp)


def ceiling(*, canaries: int, delta: float, confidence: float = 0.95, guess_counts: Sequence[int] | None = None,
            included: int | None = None) -> float:
    """What `audit_scores` certifies by the one-run test from perfect scores with these guess counts (default
    `default_guess_counts`) at its Bonferroni level, when `included` of the canaries were drawn in: each k then
    gets min(k, included) + min(k, m - included) of its 2k guesses right. No run with that draw can show more.
    Without `included`, the best draw (m // 2 in), so no run at all can show more.

    m = 1000, delta = 1e-5, 95%: 5.27 with exactly 500 drawn in, 4.93 and 4.71 one and two off, and 4.57 (k = 250)
    from three off on, the usual case. The unrestricted one-run test (r = v = m at the full confidence,
    `one_run_epsilon(canaries=m, guesses=m, correct=m, ...)`) would give 5.78, but `audit_scores` never runs it."""
    _check_confidence(confidence)
    counts = default_guess_counts(canaries) if guess_counts is None else tuple(guess_counts)
    if not counts:
        raise ValueError("guess_counts is empty")
    inside = canaries // 2 if included is None else included
    if isinstance(inside, bool) or not isinstance(inside, int) or not 0 <= inside <= canaries:
        raise ValueError(f"included must be an int in [0, {canaries}], not {included!r}")
    level = 1 - (1 - confidence) / len(counts)
    return max(one_run_epsilon(canaries=canaries, guesses=2 * k, correct=min(k, inside) + min(k, canaries - inside),
                               delta=delta, confidence=level) for k in counts)
