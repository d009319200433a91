"""PRISM and DP-Muon move stacks of same-shape pairs and matrices at once: against the per-pair loop.

The oracle is the obvious loop, one pair (one matrix) at a time through the public per-pair functions,
entirely in float64. In float64 the stacked update agrees with it to rounding; in float32 (where the
stacked update does its tall QRs and products in float32) to the tolerances stated at each test.
"""

from __future__ import annotations

import io

import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from govtrain.mechanisms import prism  # noqa: E402
from govtrain.mechanisms.muon import DPMuon, newton_schulz, quintic  # noqa: E402
from govtrain.mechanisms.prism import Prism, floored_inverse_sqrt  # noqa: E402
from govtrain.mechanisms.retraction import align, retract, retract_aligned  # noqa: E402
from govtrain.mechanisms.tangent_space import (canonical, gram, intrinsic_sq_norm, projected_sq_norm,  # noqa: E402
                                               tangent_lift, tangent_noise)
from govtrain.mechanisms.stacking import shape_groups, write  # noqa: E402

F64 = torch.float64
LR, BETAS, FLOOR, MAX_CONDITION, EPS = 0.05, (0.9, 0.99), 1.0, 1e4, 1e-12


# -- the oracle: the per-pair loop, in float64 ----------------------------------------------------------

def reference_prism_step(state: dict, A, B, gA, gB, tau: float):
    """One PRISM step of one pair, as the update read before it was stacked: returns the new (A, B)."""
    A, B, gA, gB = (t.to(F64) for t in (A, B, gA, gB))
    (m, r), n = A.shape, B.shape[0]
    beta1, beta2 = BETAS
    if not state:
        state.update(step=0, m_A=torch.zeros_like(gA), m_B=torch.zeros_like(gB), v_A=gA.new_zeros(r, r),
                     v_B=gA.new_zeros(r, r))
    state["step"] = t = state["step"] + 1
    state["m_A"] = beta1 * state["m_A"] + (1 - beta1) * gA
    state["m_B"] = beta1 * state["m_B"] + (1 - beta1) * gB
    state["v_A"] = beta2 * state["v_A"] + (1 - beta2) * gA.T @ gA / m
    state["v_B"] = beta2 * state["v_B"] + (1 - beta2) * gB.T @ gB / n
    GM, GN = gram(A), gram(B)
    floor_A = FLOOR * tau ** 2 * (1 - 0.75 * r / m) * float(torch.trace(GN.inverse)) / r
    floor_B = FLOOR * tau ** 2 * (1 - 0.75 * r / n) * float(torch.trace(GM.inverse)) / r
    c1, c2 = 1 - beta1 ** t, 1 - beta2 ** t
    U_A = state["m_A"] / c1 @ floored_inverse_sqrt(state["v_A"] / c2, floor_A, MAX_CONDITION, EPS)
    U_B = state["m_B"] / c1 @ floored_inverse_sqrt(state["v_B"] / c2, floor_B, MAX_CONDITION, EPS)
    return align(*retract(A, B, U_A, U_B, -LR), A, B)


# (m, n) of the pairs: three of one shape, two of another, one alone, a square one; r = 3
SHAPES = [(12, 9), (12, 9), (12, 9), (7, 15), (7, 15), (20, 6), (9, 9)]
R = 3


def make_pairs(dtype, seed: int, zero_start: tuple[int, ...] = (1, 4)):
    """lora_A (r × n) and lora_B (m × r) parameters; the pairs in `zero_start` begin as peft does, lora_B = 0."""
    generator = torch.Generator().manual_seed(seed)
    pairs = {}
    for i, (m, n) in enumerate(SHAPES):
        lora_A = torch.randn(R, n, generator=generator, dtype=F64) / n ** 0.5
        lora_B = torch.zeros(m, R, dtype=F64) if i in zero_start else torch.randn(m, R, generator=generator, dtype=F64)
        pairs[f"pair{i}"] = (torch.nn.Parameter(lora_A.to(dtype)), torch.nn.Parameter(lora_B.to(dtype)))
    return pairs


def gradients(factors: dict, generator) -> dict:
    """Privatized-looking gradients at the factors {key: (A, B)}: the canonical lift of an ambient gradient
    plus tangent noise, as (lora_A.grad, lora_B.grad) in float64."""
    out = {}
    for key, (A, B) in factors.items():
        G = torch.randn(A.shape[0], B.shape[0], generator=generator, dtype=F64)
        dA, dB = tangent_lift(A, B, G @ B, G.T @ A)
        xA, xB = canonical(A, B, *tangent_noise(A, B, 0.3, generator))
        out[key] = ((dB + xB).T, dA + xA)
    return out


def factors_of(pairs: dict) -> dict:
    return {k: (lora_B.detach().to(F64), lora_A.detach().to(F64).T) for k, (lora_A, lora_B) in pairs.items()}


def run_both(dtype, steps: int, skip: dict[int, set[str]] | None = None, seed: int = 0):
    """The stacked Prism on `dtype` parameters and the float64 per-pair oracle, fed the same gradients
    (those at the oracle's factors). Returns the parameters, the oracle's factors {key: (A, B)} and states."""
    pairs = make_pairs(dtype, seed)
    reference = factors_of(pairs)
    states: dict[str, dict] = {k: {} for k in pairs}
    optimizer = Prism(pairs, lr=LR, betas=BETAS, floor=FLOOR, max_condition=MAX_CONDITION, eps=EPS)
    generator = torch.Generator().manual_seed(seed + 100)
    taus = {k: 0.01 * (1 + i) for i, k in enumerate(pairs)}  # a different τ per pair: per-pair floors
    for t in range(steps):
        grads = gradients(reference, generator)
        for key, (lora_A, lora_B) in pairs.items():
            if key in (skip or {}).get(t, set()):
                continue  # no gradient this step: neither implementation moves the pair
            lora_A.grad, lora_B.grad = (g.to(dtype) for g in grads[key])
            reference[key] = reference_prism_step(states[key], *reference[key], grads[key][1], grads[key][0].T,
                                                  taus[key])
        optimizer.step(taus)
    return pairs, reference, states, optimizer


def test_the_stacked_prism_step_is_the_per_pair_loop_in_float64():
    pairs, reference, states, optimizer = run_both(F64, steps=4)
    for key, (lora_A, lora_B) in pairs.items():
        A, B = reference[key]
        assert lora_A.grad is None and lora_B.grad is None
        assert torch.allclose(lora_B.detach(), A, rtol=1e-10, atol=1e-12), key
        assert torch.allclose(lora_A.detach(), B.T, rtol=1e-10, atol=1e-12), key
        for field in ("m_A", "m_B", "v_A", "v_B"):
            assert torch.allclose(optimizer.state[key][field], states[key][field], rtol=1e-10, atol=1e-13), (key, field)
        assert optimizer.state[key]["step"] == states[key]["step"] == 4


def test_pairs_that_skip_steps_keep_their_own_step_counts_inside_a_stack():
    """pair1 (peft's zero start) misses step 0 and pair2 step 2: within the (12, 9) stack the pairs then
    carry different step counts, so different bias corrections, and the stack is regrouped twice."""
    pairs, reference, states, optimizer = run_both(F64, steps=4, skip={0: {"pair1"}, 2: {"pair2", "pair6"}})
    assert [optimizer.state[k]["step"] for k in ("pair0", "pair1", "pair2", "pair6")] == [4, 3, 3, 3]
    for key, (lora_A, lora_B) in pairs.items():
        A, B = reference[key]
        assert torch.allclose(lora_B.detach(), A, rtol=1e-10, atol=1e-12), key
        assert torch.allclose(lora_A.detach(), B.T, rtol=1e-10, atol=1e-12), key
        assert states[key]["step"] == optimizer.state[key]["step"]


def test_the_stacked_prism_step_in_float32_follows_the_float64_loop():
    """float32 parameters: the tall QRs and products in float32, the r × r algebra in float64. After three
    steps each factor is within 2e-6 of the float64 loop's, relative to its norm (float32 rounds at 6e-8;
    2.4e-7 was seen; the margin covers other BLAS and LAPACK builds)."""
    pairs, reference, _, _ = run_both(torch.float32, steps=3)
    for key, (lora_A, lora_B) in pairs.items():
        for new, expected in ((lora_B.detach(), reference[key][0]), (lora_A.detach(), reference[key][1].T)):
            assert new.dtype == torch.float32
            assert float((new.to(F64) - expected).norm()) <= 2e-6 * float(expected.norm()), key


def test_a_resumed_prism_continues_exactly_and_an_older_float64_state_loads():
    pairs, _, _, optimizer = run_both(torch.float32, steps=2)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    assert set(saved["state"]["pair0"]) == {"step", "m_A", "m_B", "v_A", "v_B"}
    assert saved["state"]["pair0"]["m_A"].shape == (12, R) and saved["state"]["pair0"]["v_A"].dtype == F64
    twins = {k: (torch.nn.Parameter(a.detach().clone()), torch.nn.Parameter(b.detach().clone())) for k, (a, b) in pairs.items()}
    resumed = Prism(twins, lr=LR, betas=BETAS, floor=FLOOR, max_condition=MAX_CONDITION, eps=EPS)
    resumed.load_state_dict(saved)
    legacy = Prism({k: (torch.nn.Parameter(a.detach().clone()), torch.nn.Parameter(b.detach().clone()))
                    for k, (a, b) in pairs.items()}, lr=LR, betas=BETAS, floor=FLOOR, max_condition=MAX_CONDITION, eps=EPS)
    legacy.load_state_dict({"state": {k: {f: v.to(F64) if isinstance(v, torch.Tensor) else v for f, v in entry.items()}
                                      for k, entry in saved["state"].items()}})  # first moments kept in float64
    generator = torch.Generator().manual_seed(9)
    for _ in range(2):
        grads = gradients(factors_of(pairs), generator)
        for group in (pairs, twins, legacy.pairs):
            for key, (lora_A, lora_B) in group.items():
                lora_A.grad, lora_B.grad = grads[key][0].float(), grads[key][1].float()
        for opt in (optimizer, resumed, legacy):
            opt.step({k: 0.01 for k in pairs})
    for key in pairs:
        assert torch.equal(pairs[key][1].detach(), twins[key][1].detach())
        assert torch.equal(pairs[key][0].detach(), twins[key][0].detach())
        assert torch.allclose(legacy.pairs[key][1].detach(), pairs[key][1].detach(), rtol=1e-5, atol=1e-7)
        assert resumed.state[key]["step"] == legacy.state[key]["step"] == 4


def test_the_state_is_one_entry_per_pair_and_follows_the_stack():
    pairs, _, _, optimizer = run_both(F64, steps=1)
    first = optimizer.state["pair0"]["m_A"].clone()
    generator = torch.Generator().manual_seed(3)
    grads = gradients(factors_of(pairs), generator)
    for key, (lora_A, lora_B) in pairs.items():
        lora_A.grad, lora_B.grad = grads[key]
    optimizer.step({})
    assert not torch.equal(optimizer.state["pair0"]["m_A"], first)  # the entry is a live view of the stack
    assert optimizer.state_dict()["state"].keys() == pairs.keys()


# -- the stacked building blocks against the per-pair ones ---------------------------------------------

shapes = st.tuples(st.integers(2, 9), st.integers(2, 9), st.integers(1, 4)).filter(lambda s: s[2] <= min(s[0], s[1]))


@settings(max_examples=30, deadline=None)
@given(shape=shapes, count=st.integers(1, 4), seed=st.integers(0, 10_000), step=st.floats(-2, 2), zero=st.booleans())
def test_retract_aligned_is_align_of_retract(shape, count, seed, step, zero):
    m, n, r = shape
    generator = torch.Generator().manual_seed(seed)
    A = torch.randn(count, m, r, generator=generator, dtype=F64)
    if zero:
        A[0] = 0  # peft's start
    B = torch.randn(count, n, r, generator=generator, dtype=F64)
    dA = torch.randn(count, m, r, generator=generator, dtype=F64)
    dB = torch.randn(count, n, r, generator=generator, dtype=F64)
    stacked = retract_aligned(A, B, dA, dB, step)
    for i in range(count):
        expected = align(*retract(A[i], B[i], dA[i], dB[i], step), A[i], B[i])
        for got, want in zip(stacked, expected):
            scale = max(1.0, float(want.abs().max()))
            assert torch.allclose(got[i], want, atol=1e-9 * scale), i


def test_retract_and_align_on_a_stack_are_the_per_pair_results():
    generator = torch.Generator().manual_seed(11)
    A, B = torch.randn(5, 10, 3, generator=generator, dtype=F64), torch.randn(5, 8, 3, generator=generator, dtype=F64)
    A[2] = 0
    dA, dB = torch.randn(5, 10, 3, generator=generator, dtype=F64), torch.randn(5, 8, 3, generator=generator, dtype=F64)
    new_A, new_B = retract(A, B, dA, dB, -0.3)
    aligned = align(new_A, new_B, A, B)
    for i in range(5):
        one = retract(A[i], B[i], dA[i], dB[i], -0.3)
        assert torch.allclose(new_A[i] @ new_B[i].T, one[0] @ one[1].T, atol=1e-12)
        for got, want in zip(aligned, align(*one, A[i], B[i])):
            assert torch.allclose(got[i], want, atol=1e-10)


def test_floored_inverse_sqrt_takes_one_floor_per_matrix():
    generator = torch.Generator().manual_seed(12)
    X = torch.randn(4, 6, 3, generator=generator, dtype=F64)
    V = X.transpose(1, 2) @ X / 6
    floors = torch.tensor([0.0, 0.1, 1.0, 10.0], dtype=F64)
    stacked = floored_inverse_sqrt(V, floors, 1e3, 1e-12)
    for i in range(4):
        assert torch.allclose(stacked[i], floored_inverse_sqrt(V[i], float(floors[i]), 1e3, 1e-12), atol=1e-12)


def stacked_factors(m: int, n: int, r: int, count: int, seed: int, zero: bool):
    generator = torch.Generator().manual_seed(seed)
    A = torch.randn(count, m, r, generator=generator, dtype=F64)
    if zero:
        A[-1] = 0
    return A, torch.randn(count, n, r, generator=generator, dtype=F64), generator


@settings(max_examples=25, deadline=None)
@given(shape=shapes, count=st.integers(1, 4), batch=st.integers(1, 3), seed=st.integers(0, 10_000), zero=st.booleans())
def test_the_routing_functions_take_a_stack_of_pairs(shape, count, batch, seed, zero):
    """What the routing layer calls per pair, called once on a stack [P, m, r] (per-sample gradients
    [P, b, m, r] with the factors as [P, 1, m, r]) gives each pair's own result: the routing layer can
    move to one call per shape. Noise drawn for the whole stack is passed as `omega`."""
    m, n, r = shape
    A, B, generator = stacked_factors(m, n, r, count, seed, zero)
    G = torch.randn(count, batch, m, n, generator=generator, dtype=F64)
    gA, gB = G @ B[:, None], G.transpose(-1, -2) @ A[:, None]  # per-sample factor gradients [P, b, ·, r]
    grams = gram(A), gram(B)
    per_sample_grams = gram(A[:, None]), gram(B[:, None])
    norms = projected_sq_norm(A[:, None], B[:, None], gA, gB, grams=per_sample_grams)
    lift = tangent_lift(A, B, gA.sum(1), gB.sum(1), grams=grams)
    omega = (torch.randn(A.shape, generator=generator, dtype=F64), torch.randn(B.shape, generator=generator, dtype=F64))
    noise = tangent_noise(A, B, 0.7, None, grams=grams, omega=omega)
    fixed = canonical(A, B, *noise, grams=grams)
    energy = intrinsic_sq_norm(A, B, *fixed)
    for i in range(count):
        one = gram(A[i]), gram(B[i])
        assert torch.allclose(grams[0].inverse[i], one[0].inverse, atol=1e-12) and int(grams[0].rank[i]) == int(one[0].rank)
        assert torch.allclose(norms[i], projected_sq_norm(A[i], B[i], gA[i], gB[i], grams=one), rtol=1e-10, atol=1e-10)
        for got, want in zip(lift, tangent_lift(A[i], B[i], gA[i].sum(0), gB[i].sum(0), grams=one)):
            assert torch.allclose(got[i], want, rtol=1e-10, atol=1e-10)
        own = tangent_noise(A[i], B[i], 0.7, None, grams=one, omega=(omega[0][i], omega[1][i]))
        for got, want in zip(noise, own):
            assert torch.allclose(got[i], want, rtol=1e-10, atol=1e-10)
        for got, want in zip(fixed, canonical(A[i], B[i], *own, grams=one)):
            assert torch.allclose(got[i], want, rtol=1e-10, atol=1e-10)
        assert torch.allclose(energy[i], intrinsic_sq_norm(A[i], B[i], *canonical(A[i], B[i], *own)), rtol=1e-9, atol=1e-10)


def test_tangent_noise_with_a_generator_is_tangent_noise_with_its_draws():
    generator = torch.Generator().manual_seed(13)
    A, B = torch.randn(9, 2, generator=generator, dtype=F64), torch.randn(5, 2, generator=generator, dtype=F64)
    drawn = tangent_noise(A, B, 0.5, torch.Generator().manual_seed(1))
    again = torch.Generator().manual_seed(1)
    omega = torch.randn(A.shape, generator=again, dtype=F64), torch.randn(B.shape, generator=again, dtype=F64)
    for got, want in zip(drawn, tangent_noise(A, B, 0.5, None, omega=omega)):
        assert torch.equal(got, want)


# -- DP-Muon -----------------------------------------------------------------------------------------------

MUON_SHAPES = {"q.lora_A": (3, 10), "k.lora_A": (3, 10), "q.lora_B": (10, 3), "k.lora_B": (10, 3),  # one oriented shape
               "fc.lora_A": (3, 17), "fc.lora_B": (6, 3), "w": (5, 5), "v": (4, 7)}


def reference_muon(start: dict, grads: list[dict], momentum: float, lr: float, orthogonalize) -> dict:
    """Heavy ball and an orthogonalized step, one matrix at a time, in float64."""
    buffers: dict = {}
    values = {k: v.to(F64).clone() for k, v in start.items()}
    for step in grads:
        for name, g in step.items():
            buffers[name] = g.to(F64).clone() if name not in buffers else momentum * buffers[name] + g.to(F64)
            values[name] -= lr * orthogonalize(buffers[name])
    return values


@pytest.mark.parametrize("iteration", ["seed", "quintic"])
@pytest.mark.parametrize("dtype, tolerance", [(F64, 1e-12), (torch.float32, 1e-6)])
def test_the_stacked_dp_muon_step_is_the_per_matrix_loop(iteration, dtype, tolerance):
    """float64: to rounding. float32: each matrix within 1e-6 of the float64 loop (relative to its norm,
    at least 1; 7e-8 was seen), the iteration running in float32 there."""
    generator = torch.Generator().manual_seed(14)
    params = {k: torch.nn.Parameter(torch.randn(*s, generator=generator, dtype=F64).to(dtype)) for k, s in MUON_SHAPES.items()}
    start = {k: p.detach().clone() for k, p in params.items()}
    steps = [{k: torch.randn(*s, generator=generator, dtype=F64) for k, s in MUON_SHAPES.items()} for _ in range(3)]
    steps[1].pop("k.lora_B")  # a matrix without a gradient in one step: not moved, its momentum kept
    steps[2].pop("w")
    muon = DPMuon(params, lr=0.1, momentum=0.8, iteration=iteration)
    for step in steps:
        for name, g in step.items():
            params[name].grad = g.to(dtype)
        muon.step()
        assert all(p.grad is None for p in params.values())
    expected = reference_muon(start, steps, 0.8, 0.1, muon.orthogonalize)
    for name in MUON_SHAPES:
        error = float((params[name].detach().to(F64) - expected[name]).norm())
        assert error <= tolerance * max(1.0, float(expected[name].norm())), name
    restored = DPMuon(params, lr=0.1, momentum=0.8, iteration=iteration)
    buffer = io.BytesIO()
    torch.save(muon.state_dict(), buffer)
    restored.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=False))
    for name, shape in MUON_SHAPES.items():
        assert restored.state[name].shape == shape and torch.equal(restored.state[name], muon.state[name])


def test_a_tall_matrix_and_its_transposed_twin_share_a_stack():
    """lora_B (10 × 3) is oriented to 3 × 10 and stacked with the lora_A beside it: one step from zero is
    −lr · NS(g) for each, and the twin fed gᵀ moves by the transpose."""
    param = torch.nn.Parameter(torch.zeros(3, 10, dtype=F64))
    other = torch.nn.Parameter(torch.zeros(10, 3, dtype=F64))
    g = torch.randn(3, 10, generator=torch.Generator().manual_seed(15), dtype=F64)
    muon = DPMuon({"a": param, "b": other}, lr=0.1, momentum=0.5)
    param.grad, other.grad = g.clone(), g.T.clone()
    muon.step()
    assert len(muon._stacks) == 1
    assert torch.allclose(param.detach(), -0.1 * newton_schulz(g, 3, 6), atol=1e-13)
    assert torch.allclose(other.detach(), param.detach().T, atol=1e-13)
    assert muon.state["b"].shape == (10, 3)


@pytest.mark.parametrize("function", [lambda X: newton_schulz(X, 3, 6), quintic])
def test_the_iterations_on_a_stack_are_the_per_matrix_iterations(function):
    X = torch.randn(2, 3, 6, 11, generator=torch.Generator().manual_seed(16), dtype=F64)
    X[0, 1] *= 40  # normalized on its own
    stacked = function(X)
    for i in range(2):
        for j in range(3):
            assert torch.allclose(stacked[i, j], function(X[i, j]), atol=1e-12)


def test_shape_groups_keep_order_and_write_copies_a_stack():
    items = {"a": (2, 3), "b": (3, 2), "c": (2, 3), "d": (4, 4)}
    assert shape_groups(items, lambda s: s) == [("a", "c"), ("b",), ("d",)]
    targets = [torch.zeros(2, 3), torch.zeros(2, 3)]
    write(targets, torch.arange(12.0).view(2, 2, 3))
    assert torch.equal(targets[1], torch.arange(6.0, 12.0).view(2, 3))
    with pytest.raises(RuntimeError):
        write(targets, torch.zeros(3, 2, 3))
