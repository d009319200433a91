"""What correlated noise charges, through govtrain's accountants, against dp-accounting's own composition of the
published reduction (jax_privacy's `amplified_bandmf_event`: DP-SGD at rate b·q over ⌈T/b⌉ rounds) and against
prv-accountant; BLT's unamplified charge against a single Gaussian at the dense multi-participation sensitivity."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from decimal import Decimal, getcontext

import dp_accounting
import pytest
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from govtrain import units
from govtrain.accounting.accountants import Bucket, PLDAccountant, PRVAccountant, RDPAccountant
from govtrain.privatizers.mf import toeplitz
from govtrain.privatizers.mf.banded import BandedMF
from govtrain.privatizers.mf.blt import BLT
from govtrain.privatizers.mf.charge import banded_charge, blt_charge, participation_factor, unamplified_multiplier_u

DELTA = 1e-5
CASES = [  # (q, σ, T, b)
    (0.005, 1.0, 1000, 16),
    (0.01, 0.8, 512, 4),
    (0.002, 1.2, 2000, 64),
    (0.2, 1.5, 100, 8),  # b·q > 1: the rate is capped at 1
]


def _bucket(charge) -> Bucket:
    assert charge.family == "gaussian" and charge.params == ()
    return Bucket.from_micro(charge.sampling_rate_u, charge.noise_multiplier_u, charge.rounds)


def _reference(q: float, sigma: float, bands: int, steps: int):
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(min(1.0, bands * q), dp_accounting.GaussianDpEvent(sigma)),
        math.ceil(steps / bands))


@pytest.mark.parametrize("q, sigma, horizon, bands", CASES)
def test_banded_charge_is_dp_sgd_over_rounds_as_dp_accounting_composes_it(q, sigma, horizon, bands):
    banded = BandedMF(bands=bands, horizon=horizon, coefficients_p=[units.PICO] + [0] * (bands - 1))
    charge = banded.charge(sampling_rate_u=units.to_micro(q, "up"), noise_multiplier_u=units.to_micro(sigma, "down"),
                           steps=horizon)
    assert charge.rounds == math.ceil(horizon / bands)
    assert charge.sampling_rate_u == min(units.MICRO, bands * units.to_micro(q, "up"))
    event = _reference(q, sigma, bands, horizon)
    pld = pld_privacy_accountant.PLDAccountant().compose(event).get_epsilon(DELTA)
    rdp = rdp_privacy_accountant.RdpAccountant().compose(event).get_epsilon(DELTA)
    assert PLDAccountant().epsilon([_bucket(charge)], DELTA).epsilon_u == units.spent_eps_u(float(pld))
    assert RDPAccountant().epsilon([_bucket(charge)], DELTA).epsilon_u == units.spent_eps_u(float(rdp))
    # prv-accountant, a second library: its bounds bracket dp-accounting's PLD answer (to its eps_error)
    prv = PRVAccountant().epsilon([_bucket(charge)], DELTA)
    assert prv.fallback is None
    assert prv.lower - 0.01 <= pld <= prv.epsilon + 0.01


def test_one_band_is_dp_sgd():
    charge = BandedMF(bands=1, horizon=100).charge(sampling_rate_u=7_000, noise_multiplier_u=1_100_000, steps=100)
    assert (charge.sampling_rate_u, charge.noise_multiplier_u, charge.rounds) == (7_000, 1_100_000, 100)


def test_at_equal_sigma_banded_costs_at_least_dp_sgd():
    # the same σ buys fewer, larger-rate rounds: banded's ε is not below DP-SGD's at equal σ (amplification is
    # weaker), which is why its error advantage is reported at equal sensitivity, and the utility bench at equal ε
    q, sigma, horizon = 0.004, 1.0, 1000
    dp_sgd = PLDAccountant().epsilon([Bucket(q, sigma, horizon)], DELTA).epsilon
    banded = BandedMF(bands=16, horizon=horizon).charge(sampling_rate_u=4_000, noise_multiplier_u=1_000_000,
                                                        steps=horizon)
    assert PLDAccountant().epsilon([_bucket(banded)], DELTA).epsilon >= dp_sgd


@pytest.mark.parametrize("bands", [3, 4, 7])
def test_per_epoch_ceilings_never_under_count(bands):
    # epochs of any lengths (not multiples of b): for every part (offset), the participations that the sampler
    # allows in the run are at most the sum of the epochs' charged rounds
    banded = BandedMF(bands=bands, horizon=64, coefficients_p=[units.PICO] + [0] * (bands - 1))
    for epochs in ([5, 5, 5, 5], [1, 2, 3, 4, 5, 6], [bands + 1] * 4, [2 * bands - 1, 1, bands]):
        charged = sum(banded.charge(sampling_rate_u=1_000, noise_multiplier_u=1_000_000, steps=n).rounds
                      for n in epochs)
        for part in range(bands):
            assert sum(1 for t in range(sum(epochs)) if t % bands == part) <= charged
        # and within each epoch, per part, it is never more than that epoch's ceiling
        start = 0
        for n in epochs:
            for part in range(bands):
                assert sum(1 for t in range(start, start + n) if t % bands == part) <= math.ceil(n / bands)
            start += n


def test_blt_multiplier_is_rounded_down_exactly():
    getcontext().prec = 50
    for sigma_u, m_p in ((1_000_000, 2_345_678_901_234), (777_777, 1_000_000_000_000), (3_000_001, 17_000_000_000_001)):
        exact = Decimal(sigma_u) / (Decimal(m_p) / Decimal(units.PICO)).sqrt()
        got = unamplified_multiplier_u(sigma_u, m_p)
        assert got <= exact < got + 1


@pytest.mark.parametrize("buffers, horizon, separation", [(2, 240, 16), (4, 500, 50), (1, 120, 3)])
def test_blt_charge_against_a_single_gaussian_at_the_dense_sensitivity(buffers, horizon, separation):
    blt = BLT(buffers=buffers, horizon=horizon, min_separation=separation)
    sigma_u = 4_000_000
    charge = blt.charge(sampling_rate_u=1_000, noise_multiplier_u=sigma_u, steps=horizon)
    k = math.ceil(horizon / separation)
    assert charge.rounds == k and charge.sampling_rate_u == units.MICRO  # unamplified: rate 1
    m = participation_factor(blt.theta, blt.omega, separation)
    charged = PLDAccountant().epsilon([_bucket(charge)], DELTA).epsilon
    # k unsampled Gaussians at σ/√m compose to one Gaussian with sensitivity √(k·m) (dp-accounting composes it)
    composed = pld_privacy_accountant.PLDAccountant().compose(
        dp_accounting.GaussianDpEvent(sigma_u / units.MICRO / math.sqrt(k * m))).get_epsilon(DELTA)
    assert charged == pytest.approx(composed, abs=2e-3)
    # the true worst case over k b-separated participations (dense over the horizon) is no larger
    sensitivity = toeplitz.min_sep_sensitivity(blt.column(horizon), separation, k)
    assert sensitivity ** 2 <= k * m
    tight = pld_privacy_accountant.PLDAccountant().compose(
        dp_accounting.GaussianDpEvent(sigma_u / units.MICRO / sensitivity)).get_epsilon(DELTA)
    assert tight <= charged
    # rebuilt from its record (the verifier's path), it charges the same
    assert BLT.from_record(blt.record()).charge(sampling_rate_u=1_000, noise_multiplier_u=sigma_u,
                                                steps=horizon) == charge


def test_the_charge_is_computed_from_the_record_without_torch():
    banded = BandedMF(bands=16, horizon=400)
    blt = BLT(buffers=2, horizon=400, min_separation=40)
    program = (
        "import sys, json\n"
        "from govtrain.privatizers.mf.charge import banded_charge, blt_charge\n"
        "records = json.loads(sys.argv[1])\n"
        "print(json.dumps([banded_charge(records[0], sampling_rate_u=4000, noise_multiplier_u=900000, steps=130),\n"
        "                  blt_charge(records[1], sampling_rate_u=4000, noise_multiplier_u=900000, steps=130)]))\n"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, sorted(sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", program, json.dumps([banded.record(), blt.record()])],
                          capture_output=True, text=True, check=True)
    verifier = [tuple(c) for c in json.loads(done.stdout)]
    for got, privatizer in zip(verifier, (banded, blt)):
        charge = privatizer.charge(sampling_rate_u=4000, noise_multiplier_u=900000, steps=130)
        assert got == (charge.sampling_rate_u, charge.noise_multiplier_u, charge.rounds)
    assert verifier[0] == banded_charge(banded.record(), sampling_rate_u=4000, noise_multiplier_u=900000, steps=130)
    assert verifier[1] == blt_charge(blt.record(), sampling_rate_u=4000, noise_multiplier_u=900000, steps=130)
