"""PRISM's tangent-space algebra against explicit m × n oracles (float64), and its optimizer."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from govtrain.mechanisms import tangent_space  # noqa: E402
from govtrain.mechanisms.prism import Prism, floored_inverse_sqrt  # noqa: E402
from govtrain.mechanisms.retraction import align, retract  # noqa: E402
from govtrain.mechanisms.tangent_space import (canonical, gram, intrinsic_sq_norm, tangent_dimension,  # noqa: E402
                                               tangent_lift, tangent_matrix, tangent_noise)
from govtrain.resolver import reach  # noqa: E402

F64 = torch.float64


def factors(m: int, n: int, r: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(m, r, generator=generator, dtype=F64), torch.randn(n, r, generator=generator, dtype=F64),
            generator)


def projections(A, B):
    """Π_A and Π_B formed explicitly (the oracle; the library never forms them)."""
    return A @ torch.linalg.pinv(A.T @ A) @ A.T, B @ torch.linalg.pinv(B.T @ B) @ B.T


def tangent_projection(A, B, G):
    PA, PB = projections(A, B)
    return PA @ G + G @ PB - PA @ G @ PB


shapes = st.tuples(st.integers(2, 9), st.integers(2, 9), st.integers(1, 4)).filter(lambda s: s[2] <= min(s[0], s[1]))


@settings(max_examples=40, deadline=None)
@given(shape=shapes, batch=st.integers(1, 4), seed=st.integers(0, 10_000))
def test_the_lift_represents_the_tangent_projection_of_the_ambient_gradient(shape, batch, seed):
    m, n, r = shape
    A, B, generator = factors(m, n, r, seed)
    G = torch.randn(batch, m, n, generator=generator, dtype=F64)
    dA, dB = tangent_lift(A, B, G @ B, G.transpose(1, 2) @ A)  # factor gradients gA = G B, gB = Gᵀ A
    assert dA.shape == (batch, m, r) and dB.shape == (batch, n, r)
    P = tangent_projection(A, B, G)
    assert torch.allclose(tangent_matrix(A, B, dA, dB), P, atol=1e-5 * max(1.0, float(P.abs().max())))
    # the trace formula is the Frobenius norm of dZ, without forming it
    assert torch.allclose(intrinsic_sq_norm(A, B, dA, dB), P.pow(2).sum((1, 2)), rtol=1e-8, atol=1e-8)


@settings(max_examples=30, deadline=None)
@given(shape=shapes, seed=st.integers(0, 10_000), scale=st.floats(-2, 2))
def test_a_change_of_gauge_changes_nothing_prism_releases(shape, seed, scale):
    m, n, r = shape
    A, B, generator = factors(m, n, r, seed)
    R = torch.randn(r, r, generator=generator, dtype=F64) + 3 * torch.eye(r, dtype=F64)
    R = R * 10 ** scale  # also a pure rescaling (A c, B / c) of several orders of magnitude
    A2, B2 = A @ R, B @ torch.linalg.inv(R).T
    assert torch.allclose(A2 @ B2.T, A @ B.T, atol=1e-9)  # the same Z
    G = torch.randn(5, m, n, generator=generator, dtype=F64)
    clip = 0.7
    released = []
    for a, b in ((A, B), (A2, B2)):
        dA, dB = tangent_lift(a, b, G @ b, G.transpose(1, 2) @ a)
        norms = intrinsic_sq_norm(a, b, dA, dB).sqrt()
        coefficients = torch.clamp(clip / norms, max=1.0)
        released.append((norms, coefficients, tangent_matrix(a, b, dA, dB)))
    (n1, c1, z1), (n2, c2, z2) = released
    assert torch.allclose(n1, n2, rtol=1e-6) and torch.allclose(c1, c2, rtol=1e-6)
    assert torch.allclose(z1, z2, atol=1e-6 * max(1.0, float(z1.abs().max())))


def test_plain_dp_sgd_on_the_factors_is_not_gauge_invariant():
    """The problem PRISM solves (seed 000 in docs/design.md, its Issue I): (cA, B/c) is the same Z,
    but the factor-space norm ‖gA‖² + ‖gB‖² that DP-SGD clips drifts with c; PRISM's intrinsic norm does not."""
    A, B, generator = factors(7, 5, 2, 0)
    G = torch.randn(7, 5, generator=generator, dtype=F64)
    factor_norms, intrinsic = [], []
    for c in (0.1, 1.0, 10.0):
        a, b = A * c, B / c
        gA, gB = G @ b, G.T @ a
        factor_norms.append(float(gA.pow(2).sum() + gB.pow(2).sum()))
        intrinsic.append(float(intrinsic_sq_norm(a, b, *tangent_lift(a, b, gA, gB))))
    assert max(factor_norms) / min(factor_norms) > 50
    assert max(intrinsic) / min(intrinsic) == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("m, n, r", [(12, 9, 3), (30, 8, 4)])
def test_tangent_noise_has_energy_r_m_plus_n_minus_r_and_lies_in_the_tangent_space(m, n, r):
    A, B, generator = factors(m, n, r, 1)
    PA, PB = projections(A, B)
    std, draws = 0.5, 4000
    energies, worst_normal = [], 0.0
    direction = tangent_projection(A, B, torch.randn(m, n, generator=generator, dtype=F64))
    direction /= direction.norm()  # a unit tangent vector: isotropy means unit variance along it
    along = []
    for _ in range(draws):
        xi_A, xi_B = tangent_noise(A, B, std, generator)
        dZ = tangent_matrix(A, B, xi_A, xi_B)
        energies.append(float(intrinsic_sq_norm(A, B, xi_A, xi_B)))
        worst_normal = max(worst_normal, float(((torch.eye(m, dtype=F64) - PA) @ dZ @ (torch.eye(n, dtype=F64) - PB))
                                               .abs().max()))
        along.append(float((dZ * direction).sum()))
    expected = std ** 2 * tangent_dimension(m, n, r)
    assert tangent_dimension(m, n, r) == r * (m + n - r)
    assert abs(sum(energies) / draws - expected) <= 0.03 * expected
    assert worst_normal < 1e-10
    assert abs(torch.tensor(along, dtype=F64).std().item() - std) <= 0.05 * std


def test_the_canonical_lift_of_the_noise_is_the_same_tangent_vector():
    A, B, generator = factors(10, 6, 3, 2)
    xi_A, xi_B = tangent_noise(A, B, 1.0, generator)
    cA, cB = canonical(A, B, xi_A, xi_B)
    assert torch.allclose(tangent_matrix(A, B, cA, cB), tangent_matrix(A, B, xi_A, xi_B), atol=1e-10)
    # and the canonical lift of a lift is itself (it is a projection onto the horizontal pairs)
    G = torch.randn(10, 6, generator=generator, dtype=F64)
    dA, dB = tangent_lift(A, B, G @ B, G.T @ A)
    again = canonical(A, B, dA, dB)
    assert torch.allclose(again[0], dA, atol=1e-10) and torch.allclose(again[1], dB, atol=1e-10)


@settings(max_examples=30, deadline=None)
@given(shape=shapes, seed=st.integers(0, 10_000), step=st.floats(-2, 2))
def test_the_retraction_is_the_best_rank_r_approximation_with_balanced_factors(shape, seed, step):
    m, n, r = shape
    A, B, generator = factors(m, n, r, seed)
    G = torch.randn(m, n, generator=generator, dtype=F64)
    dA, dB = tangent_lift(A, B, G @ B, G.T @ A)
    new_A, new_B = retract(A, B, dA, dB, step)
    assert new_A.shape == (m, r) and new_B.shape == (n, r)
    target = A @ B.T + step * tangent_matrix(A, B, dA, dB)
    U, S, Vh = torch.linalg.svd(target)
    best = (U[:, :r] * S[:r]) @ Vh[:r]
    result = new_A @ new_B.T
    assert int(torch.linalg.matrix_rank(result)) <= r
    assert torch.allclose(result, best, atol=1e-8 * max(1.0, float(S[0])))
    assert torch.allclose(new_A.T @ new_A, new_B.T @ new_B, atol=1e-8 * max(1.0, float(S[0])))  # balanced


def test_peft_initialization_a_zero_factor_is_handled_by_pseudo_inverses():
    """peft starts lora_B (A here) at zero: the first step is the gradient seen through B, dZ = G Π_B,
    the noise is std·Ξ Π_B, and the retraction reaches rank r from Z = 0."""
    _, B, generator = factors(8, 6, 2, 3)
    A = torch.zeros(8, 2, dtype=F64)
    G = torch.randn(8, 6, generator=generator, dtype=F64)
    _, PB = projections(B, B)
    dA, dB = tangent_lift(A, B, G @ B, G.T @ A)
    assert torch.allclose(tangent_matrix(A, B, dA, dB), G @ PB, atol=1e-12) and float(dB.abs().max()) == 0
    xi_A, xi_B = tangent_noise(A, B, 1.0, generator)
    assert float(xi_B.abs().max()) == 0
    new_A, new_B = retract(A, B, dA, dB, -0.5)
    assert torch.allclose(new_A @ new_B.T, -0.5 * G @ PB, atol=1e-12)
    assert int(gram(new_A).rank) == 2


def test_the_floored_preconditioner_raises_small_eigenvalues_and_caps_the_condition_number():
    Q, _ = torch.linalg.qr(torch.randn(3, 3, generator=torch.Generator().manual_seed(0), dtype=F64))
    V = Q @ torch.diag(torch.tensor([1e-9, 1e-3, 4.0], dtype=F64)) @ Q.T
    P = floored_inverse_sqrt(V, floor=1e-2, max_condition=1e6, eps=0.0)
    assert torch.allclose(torch.linalg.eigvalsh(P).sort().values, torch.tensor([0.5, 10.0, 10.0], dtype=F64))
    P = floored_inverse_sqrt(V, floor=0.0, max_condition=100.0, eps=0.0)  # 4 / 100: the cap binds
    assert torch.allclose(torch.linalg.eigvalsh(P).sort().values, torch.tensor([0.5, 5.0, 5.0], dtype=F64))


def test_alignment_keeps_z_and_the_balance():
    A, B, generator = factors(9, 7, 3, 4)
    Q, _ = torch.linalg.qr(torch.randn(3, 3, generator=generator, dtype=F64))
    aligned_A, aligned_B = align(A @ Q, B @ Q, A, B)
    assert torch.allclose(aligned_A, A, atol=1e-10) and torch.allclose(aligned_B, B, atol=1e-10)


def test_prism_descends_to_a_low_rank_target_without_noise():
    """An oracle for the whole update: with no noise, PRISM's steps fit Z = ABᵀ to a rank-2 target from
    peft's start (A = 0), through the pseudo-inverse regime, keeping the factors balanced and rank ≤ r."""
    generator = torch.Generator().manual_seed(5)
    m, n, r = 20, 15, 2
    target = torch.randn(m, r, generator=generator, dtype=F64) @ torch.randn(r, n, generator=generator, dtype=F64)
    lora_B = torch.nn.Parameter(torch.zeros(m, r, dtype=F64))  # A
    lora_A = torch.nn.Parameter(torch.randn(r, n, generator=generator, dtype=F64) / math.sqrt(n))  # Bᵀ
    optimizer = Prism({"pair": (lora_A, lora_B)}, lr=0.05, floor=0.0)
    start = float((lora_B @ lora_A - target).detach().norm())
    for _ in range(300):
        loss = 0.5 * (lora_B @ lora_A - target).pow(2).sum()
        lora_A.grad, lora_B.grad = None, None
        gA, gB = torch.autograd.grad(loss, [lora_B, lora_A])
        dA, dB = tangent_lift(lora_B.detach(), lora_A.detach().T, gA, gB.T)
        lora_B.grad, lora_A.grad = dA, dB.T
        optimizer.step({"pair": 0.0})
        assert lora_A.grad is None and lora_B.grad is None
    final = float((lora_B @ lora_A - target).detach().norm())
    assert final < 1e-2 * start
    A, B = lora_B.detach(), lora_A.detach().T
    assert torch.allclose(A.T @ A, B.T @ B, atol=1e-8 * float((A.T @ A).norm()))
    state = optimizer.state_dict()
    again = Prism({"pair": (lora_A, lora_B)}, lr=0.05)
    again.load_state_dict(state)
    assert again.state["pair"]["step"] == 300


def test_the_floor_keeps_a_pure_noise_step_from_being_whitened_to_unit_scale():
    """Feed PRISM gradients that are pure tangent noise of std τ: unfloored, the preconditioner divides
    by √(noise variance) and every step has the same size whatever τ is (the noise is "learned"); floored
    at the noise's own level, the step shrinks as the noise grows relative to the (here absent) signal."""
    def step_size(tau: float, floor: float) -> float:
        generator = torch.Generator().manual_seed(6)
        lora_B = torch.nn.Parameter(torch.randn(16, 3, generator=generator, dtype=F64))
        lora_A = torch.nn.Parameter(torch.randn(3, 12, generator=generator, dtype=F64))
        optimizer = Prism({"p": (lora_A, lora_B)}, lr=0.01, floor=floor, betas=(0.0, 0.0))
        A, B = lora_B.detach().clone(), lora_A.detach().T.clone()
        xi_A, xi_B = canonical(A, B, *tangent_noise(A, B, tau, generator))
        lora_B.grad, lora_A.grad = xi_A, xi_B.T
        optimizer.step({"p": tau})
        return float((lora_B.detach() @ lora_A.detach() - A @ B.T).norm())

    assert step_size(1e-3, 0.0) == pytest.approx(step_size(1.0, 0.0), rel=1e-4)  # whitened: τ is invisible
    assert step_size(1.0, 4.0) < 0.7 * step_size(1.0, 0.0)


def test_lora_pairs_finds_both_factors_of_each_module_and_adapter():
    names = ["m.layer.0.attention.self.query.lora_A.default.weight", "m.layer.0.attention.self.query.lora_B.default.weight",
             "m.layer.0.attention.self.query.lora_A.own.weight", "m.layer.0.attention.self.query.lora_B.own.weight",
             "m.layer.1.attention.self.value.lora_A.default.weight",  # its lora_B is frozen: no pair
             "m.classifier.modules_to_save.default.weight"]
    assert reach.lora_pairs(names) == {names[1]: names[0], names[3]: names[2]}


@settings(max_examples=30, deadline=None)
@given(shape=shapes, batch=st.integers(1, 4), seed=st.integers(0, 10_000), zero=st.booleans())
def test_the_norm_from_factor_gradients_equals_the_norm_of_the_lift(shape, batch, seed, zero):
    m, n, r = shape
    A, B, generator = factors(m, n, r, seed)
    if zero:
        A = torch.zeros_like(A)  # peft's start
    G = torch.randn(batch, m, n, generator=generator, dtype=F64)
    gA, gB = G @ B, G.transpose(1, 2) @ A
    expected = tangent_projection(A, B, G).pow(2).sum((1, 2))
    assert torch.allclose(tangent_space.projected_sq_norm(A, B, gA, gB), expected, rtol=1e-8, atol=1e-9)
    assert torch.allclose(intrinsic_sq_norm(A, B, *tangent_lift(A, B, gA, gB)), expected, rtol=1e-8, atol=1e-9)


def test_a_prism_step_depends_on_z_alone_under_orthogonal_gauges():
    """The privatized input is gauge-invariant; the r × r preconditioner is equivariant under orthogonal
    changes of gauge (the retraction returns balanced factors, which fixes the gauge up to O(r)): the same
    Z and the same ambient gradient give the same next Z."""
    generator = torch.Generator().manual_seed(8)
    A, B = torch.randn(10, 3, generator=generator, dtype=F64), torch.randn(7, 3, generator=generator, dtype=F64)
    G = torch.randn(10, 7, generator=generator, dtype=F64)
    Q, _ = torch.linalg.qr(torch.randn(3, 3, generator=generator, dtype=F64))
    results = []
    for a, b in ((A, B), (A @ Q, B @ Q)):
        lora_B, lora_A = torch.nn.Parameter(a.clone()), torch.nn.Parameter(b.T.clone())
        optimizer = Prism({"p": (lora_A, lora_B)}, lr=0.05, floor=1.0)
        for _ in range(3):
            dA, dB = tangent_lift(lora_B.detach(), lora_A.detach().T, G @ lora_A.detach().T, G.T @ lora_B.detach())
            lora_B.grad, lora_A.grad = dA, dB.T
            optimizer.step({"p": 0.1})
        results.append(lora_B.detach() @ lora_A.detach())
    assert torch.allclose(results[0], results[1], atol=1e-9)
