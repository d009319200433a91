"""Adversarial review of the correlated-noise privatizers (issue 24 item 2): govtrain/privatizers/mf and the
CyclicPoissonSampler, standalone (the router/run/ledger wiring is reviewed elsewhere).

The first section holds the findings: each test states the attack, the adversary and what should happen instead,
and fails on the code under review. The second section holds attacks that held: they pass, and stay as regression
tests. The oracle throughout is the strategy the stream *really* realises: for a float64 stream of T steps over d ≥ T
coordinates, the released noise is W = M·Z with Z the keyed draws (`standard_normal`), so M = W·Z⁺ exactly, and the
encoder C_eff = M⁻¹ is what the sensitivity is a column norm of (`_realised_strategy`)."""

from __future__ import annotations

import hashlib
import hmac
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from govtrain import units
from govtrain.privatizers.base import Slot
from govtrain.privatizers.mf import toeplitz
from govtrain.privatizers.mf.banded import BandedMF
from govtrain.privatizers.mf.blt import BLT
from govtrain.privatizers.mf.charge import banded_charge, blt_charge, unamplified_multiplier_u
from govtrain.privatizers.mf.stream import standard_normal
from govtrain.routing.sampler import CyclicPoissonSampler, cyclic_parts, unit_identities

CPU = torch.device("cpu")


def _slot(key: str = "w", shape=(64,), dtype=torch.float64) -> Slot:
    return Slot(key=key, shape=torch.Size(shape), dtype=dtype, device=CPU)


def _zeros(slot: Slot) -> torch.Tensor:
    return torch.zeros(slot.shape, dtype=slot.dtype)


def _realised_strategy(released: list[np.ndarray], key: bytes, slot: Slot) -> np.ndarray:
    """C_eff (T×T) of a float64 stream whose noise alone (zero sums, std 1) was `released` at steps 0..T-1."""
    w = np.stack([r.ravel() for r in released])
    z = np.stack([standard_normal(key, slot, t).numpy().ravel() for t in range(len(released))])
    return np.linalg.inv(w @ np.linalg.pinv(z))


def _fixed_entropy(count: int) -> bytes:
    return b"\xab" * count


def _per_participation_bound(privatizer) -> float:
    """The squared sensitivity the charge assumes for one participation: 1 (banded), m (BLT)."""
    return 1.0 if isinstance(privatizer, BandedMF) else privatizer.factor_p / units.PICO


def _exact_blt_factor(theta, omega, separation: int, scale_sq: Fraction) -> Fraction:
    """m of the BLT strategy with decays `theta`, weights `omega` (Fractions), normalised by n² = `scale_sq`, in exact
    rational arithmetic: (r(0) + 2·Σ_{i≥1} r(i·b)) / n² (the closed form of charge.participation_factor)."""
    pairs = [(tj, wj, tl, wl) for tj, wj in zip(theta, omega) for tl, wl in zip(theta, omega)]
    r0 = 1 + sum(wj * wl / (1 - tj * tl) for tj, wj, tl, wl in pairs)
    lagged = sum(w * t ** (separation - 1) / (1 - t ** separation) for t, w in zip(theta, omega))
    lagged += sum(wj * wl * tl ** separation / ((1 - tj * tl) * (1 - tl ** separation)) for tj, wj, tl, wl in pairs)
    return (r0 + 2 * lagged) / scale_sq


# ======================================================================================================================
# FINDINGS: these fail on the code under review.
# ======================================================================================================================


def test_keyed_draws_of_two_slots_or_steps_never_coincide():
    """Attack: birthday collision in the keyed noise seed. Adversary: anyone who sees the released (noisy) updates of
    an ordinary run, e.g. consecutive checkpoints. Defect: `standard_normal` seeds a torch CPU generator with the
    first 64 bits of HMAC-SHA-256(key, slot ‖ t), but torch's CPU generator (mt19937) keeps only the low 32 bits of
    its seed, so two (slot, step) pairs share z̃ after about 2^16 pairs: with 100 parameter tensors it happens within
    300 steps (here `layers.3.weight` at step 195 and `layers.25.weight` at step 285 for the all-zero key). The two
    slots then carry bitwise identical z̃, so their z-domain releases (C·S⁻¹·release = C·S⁻¹·x + z̃, computable from
    public data) subtract to a noiseless linear function of the gradients. Should: a generator whose whole state is
    keyed with ≥ 128 bits (a CSPRNG keystream, or numpy's Philox/PCG64 from the full digest): no two pairs coincide."""
    key = bytes(32)
    names = [f"layers.{i}.weight" for i in range(100)]
    seen: dict[bytes, tuple[str, int]] = {}
    for step in range(300):
        for name in names:
            fingerprint = standard_normal(key, _slot(name, (8,)), step).numpy().tobytes()
            if fingerprint in seen:
                other, other_step = seen[fingerprint]
                whole = torch.equal(standard_normal(key, _slot(name, (64, 64), torch.float32), step),
                                    standard_normal(key, _slot(other, (64, 64), torch.float32), other_step))
                pytest.fail(f"z̃ of {name!r} at step {step} equals z̃ of {other!r} at step {other_step} "
                            f"(as whole 64×64 float32 tensors too: {whole})")
            seen[fingerprint] = (name, step)


def test_a_keyed_draw_is_not_a_function_of_32_bits():
    """Attack: brute force of the noise seed. Adversary: an observer of one released step of one slot (two
    consecutive checkpoints under SGD give it). Defect: as documented (docs/privatizers.md, Secrecy), z̃_t is drawn
    from a torch generator seeded with the first 64 bits of HMAC-SHA-256(key, "govtrain-mf-noise" ‖ slot ‖ t); on the
    CPU torch uses only the seed's low 32 bits, so every z̃ is one of 2^32 sequences. At step 0 the banded release is
    x + s·z̃_0/c_0: trying all 2^32 seeds (a search within reach of one machine; 16 coordinates of each suffice)
    finds z̃_0 by its correlation with the release, then each later step the same way, and subtracting them
    leaves the gradients. (The router's i.i.d. noise,
    govtrain/routing/router.py:177, seeds the same CPU generator from os.urandom(8): the same 32 bits.) Should:
    draws that no 32-bit (or 64-bit) seed reproduces."""
    key = bytes(range(32))
    slot = _slot("fc.weight", (32,))
    for step in (0, 1, 977):
        name = slot.key.encode()
        message = b"govtrain-mf-noise\0" + len(name).to_bytes(4, "big") + name + step.to_bytes(8, "big")
        seed = int.from_bytes(hmac.new(key, message, hashlib.sha256).digest()[:8], "big")
        low = torch.Generator().manual_seed(seed & 0xFFFF_FFFF)
        assert not torch.equal(torch.randn(slot.shape, generator=low, dtype=slot.dtype),
                               standard_normal(key, slot, step)), f"step {step}'s noise is fixed by 32 bits"


@pytest.mark.parametrize("saved_by, resumed_by", [
    (lambda: BandedMF(bands=4, horizon=100, insecure_seed=1), lambda: BandedMF(bands=4, horizon=5_000)),
    (lambda: BandedMF(bands=16, horizon=64, insecure_seed=1), lambda: BandedMF(bands=16, horizon=5_000)),
    (lambda: BLT(buffers=1, horizon=100, min_separation=1, insecure_seed=1), lambda: BandedMF(bands=2, horizon=100)),
], ids=["banded-horizon-extended", "banded-16-horizon-extended", "blt-state-into-banded"])
def test_a_state_resumes_only_under_the_record_that_saved_it(saved_by, resumed_by):
    """Attack: resume a run's noise state under another record. Adversary: a key-holding operator against a pinned
    auditor (or an honest one who extends the run's horizon when resuming: banded.py says "the horizon only tunes
    the coefficients"). Defect: `load_state` checks only the slots' shapes and dtypes, so a state saved by one
    strategy loads into another whose buffers have the same depth (banded b=4 for T=100 into b=4 for T=5,000; a
    1-buffer BLT into 2 bands). The stream then realises a hybrid encoder: rows before the switch follow the old
    coefficients, rows after it the new, so the columns that straddle the switch take the old head and the new tail:
    norm 1.079 (b=4), 1.167 (b=16), 1.169 (BLT → banded) where each record, which is all the verifier sees (one per
    spend entry), promises ≤ 1: the participations at those steps are under-charged. Should: `state_dict` carries
    the record (or its hash) and `load_state` refuses a state saved under any other record (ValueError)."""
    slot = _slot()
    first, second = saved_by(), resumed_by()
    state = first.init([slot])
    released = []
    for _ in range(8):
        noisy, state = first.update({slot.key: _zeros(slot)}, state, std={slot.key: 1.0})
        released.append(noisy[slot.key].numpy().copy())
    try:
        state = second.load_state([slot], first.state_dict(state))
    except ValueError:
        return  # refused: what should happen
    for _ in range(16):
        noisy, state = second.update({slot.key: _zeros(slot)}, state, std={slot.key: 1.0})
        released.append(noisy[slot.key].numpy().copy())
    norms = np.linalg.norm(_realised_strategy(released, state.key, slot), axis=0)
    bound = max(_per_participation_bound(first), _per_participation_bound(second))
    assert norms.max() ** 2 <= bound * (1 + 1e-9), (
        f"resumed under another record: the realised column {int(norms.argmax())} has norm {norms.max():.4f}, "
        f"the records promise ≤ {math.sqrt(bound):.4f}")


@pytest.mark.parametrize("privatizer", [
    BandedMF(bands=4, horizon=100, insecure_seed=2),
    BandedMF(bands=16, horizon=1000, insecure_seed=2),
    BLT(buffers=2, horizon=100, min_separation=4, insecure_seed=2),
], ids=["banded-4", "banded-16", "blt-2"])
def test_a_refused_update_changes_nothing(privatizer):
    """Attack: an update that fails half-way, then the step is retried (a bad keep mask or sums for one slot, an OOM on
    one slot's noise, a preemption signal: any exception after the first slot). Adversary: none needed, an honest retry
    loop or a run state saved on the way out. Defect: `update` advances each slot's buffers in place (`_advance`) before
    it adds the noise; the failed call returns no state, and the one passed in holds those very buffers: the first
    slots' buffers (and every slot whose `_advance` ran) have moved on while `step` has not.
    The retried step advances them again, and the realised encoder's column at that step has norm 1.61 (banded b=4),
    1.15 (b=16), 4.53 (BLT, where √m ≈ 1.20): that participation's sensitivity is far above what the charge assumes.
    Should: an update that raises leaves the state as it was (check every slot's sums, keep and dtype before touching a
    buffer, and advance out of place, committing only when every slot succeeded), so the retry continues the
    uninterrupted stream."""
    a, b = _slot("a"), _slot("b", (3, 4))
    state = privatizer.init([a, b])
    released = []
    for step in range(24):
        if step == 6:
            with pytest.raises(RuntimeError):  # slot b's keep mask does not fit its tensor
                privatizer.update({a.key: _zeros(a), b.key: _zeros(b)}, state, std={a.key: 1.0, b.key: 1.0},
                                  keep={b.key: torch.ones(5, dtype=torch.float64)})
        noisy, state = privatizer.update({a.key: _zeros(a)}, state, std={a.key: 1.0})
        released.append(noisy[a.key].numpy().copy())
    norms = np.linalg.norm(_realised_strategy(released, state.key, a), axis=0)
    bound = _per_participation_bound(privatizer)
    assert norms.max() ** 2 <= bound * (1 + 1e-9), (
        f"after a refused update and its retry, the realised column {int(norms.argmax())} has norm "
        f"{norms.max():.4f}; the charge assumes ≤ {math.sqrt(bound):.4f}")


def test_a_banded_record_with_an_unstable_inverse_is_refused():
    """Attack: a banded record whose C⁻¹ grows without bound (c = (0.3, 0.95): Σc² = 0.9925 ≤ 1, c_0 > 0, so
    `check_banded` accepts it; the root of c(x) is at -0.316, inside the unit disc). Adversary: a careless or
    hostile operator (utility, not privacy: more noise). Defect: the noise grows as 3.17^t and reaches inf in a
    float32 slot within 80 steps, so the run's parameters become NaN; BLT refuses exactly this ("this BLT's inverse
    is unstable") but BandedMF does not. Should: `BandedMF.from_record` (and the constructor) raise ValueError when
    c(x) has a root in the closed unit disc (e.g. the companion matrix's spectral radius ≥ 1, as blt.py checks)."""
    record = {"name": "banded-mf", "bands": 2, "horizon": 1000, "coefficients_p": [300_000_000_000, 950_000_000_000]}
    try:
        privatizer = BandedMF.from_record(record)
    except ValueError:
        return
    slot = _slot(dtype=torch.float32)
    state = privatizer.init([slot])
    for _ in range(100):
        noisy, state = privatizer.update({slot.key: _zeros(slot)}, state, std={slot.key: 1.0})
    assert torch.isfinite(noisy[slot.key]).all(), "the accepted record's noise overflowed within 100 steps"


def _float32_release_is_the_float64_one_cast(privatizer, steps: int = 12) -> None:
    """The float32 slot's released noise, step by step, is bitwise the float64 slot's cast to float32, and its buffers
    are float64: the float32 stream applies the very strategy the float64 one does (the held tests pin that one to
    the record), rounding only what it releases."""
    wide, narrow = _slot(shape=(16,)), _slot(shape=(16,), dtype=torch.float32)
    wide_state, narrow_state = privatizer.init([wide]), privatizer.init([narrow])
    for _ in range(steps):
        released, wide_state = privatizer.update({"w": _zeros(wide)}, wide_state, std={"w": 1.7})
        cast, narrow_state = privatizer.update({"w": _zeros(narrow)}, narrow_state, std={"w": 1.7})
        assert cast["w"].dtype == torch.float32 and narrow_state.buffers["w"].dtype == torch.float64
        assert torch.equal(cast["w"], released["w"].to(torch.float32))


def test_the_float32_banded_stream_keeps_column_norm_at_most_one():
    """Attack: rounding in the stream's dtype. Adversary: a pinned auditor who takes `round_coefficients`' promise
    (Σ c² ≤ 1 "exactly in the recorded integers", rounded toward zero and trimmed). Defect: `_advance` casts the
    coefficients to the slot's dtype, which the router makes float32, with round-to-nearest: for the optimised
    b = 16, T = 1000 strategy the float32 coefficients have Σ c² = 1 + 1.2·10⁻⁸ exactly, so the strategy the stream
    applies has a sensitivity above the charge's 1 (small, but the rounding the record was trimmed for is undone).
    Should: run the recurrence on the float64 coefficients (float64 buffers, the noise cast at the end), or round
    the coefficients toward zero in the slot's dtype.

    Fixed by the first remedy, so this test now measures what the fixed stream applies (it first measured
    `privatizer.column.to(torch.float32)`, what the old `_advance` multiplied by on a float32 slot, and no longer
    what any stream applies): a float32 slot's stream is the float64 stream cast at the output, and the float64
    coefficients it recurs on (`privatizer.column`, rounded toward zero from the record) have Σ c² ≤ 1 exactly."""
    privatizer = BandedMF(bands=16, horizon=1000, insecure_seed=4)
    _float32_release_is_the_float64_one_cast(privatizer)
    applied = privatizer.column  # what BandedMF._advance multiplies and divides by, on every slot
    assert applied.dtype == torch.float64
    norm_sq = sum(Fraction(float(v)) ** 2 for v in applied.tolist())
    at_most_one = norm_sq <= 1
    assert at_most_one, f"float64 coefficients: Σc² - 1 = {float(norm_sq - 1):.3g}"


def test_the_float32_blt_stream_is_charged_for_the_strategy_it_applies():
    """Attack: rounding in the stream's dtype, amplified by 1/(1-θ). Adversary: as above (a pinned auditor reading
    `factor_p`, "rounded up after a relative margin" of 10⁻⁹ "for float64 error"). Defect: on a float32 slot
    `BLT._advance` applies θ, ω rounded to nearest float32 (and n rounded to float32); for the docs' own
    configuration (d = 2, T = 1000, min separation 250: θ_2 = 0.989…) the exact m of the strategy the stream applies
    exceeds the charged m by 1.6·10⁻⁶ relative, 1600 times the margin, and at σ = 10 the charged multiplier ⌊σ/√m⌋ is
    above σ/√m_real by several micro-units. Should: recur in float64 (θ, ω, n and the buffers), or charge m of the
    dtype-rounded parameters (θ rounded up, n down).

    Fixed by the first remedy, so this test now measures what the fixed stream applies (it first rounded θ, ω and n
    to float32, what the old `_advance` multiplied by on a float32 slot, and no longer what any stream applies): a
    float32 slot's stream is the float64 stream cast at the output, and the exact m of the float64 θ, ω, n it
    recurs on is ≤ the charged m."""
    blt = BLT(buffers=2, horizon=1000, min_separation=250, insecure_seed=4)
    _float32_release_is_the_float64_one_cast(blt)
    theta, omega = [Fraction(t) for t in blt.theta], [Fraction(w) for w in blt.omega]
    realised = _exact_blt_factor(theta, omega, blt.min_separation, Fraction(blt.scale) ** 2)
    sigma_u = 10 * units.MICRO
    charged_u = unamplified_multiplier_u(sigma_u, blt.factor_p)
    rounded_up = Fraction(blt.factor_p, units.PICO) >= realised
    assert rounded_up, (
        f"m of the float32 stream exceeds the charged m by {float(realised * units.PICO / blt.factor_p - 1):.3g} "
        f"relative; charged multiplier {charged_u} µ, real σ/√m = {sigma_u / math.sqrt(realised):.1f} µ")
    assert charged_u <= sigma_u / math.sqrt(realised)


def test_blt_factor_is_rounded_up_even_with_theta_next_to_one():
    """Attack: a BLT record at the limits the checks allow, θ → 1 with Σω = 1 (θ_p = 10¹² - 50, ω_p = 10¹²,
    min separation 1000). Adversary: a key-holding operator against a pinned auditor. Defect: `factor_p` computes m
    in float64 (θ^b by repeated squaring, then 1 - θ^b ≈ b·(1-θ) = 5·10⁻⁸) and adds a relative margin of 10⁻⁹; the
    rounding error of 1 - θ^b is ~log₂(b)·10⁻¹⁶ / (b·(1-θ)), so the exact m of the very strategy the float64 stream
    applies exceeds the charged m by 6·10⁻⁹ relative (also at θ_p = 10¹² - 999 with b = 5, 7, 13): "rounded up" is
    not true (negligible ε, but the rule is that rounding favours privacy). Should: compute m with exact
    rationals (the record is integers) or with a margin from a proven error bound, or refuse records where
    b·(1-θ) is below, say, 10⁻⁶."""
    for k, separation in ((50, 1000), (999, 5), (999, 13)):
        blt = BLT(buffers=1, horizon=10**6, min_separation=separation, theta_p=[units.PICO - k], omega_p=[units.PICO])
        realised = _exact_blt_factor([Fraction(blt.theta[0])], [Fraction(blt.omega[0])], separation,
                                     Fraction(blt.scale) ** 2)
        rounded_up = realised <= Fraction(blt.factor_p, units.PICO)
        assert rounded_up, (
            f"θ_p = 10¹² - {k}, b = {separation}: exact m exceeds the charged m by "
            f"{float(realised * units.PICO / blt.factor_p - 1):.3g} relative")


def test_a_negative_noise_scale_is_refused_not_charged_as_its_magnitude():
    """Attack: a negative σ (a sign slip in a config, or a spend entry written by hand). Adversary: a pinned auditor
    replaying a spend through charge.py, the verifier's path. Defect: `update` treats std < 0 as std 0 and adds no
    noise at all ("scale <= 0: continue"), while `blt_charge` squares σ and charges a negative multiplier as its
    magnitude (σ = -4 → the charge of σ = +4; `banded_charge` passes it through unchanged). The ledger's signed floor
    refuses σ below the contribution's minimum today, so this is defence in depth for the verifier's own path.
    Should: `update` raise ValueError on a negative or non-finite std, and both charges on σ ≤ 0 or q outside
    (0, 1] (as they already do on negative steps)."""
    blt = BLT(buffers=2, horizon=100, min_separation=4)
    with pytest.raises(ValueError):
        blt_charge(blt.record(), sampling_rate_u=1_000, noise_multiplier_u=-4_000_000, steps=10)
    banded = BandedMF(bands=4, horizon=100).record()
    with pytest.raises(ValueError):
        banded_charge(banded, sampling_rate_u=-1_000, noise_multiplier_u=1_000_000, steps=10)
    slot = _slot()
    state = blt.init([slot])
    with pytest.raises(ValueError):
        blt.update({slot.key: _zeros(slot)}, state, std={slot.key: -1.0})


# ======================================================================================================================
# HELD: attacks tried that the code withstands (regression tests).
# ======================================================================================================================


@pytest.mark.parametrize("privatizer", [BandedMF(bands=4, horizon=40, insecure_seed=5),
                                        BLT(buffers=2, horizon=40, min_separation=4, insecure_seed=5)],
                         ids=lambda p: p.name)
def test_held_the_uninterrupted_and_resumed_stream_realise_the_recorded_strategy(privatizer):
    """The oracle's baseline: an uninterrupted float64 stream, and one resumed mid-cycle (step 6, b = 4) under the
    same record, realise exactly C/n: the same columns, norms ≤ the charge's bound."""
    slot = _slot()
    for resume_at in (None, 6):
        state = privatizer.init([slot])
        released = []
        for step in range(24):
            if step == resume_at:
                state = type(privatizer).from_record(privatizer.record()).load_state([slot],
                                                                                      privatizer.state_dict(state))
            noisy, state = privatizer.update({slot.key: _zeros(slot)}, state, std={slot.key: 1.0})
            released.append(noisy[slot.key].numpy().copy())
        realised = _realised_strategy(released, state.key, slot)
        if isinstance(privatizer, BandedMF):
            column = np.pad(privatizer.column.numpy(), (0, 24 - privatizer.bands))
        else:
            column = privatizer.column(24)
        dense = np.array([[column[i - j] if i >= j else 0.0 for j in range(24)] for i in range(24)])
        np.testing.assert_allclose(realised, dense, atol=1e-9)
        assert np.linalg.norm(realised, axis=0).max() ** 2 <= _per_participation_bound(privatizer) * (1 + 1e-9)


@pytest.mark.parametrize("buffers, separation", [(2, 1), (4, 16), (3, 50)])
def test_held_blt_m_bounds_the_dense_worst_case_at_large_horizon_and_varying_sigma(buffers, separation):
    """m too small? Against a dense brute force at T = 2000 (1200 at b = 1): for b-separated participations with any
    weights v_t = 1/σ_t ≥ 0, max ‖(C/n)v‖² / Σv² over the earliest (worst) pattern is the top eigenvalue of C's Gram
    matrix restricted to it (its Perron vector is ≥ 0), which must stay ≤ the charged m and be close to it."""
    horizon = 1200 if separation == 1 else 2000
    blt = BLT(buffers=buffers, horizon=horizon, min_separation=separation)
    column = blt.column(horizon)
    pattern = np.arange(0, horizon, separation)
    # C/n restricted to the pattern's columns, built without a T×T matrix: column s is the shifted first column
    block = np.stack([np.concatenate([np.zeros(s), column[: horizon - s]]) for s in pattern], axis=1)
    top = float(np.linalg.eigvalsh(block.T @ block)[-1])
    m = blt.factor_p / units.PICO
    assert top <= m
    assert top >= 0.95 * m  # tight: the bound is what the worst pattern costs
    generator = np.random.default_rng(3)
    for _ in range(5):  # step-varying σ_t: the weighted sensitivity stays under m·Σ 1/σ_t²
        v = 1 / generator.uniform(0.3, 3.0, pattern.shape[0])
        assert float(np.sum((block @ v) ** 2)) <= m * float(np.sum(v * v))


@pytest.mark.parametrize("buffers, horizon, separation", [(2, 1000, 250), (2, 1000, 16), (4, 500, 50), (2, 10_000, 1)])
def test_held_float64_blt_m_is_rounded_up_for_optimised_records(buffers, horizon, separation):
    """For the records the optimiser writes (θ no closer to 1 than about 1 - 1/T), the exact m of the strategy the
    float64 stream applies (θ, ω as the floats it multiplies by, n = `scale`) stays ≤ the charged `factor_p`."""
    blt = BLT(buffers=buffers, horizon=horizon, min_separation=separation)
    realised = _exact_blt_factor([Fraction(t) for t in blt.theta], [Fraction(w) for w in blt.omega], separation,
                                 Fraction(blt.scale) ** 2)
    assert realised <= Fraction(blt.factor_p, units.PICO)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-9), (torch.float32, 2e-4)])
def test_held_the_stream_does_not_drift_over_thousands_of_steps(dtype, tolerance):
    """Numerics: the streamed noise against the dense C⁻¹z at T = 2000 (banded b = 64 and a 4-buffer BLT at min
    separation 1, θ close to 1), in float64 and float32: no drift or instability of the recursions."""
    horizon, slot = 2000, _slot(shape=(4,), dtype=dtype)
    for privatizer in (BandedMF(bands=64, horizon=horizon, insecure_seed=9),
                       BLT(buffers=4, horizon=horizon, min_separation=1, insecure_seed=9)):
        state = privatizer.init([slot])
        released = []
        for _ in range(horizon):
            noisy, state = privatizer.update({slot.key: _zeros(slot)}, state, std={slot.key: 1.0})
            released.append(noisy[slot.key].double().numpy())
        z = np.stack([standard_normal(state.key, slot, t).double().numpy() for t in range(horizon)])
        if isinstance(privatizer, BandedMF):
            numerator, denominator = [1.0], privatizer.column.numpy()
        else:
            numerator, denominator = [1.0], privatizer.column(horizon)
        inverse = toeplitz.inverse_column(numerator, denominator, horizon)  # C⁻¹'s first column
        expected = np.stack([np.convolve(inverse, z[:, i])[:horizon] for i in range(z.shape[1])], axis=1)
        error = np.abs(np.stack(released) - expected).max() / np.abs(expected).max()
        assert error <= tolerance, (privatizer.name, error)


def test_held_secrets_stay_out_of_repr_errors_records_and_pickles():
    """Secrecy: the key and buffers appear in no repr or str of the state, in no error `load_state` or `update`
    raises, in no record, and not in a pickle of the privatizer (only `state_dict` holds them, as a copy)."""
    import pickle

    slot = _slot(shape=(3,))
    privatizer = BandedMF(bands=4, horizon=20, entropy=_fixed_entropy)
    state = privatizer.init([slot])
    _, state = privatizer.update({slot.key: _zeros(slot)}, state, std={slot.key: 1.0})
    secret_hex = state.key.hex()
    values = [f"{v:.4f}" for v in state.buffers[slot.key].flatten().tolist() if v != 0]
    texts = [repr(state), str(state), repr(privatizer.record()), pickle.dumps(privatizer).hex()]
    saved = privatizer.state_dict(state)
    for broken in ({**saved, "step": -1}, {**saved, "buffers": {slot.key: torch.zeros(2, 3)}}, {"key": saved["key"]}):
        with pytest.raises(ValueError) as caught:
            privatizer.load_state([slot], broken)
        texts.append(str(caught.value))
    with pytest.raises(ValueError) as caught:
        privatizer.update({"other": torch.zeros(3)}, state, std={})
    texts.append(str(caught.value))
    for text in texts:
        assert secret_hex not in text and "abab" not in text.lower()
        assert not any(v in text for v in values)
    saved["buffers"][slot.key].add_(1.0)  # the saved copy is a copy
    assert not torch.equal(saved["buffers"][slot.key], state.buffers[slot.key])


def test_held_the_charge_reads_the_record_alone():
    """The charge uses only the record: a privatizer optimised here and one rebuilt from its record with different
    torch thread counts charge the same, and records that differ only in the (public) horizon charge the same."""
    banded = BandedMF(bands=8, horizon=300)
    blt = BLT(buffers=2, horizon=300, min_separation=30)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        rebuilt = [type(p).from_record(p.record()) for p in (banded, blt)]
    finally:
        torch.set_num_threads(threads)
    for original, copy in zip((banded, blt), rebuilt):
        assert copy.charge(sampling_rate_u=3_000, noise_multiplier_u=1_100_000, steps=77) == \
            original.charge(sampling_rate_u=3_000, noise_multiplier_u=1_100_000, steps=77)
    assert banded_charge({**banded.record(), "horizon": 10**9}, sampling_rate_u=3_000, noise_multiplier_u=1_100_000,
                         steps=77) == banded_charge(banded.record(), sampling_rate_u=3_000,
                                                    noise_multiplier_u=1_100_000, steps=77)


def test_held_records_past_the_bounds_are_refused():
    """Under-charging records the checks refuse: bands > horizon, a coefficient list longer or shorter than b,
    c_0 = 0 or negative, Σc² = 1 + 10⁻²⁴, bool or float ints; θ = 1, θ = 0, Σω = 1 + 10⁻¹², ω < 0."""
    pico = units.PICO
    banded = {"name": "banded-mf", "bands": 2, "horizon": 10, "coefficients_p": [pico // 2, pico // 2]}
    for bad in ({**banded, "bands": 11, "horizon": 10},
                {**banded, "coefficients_p": [pico // 2, pico // 2, 1]},
                {**banded, "coefficients_p": [pico // 2]},
                {**banded, "coefficients_p": [0, pico // 2]},
                {**banded, "coefficients_p": [-1, pico // 2]},
                {**banded, "bands": 1, "coefficients_p": [pico + 1]},
                {**banded, "coefficients_p": [pico // 2, True]},
                {**banded, "coefficients_p": [pico / 2, 1]}):
        with pytest.raises(ValueError):
            banded_charge(bad, sampling_rate_u=1, noise_multiplier_u=1, steps=1)
    blt = {"name": "blt", "buffers": 2, "horizon": 10, "min_separation": 2, "theta_p": [pico // 2, pico // 3],
           "omega_p": [pico // 2, pico // 2]}
    for bad in ({**blt, "theta_p": [pico, 1]}, {**blt, "theta_p": [0, 1]},
                {**blt, "omega_p": [pico // 2 + 1, pico // 2]},
                {**blt, "omega_p": [-1, 1]}, {**blt, "min_separation": 11}):
        with pytest.raises(ValueError):
            blt_charge(bad, sampling_rate_u=1, noise_multiplier_u=1, steps=1)


def test_held_a_rate_past_one_is_capped_alike_in_the_sampler_and_the_charge():
    """b·q > 1: the sampler draws each part member at min(1, b·q) and the banded charge composes at that same
    rate, so nothing is under-charged (the expected batch silently falls below q·N: a utility surprise, not a
    privacy one).

    After the review the sampler refuses b·q > 1 unless it is explicitly allowed (`allow_rate_cap=True`), so the
    surprise is no longer silent; the capped sampler, once allowed, still draws at the rate the charge composes."""
    with pytest.raises(ValueError, match="expected batch would drop"):
        CyclicPoissonSampler(0.3, cycle=4, partition_key=b"run")
    sampler = CyclicPoissonSampler(0.3, cycle=4, partition_key=b"run", allow_rate_cap=True)
    rate_u, _, rounds = banded_charge(BandedMF(bands=4, horizon=20).record(), sampling_rate_u=300_000,
                                      noise_multiplier_u=1_000_000, steps=20)
    assert sampler.part_rate == 1.0 and rate_u == units.MICRO and rounds == 5


def _cyclic(cycle: int, q: float, key: bytes = bytes(range(32)), partition_key: bytes = b"run-7"):
    sampler = CyclicPoissonSampler(q, cycle=cycle, partition_key=partition_key)
    sampler.key = key
    return sampler


def test_held_withdrawal_readmission_and_mid_cycle_resume_keep_min_separation():
    """Eligibility churns every step (withdrawals, readmissions, a unit's index coming back), the run is resumed
    mid-cycle by new sampler objects at odd epoch lengths (5, 7, 3, 9 with b = 4): no unit is drawn twice within b
    steps, and each unit's draws are ≤ Σ ⌈n_e / b⌉, the rounds the per-epoch charge counts."""
    cycle, units_ = 4, 3000
    generator = np.random.default_rng(11)
    epochs = [5, 7, 3, 9]
    last: dict[int, int] = {}
    draws: dict[int, int] = {}
    step = 0
    identities = unit_identities(str(u) for u in range(units_))
    for length in epochs:
        sampler = _cyclic(cycle, 0.2)  # a new process: rebuilt from the run state
        for _ in range(length):
            eligible = np.flatnonzero(generator.random(units_) < 0.7)
            sampler.at_step(step)
            for unit in sampler.sample(eligible, identities=identities).tolist():
                assert step - last.get(unit, -cycle) >= cycle
                last[unit] = step
                draws[unit] = draws.get(unit, 0) + 1
            step += 1
    assert max(draws.values()) <= sum(math.ceil(n / cycle) for n in epochs)


def test_held_inclusion_is_independent_across_units_within_a_part():
    """Independence within a part: over 400 steps of one part (rate 0.5), the batch size has the binomial variance
    (a shared or correlated draw inflates or deflates it), and neighbouring indices of the part are co-drawn at p²
    (χ² over their 2×2 tables), each within 5 standard errors."""
    cycle, units_, rate = 4, 4000, 0.5
    sampler = _cyclic(cycle, rate / cycle)
    identities = unit_identities(str(u) for u in range(units_))
    parts = cyclic_parts(identities, cycle, b"run-7")
    members = np.flatnonzero(parts == 0)
    included = []
    for i in range(400):
        sampler.at_step(i * cycle)  # part 0's steps
        row = np.zeros(units_, dtype=bool)
        row[sampler.sample(np.arange(units_), identities=identities)] = True
        included.append(row[members])
    included = np.array(included)
    sizes = included.sum(axis=1)
    n = members.shape[0]
    variance = n * rate * (1 - rate)
    # the sample variance of 400 binomial sizes has standard error ≈ variance·√(2/399)
    assert abs(sizes.var(ddof=1) - variance) <= 5 * variance * math.sqrt(2 / 399)
    a, b = included[:, :-1].ravel(), included[:, 1:].ravel()
    both = float(np.mean(a & b))
    assert abs(both - rate * rate) <= 5 * math.sqrt(rate * rate * (1 - rate * rate) / a.shape[0])


def test_held_the_partition_ignores_who_else_is_eligible_and_the_secret_key():
    """The part is a function of the unit's identity and the public partition key alone: not of the eligible set,
    not of the secret draw key; two runs under one partition key agree, and the draws inside a part follow the key."""
    units_ = 5000
    identities = unit_identities(str(u) for u in range(units_))
    parts = cyclic_parts(identities, 8, b"run-7")
    for subset in (np.arange(0, units_, 3), np.array([4999, 0, 17])):
        assert np.array_equal(cyclic_parts(identities[subset], 8, b"run-7"), parts[subset])
    one, two = _cyclic(8, 0.05, key=bytes(32)), _cyclic(8, 0.05, key=bytes(range(32)))
    one.at_step(3)
    two.at_step(3)
    batch_one = one.sample(np.arange(units_), identities=identities)
    batch_two = two.sample(np.arange(units_), identities=identities)
    assert np.all(parts[batch_one] == 3) and np.all(parts[batch_two] == 3)
    assert not np.array_equal(batch_one, batch_two)
