"""Split inference's mechanism (`govtrain.accounting.gaussian`, `govtrain.inference.mechanism`), against oracles:
the analytic Gaussian's delta in 50-digit arithmetic (mpmath), dp-accounting's own calibration and its PLD
accountant, alone and composed; the paper's properties; clipping and the noise's statistics; the seed's numbers."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from govtrain.accounting import gaussian
from govtrain.errors import Code, InferenceError
from govtrain.inference.mechanism import (MAX_EPSILON, add_noise, check_noise, clip, noise_rng, norm_bounds,
                                          release_for, session_budget)
from govtrain.inference.snr import expected_noise_norm, seed_002_claim
from govtrain.inference.wire import SplitRequest, parse_split_request

mpmath = pytest.importorskip("mpmath")
REPO = Path(__file__).resolve().parents[1]
GRID = [(e, d) for d in (1e-3, 1e-6, 1e-10) for e in (0.05, 0.5, 1.0, 4.0, 16.0, 64.0)]


def exact_delta(epsilon: float, mu: float):
    """Balle & Wang's delta(eps) in 50-digit arithmetic: no cancellation, no overflow."""
    with mpmath.workdps(50):
        eps, mu = mpmath.mpf(epsilon), mpmath.mpf(mu)
        return mpmath.ncdf(mu / 2 - eps / mu) - mpmath.exp(eps) * mpmath.ncdf(-mu / 2 - eps / mu)


# -- calibration ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("epsilon, delta", GRID)
def test_the_analytic_sigma_is_the_smallest_micro_unit_that_meets_delta_exactly(epsilon, delta):
    from dp_accounting.pld import accountant, common

    sigma = gaussian.calibrate_sigma(epsilon, delta, 1.0)
    assert round(sigma * 1e6) / 1e6 == sigma  # micro-units
    assert exact_delta(epsilon, 1 / sigma) <= delta < exact_delta(epsilon, 1 / (sigma - 1e-6))  # rounded up, tight
    theirs = accountant.get_smallest_gaussian_noise(common.DifferentialPrivacyParameters(epsilon, delta), 1, 1.0)
    assert sigma == pytest.approx(theirs, rel=1e-5)  # dp-accounting's calibration, a second source (to its tolerance)


@pytest.mark.parametrize("epsilon, delta", [(e, d) for e, d in GRID if e <= 4])
def test_the_pld_accountant_charges_the_analytic_sigma_at_most_its_epsilon(epsilon, delta):
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant

    sigma = gaussian.calibrate_sigma(epsilon, delta, 1.0)
    pld = pld_privacy_accountant.PLDAccountant()
    pld.compose(dp_event.GaussianDpEvent(sigma), 1)
    charged = pld.get_epsilon(delta)
    # PLD rounds pessimistically (1e-4 discretization): at most a hair above the target, and close below it
    assert epsilon * (1 - 1e-3) <= charged <= epsilon * (1 + 1e-6)


def test_the_float_delta_keeps_its_digits_near_epsilon_zero():
    """Near eps = 0, delta is a small difference of two near-equal terms, and mu/2 - eps/mu and -mu/2 - eps/mu agree
    in most of their digits: subtracting two rounded log Phi's lost up to 1e-7 of delta (at eps 1e-6, delta 1e-12)."""
    for epsilon in (1e-6, 3e-6, 1e-5, 1e-3, 0.1, 1.0, 8.0, 100.0, 1000.0):
        for delta in (0.5, 1e-3, 1e-6, 1e-9, 1e-12):
            for scale in (0.99, 1.0, 1.01):
                mu = 2.0 / (gaussian.analytic_sigma(epsilon, delta, 2.0) * scale)
                exact = exact_delta(epsilon, mu)
                assert abs(gaussian.gaussian_delta(epsilon, mu) - exact) <= 1e-12 * exact, (epsilon, delta, scale)


@pytest.mark.parametrize("epsilon_u, delta_p, sensitivity_u", [(1, 1, 2), (1, 10**6, 2 * 10**6), (10, 1, 2 * 10**6),
                                                               (3, 10**11, 2 * 10**12), (10**9, 1, 2)])
def test_the_calibrated_sigma_is_the_smallest_micro_unit_that_meets_delta_at_the_extremes(epsilon_u, delta_p,
                                                                                        sensitivity_u):
    sigma_u = gaussian.calibrate_sigma_u(epsilon_u, delta_p, sensitivity_u)
    with mpmath.workdps(50):
        def delta_at(sigma_u: int):  # type: ignore[no-untyped-def]
            eps, mu = mpmath.mpf(epsilon_u) / 10**6, mpmath.mpf(sensitivity_u) / sigma_u
            return mpmath.ncdf(mu / 2 - eps / mu) - mpmath.exp(eps) * mpmath.ncdf(-mu / 2 - eps / mu)

        target = mpmath.mpf(delta_p) / 10**12
        assert delta_at(sigma_u) <= target and (sigma_u == 1 or delta_at(sigma_u - 1) > target)


def test_the_analytic_sigma_holds_for_every_epsilon_where_the_classical_one_does_not():
    for epsilon in (0.01, 0.1, 0.5, 0.9, 0.999):
        for delta in (1e-3, 1e-5, 1e-9):
            assert gaussian.calibrate_sigma(epsilon, delta, 1.0) < gaussian.classical_sigma(epsilon, delta)
    # Past epsilon = 1 the classical formula is no theorem, and from about epsilon 8 on it adds too little noise.
    classical = gaussian.classical_sigma(50.0, 1e-5)
    assert exact_delta(50.0, 1 / classical) > 1e-5 and gaussian.calibrate_sigma(50.0, 1e-5, 1.0) > classical
    for epsilon in (100.0, 500.0, MAX_EPSILON):  # e^eps overflows a float from eps = 710: computed in log space
        sigma = gaussian.calibrate_sigma(epsilon, 1e-5, 1.0)
        assert math.isfinite(sigma) and exact_delta(epsilon, 1 / sigma) <= 1e-5
    assert gaussian.gaussian_delta(800.0, 40.0) == pytest.approx(float(exact_delta(800.0, 40.0)), rel=1e-9)


def test_sigma_falls_with_epsilon_and_delta_and_scales_with_sensitivity():
    epsilons = [0.05, 0.1, 0.3, 1.0, 2.0, 5.0, 10.0, 40.0]
    for delta in (1e-4, 1e-8):
        sigmas = [gaussian.analytic_sigma(e, delta) for e in epsilons]
        assert all(a > b for a, b in zip(sigmas, sigmas[1:]))
    for epsilon in (0.5, 4.0):
        sigmas = [gaussian.analytic_sigma(epsilon, d) for d in (1e-10, 1e-7, 1e-4, 1e-2)]
        assert all(a > b for a, b in zip(sigmas, sigmas[1:]))
    assert gaussian.analytic_sigma(1.0, 1e-6, 3.0) == pytest.approx(3 * gaussian.analytic_sigma(1.0, 1e-6), rel=1e-11)


def test_gdp_epsilon_inverts_the_calibration():
    for epsilon, delta in GRID:
        sigma = gaussian.calibrate_sigma(epsilon, delta, 2.0)
        # sigma was rounded up, so the epsilon it gives is a hair less than asked for
        assert epsilon * (1 - 1e-4) <= gaussian.gdp_epsilon(2.0 / sigma, delta) <= epsilon
    assert gaussian.gdp_epsilon(0.0, 1e-5) == 0.0 and gaussian.gdp_epsilon_u(0, 10) == 0


def test_nonsense_parameters_are_refused_by_the_math():
    for args in [(0.0, 1e-5, 1.0), (-1.0, 1e-5, 1.0), (math.nan, 1e-5, 1.0), (math.inf, 1e-5, 1.0), (1.0, 0.0, 1.0),
                 (1.0, 1.0, 1.0), (1.0, 1e-5, 0.0), (1.0, 1e-5, -2.0)]:
        with pytest.raises(ValueError):
            gaussian.analytic_sigma(*args)
        with pytest.raises(ValueError):
            gaussian.calibrate_sigma(*args)


# -- composition ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 4, 25])
def test_k_requests_at_sigma_are_one_request_at_sigma_over_root_k(k):
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant

    release = release_for(2.0, 1e-6, 1.0)
    composed_u = gaussian.gdp_epsilon_u(k * release.mu_sq, 10**6)
    one_release = gaussian.gdp_epsilon(release.sensitivity_u / (release.sigma_u / math.sqrt(k)), 1e-6)
    assert composed_u / 1e6 == pytest.approx(one_release, rel=1e-6)
    pld = pld_privacy_accountant.PLDAccountant()
    pld.compose(dp_event.GaussianDpEvent(release.sigma / 2.0), k)  # noise multiplier: sigma / Delta, Delta = 2C
    assert pld.get_epsilon(1e-6) == pytest.approx(composed_u / 1e6, rel=2e-3)


def test_mixed_requests_compose_as_pld_composes_them():
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant

    releases = [release_for(e, d, c) for e, d, c in [(0.5, 1e-5, 1.0), (2.0, 1e-7, 3.0), (1.0, 1e-6, 0.25)]]
    ours = gaussian.gdp_epsilon_u(sum(r.mu_sq for r in releases), 10**6) / 1e6
    pld = pld_privacy_accountant.PLDAccountant()
    pld.compose(dp_event.ComposedDpEvent([dp_event.GaussianDpEvent(r.sigma_u / r.sensitivity_u) for r in releases]))
    assert pld.get_epsilon(1e-6) == pytest.approx(ours, rel=2e-3)


def test_exact_composition_against_the_seeds_advanced_composition_and_the_sum():
    """Seed 002: epsilon 1 per request at delta 1e-5, a budget of 10. Exact composition admits 55 requests; summing
    the epsilons admits 10, and the advanced composition theorem (delta' = 1e-5) only 1."""
    release = release_for(1.0, 1e-5, 1.0)
    ks = range(1, 101)
    exact = [gaussian.gdp_epsilon_u(k * release.mu_sq, 10**7) / 1e6 for k in ks]
    advanced = [gaussian.advanced_composition_epsilon(1.0, k, 1e-5) for k in ks]
    assert exact[0] == 1.0 and exact[9] == pytest.approx(3.62, abs=0.01)
    assert advanced[9] == pytest.approx(32.36, abs=0.01)
    assert all(e < a and e <= k for k, e, a in zip(ks, exact, advanced))
    assert sum(e <= 10 for e in exact) == 55 and sum(a <= 10 for a in advanced) == 1
    page = (REPO / "docs" / "split-inference.md").read_text()
    for k in (1, 2, 10, 55, 56, 100):  # the page's table states these numbers
        assert f"| {k} | {exact[k - 1]:.2f} | {advanced[k - 1]:.2f} | {k} |" in page, k


# -- one request: rounding, clipping, noise -------------------------------------------------------------------


def test_a_request_rounds_every_value_toward_privacy_and_crosses_the_wire_exactly():
    release = release_for(1.0000009, 1.9e-12, 0.7000009)
    assert (release.epsilon_u, release.delta_p, release.clip_norm_u) == (1_000_000, 1, 700_000)
    assert release.sensitivity_u == 1_400_000
    assert release.sigma_u == gaussian.calibrate_sigma_u(1_000_000, 1, 1_400_000)
    request = parse_split_request(SplitRequest.of("s", release, [0.5, -0.25]).model_dump_json())
    assert release_for(request.epsilon, request.delta, request.clip_norm) == release
    assert round(request.sigma * 1e6) == release.sigma_u


@pytest.mark.parametrize("epsilon, delta, clip_norm", [
    (0.0, 1e-5, 1.0), (-1.0, 1e-5, 1.0), (math.nan, 1e-5, 1.0), (math.inf, 1e-5, 1.0), (MAX_EPSILON * 2, 1e-5, 1.0),
    (1e-7, 1e-5, 1.0), (True, 1e-5, 1.0), ("1", 1e-5, 1.0), (1.0, 0.0, 1.0), (1.0, 1.0, 1.0), (1.0, 1e-13, 1.0),
    (1.0, -1e-5, 1.0), (1.0, 1e-5, 0.0), (1.0, 1e-5, -1.0), (1.0, 1e-5, 1e-7), (1.0, 1e-5, math.inf),
])
def test_a_request_out_of_range_is_refused_with_its_code(epsilon, delta, clip_norm):
    with pytest.raises(InferenceError) as info:
        release_for(epsilon, delta, clip_norm)
    assert info.value.code is Code.BAD_PRIVACY_REQUEST


def test_a_session_budget_out_of_range_is_refused():
    assert session_budget(8.0000009, 1.0000009e-6).epsilon_u == 8_000_000
    for epsilon, delta in [(0.0, 1e-6), (-3.0, 1e-6), (math.inf, 1e-6), (1e9, 1e-6), (8.0, 0.0), (8.0, 1.0)]:
        with pytest.raises(InferenceError) as info:
            session_budget(epsilon, delta)
        assert info.value.code is Code.BAD_PRIVACY_REQUEST


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=64), st.floats(1e-3, 1e3))
def test_clipping_bounds_the_norm_and_keeps_the_direction(values, clip_norm):
    vector = np.array(values)
    clipped = clip(vector, clip_norm)
    norm = np.linalg.norm(vector)
    assert np.linalg.norm(clipped) <= clip_norm  # the oracle: inside the ball, always
    if norm <= clip_norm:
        assert np.array_equal(clipped, vector)
    else:
        assert np.allclose(clipped, vector * (clip_norm / norm), rtol=1e-12, atol=0)


def test_clipping_refuses_a_state_that_is_not_finite():
    with pytest.raises(InferenceError) as info:
        clip(np.array([1.0, np.nan]), 1.0)
    assert info.value.code is Code.BAD_VECTOR


def test_the_noise_has_the_calibrated_spread_and_comes_from_the_operating_system():
    release = release_for(1.0, 1e-5, 1.0)
    dimension, draws = 384, 200
    clipped = clip(np.full(dimension, 3.0), release.clip_norm)
    noise = np.stack([add_noise(clipped, release, np.random.default_rng(seed)) - clipped for seed in range(draws)])
    n = noise.size
    # Oracle: the sample variance of n normals lies within 6 standard errors (sqrt(2/n)) of sigma^2, the mean
    # within 6 sigma / sqrt(n).
    assert abs(noise.var() / release.sigma ** 2 - 1) < 6 * math.sqrt(2 / n)
    assert abs(noise.mean()) < 6 * release.sigma / math.sqrt(n)
    norms = np.linalg.norm(noise, axis=1)
    assert norms.mean() == pytest.approx(expected_noise_norm(release.sigma, dimension), rel=0.01)
    assert not np.array_equal(noise_rng().normal(size=8), noise_rng().normal(size=8))  # fresh OS entropy each time
    child = "import numpy as np; from govtrain.inference.mechanism import noise_rng; print(noise_rng().normal())"
    runs = {subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout
            for _ in range(2)}
    assert len(runs) == 2  # no fixed seed across processes


def test_honest_vectors_pass_the_noise_check_and_missing_noise_does_not():
    release = release_for(1.0, 1e-5, 1.0)
    rng = np.random.default_rng(7)
    for dimension, less in ((16, 0.05), (384, 0.25)):  # the fewer the dimensions, the looser the chi-square bounds
        low, high = norm_bounds(release, dimension)
        assert 0 < low < release.sigma * math.sqrt(dimension) < high
        for _ in range(300):
            state = rng.normal(size=dimension) * rng.uniform(0.01, 100)
            check_noise(add_noise(clip(state, release.clip_norm), release, rng), release)
        for dishonest in (clip(rng.normal(size=dimension), 1.0),  # no noise at all
                          clip(rng.normal(size=dimension), 1.0) + rng.normal(0, release.sigma * less, dimension),
                          rng.normal(size=dimension) * 1e3 + rng.normal(0, release.sigma, dimension)):  # unclipped
            with pytest.raises(InferenceError) as info:
                check_noise(dishonest, release)
            assert info.value.code is Code.NOISE_IMPLAUSIBLE


# -- seed 002's claim ------------------------------------------------------------------------------------------


def test_seed_002s_numbers_for_minilm():
    claim = seed_002_claim(384, 1.0, 1e-5, 1.0)
    assert claim.sigma_classical == pytest.approx(4.8448, abs=1e-4)  # the seed's sigma
    assert claim.sigma_analytic_seed == pytest.approx(3.7306, abs=1e-4)
    assert claim.sigma_govtrain == pytest.approx(2 * claim.sigma_analytic_seed, abs=2e-6)  # Delta = 2C
    assert claim.noise_norm(claim.sigma_classical) == pytest.approx(94.94, abs=0.01)
    assert claim.snr(claim.sigma_govtrain) == pytest.approx(1 / 146.21, rel=1e-4)
    assert claim.seed_true_epsilon == pytest.approx(1.61, abs=0.01)  # the seed's sigma against any two queries
    assert seed_002_claim(1536).noise_norm(4.8448) == pytest.approx(189.87, abs=0.01)  # the seed's own "~190"
    page = (REPO / "docs" / "split-inference.md").read_text()
    for name, sigma, noise, snr in claim.rows():
        assert re.search(rf"\| {re.escape(name)} \| {sigma:.4f} \| {noise:.1f} \| {snr:.4f} \|", page), name
