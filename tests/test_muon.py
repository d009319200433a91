"""DP-Muon's orthogonalization and its privacy charge."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from govtrain.accounting.accountants import Bucket, get_accountant  # noqa: E402
from govtrain.mechanisms.muon import (QUINTIC, QUINTIC_STEPS, DPMuon, joint_noise_multiplier, newton_schulz,  # noqa: E402
                                      ns_coefficients, orient, quintic, unit_clip_norms, unorient)


def well_conditioned(rows: int, cols: int, seed: int, condition: float = 4.0, scale: float = 7.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    U, _ = torch.linalg.qr(torch.randn(rows, k, generator=generator, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(cols, k, generator=generator, dtype=torch.float64))
    return scale * (U * torch.linspace(1.0, condition, k, dtype=torch.float64)) @ V.T


def test_the_polynomial_is_the_taylor_series_of_the_inverse_square_root():
    assert ns_coefficients(3) == [1.0, 0.5, 0.375, 0.3125]
    for kappa in (1, 2, 4, 8):
        p = sum(c * (1 - 0.9) ** s for s, c in enumerate(ns_coefficients(kappa)))
        assert abs(p - 0.9 ** -0.5) < 0.1 ** (kappa + 1)
    with pytest.raises(ValueError):
        ns_coefficients(0)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(2, 40), cols=st.integers(2, 40), seed=st.integers(0, 1000),
       scale=st.sampled_from([0.5, 1.0, 30.0]))
def test_newton_schulz_brings_every_singular_value_of_a_well_conditioned_matrix_to_one(rows, cols, seed, scale):
    X = well_conditioned(rows, cols, seed, scale=scale * math.sqrt(min(rows, cols)))
    out = newton_schulz(X, kappa=3, steps=8)
    assert out.shape == X.shape
    assert float((torch.linalg.svdvals(out) - 1).abs().max()) < 1e-2
    # it is the polar factor U Vᵀ of X
    U, _, Vh = torch.linalg.svd(X, full_matrices=False)
    assert torch.allclose(out, U @ Vh, atol=2e-2)


@pytest.mark.parametrize("shape", [(8, 384), (384, 8), (33, 20), (20, 33)])
def test_the_defaults_orthogonalize_lora_shaped_factors(shape):
    X = well_conditioned(*shape, seed=1)
    out = DPMuon({}, lr=1.0).orthogonalize(X)  # the run's defaults: kappa 3, 6 iterations
    assert float((torch.linalg.svdvals(out) - 1).abs().max()) < 1e-2


@pytest.mark.parametrize("shape", [(3, 7), (7, 3), (5, 5)])
def test_orientation_round_trips_for_tall_and_wide_matrices(shape):
    X = torch.randn(*shape, dtype=torch.float64)
    assert orient(X).shape[0] <= orient(X).shape[1]
    assert torch.equal(unorient(orient(X), X.shape), X)
    # orthogonalizing the transpose is the transpose of orthogonalizing
    assert torch.allclose(newton_schulz(X.T, 2, 5), newton_schulz(X, 2, 5).T, atol=1e-12)


def test_rows_and_columns_no_class_reaches_stay_zero():
    X = well_conditioned(6, 10, seed=2)
    X[[1, 4]] = 0  # rows of a heads profile's parameter that the class does not reach
    assert float(newton_schulz(X, 3, 6)[[1, 4]].abs().max()) == 0
    Y = well_conditioned(10, 6, seed=3)
    Y[:, [0, 5]] = 0
    assert float(newton_schulz(Y, 3, 6)[:, [0, 5]].abs().max()) == 0
    assert float(quintic(Y)[:, [0, 5]].abs().max()) == 0


def test_quintic_is_torch_optim_muons_own_iteration():
    """A step of torch.optim.Muon (no momentum, no decay, no lr adjustment for a wide matrix) moves the
    parameter by −lr · its quintic iteration, computed in bfloat16; ours runs in float32."""
    assert QUINTIC == (3.4445, -4.775, 2.0315) and QUINTIC_STEPS == 5
    X = well_conditioned(8, 48, seed=4).float()
    param = torch.nn.Parameter(torch.zeros(8, 48))
    param.grad = X.clone()
    torch.optim.Muon([param], lr=1.0, weight_decay=0.0, momentum=0.0, nesterov=False).step()
    expected = -param.detach()
    ours = quintic(X)
    assert float((ours - expected).norm() / expected.norm()) < 2e-2
    values = torch.linalg.svdvals(ours)
    assert 0.5 < float(values.min()) and float(values.max()) < 1.5  # spread around 1, by design


def test_heavy_ball_momentum_and_the_step():
    param = torch.nn.Parameter(torch.zeros(4, 6, dtype=torch.float64))
    muon = DPMuon({"w": param}, lr=0.1, momentum=0.5, kappa=3, steps=8)
    g1, g2 = well_conditioned(4, 6, 5), well_conditioned(4, 6, 6)
    param.grad = g1.clone()
    muon.step()
    assert param.grad is None
    param.grad = g2.clone()
    muon.step()
    expected = -0.1 * (newton_schulz(g1, 3, 8) + newton_schulz(0.5 * g1 + g2, 3, 8))
    assert torch.allclose(param.detach(), expected, atol=1e-12)
    restored = DPMuon({"w": param}, lr=0.1, momentum=0.5)
    restored.load_state_dict(muon.state_dict())
    assert torch.equal(restored.state["w"], 0.5 * g1 + g2)


# -- the charge ---------------------------------------------------------------------------------------

def test_matrices_clipped_separately_are_one_mechanism_with_the_documented_multiplier():
    sigma, L, C = 1.2, 9, 0.8
    # govtrain: each of L matrices clipped to C/sqrt(L), every coordinate noised at sigma*C (= sigma*||C||_2)
    shares = unit_clip_norms(C, L)
    assert math.sqrt(sum(c * c for c in shares)) == pytest.approx(C)
    assert joint_noise_multiplier(shares, [sigma * C] * L) == pytest.approx(sigma)
    # the seed's rule read literally: each matrix clipped to C_W and noised at sigma*C_W is sigma/sqrt(L)
    assert joint_noise_multiplier([C] * L, [sigma * C] * L) == pytest.approx(sigma / math.sqrt(L))
    # and that is a real difference in epsilon, which charging sigma would hide
    rdp = get_accountant("rdp")
    honest = rdp.epsilon([Bucket(0.01, sigma / math.sqrt(L), 200)], 1e-5).epsilon
    understated = rdp.epsilon([Bucket(0.01, sigma, 200)], 1e-5).epsilon
    assert honest > 3 * understated


def test_joint_noise_multiplier_refuses_nonsense():
    for clips, stds in (([], []), ([1.0], [1.0, 2.0]), ([1.0], [0.0]), ([-1.0], [1.0])):
        with pytest.raises(ValueError):
            joint_noise_multiplier(clips, stds)
    with pytest.raises(ValueError):
        unit_clip_norms(1.0, 0)
