"""The noise families' accountants (govtrain/accounting/families.py) against a second source: dp-accounting's
exact subsampled-Gaussian RDP (for the general subsampling bound), dp-accounting's PLD for the discrete Laplace
and the 1-D discrete Gaussian, and Rényi divergences computed numerically from the exact 1-D pmfs (shifted by
the sensitivity) for the discrete Gaussian and Skellam."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats
from scipy.special import logsumexp

from govtrain.accounting import families
from govtrain.accounting.accountants import _rdp_curve, _rdp_orders
from govtrain.accounting.spend import spend_epsilon_u
from govtrain.privatizers.base import Charge

ORDERS = _rdp_orders()
INTEGER = ORDERS[ORDERS == np.round(ORDERS)]


def _renyi(p: np.ndarray, q: np.ndarray, alpha: float) -> float:
    """D_α(P‖Q) of two pmfs on one support, from their logs."""
    with np.errstate(divide="ignore"):
        lp, lq = np.log(p), np.log(q)
    keep = (p > 0) & (q > 0)  # the pmfs' far tails underflow to 0: their share is below 1e-80 here
    return float(logsumexp(alpha * lp[keep] + (1 - alpha) * lq[keep])) / (alpha - 1)


@pytest.mark.parametrize("q, sigma", [(0.01, 1.0), (0.1, 0.8), (0.001, 2.0), (0.5, 1.5), (0.03, 5.0)])
def test_general_subsampling_bound_is_at_least_the_exact_gaussian(q, sigma):
    exact = _rdp_curve(q, sigma)
    bound = families.poisson_subsampled_rdp(ORDERS, q, lambda a: a / (2 * sigma * sigma))
    # At integer orders (where the theorem is stated). At fractional ones dp-accounting's series is not even
    # monotone in the order (q = 0.03, σ = 5: its value at 1.9 exceeds its exact value at 2), so no comparison.
    integer = np.isin(ORDERS, INTEGER) & np.isfinite(exact)
    assert bool((bound[integer] >= exact[integer] - 1e-12).all())
    assert bool((bound <= ORDERS / (2 * sigma * sigma) + 1e-12).all())  # never above the unsampled curve
    # and it amplifies: at small q and moderate orders it is far below the unsampled curve
    if q <= 0.03:
        small = ORDERS == 8
        assert bound[small].item() < 0.2 * 8 / (2 * sigma * sigma)


@pytest.mark.parametrize("sigma", [0.7, 1.0, 3.0])
@pytest.mark.parametrize("shift", [1, 2, 3])
def test_discrete_gaussian_rdp_bounds_the_exact_pmfs(sigma, shift):
    support = np.arange(-60 - int(20 * sigma), 61 + int(20 * sigma))
    base = np.exp(-support.astype(np.float64) ** 2 / (2 * sigma * sigma))
    base /= base.sum()
    moved = np.exp(-(support.astype(np.float64) - shift) ** 2 / (2 * sigma * sigma))
    moved /= moved.sum()
    for alpha in (2, 3, 5, 10, 32):
        exact = max(_renyi(moved, base, alpha), _renyi(base, moved, alpha))
        bound = float(families.discrete_gaussian_rdp(np.array([float(alpha)]), shift, sigma)[0])
        assert exact <= bound * (1 + 1e-9)
        if sigma >= 3 and alpha <= 10:
            assert exact >= 0.99 * bound  # tight: the discrete Gaussian is as private as the continuous one


@pytest.mark.parametrize("mu", [2, 8, 40])
@pytest.mark.parametrize("shift", [1, 2, 3])
def test_skellam_rdp_bounds_the_exact_pmfs(mu, shift):
    """Skellam(μ, μ) (variance 2μ) against itself shifted: d = 1, so Δ₁ = Δ₂ = the shift."""
    support = np.arange(-400, 401)
    base = stats.skellam.pmf(support, mu, mu)
    moved = stats.skellam.pmf(support - shift, mu, mu)
    for alpha in (2, 3, 5, 10, 32):
        exact = max(_renyi(moved, base, alpha), _renyi(base, moved, alpha))
        bound = float(families.skellam_rdp(np.array([float(alpha)]), shift, shift, 2 * mu)[0])
        assert exact <= bound * (1 + 1e-9), (alpha, exact, bound)


def _charge(family: str, q_u: int, sigma_u: int, rounds: int, params=(10, 40, 1)) -> Charge:
    return Charge(family=family, sampling_rate_u=q_u, noise_multiplier_u=sigma_u, rounds=rounds,
                  params=tuple(params) if family != "gaussian" else ())


@pytest.mark.parametrize("q_u, rounds", [(1_000_000, 1), (10_000, 300), (100_000, 50)])
def test_laplace_against_dp_accountings_discrete_laplace_pld(q_u, rounds):
    """1-D (d = 1): the discrete Laplace of scale 2^b under an integer shift of at most Δ₁."""
    from dp_accounting.pld import privacy_loss_distribution as pld

    params, sigma_u, delta = (10, 40, 1), 2_000_000, 1e-6
    ours = families.epsilon([_charge("laplace", q_u, sigma_u, rounds, params)], delta)
    lattice = families.Lattice(params)
    shift = math.floor(lattice.l1(sigma_u))  # the largest integer shift the rounding lets through
    one = pld.from_discrete_laplace_mechanism(parameter=2.0 ** -params[0], sensitivity=shift,
                                              sampling_prob=q_u / 1e6)
    reference = one.self_compose(rounds).get_epsilon_for_delta(delta)
    assert ours >= reference - 1e-4  # the PLD's own discretisation (1e-4) rounds it up
    if q_u == 1_000_000:  # one unsampled step: pure ε is the whole story, and both agree
        assert ours <= reference * 1.01 + 1e-3
    assert ours <= 3 * reference + 0.05  # and it is a useful bound, not a vacuous one


@pytest.mark.parametrize("q_u, rounds", [(1_000_000, 1), (10_000, 1000), (50_000, 200)])
def test_discrete_gaussian_against_dp_accountings_discrete_gaussian_pld(q_u, rounds):
    from dp_accounting.pld import privacy_loss_distribution as pld

    params, sigma_u, delta = (4, 40, 1), 1_000_000, 1e-6
    ours = families.epsilon([_charge("discrete-gaussian", q_u, sigma_u, rounds, params)], delta)
    shift = math.floor(families.Lattice(params).l2(sigma_u))
    one = pld.from_discrete_gaussian_mechanism(sigma=2.0 ** params[0], sensitivity=shift, sampling_prob=q_u / 1e6)
    reference = one.self_compose(rounds).get_epsilon_for_delta(delta)
    assert reference <= ours <= 2 * reference + 0.1


def test_a_history_of_gaussian_charges_is_the_policys_accountant_unchanged():
    history = [(10_000, 1_100_000, 40), (10_000, 900_000, 10)]
    charges = [_charge("gaussian", q, s, t) for q, s, t in history]
    for accountant in ("rdp", "pld"):
        assert families.epsilon_u(accountant, 10**7, charges) == spend_epsilon_u(accountant, 10**7, history)
    assert families.epsilon_u("rdp", 10**7, []) == 0


def test_a_mixed_history_is_composed_in_rdp():
    """Gaussian then discrete-Gaussian: at least either alone, and what dp-accounting converts from the summed
    curves."""
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    params = (12, 40, 10_000)
    g, dg = _charge("gaussian", 10_000, 1_000_000, 100), _charge("discrete-gaussian", 10_000, 1_000_000, 100, params)
    both = families.epsilon([g, dg], 1e-5)
    assert both > families.epsilon([dg], 1e-5)
    total = 100 * _rdp_curve(0.01, 1.0) + 100 * families.step_rdp("discrete-gaussian", 10_000, 1_000_000, params)
    assert both == pytest.approx(rdp.compute_epsilon(ORDERS, total, 1e-5)[0], rel=1e-12)
    assert families.epsilon_u("prv", 10**7, [g, dg]) == math.ceil(both * 1e6 - 1e-9) or \
        families.epsilon_u("prv", 10**7, [g, dg]) == math.ceil(both * 1e6)


def test_laplace_alone_takes_the_smaller_of_pure_and_rdp():
    params = (12, 40, 100)
    charges = [_charge("laplace", 10_000, 3_000_000, 500, params)]
    eps0 = families.laplace_pure_epsilon(params, 3_000_000)
    pure = 500 * math.log1p(0.01 * math.expm1(eps0))
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    via_rdp = rdp.compute_epsilon(ORDERS, 500 * families.step_rdp("laplace", 10_000, 3_000_000, params), 1e-5)[0]
    assert families.epsilon(charges, 1e-5) == pytest.approx(min(pure, via_rdp), rel=1e-12)
    assert eps0 > 1 / 3  # 1/σ plus the rounding's share


def test_the_quantised_sensitivity_follows_the_recorded_multiplier():
    """More noise claimed, smaller span and smaller Δ₂; the rounding's overhead shrinks as 2^b grows."""
    low, high = families.Lattice((10, 40, 1000)), families.Lattice((16, 40, 1000))
    assert low.l2(2_000_000) < low.l2(1_000_000)
    assert high.l2(1_000_000) / high.span(1_000_000) < low.l2(1_000_000) / low.span(1_000_000)
    assert high.span(1_000_000) >= 2 ** 16


@pytest.mark.parametrize("bad", [
    Charge(family="binomial", sampling_rate_u=1, noise_multiplier_u=1, rounds=1),
    Charge(family="skellam", sampling_rate_u=1, noise_multiplier_u=1, rounds=1, params=(1, 2)),
    Charge(family="skellam", sampling_rate_u=1, noise_multiplier_u=1, rounds=1, params=(0, 40, 5)),
    Charge(family="gaussian", sampling_rate_u=1, noise_multiplier_u=1, rounds=1, params=(1,)),
    Charge(family="laplace", sampling_rate_u=2_000_000, noise_multiplier_u=1, rounds=1, params=(8, 40, 5)),
    Charge(family="laplace", sampling_rate_u=1, noise_multiplier_u=0, rounds=1, params=(8, 40, 5)),
])
def test_malformed_charges_are_refused(bad):
    with pytest.raises(ValueError):
        families.epsilon_u("rdp", 10**7, [bad])


@pytest.mark.parametrize("eps0", [1e-6, 0.3, 1.0, 1.5, 40.0, 709.0, 800.0, 5000.0])
@pytest.mark.parametrize("q", [1e-6, 0.01, 0.5, 1.0])
def test_the_subsampled_pure_epsilon_is_stable_at_any_epsilon(eps0, q):
    """log(1 + q(e^ε₀ − 1)) against mpmath at 200 bits: no overflow past ε₀ = 709, and no cancellation."""
    import mpmath

    with mpmath.workprec(200):
        exact = float(mpmath.log(1 + mpmath.mpf(q) * (mpmath.exp(mpmath.mpf(eps0)) - 1)))
    assert families.subsampled_pure_epsilon(eps0, q) == pytest.approx(exact, rel=1e-13)


def test_a_huge_laplace_epsilon_is_charged_not_raised():
    params = (16, 40, 1000)
    charge = _charge("laplace", 10_000, 1_000, 3, params)
    eps0 = families.laplace_pure_epsilon(params, 1_000)
    assert eps0 > 709
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    pure = 3 * families.subsampled_pure_epsilon(eps0, 0.01)
    via_rdp = rdp.compute_epsilon(ORDERS, 3 * families.step_rdp("laplace", 10_000, 1_000, params), 1e-5)[0]
    assert families.epsilon([charge], 1e-5) == pytest.approx(min(pure, via_rdp), rel=1e-12)
    # one step sampled (probability q = 0.01 ≫ δ) leaks about ε₀ + ln q
    assert families.epsilon_u("rdp", 10**7, [charge]) >= (eps0 + math.log(0.01) - 1) * 1e6


@pytest.mark.parametrize("call", [
    lambda: families.discrete_gaussian_rdp(ORDERS, 1.0, 0.0),
    lambda: families.discrete_gaussian_rdp(ORDERS, 1.0, -1.0),
    lambda: families.discrete_gaussian_rdp(ORDERS, 1.0, math.nan),
    lambda: families.discrete_gaussian_rdp(ORDERS, -1.0, 1.0),
    lambda: families.skellam_rdp(ORDERS, 1.0, 1.0, 0.0),
    lambda: families.skellam_rdp(ORDERS, 1.0, 1.0, -4.0),
    lambda: families.pure_rdp(ORDERS, -0.5),
    lambda: families.pure_rdp(ORDERS, math.inf),
    lambda: families.poisson_subsampled_rdp(ORDERS, 0.0, lambda a: a / 2),
    lambda: families.poisson_subsampled_rdp(ORDERS, -0.1, lambda a: a / 2),
    lambda: families.poisson_subsampled_rdp(ORDERS, 1.5, lambda a: a / 2),
    lambda: families.poisson_subsampled_rdp(ORDERS, math.nan, lambda a: a / 2),
    lambda: families.subsampled_pure_epsilon(1.0, 0.0),
    lambda: families.subsampled_pure_epsilon(1.0, 1.01),
    lambda: families.subsampled_pure_epsilon(-1.0, 0.5),
    lambda: families.step_rdp("discrete-gaussian", 0, 1_000_000, (8, 40, 5)),
    lambda: families.step_rdp("laplace", 1_000_001, 1_000_000, (8, 40, 5)),
    lambda: families.step_rdp("skellam", 10_000, 0, (8, 40, 5)),
    lambda: families.step_rdp("gaussian", 10_000, -1, ()),
    lambda: families.step_rdp("skellam", 10_000, 1_000_000, (families.SKELLAM_MAX_BITS + 1, 40, 5)),
])
def test_every_family_curve_refuses_a_non_positive_noise_or_a_rate_outside_0_1(call):
    with pytest.raises(ValueError):
        call()
