"""Correlated noise (govtrain/privatizers/mf): the streamed noise against a dense C⁻¹z, its covariance, the
strategies' sensitivity against the dense maximum over participation patterns, the optimised error, records, keyed
draws and resume. Accounting is in test_mf_accounting.py."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from govtrain import units
from govtrain.privatizers.base import Slot
from govtrain.privatizers.mf import toeplitz
from govtrain.privatizers.mf.banded import BandedMF, round_coefficients
from govtrain.privatizers.mf.blt import BLT, inverse_is_stable
from govtrain.privatizers.mf.charge import banded_charge, blt_charge, participation_factor
from govtrain.privatizers.mf.optimize import banded_column, sqrt_column
from govtrain.privatizers.mf.stream import standard_normal

T = 12
CPU = torch.device("cpu")


def _slot(key: str = "w", shape=(6,), dtype=torch.float64) -> Slot:
    return Slot(key=key, shape=torch.Size(shape), dtype=dtype, device=CPU)


def _privatizers():
    return [BandedMF(bands=4, horizon=T, insecure_seed=7), BLT(buffers=2, horizon=T, min_separation=3, insecure_seed=7)]


def _dense(privatizer, horizon: int = T) -> np.ndarray:
    """The T×T strategy C (normalised), built densely from its first column: the reference."""
    if isinstance(privatizer, BandedMF):
        column = np.zeros(horizon)
        column[: privatizer.bands] = privatizer.column.numpy()[:horizon]
    else:
        column = privatizer.column(horizon)
    return np.array([[column[i - j] if i >= j else 0.0 for j in range(horizon)] for i in range(horizon)])


def _stream(privatizer, slot: Slot, stds, *, state=None, steps=None):
    """Noise alone (zero sums) for each step, as [steps, *shape], and the final state."""
    state = privatizer.init([slot]) if state is None else state
    out = []
    for t in range(len(stds) if steps is None else steps):
        noisy, state = privatizer.update({slot.key: torch.zeros(slot.shape, dtype=slot.dtype)}, state,
                                         std={slot.key: stds[t]})
        out.append(noisy[slot.key])
    return torch.stack(out).numpy(), state


@pytest.mark.parametrize("privatizer", _privatizers(), ids=lambda p: p.name)
def test_streamed_noise_equals_dense_inverse(privatizer):
    slot = _slot()
    stds = [0.5 + 0.25 * (t % 3) for t in range(T)]  # the scale changes between steps, as s_g may between epochs
    noise, state = _stream(privatizer, slot, stds)
    z = torch.stack([standard_normal(state.key, slot, t) for t in range(T)]).numpy()
    expected = np.diag(stds) @ np.linalg.solve(_dense(privatizer), z)
    np.testing.assert_allclose(noise, expected, rtol=0, atol=1e-12)
    # with a constant scale s it is C⁻¹z for z ~ N(0, s²I)
    constant, state = _stream(privatizer, slot, [2.0] * T)
    np.testing.assert_allclose(constant, np.linalg.solve(_dense(privatizer), 2.0 * z), rtol=0, atol=1e-12)


@pytest.mark.parametrize("privatizer", _privatizers(), ids=lambda p: p.name)
def test_noise_covariance_matches_dense(privatizer):
    # 40,000 coordinates of one slot are 40,000 independent keyed draws of the stream w_1..T
    n, sigma = 40_000, 1.5
    noise, _ = _stream(privatizer, _slot(shape=(n,)), [sigma] * T)
    empirical = noise @ noise.T / n
    inverse = np.linalg.inv(_dense(privatizer))
    expected = sigma ** 2 * inverse @ inverse.T
    # each entry's standard error is √((Σ_ii Σ_jj + Σ_ij²) / n); allow 5 of them (a false alarm has p < 1e-4 overall)
    standard_error = np.sqrt((np.outer(np.diag(expected), np.diag(expected)) + expected ** 2) / n)
    assert np.all(np.abs(empirical - expected) <= 5 * standard_error)


def _patterns(horizon: int, separation: int):
    """Every non-empty 0/1 participation pattern whose participations are ≥ `separation` steps apart."""
    for size in range(1, horizon // separation + 2):
        for steps in itertools.combinations(range(horizon), size):
            if all(b - a >= separation for a, b in zip(steps, steps[1:])):
                yield steps


def test_banded_sensitivity_is_one_per_participation():
    privatizer = BandedMF(bands=4, horizon=T)
    dense = _dense(privatizer)
    assert np.linalg.norm(dense, axis=0).max() == pytest.approx(1.0, abs=1e-11)
    assert np.linalg.norm(dense, axis=0).max() <= 1.0
    worst = 0.0
    for steps in _patterns(T, privatizer.bands):
        u = np.zeros(T)
        u[list(steps)] = 1
        # b-separated columns of a b-banded C have disjoint supports: ‖Cu‖² is the sum of their norms²
        assert np.dot(dense @ u, dense @ u) == pytest.approx(sum(np.dot(dense[:, s], dense[:, s]) for s in steps))
        worst = max(worst, np.dot(dense @ u, dense @ u) / len(steps))
    assert worst == pytest.approx(1.0, abs=1e-11)


@pytest.mark.parametrize("separation", [1, 2, 3])
def test_min_separated_sensitivity_is_the_earliest_pattern(separation):
    for column in (np.array(sqrt_column(T)), BLT(buffers=2, horizon=T, min_separation=separation).column(T)):
        dense = np.array([[column[i - j] if i >= j else 0.0 for j in range(T)] for i in range(T)])
        best: dict[int, float] = {}
        for steps in _patterns(T, separation):
            u = np.zeros(T)
            u[list(steps)] = 1
            best[len(steps)] = max(best.get(len(steps), 0.0), float(np.linalg.norm(dense @ u)))
        running = 0.0
        for k in sorted(best):
            running = max(running, best[k])  # at most k participations
            assert toeplitz.min_sep_sensitivity(column, separation, k) == pytest.approx(running, rel=1e-12)


@pytest.mark.parametrize("separation", [1, 2, 3])
def test_blt_participation_factor_bounds_every_pattern(separation):
    blt = BLT(buffers=2, horizon=T, min_separation=separation)
    m = participation_factor(blt.theta, blt.omega, separation)
    assert blt.factor_p / units.PICO >= m
    dense = _dense(blt)
    generator = np.random.default_rng(0)
    sigmas = [np.ones(T)] + [generator.uniform(0.3, 3.0, T) for _ in range(3)]  # σ_t varying between steps
    tightest = 0.0
    for steps in _patterns(T, separation):
        for sigma in sigmas:
            v = np.zeros(T)
            v[list(steps)] = 1 / sigma[list(steps)]
            bound = m * np.sum(v[list(steps)] ** 2)
            assert np.dot(dense @ v, dense @ v) <= bound * (1 + 1e-12)
            tightest = max(tightest, np.dot(dense @ v, dense @ v) / bound)
    assert tightest > 0.5  # a bound, but not a vacuous one
    # the infinite-horizon closed form against the truncated sums at a long horizon
    column = blt.column(4000)
    r = [np.dot(column[: 4000 - lag], column[lag:]) for lag in range(0, 4000, separation)]
    assert m == pytest.approx(r[0] + 2 * sum(r[1:]), rel=1e-9)


def test_prefix_error_against_dense():
    horizon = 64
    blt = BLT(buffers=2, horizon=horizon, min_separation=8)
    for column in (np.array(banded_column(8, horizon)), blt.column(horizon)):
        padded = np.pad(column, (0, horizon - column.shape[0]))
        dense = np.array([[padded[i - j] if i >= j else 0.0 for j in range(horizon)] for i in range(horizon)])
        a = np.tril(np.ones((horizon, horizon)))
        expected = np.sum((a @ np.linalg.inv(dense)) ** 2) / horizon
        inverse = toeplitz.inverse_column([1.0], column, horizon)
        assert toeplitz.prefix_error(inverse) == pytest.approx(expected, rel=1e-10)
        assert float(toeplitz.prefix_error_t(torch.tensor(column), horizon)) == pytest.approx(expected, rel=1e-9)
    assert toeplitz.identity_error(horizon) == pytest.approx(np.sum(np.tril(np.ones((horizon, horizon)))) / horizon)


def test_banded_error_against_dp_sgd_at_equal_sensitivity():
    horizon = 1000
    errors = {}
    for bands in (1, 4, 16, 64):
        column = np.array(BandedMF(bands=bands, horizon=horizon).coefficients_p) / units.PICO
        errors[bands] = toeplitz.prefix_error(toeplitz.inverse_column([1.0], column, horizon)) * np.dot(column, column)
    assert errors[1] == pytest.approx(toeplitz.identity_error(horizon))
    assert errors[1] > errors[4] > errors[16] > errors[64]  # more bands, less error (before amplification)
    # the optimum is a stationary point: no small move of one coefficient lowers the error
    column = np.array(banded_column(16, horizon))

    def error(c):
        return toeplitz.prefix_error(toeplitz.inverse_column([1.0], c, horizon)) * np.dot(c, c)

    for k in range(1, 16):
        for step in (1e-4, -1e-4):
            moved = column.copy()
            moved[k] += step
            assert error(moved) >= error(column) * (1 - 1e-10)


def test_records_round_trip_and_rebuild_the_same_strategy():
    for privatizer in _privatizers():
        record = privatizer.record()
        assert next(iter(record)) == "name"
        assert all(type(v) in (int, str, list) for v in record.values())
        rebuilt = type(privatizer).from_record(record)
        assert rebuilt.record() == record
        assert rebuilt.charge(sampling_rate_u=10_000, noise_multiplier_u=900_000, steps=50) == \
            privatizer.charge(sampling_rate_u=10_000, noise_multiplier_u=900_000, steps=50)


def test_records_it_did_not_write_are_refused():
    banded = BandedMF(bands=4, horizon=T).record()
    blt = BLT(buffers=2, horizon=T, min_separation=3).record()
    bad = [
        (BandedMF, {**banded, "name": "blt"}),
        (BandedMF, {k: v for k, v in banded.items() if k != "horizon"}),
        (BandedMF, {**banded, "extra": 1}),
        (BandedMF, {**banded, "bands": True}),
        (BandedMF, {**banded, "bands": 5}),
        (BandedMF, {**banded, "coefficients_p": [units.PICO, 1, 0, 0]}),  # norm above 1
        (BandedMF, {**banded, "coefficients_p": [0, units.PICO // 2, 0, 0]}),
        (BandedMF, {**banded, "coefficients_p": "1,2,3,4"}),
        (BLT, {**blt, "theta_p": [units.PICO, blt["theta_p"][1]]}),
        (BLT, {**blt, "omega_p": [units.PICO, 1]}),  # Σω > 1: the column would increase
        (BLT, {**blt, "omega_p": [-1, 1]}),
        (BLT, {**blt, "min_separation": 0}),
        (BLT, {**blt, "buffers": 3}),
    ]
    for cls, record in bad:
        with pytest.raises(ValueError):
            cls.from_record(record)


def test_rounded_coefficients_keep_the_norm_at_most_one():
    for bands in (2, 16, 64):
        ints = round_coefficients(banded_column(bands, 500))
        assert sum(v * v for v in ints) <= units.PICO ** 2
        assert sum(v * v for v in ints) >= (units.PICO - bands) ** 2


def test_resume_reproduces_the_uninterrupted_stream_exactly():
    slots = [_slot("a", (3, 4), torch.float32), _slot("b", (5,), torch.float32)]
    stds = {"a": 0.7, "b": 1.3}
    for privatizer in _privatizers():
        def run(state, steps):
            out = []
            for _ in range(steps):
                sums = {s.key: torch.ones(s.shape, dtype=s.dtype) for s in slots}
                noisy, state = privatizer.update(sums, state, std=stds)
                out.append({k: v.clone() for k, v in noisy.items()})
            return out, state

        whole, _ = run(privatizer.init(slots), 2 * T)
        first, state = run(privatizer.init(slots), 5)
        saved = privatizer.state_dict(state)
        resumed = type(privatizer).from_record(privatizer.record())  # a new process rebuilds it from the record
        rest, _ = run(resumed.load_state(slots, saved), 2 * T - 5)
        for expected, got in zip(whole, first + rest):
            for key in expected:
                assert torch.equal(expected[key], got[key])


def test_load_state_refuses_a_state_for_other_slots():
    privatizer = BandedMF(bands=4, horizon=T, insecure_seed=1)
    slots = [_slot("a"), _slot("b")]
    saved = privatizer.state_dict(privatizer.init(slots))
    bad_slots = ([_slot("a")], [_slot("a"), _slot("c")], [_slot("a"), _slot("b", (7,))],
                 [_slot("a"), _slot("b", dtype=torch.float32)])
    for other in bad_slots:
        with pytest.raises(ValueError):
            privatizer.load_state(other, saved)
    for broken in ({**saved, "step": -1}, {**saved, "key": saved["key"][:16]}, {"key": saved["key"]}):
        with pytest.raises(ValueError):
            privatizer.load_state(slots, broken)
    with pytest.raises(ValueError):  # a BLT's buffers do not fit a banded state
        BLT(buffers=2, horizon=T, min_separation=3).load_state(slots, saved)


def test_the_key_comes_from_the_entropy_source_and_stays_out_of_repr():
    slots = [_slot()]
    drawn = []

    def entropy(n):
        drawn.append(n)
        return bytes(range(n))

    state = BandedMF(bands=4, horizon=T, entropy=entropy).init(slots)
    assert drawn == [32] and state.key == bytes(range(32))
    assert state.key.hex() not in repr(state) and "secret" in repr(state)
    # the default source is the OS: two runs never share a key
    assert BandedMF(bands=4, horizon=T).init(slots).key != BandedMF(bands=4, horizon=T).init(slots).key


def test_update_semantics_keep_zero_std_and_shared_tensors():
    privatizer = BLT(buffers=2, horizon=T, min_separation=3, insecure_seed=3)
    slots = [_slot("x:0", (4, 2)), _slot("x:1", (4, 2)), _slot("y", (3,))]
    state = privatizer.init(slots)
    reference = privatizer.init(slots)
    shared = torch.zeros(4, 2, dtype=torch.float64)
    keep0 = torch.tensor([[1.0], [1.0], [0.0], [0.0]], dtype=torch.float64)
    keep1 = 1 - keep0
    y = torch.zeros(3, dtype=torch.float64)
    noisy, state = privatizer.update({"x:0": shared, "x:1": shared, "y": y}, state,
                                     std={"x:0": 1.0, "x:1": 2.0}, keep={"x:0": keep0, "x:1": keep1, "y": None})
    alone, _ = privatizer.update({k: torch.zeros(s.shape, dtype=s.dtype) for k, s in zip(["x:0", "x:1", "y"], slots)},
                                 reference, std={"x:0": 1.0, "x:1": 2.0})
    assert noisy["x:0"] is shared and noisy["x:1"] is shared  # one tensor, noised in place by both slots in turn
    assert torch.equal(shared, alone["x:0"] * keep0 + alone["x:1"] * keep1)
    assert torch.equal(y, torch.zeros(3, dtype=torch.float64))  # no std: no noise, but the stream still advanced
    assert state.step == 1 and torch.count_nonzero(state.buffers["y"]) > 0
    with pytest.raises(ValueError):
        privatizer.update({"z": torch.zeros(1)}, state, std={})


def test_a_training_loop_over_fake_clipped_sums():
    privatizer = BandedMF(bands=8, horizon=64, insecure_seed=11)
    slots = [_slot("layer.weight", (8, 4), torch.float32), _slot("layer.bias", (8,), torch.float32)]
    generator = torch.Generator().manual_seed(0)
    state = privatizer.init(slots)
    column = np.pad(privatizer.column.numpy(), (0, 64 - 8))
    dense = np.array([[column[i - j] if i >= j else 0.0 for j in range(64)] for i in range(64)])
    released, clipped = [], []
    for step in range(64):
        sums = {s.key: torch.randn(s.shape, generator=generator) for s in slots}
        clipped.append({k: v.clone() for k, v in sums.items()})
        noisy, state = privatizer.update(sums, state, std={"layer.weight": 0.5, "layer.bias": 0.5})
        released.append({k: v.clone() for k, v in noisy.items()})
    for s in slots:
        noise = np.stack([(r[s.key] - c[s.key]).double().numpy().ravel() for r, c in zip(released, clipped)])
        z = np.stack([standard_normal(state.key, s, t).double().numpy().ravel() for t in range(64)])
        # float32 state and sums: the released noise is the dense 0.5·C⁻¹z to float32 precision
        np.testing.assert_allclose(noise, 0.5 * np.linalg.solve(dense, z), atol=1e-4)
    assert math.isclose(float(np.linalg.norm(dense, axis=0).max()), 1.0, abs_tol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_stream_is_keyed_and_resumes_exactly():
    cuda = torch.device("cuda")
    slot = Slot(key="w", shape=torch.Size([64, 32]), dtype=torch.float32, device=cuda)
    for privatizer in _privatizers():
        def run(state, steps):
            out = []
            for _ in range(steps):
                noisy, state = privatizer.update({"w": torch.zeros(64, 32, device=cuda)}, state, std={"w": 1.0})
                out.append(noisy["w"].clone())
            return out, state

        whole, _ = run(privatizer.init([slot]), 10)
        first, state = run(privatizer.init([slot]), 4)
        saved = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in privatizer.state_dict(state).items()}
        saved["buffers"] = {k: v.cpu() for k, v in saved["buffers"].items()}
        rest, _ = run(privatizer.load_state([slot], saved), 6)
        assert all(torch.equal(a, b) for a, b in zip(whole, first + rest))
        assert all(t.device.type == "cuda" for t in whole)


def test_update_checks_the_run_step_and_the_std_and_changes_nothing_when_it_refuses():
    privatizer = BandedMF(bands=4, horizon=T, insecure_seed=5)
    slot = _slot()
    state = privatizer.init([slot])
    for step in range(3):
        _, state = privatizer.update({"w": torch.zeros(6, dtype=torch.float64)}, state, std={"w": 1.0}, step=step)
    before = {k: v.clone() for k, v in state.buffers.items()}
    sums = torch.ones(6, dtype=torch.float64)
    refused = [dict(std={"w": 1.0}, step=2), dict(std={"w": 1.0}, step=4), dict(std={"w": 1.0}, step=True),
               dict(std={"w": -0.5}), dict(std={"w": float("nan")}), dict(std={"w": float("inf")})]
    for kwargs in refused:
        with pytest.raises(ValueError):
            privatizer.update({"w": sums}, state, **kwargs)
    with pytest.raises(ValueError):  # a sum of another dtype than the slot's
        privatizer.update({"w": torch.ones(6, dtype=torch.float32)}, state, std={"w": 1.0})
    assert state.step == 3 and torch.equal(sums, torch.ones(6, dtype=torch.float64))
    assert all(torch.equal(before[k], state.buffers[k]) for k in before)
    _, after = privatizer.update({"w": sums}, state, std={"w": 1.0}, step=3)
    assert after.step == 4 and all(torch.equal(before[k], state.buffers[k]) for k in before)  # a new state


def test_charges_refuse_a_rate_or_multiplier_out_of_range():
    banded = BandedMF(bands=4, horizon=T).record()
    blt = BLT(buffers=2, horizon=T, min_separation=3).record()
    for charge, record in ((banded_charge, banded), (blt_charge, blt)):
        for rate_u, multiplier_u in ((0, 1_000_000), (units.MICRO + 1, 1_000_000), (1_000, 0), (1_000, -1),
                                     (1_000, 1.5), (True, 1_000_000)):
            with pytest.raises(ValueError):
                charge(record, sampling_rate_u=rate_u, noise_multiplier_u=multiplier_u, steps=10)
        assert charge(record, sampling_rate_u=units.MICRO, noise_multiplier_u=1, steps=10)[2] > 0


def test_the_root_test_against_numpy():
    """`no_root_in_closed_unit_disc` (exact integers) against numpy's roots on random integer polynomials, both of its
    paths (decreasing positive coefficients, Schur–Cohn), away from roots on the circle where floats cannot decide;
    and the BLT eigenvalue test against numpy's eigenvalues of diag(θ) - 1ωᵀ."""
    generator = np.random.default_rng(4)
    decided = 0
    for _ in range(2000):
        degree = int(generator.integers(1, 8))
        coefficients = [int(v) for v in generator.integers(-30, 31, degree + 1)]
        coefficients[-1] = coefficients[-1] or 1
        if generator.random() < 0.2:
            coefficients = sorted((abs(v) + 1 for v in coefficients), reverse=True)
        moduli = np.abs(np.roots(coefficients[::-1]))
        if np.any(np.abs(moduli - 1) < 1e-6):
            continue
        decided += 1
        assert toeplitz.no_root_in_closed_unit_disc(coefficients) == bool(np.all(moduli > 1)), coefficients
    assert decided > 1500
    assert not toeplitz.no_root_in_closed_unit_disc([1, 0, 1])  # roots ±i, on the circle
    assert not toeplitz.no_root_in_closed_unit_disc([2, 2, 2])  # not strictly decreasing: roots on the circle
    for _ in range(300):
        buffers = int(generator.integers(1, 5))
        theta = [int(v) for v in generator.integers(1, units.PICO, buffers)]
        omega = [int(v) for v in generator.integers(0, units.PICO // buffers, buffers)]
        system = np.diag(np.array(theta) / units.PICO) - np.outer(np.ones(buffers), np.array(omega) / units.PICO)
        radius = float(np.max(np.abs(np.linalg.eigvals(system))))
        if abs(radius - 1) > 1e-6:
            assert inverse_is_stable(theta, omega) == (radius < 1)


def test_unstable_banded_records_are_refused_and_optimised_ones_accepted():
    pico = units.PICO
    for coefficients in ([pico // 2, pico // 2], [300_000_000_000, 950_000_000_000], [pico // 4, 0, pico // 2]):
        record = {"name": "banded-mf", "bands": len(coefficients), "horizon": 100, "coefficients_p": coefficients}
        with pytest.raises(ValueError, match="unstable"):
            BandedMF.from_record(record)
    # a stable record that is not decreasing (c(x) = 0.5 - 0.3x + 0.2x²) goes through the Schur–Cohn path
    BandedMF.from_record({"name": "banded-mf", "bands": 3, "horizon": 100,
                          "coefficients_p": [pico // 2, -3 * pico // 10, pico // 5]})
    for bands in (2, 16, 64):
        BandedMF.from_record(BandedMF(bands=bands, horizon=500).record())


@pytest.mark.parametrize("buffers, separation", [(1, 1), (2, 3), (2, 250), (4, 16)])
def test_the_exact_participation_factor_is_the_float_one_rounded_up(buffers, separation):
    blt = BLT(buffers=buffers, horizon=1000, min_separation=separation)
    m = participation_factor(blt.theta, blt.omega, separation)
    assert m <= blt.factor_p / units.PICO <= m * (1 + 1e-9)
