"""The empirical privacy audit in CI (docs/auditing.md): an honest white-box audit through the governed path certifies
a clearly positive ε that never exceeds what the ledger claims and does not reject the claimed mechanism, and a
broken mechanism is caught (a bound above the claim, or the claimed curve rejected).

The honest and the noise-off runs are the CI pair (about 40 s together on 2 cores); the other three broken runs
are marked slow (CI still runs them: pytest's default options select every marker)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from govtrain.audit.audit import AuditConfig, run_audit  # noqa: E402
from govtrain.audit.scores import displacement_scores  # noqa: E402
from tests import audit_faults  # noqa: E402

# q = 0.5 over ~500 admitted canaries and the real data, 5 steps: the run's Poisson sampler draws every step
HONEST = AuditConfig(mechanism="dpsgd", epsilon=8.0, m=1000, steps=5, q=0.5, seed=0)
BROKEN = AuditConfig(mechanism="dpsgd", epsilon=2.0, m=1000, steps=5, q=0.5, seed=0)
LAYER = 0  # the adapter profile's canaries: the audit class adapter's LoRA factors, 768 of 1000 in layer 0


def test_an_honest_white_box_audit_certifies_a_positive_epsilon_below_the_claim(tmp_path: Path):
    result = run_audit(HONEST, tmp_path / "audit")
    bound = result.bound
    assert result.delta < 1 / (2 * HONEST.m) and bound.canaries == HONEST.m >= 1000
    assert 6.0 < result.claimed <= HONEST.epsilon  # the ledger's charge, read back: at most the calibrated target
    assert result.mechanism.sampling_rate == HONEST.q and result.mechanism.steps == HONEST.steps
    assert bound.epsilon_one_run <= result.claimed and bound.fdp.epsilon <= result.claimed
    assert not bound.fdp.claim_rejected and not result.failed
    assert bound.fdp.noise_multiplier > result.mechanism.noise_multiplier  # only more private members rejected
    # not vacuous: measured 1.78 (one-run) and 2.61 (f-DP family) with this seed and the step score (2.02 and 3.02
    # by displacement); the floor leaves room
    assert bound.epsilon_one_run > 1.0 and bound.fdp.epsilon > 1.5
    # a canary's displacement is its clipped Dirac: the included ones moved up on average, the others did not
    moved = displacement_scores(result.released)
    assert moved[result.included].mean() > 3 * abs(moved[~result.included].mean())
    assert result.released.shape == (HONEST.m, HONEST.steps)


def test_the_audit_fails_a_run_with_the_noise_off(tmp_path: Path):
    with audit_faults.noise_off():
        result = run_audit(BROKEN, tmp_path / "audit")
    assert result.claimed <= BROKEN.epsilon
    assert result.bound.epsilon_one_run > result.claimed  # measured 2.72 against a claim of 1.81 (f-DP family: 4.47)
    assert result.bound.fdp.claim_rejected and result.bound.fdp.epsilon > result.claimed and result.failed
    # with no noise each step releases exactly the clipped Dirac (1 in units of C) where the canary was drawn,
    # and 0 elsewhere: the per-step reading (`AuditResult.released`) is the mechanism's own release
    released = result.released
    assert released.shape == (BROKEN.m, BROKEN.steps)
    assert np.all(np.abs(released[~result.included]) < 1e-3)
    drawn = np.abs(released[result.included] - 1) < 1e-3
    assert np.all(drawn | (np.abs(released[result.included]) < 1e-3))
    assert 0.4 < drawn.mean() < 0.6  # Poisson at q = 0.5


@pytest.mark.long
def test_more_canaries_and_the_step_score_catch_half_the_noise(tmp_path: Path):
    """Issue 34 item 6: noise at half the charged std (true ε 4.36 against a claim of 1.83). Seed 1, which the
    m = 1000 last-iterate audit missed, is caught with m = 10000 canaries scored by their per-step likelihood
    ratio; its honest twin passes."""
    config = replace(BROKEN, m=10000, steps=10, seed=1)
    with audit_faults.noise_scaled(0.5):
        broken = run_audit(config, tmp_path / "broken")
    honest = run_audit(config, tmp_path / "honest")
    assert broken.failed and not honest.failed


@pytest.mark.slow
def test_the_audit_fails_noise_scaled_by_the_realised_batch(tmp_path: Path):
    with audit_faults.noise_over_realised_batch():
        result = run_audit(BROKEN, tmp_path / "audit")
    assert result.bound.epsilon_one_run > result.claimed and result.bound.fdp.claim_rejected


@pytest.mark.slow
def test_the_audit_fails_clipping_skipped_for_a_transformer_layer(tmp_path: Path):
    """Clipping skipped for every parameter of layer 0, the real class's adapter factors there as well as the
    audit class adapter's, where the adapter profile's canaries sit (a fault in a layer the canaries do not reach
    would be invisible: docs/auditing.md)."""
    config = replace(BROKEN, profile="adapter")
    with audit_faults.clipping_skipped_for_layer(LAYER):
        result = run_audit(config, tmp_path / "audit")
    assert result.failed and result.bound.fdp.claim_rejected


@pytest.mark.slow
def test_the_audit_sees_a_contribution_charged_at_the_wrong_q(tmp_path: Path):
    """The ledger charges q = 0.05; the broken sampler draws at 0.5. The honest run at q = 0.05 certifies about
    nothing; the broken one certifies far more than it, and more than the claim."""
    config = AuditConfig(mechanism="dpsgd", epsilon=2.0, m=1000, steps=5, q=0.05, seed=0)
    honest = run_audit(config, tmp_path / "honest")
    with audit_faults.sampled_at(10):
        broken = run_audit(config, tmp_path / "broken")
    assert broken.claimed == honest.claimed and not honest.failed
    assert broken.bound.fdp.epsilon > max(2 * honest.bound.fdp.epsilon, honest.bound.fdp.epsilon + 1.0)
    assert broken.failed and broken.bound.fdp.claim_rejected


@pytest.mark.slow
def test_the_scaled_faults_release_what_they_say(tmp_path: Path):
    """tests/audit_faults.py's parametrised faults, read through the per-step release (units of C): clipping at
    2C with the noise off moves a drawn canary by exactly 2; half the noise leaves an excluded canary's values
    with half the claimed noise multiplier's spread (m = 200, 5 steps: about 500 such values)."""
    small = replace(BROKEN, m=200)
    with audit_faults.noise_scaled(0.0), audit_faults.clip_scaled(2.0):
        clipped = run_audit(small, tmp_path / "clip")
    inside = clipped.released[clipped.included]
    assert np.all((np.abs(inside - 2) < 1e-3) | (np.abs(inside) < 1e-3)) and np.any(np.abs(inside - 2) < 1e-3)
    with audit_faults.noise_scaled(0.5):
        halved = run_audit(small, tmp_path / "half")
    spread = halved.released[~halved.included].std()
    assert 0.85 < spread / (halved.mechanism.noise_multiplier / 2) < 1.15
