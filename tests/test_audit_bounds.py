"""The audit's statistics (govtrain/audit/bounds.py) against oracles written here, and by simulation.

Oracles: scipy.stats.binom's tail for the pure-epsilon test; the (epsilon, delta) test's bound written out again in
mpmath, in 50 digits; the mu-GDP curve solved again in mpmath; the claimed subsampled-Gaussian curve (dp_accounting's
PLD) against the exact Gaussian trade-off and against dp_accounting's RDP accountant. Simulation: mechanisms whose privacy is known exactly
(randomized response: exactly eps-DP; a Gaussian shift of the score: exactly mu-GDP), audited over seeded trials,
must see their true privacy exceeded in at most about 5% of the trials, and a strong attack must come close to it.
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.special import expit
from scipy.stats import binom, norm

from govtrain.accounting.gaussian import gdp_epsilon as charged_epsilon
from govtrain.audit.bounds import (
    TOLERANCE,
    AuditBound,
    audit_scores,
    ceiling,
    default_guess_counts,
    fdp_rejects,
    gdp_epsilon,
    gdp_mu,
    one_run_epsilon,
)
from govtrain.audit.tradeoff import SubsampledGaussian, epsilon_delta_curve

ALPHA = 0.05


def binomial_epsilon(m: int, r: int, v: int, alpha: float = ALPHA) -> float:
    """The pure-epsilon test, solved directly: the eps with P[Binomial(r, e^eps / (1 + e^eps)) >= v] = alpha."""
    def excess(eps):
        return alpha - binom.sf(v - 1, r, expit(eps))
    if excess(0.0) < 0:
        return 0.0
    return brentq(excess, 0.0, 50.0, xtol=1e-12)


def mp_one_run_epsilon(m: int, r: int, v: int, delta: float, alpha: float = ALPHA) -> float:
    """The (eps, delta) test in mpmath: P[W >= v] <= f(v) + 2 m delta max_i (f(v - i) - f(v)) / i, written as a
    plain sum of binomial terms, and the largest eps it rejects by 80 steps of bisection."""
    mpmath.mp.dps = 50

    def p_value(eps):
        q = 1 / (1 + mpmath.exp(-eps))
        term = [mpmath.binomial(r, j) * q**j * (1 - q) ** (r - j) for j in range(r + 1)]
        f = [mpmath.fsum(term[u:]) for u in range(v + 1)]
        steepest = max((f[v - i] - f[v]) / i for i in range(1, v + 1))
        return f[v] + 2 * m * mpmath.mpf(delta) * steepest

    low, high = mpmath.mpf(0), mpmath.mpf(20)
    for _ in range(80):
        middle = (low + high) / 2
        low, high = (middle, high) if p_value(middle) <= alpha else (low, middle)
    return float(low)


def mp_gdp_epsilon(mu: float, delta: float) -> float:
    """The eps of mu-GDP at delta, from delta = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) in 50 digits."""
    mpmath.mp.dps = 50
    mu_, delta_ = mpmath.mpf(mu), mpmath.mpf(delta)

    def gap(eps):
        return mpmath.ncdf(-eps / mu_ + mu_ / 2) - mpmath.exp(eps) * mpmath.ncdf(-eps / mu_ - mu_ / 2) - delta_

    low, high = mpmath.mpf(0), mpmath.mpf(200)
    for _ in range(120):
        middle = (low + high) / 2
        low, high = (middle, high) if gap(middle) > 0 else (low, middle)
    return float(low)


# --- the one-run (epsilon, delta) test --------------------------------------------------------------------------

@pytest.mark.parametrize("m, r, v", [(1000, 1000, 600), (1000, 200, 180), (1000, 20, 20), (100, 50, 40),
                                     (10_000, 400, 390), (1000, 1000, 1000)])
def test_pure_epsilon_is_the_binomial_tail(m, r, v):
    oracle = binomial_epsilon(m, r, v)
    for delta in (0.0, 1e-15):
        ours = one_run_epsilon(canaries=m, guesses=r, correct=v, delta=delta)
        assert oracle - 2 * TOLERANCE <= ours <= oracle + 1e-9  # rounded down, never above the oracle


def test_pure_epsilon_nothing_to_show():
    assert one_run_epsilon(canaries=1000, guesses=100, correct=50, delta=1e-6) == 0.0  # chance accuracy
    assert one_run_epsilon(canaries=1000, guesses=0, correct=0, delta=1e-6) == 0.0
    assert gdp_mu(canaries=1000, guesses=100, correct=50) == 0.0
    assert gdp_mu(canaries=1000, guesses=0, correct=0) == 0.0


@pytest.mark.parametrize("m, r, v, delta", [(60, 60, 55, 1e-3), (60, 40, 38, 1e-4), (200, 40, 40, 1e-5)])
def test_delta_term_against_mpmath(m, r, v, delta):
    oracle = mp_one_run_epsilon(m, r, v, delta)
    ours = one_run_epsilon(canaries=m, guesses=r, correct=v, delta=delta)
    assert oracle - 2 * TOLERANCE <= ours <= oracle + 1e-9
    assert ours < binomial_epsilon(m, r, v)  # the delta term only weakens the test


def test_ceiling_for_a_thousand_canaries():
    """The unrestricted one-run test's ceiling (every canary guessed right, at the full confidence), and what
    `audit_scores` itself can certify: k <= m/2 per side, each k at the Bonferroni level."""
    q = 0.05 ** (1 / 1000)  # a perfect attack at 95%: q^1000 = 0.05
    oracle = math.log(q / (1 - q))
    assert oracle == pytest.approx(5.809, abs=1e-3)
    unrestricted = one_run_epsilon(canaries=1000, guesses=1000, correct=1000, delta=0.0)
    assert oracle - 2 * TOLERANCE <= unrestricted <= oracle
    assert 5.80 < one_run_epsilon(canaries=1000, guesses=1000, correct=1000, delta=1e-6) < oracle
    # audit_scores': at best (500 drawn in) k = 500 at the 0.05/6 level; three or more off, k = 250
    q_best = (0.05 / 6) ** (1 / 1000)
    assert ceiling(canaries=1000, delta=0.0) == pytest.approx(math.log(q_best / (1 - q_best)), abs=2 * TOLERANCE)
    best, usual = ceiling(canaries=1000, delta=1e-5), ceiling(canaries=1000, delta=1e-5, included=480)
    assert round(best, 2) == 5.27 and round(usual, 2) == 4.57 and usual < best < unrestricted
    assert usual == ceiling(canaries=1000, delta=1e-5, included=520) == one_run_epsilon(
        canaries=1000, guesses=500, correct=500, delta=1e-5, confidence=1 - ALPHA / 6)
    assert ceiling(canaries=1000, delta=1e-5, guess_counts=[250]) == one_run_epsilon(
        canaries=1000, guesses=500, correct=500, delta=1e-5)  # one k: no correction
    assert ceiling(canaries=100, delta=1e-6) < ceiling(canaries=1000, delta=1e-6) < ceiling(canaries=10_000,
                                                                                           delta=1e-6)


def test_a_perfect_attack_certifies_exactly_the_ceiling():
    rng = np.random.default_rng(5)
    for m in (200, 1000):
        included = rng.random(m) < 0.5
        perfect = audit_scores(included + 1e-3 * rng.random(m), included, delta=1e-5)
        assert perfect.epsilon_one_run == perfect.ceiling


def test_more_correct_more_canaries_larger_bound():
    eps = [one_run_epsilon(canaries=1000, guesses=200, correct=v, delta=1e-6) for v in range(120, 201, 10)]
    mus = [gdp_mu(canaries=1000, guesses=200, correct=v) for v in range(120, 201, 10)]
    assert all(a < b for a, b in zip(eps, eps[1:])) and all(a < b for a, b in zip(mus, mus[1:]))
    # the same accuracy (90%) on more canaries, guessing the same share of them
    eps = [one_run_epsilon(canaries=m, guesses=m // 5, correct=9 * m // 50, delta=1e-6) for m in (500, 1000, 4000)]
    mus = [gdp_mu(canaries=m, guesses=m // 5, correct=9 * m // 50) for m in (500, 1000, 4000)]
    assert all(a < b for a, b in zip(eps, eps[1:])) and all(a < b for a, b in zip(mus, mus[1:]))
    # more confidence asked, less shown
    assert (one_run_epsilon(canaries=1000, guesses=200, correct=180, delta=1e-6, confidence=0.99)
            < one_run_epsilon(canaries=1000, guesses=200, correct=180, delta=1e-6))


# --- mu-GDP -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mu, delta", [(0.1, 1e-5), (0.5, 1e-5), (1.0, 1e-6), (2.0, 1e-5), (5.0, 1e-3)])
def test_gdp_epsilon_against_mpmath(mu, delta):
    oracle = mp_gdp_epsilon(mu, delta)
    ours = gdp_epsilon(mu, delta)
    assert oracle - 2 * TOLERANCE <= ours <= oracle + 1e-9
    assert ours <= charged_epsilon(mu, delta)  # the ledger rounds the same curve up


def test_gdp_epsilon_of_no_privacy_loss():
    assert gdp_epsilon(0.0, 1e-5) == 0.0
    assert gdp_epsilon(0.01, 0.5) == 0.0  # delta(0) = Phi(mu/2) - Phi(-mu/2) < 0.5 already


def test_gdp_bound_approaches_mu_from_below():
    """With the expected counts of a Gaussian shift by mu (exactly mu-GDP), guessing the top and bottom 1%, the
    bound grows with the number of canaries and stays below mu."""
    mu, share = 1.0, 0.01
    threshold = brentq(lambda t: (norm.sf(t) + norm.sf(t - mu)) / 2 - share, -20, 20)
    precision = norm.sf(threshold - mu) / (norm.sf(threshold) + norm.sf(threshold - mu))
    bounds = []
    for m in (1000, 10_000, 100_000):
        r = 2 * round(share * m)
        bounds.append(gdp_mu(canaries=m, guesses=r, correct=round(r * precision)))
    assert 0 < bounds[0] < bounds[1] < bounds[2] < mu
    assert bounds[2] > 0.7 * mu


# --- scores to guesses ------------------------------------------------------------------------------------------

def test_audit_scores_is_the_best_k_at_the_bonferroni_level():
    rng = np.random.default_rng(7)
    m, mu, delta = 1000, 1.5, 1e-5
    included = rng.random(m) < 0.5
    scores = rng.normal(size=m) + mu * included
    bound = audit_scores(scores, included, delta=delta)
    assert isinstance(bound, AuditBound) and bound.canaries == m and bound.delta == delta
    counts = default_guess_counts(m)
    assert counts == (10, 25, 50, 100, 250, 500)
    level = 1 - ALPHA / len(counts)
    by_rank = np.argsort(scores)  # no ties here
    candidates = []
    for k in counts:
        right = int(np.sum(~included[by_rank[:k]]) + np.sum(included[by_rank[-k:]]))
        candidates.append((one_run_epsilon(canaries=m, guesses=2 * k, correct=right, delta=delta,
                                           confidence=level), 2 * k, right,
                           0))
    eps, guesses, right, _ = max(candidates)
    assert (bound.epsilon_one_run, bound.guesses, bound.correct) == (eps, guesses, right)
    assert bound.fdp is None  # no claim given, no f-DP test
    assert bound.ceiling == ceiling(canaries=m, delta=delta, included=int(included.sum()))
    # one k, no correction
    single = audit_scores(scores, included, delta=delta, guess_counts=[50])
    right = candidates[counts.index(50)][2]
    assert single.epsilon_one_run == one_run_epsilon(canaries=m, guesses=100, correct=right, delta=delta)
    # the canaries' order is nobody's business
    order = rng.permutation(m)
    assert audit_scores(scores[order], included[order], delta=delta) == bound


def test_ties_count_against_the_auditor():
    included = [True] * 50 + [False] * 50
    flat = audit_scores([0.0] * 100, included, delta=1e-5)
    assert flat.correct == 0 and flat.epsilon_one_run == 0.0
    # two tied blocks: the top 10 come from the "high" block, whose excluded members are taken first
    scores = [1.0] * 20 + [0.0] * 80
    inc = [True] * 12 + [False] * 8 + [True] * 38 + [False] * 42
    bound = audit_scores(scores, inc, delta=1e-5, guess_counts=[10])
    assert bound.correct == 2  # "in" on 8 excluded and 2 included, "out" on 10 included


def _rejected_by_some_k(scores, included, curve, level) -> bool:  # type: ignore[no-untyped-def]
    """audit_scores' claim_rejected, without the family search: the f-DP test of each default k at `level`."""
    m, by_rank = len(scores), np.argsort(scores)
    for k in default_guess_counts(m):
        right = int(np.sum(~included[by_rank[:k]]) + np.sum(included[by_rank[-k:]]))
        if fdp_rejects(canaries=m, guesses=2 * k, correct=right, curve=curve, confidence=level):
            return True
    return False


@pytest.mark.parametrize("mu", [1.5])
def test_validity_gaussian_shift(mu):
    """Scores shifted by mu when included: the scores are exactly mu-GDP in each canary (the subsampled Gaussian at
    q = 1, one step, noise multiplier 1/mu), so the audit may exceed mu or its epsilon at delta, or reject that
    claimed curve, in at most ~5% of the trials."""
    rng, m, delta, trials = np.random.default_rng(2023), 1000, 1e-5, 200
    truth = gdp_epsilon(mu, delta) + 2 * TOLERANCE
    claimed = SubsampledGaussian(noise_multiplier=1 / mu, sampling_rate=1.0, steps=1).curve()
    level = 1 - ALPHA / len(default_guess_counts(m))
    over_mu = over_one_run = rejected = 0
    for _ in range(trials):
        included = rng.random(m) < 0.5
        scores = rng.normal(size=m) + mu * included
        bound = audit_scores(scores, included, delta=delta)
        over_mu += gdp_mu(canaries=m, guesses=bound.guesses, correct=bound.correct, confidence=level) > mu
        over_one_run += bound.epsilon_one_run > truth
        rejected += _rejected_by_some_k(scores, included, claimed, level)
        assert bound.epsilon_one_run <= bound.ceiling
    for over in (over_mu, over_one_run, rejected):
        assert over / trials <= ALPHA + 0.03


def test_a_mechanism_three_times_its_claim_is_caught():
    """Scores shifted by 3 audited against a claim of mu = 1 (noise multiplier 1): the f-DP test rejects the claimed
    curve in nearly every trial."""
    rng, m = np.random.default_rng(11), 1000
    claimed = SubsampledGaussian(noise_multiplier=1.0, sampling_rate=1.0, steps=1).curve()
    level = 1 - ALPHA / len(default_guess_counts(m))
    caught = 0
    for _ in range(50):
        included = rng.random(m) < 0.5
        caught += _rejected_by_some_k(rng.normal(size=m) + 3.0 * included, included, claimed, level)
    assert caught >= 48


# --- the f-DP test against a claimed curve -----------------------------------------------------------------------

@pytest.mark.parametrize("sigma", [0.5, 1.0, 3.0])
def test_the_claimed_curve_of_a_pure_gaussian_is_the_exact_trade_off_from_below(sigma):
    """q = 1, one step: the PLD curve is the Gaussian trade-off Phi(Phi^-1(1 - a) - 1/sigma), within the
    discretisation and never above it (above would make a false rejection likelier)."""
    curve = SubsampledGaussian(noise_multiplier=sigma, sampling_rate=1.0, steps=1).curve()
    alphas = np.linspace(0.0, 1.0, 1001)
    ours = np.array([curve(a) for a in alphas])
    exact = norm.cdf(norm.ppf(1 - alphas) - 1 / sigma)
    assert np.all(ours <= exact + 1e-12)
    assert np.max(exact - ours) < 1e-4


def test_the_claimed_epsilon_against_a_second_accountant():
    """Subsampled and composed: the optimistic PLD's epsilon at delta (a family member's stated epsilon) against
    Microsoft's prv-accountant (Gopi et al.), a second library: at most its upper bound, and within its error
    band of its estimate."""
    prv = pytest.importorskip("prv_accountant")

    for sigma, q, steps in ((1.0, 0.5, 10), (2.0, 0.05, 10), (0.8, 1.0, 5)):
        ours = SubsampledGaussian(noise_multiplier=sigma, sampling_rate=q, steps=steps).epsilon(1e-5)
        accountant = prv.PRVAccountant(prvs=[prv.PoissonSubsampledGaussianMechanism(
            noise_multiplier=sigma, sampling_probability=q)], max_self_compositions=[steps], eps_error=0.01,
            delta_error=1e-10)
        lower, _, upper = accountant.compute_epsilon(delta=1e-5, num_self_compositions=[steps])
        assert lower - 0.02 <= ours <= upper


def test_the_family_bound_is_the_gaussian_bound_for_a_pure_gaussian_claim():
    """At q = 1 and one step the family is mu-GDP with mu = 1/sigma': its bound is the diagnostic gdp_mu, from
    below (the claimed curve is never above the true one), and a claim weaker than the truth is not rejected."""
    rng, m, delta = np.random.default_rng(3), 1000, 1e-5
    level = 1 - ALPHA / len(default_guess_counts(m))
    for mu in (1.0, 2.0):
        included = rng.random(m) < 0.5
        scores = rng.normal(size=m) + mu * included
        bound = audit_scores(scores, included, delta=delta,
                             claim=SubsampledGaussian(noise_multiplier=1 / mu, sampling_rate=1.0, steps=1))
        fdp = bound.fdp
        diagnostic = gdp_mu(canaries=m, guesses=fdp.guesses, correct=fdp.correct, confidence=level)
        assert diagnostic - 0.01 < 1 / fdp.noise_multiplier <= diagnostic + 2 * TOLERANCE
        assert not fdp.claim_rejected and fdp.noise_multiplier > 1 / mu
        assert 0 < fdp.epsilon <= gdp_epsilon(1 / fdp.noise_multiplier, delta) + 1e-3
        weaker = audit_scores(scores, included, delta=delta,
                              claim=SubsampledGaussian(noise_multiplier=0.5 / mu, sampling_rate=1.0, steps=1))
        assert not weaker.fdp.claim_rejected


def test_the_f_dp_test_against_an_epsilon_delta_claim_rejects_a_stronger_one():
    """Randomized response at eps = 2 guessed on every canary: the f-DP test does not reject (2, delta) and does
    reject (0.5, delta), in the expected case."""
    m, q = 1000, math.exp(2) / (1 + math.exp(2))
    right = round(m * q)
    assert not fdp_rejects(canaries=m, guesses=m, correct=right, curve=epsilon_delta_curve(2.0, 1e-5))
    assert fdp_rejects(canaries=m, guesses=m, correct=right, curve=epsilon_delta_curve(0.5, 1e-5))


def test_validity_and_tightness_randomized_response():
    """Randomized response at eps (each canary's bit reported truly with probability e^eps / (1 + e^eps)) is exactly
    eps-DP. Guessing every canary's bit as reported, the correct count is Binomial(m, q): the one-run test must
    exceed eps in at most ~5% of trials, reach it in some (the test is not slack), and sit close to it."""
    rng, m, eps, trials = np.random.default_rng(5), 1000, 2.0, 300
    correct = rng.binomial(m, expit(eps), size=trials)
    bounds = np.array([one_run_epsilon(canaries=m, guesses=m, correct=int(v), delta=1e-6) for v in correct])
    assert 0.01 <= np.mean(bounds > eps) <= ALPHA + 0.03
    assert np.median(bounds) > 0.85 * eps
    # the same mechanism through scores (jitter breaks the ties; post-processing keeps it eps-DP)
    over, found = 0, []
    for _ in range(100):
        included = rng.random(m) < 0.5
        truthful = rng.random(m) < expit(eps)
        scores = np.where(truthful, included, ~included) + 1e-3 * rng.normal(size=m)
        bound = audit_scores(scores, included, delta=1e-6)
        over += bound.epsilon_one_run > eps
        found.append(bound.epsilon_one_run)
    assert over / 100 <= ALPHA + 0.03
    assert np.median(found) > 0.75 * eps


# --- refusals ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    dict(scores=[], included=[]),
    dict(scores=[0.1, 0.2], included=[True]),
    dict(scores=[0.1, float("nan")], included=[True, False]),
    dict(scores=[0.1, 0.2], included=[1, 0]),
    dict(scores=[0.1, 0.2], included=[True, False], delta=0.0),
    dict(scores=[0.1, 0.2], included=[True, False], delta=1.0),
    dict(scores=[0.1, 0.2], included=[True, False], delta=-1e-5),
    dict(scores=[0.1, 0.2], included=[True, False], confidence=1.0),
    dict(scores=[0.1, 0.2], included=[True, False], confidence=0.0),
    dict(scores=[0.1, 0.2], included=[True, False], confidence=95),
    dict(scores=[0.1, 0.2], included=[True, False], guess_counts=[2]),
    dict(scores=[0.1, 0.2], included=[True, False], guess_counts=[0]),
    dict(scores=[0.1, 0.2], included=[True, False], guess_counts=[]),
])
def test_audit_scores_refuses_nonsense(kwargs):
    kwargs = {"delta": 1e-5, **kwargs}
    with pytest.raises(ValueError):
        audit_scores(kwargs.pop("scores"), kwargs.pop("included"), **kwargs)


@pytest.mark.parametrize("counts", [(0, 0, 0), (10, 5, 6), (10, 11, 5), (10, -1, 0), (10, 5.0, 5), (10, True, 1)])
def test_count_functions_refuse_nonsense(counts):
    m, r, v = counts
    with pytest.raises(ValueError):
        one_run_epsilon(canaries=m, guesses=r, correct=v, delta=1e-6)
    with pytest.raises(ValueError):
        gdp_mu(canaries=m, guesses=r, correct=v)


def test_parameters_refused():
    for delta in (-1e-9, 1.0, float("nan")):
        with pytest.raises(ValueError):
            one_run_epsilon(canaries=10, guesses=10, correct=10, delta=delta)
        with pytest.raises(ValueError):
            gdp_epsilon(1.0, delta)
    with pytest.raises(ValueError):
        gdp_epsilon(1.0, 0.0)
    for mu in (-0.5, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            gdp_epsilon(mu, 1e-5)
    for confidence in (0.0, 1.0, float("nan")):
        with pytest.raises(ValueError):
            ceiling(canaries=10, delta=1e-6, confidence=confidence)
        with pytest.raises(ValueError):
            gdp_mu(canaries=10, guesses=10, correct=10, confidence=confidence)
