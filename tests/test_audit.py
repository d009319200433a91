"""The empirical privacy audit in CI (docs/auditing.md): an honest white-box audit through the governed path certifies
a clearly positive ε that never exceeds what the ledger claims, and a broken mechanism is caught.

The honest and the noise-off runs are the CI pair (about 40 s together on 2 cores); the other three broken runs
are marked slow (CI still runs them: pytest's default options select every marker)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from govtrain.audit.audit import AuditConfig, run_audit  # noqa: E402
from tests import audit_faults  # noqa: E402

# q = 0.5 over ~500 admitted canaries and the real data, 5 steps: the run's Poisson sampler draws every step
HONEST = AuditConfig(mechanism="dpsgd", epsilon=8.0, m=1000, steps=5, q=0.5, seed=0)
BROKEN = AuditConfig(mechanism="dpsgd", epsilon=2.0, m=1000, steps=5, q=0.5, seed=0)
HEAD = "classifier.modules_to_save.default.weight"  # where the head profile's canaries sit


def test_an_honest_white_box_audit_certifies_a_positive_epsilon_below_the_claim(tmp_path: Path):
    result = run_audit(HONEST, tmp_path / "audit")
    bound = result.bound
    assert result.delta < 1 / (2 * HONEST.m) and bound.canaries == HONEST.m >= 1000
    assert 6.0 < result.claimed <= HONEST.epsilon  # the ledger's charge, read back: at most the calibrated target
    assert bound.epsilon_one_run <= result.claimed and bound.epsilon_gdp <= result.claimed
    # not vacuous: measured 2.02 (one-run) and 2.85 (GDP) with this seed; the floor leaves room
    assert bound.epsilon_one_run > 1.0 and bound.epsilon_gdp > 1.5
    # a canary's displacement is its clipped Dirac: the included ones moved up on average, the others did not
    assert result.scores[result.included].mean() > 3 * abs(result.scores[~result.included].mean())


def test_the_audit_fails_a_run_with_the_noise_off(tmp_path: Path):
    with audit_faults.noise_off():
        result = run_audit(BROKEN, tmp_path / "audit")
    assert result.claimed <= BROKEN.epsilon
    assert result.bound.epsilon_one_run > result.claimed  # measured 2.72 against a claim of 1.81
    assert result.bound.epsilon_gdp > result.claimed


@pytest.mark.slow
def test_the_audit_fails_noise_scaled_by_the_realised_batch(tmp_path: Path):
    with audit_faults.noise_over_realised_batch():
        result = run_audit(BROKEN, tmp_path / "audit")
    assert result.bound.epsilon_one_run > result.claimed


@pytest.mark.slow
def test_the_audit_fails_clipping_skipped_for_the_canaries_layer(tmp_path: Path):
    with audit_faults.clipping_skipped_for(HEAD):
        result = run_audit(BROKEN, tmp_path / "audit")
    assert result.bound.epsilon_one_run > result.claimed


@pytest.mark.slow
def test_the_audit_sees_a_contribution_charged_at_the_wrong_q(tmp_path: Path):
    """The ledger charges q = 0.05; the broken sampler draws at 0.5. The honest run at q = 0.05 certifies about
    nothing; the broken one certifies far more than it, and more than the claim."""
    config = AuditConfig(mechanism="dpsgd", epsilon=2.0, m=1000, steps=5, q=0.05, seed=0)
    honest = run_audit(config, tmp_path / "honest")
    with audit_faults.sampled_at(10):
        broken = run_audit(config, tmp_path / "broken")
    assert broken.claimed == honest.claimed
    assert broken.bound.epsilon_gdp > max(2 * honest.bound.epsilon_gdp, honest.bound.epsilon_gdp + 1.0)
    assert max(broken.bound.epsilon_one_run, broken.bound.epsilon_gdp) > broken.claimed
