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
- `gdp_mu`: the Gaussian f-DP test of Mahloujifar, Melis & Chaudhuri ("Auditing f-Differential Privacy in One Run",
  ICML 2025): for a mu-GDP mechanism (trade-off G_mu(a) = Phi(Phi^-1(1 - a) - mu)), suppose v or more correct
  guesses had probability tau = 1 - confidence or more. Pick a canary J uniformly: then P[J guessed, correctly]
  >= tau v / m and P[J guessed, wrongly] >= tau (r - v) / m, and the trade-off between the two, lowered one correct
  guess at a time (i = v - 1 .. 0), forces

      h <- max(h, Phi(Phi^-1(c) - mu)),   c <- min(1, c + i / (r - i) (h_new - h_old))

  from c = tau v / m, h = tau (r - v) / m. If c + h exceeds r / m, the chance that J is guessed at all, the
  supposition is impossible, and mu-GDP is rejected. It uses the whole Gaussian curve, where the (eps, delta) test
  sees one point of it and pays 2 m delta for the rest, so it certifies more from the same guesses (docs/auditing.md
  has the figures). `gdp_epsilon` states the mu as epsilon at delta: a bound on epsilon *of a Gaussian-shaped
  mechanism* (as DP-SGD's is), not of every mechanism.
- `audit_scores`: scores to guesses, the paper's way: "in" on the k highest scores and "out" on the k lowest, for a
  few k fixed before the scores are seen; each test is run at (1 - confidence) / (number of k) and the best k kept
  (Bonferroni), so the search over k costs confidence rather than validity.

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

TOLERANCE = 1e-6  # width of the final bracket on epsilon or mu; the lower end is reported
_LARGEST = 1024.0  # no bound is searched above this (m canaries certify at most ~ln(m / (1 - confidence)))
_DEFAULT_FRACTIONS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5)  # k / m: from a few confident guesses to guessing them all
_PHI = NormalDist()


@dataclass(frozen=True, kw_only=True)
class AuditBound:
    """What one audited run proves, at `confidence`: the mechanism is not (epsilon_one_run, delta)-DP, and not
    mu-GDP (equivalently, as a Gaussian-shaped mechanism, not (epsilon_gdp, delta)-DP). `guesses` and `correct` are
    those of the choice of k that gave epsilon_one_run, `gdp_guesses` and `gdp_correct` the one that gave mu.
    `ceiling` is what a perfect attack on `canaries` canaries would certify by the one-run test."""

    canaries: int
    guesses: int
    correct: int
    epsilon_one_run: float
    gdp_guesses: int
    gdp_correct: int
    mu: float
    epsilon_gdp: float
    ceiling: float
    confidence: float
    delta: float


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


def _largest_rejected(rejects) -> float:
    """The lower end of a bisection for the largest value that `rejects`: 0 when even 0 is not rejected."""
    if not rejects(0.0):
        return 0.0
    low, high = 0.0, 1.0
    while rejects(high):
        if high >= _LARGEST:
            return high
        low, high = high, high * 2
    while high - low > TOLERANCE:
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


def ceiling(*, canaries: int, delta: float, confidence: float = 0.95) -> float:
    """What a perfect attack (every canary guessed, every guess right) certifies by `one_run_epsilon`: no honest or
    broken run can show more with this many canaries. m = 1000 at 95% gives about 5.8 (q^1000 = 0.05)."""
    return one_run_epsilon(canaries=canaries, guesses=canaries, correct=canaries, delta=delta, confidence=confidence)


# --- 2. Mahloujifar, Melis & Chaudhuri: the Gaussian f-DP one-run test ------------------------------------------

def _gdp_rejects(canaries: int, guesses: int, correct: int, mu: float, alpha: float) -> bool:
    """Whether `correct` or more right guesses with probability alpha or more is impossible under mu-GDP."""
    if correct == 0:
        return False
    right = alpha * correct / canaries
    wrong = alpha * (guesses - correct) / canaries
    inverse, erfc, shift = _PHI.inv_cdf, math.erfc, mu / math.sqrt(2)
    for i in range(correct - 1, -1, -1):
        # the fewest wrong guesses G_mu allows beside `right` correct ones: 1 - G_mu(1 - x) = Phi(Phi^-1(x) - mu),
        # with Phi(t) = erfc(-t / sqrt 2) / 2
        least_wrong = 0.5 * erfc(shift - inverse(right) / math.sqrt(2)) if right < 1 else 1.0
        if least_wrong <= wrong:
            break  # nothing moves any more: neither does anything below
        right += i / (guesses - i) * (least_wrong - wrong)
        if right > 1:
            right = 1.0
        wrong = least_wrong
    return right + wrong > guesses / canaries


def gdp_mu(*, canaries: int, guesses: int, correct: int, confidence: float = 0.95) -> float:
    """The largest mu whose mu-GDP claim the guesses reject at `confidence`: a lower bound on mu (module
    docstring)."""
    _check_counts(canaries, guesses, correct, confidence)
    alpha = 1 - confidence
    return _largest_rejected(lambda mu: _gdp_rejects(canaries, guesses, correct, mu, alpha))


def gdp_epsilon(mu: float, delta: float) -> float:
    """epsilon of mu-GDP at delta: the eps with delta = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) (Dong, Roth &
    Su, Corollary 2.13; the ledger's own curve, `govtrain.accounting.gaussian.gaussian_delta`), by bisection to
    `TOLERANCE`, rounded *down*: the ledger rounds the same curve up to charge, the audit down to accuse."""
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
                 guess_counts: Sequence[int] | None = None) -> AuditBound:
    """Both bounds from canary scores (higher = more likely included) and the canaries' true inclusion.

    For each k in `guess_counts` (default `default_guess_counts`; each needs 1 <= k and 2k <= m) the auditor guesses
    "in" on the k highest scores and "out" on the k lowest (k+ = k- = k, r = 2k guesses). The k are fixed before the
    scores are seen, and each test is run at significance (1 - confidence) / len(guess_counts), Bonferroni, so the
    best k's bound still holds at `confidence`; each of the two bounds holds at `confidence` on its own. Equal scores
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
    best_eps, best_mu = (0.0, 0, 0), (0.0, 0, 0)
    for k in counts:
        right = _guesses(order, included, k)
        eps = one_run_epsilon(canaries=m, guesses=2 * k, correct=right, delta=delta, confidence=level)
        mu = gdp_mu(canaries=m, guesses=2 * k, correct=right, confidence=level)
        best_eps = max(best_eps, (eps, 2 * k, right))
        best_mu = max(best_mu, (mu, 2 * k, right))
    return AuditBound(canaries=m, guesses=best_eps[1], correct=best_eps[2], epsilon_one_run=best_eps[0],
                      gdp_guesses=best_mu[1], gdp_correct=best_mu[2], mu=best_mu[0],
                      epsilon_gdp=gdp_epsilon(best_mu[0], delta), ceiling=ceiling(canaries=m, delta=delta,
                                                                                   confidence=confidence),
                      confidence=confidence, delta=delta)
