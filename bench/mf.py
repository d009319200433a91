"""Correlated noise figures for issue 24 (govtrain/privatizers/mf).

1. Prefix-sum error against DP-SGD at equal sensitivity, before amplification: the mean squared error of the T
   noisy prefix sums at unit noise, ‖A C⁻¹‖_F²/T, times the squared sensitivity the charge uses (1 for banded, whose
   b-separated participations touch disjoint rows; m for BLT at its min separation), over DP-SGD's (T+1)/2. Printed as
   the MSE ratio and its square root (the RMS noise ratio). BLT is shown for one participation (min separation T)
   and for min separation 16 (⌈T/16⌉ participations, unamplified, per participation).
2. ε at equal σ: DP-SGD (rate q, T steps) against banded MF (rate b·q, ⌈T/b⌉ rounds) through the PLD accountant.
3. Error at equal ε (the utility proxy): each mechanism's σ calibrated to ε, then σ·√(err·sensitivity²) over
   DP-SGD's: DP-SGD and banded at rate q (amplified), BLT at min separation 1/q (one participation per epoch,
   unamplified, σ from the analytic Gaussian at sensitivity √(k·m)).

    .venv/bin/python bench/mf.py [--horizons 256 1000 4000] [--skip-calibration]

Strategies are the ones the privatizers build (optimised for each horizon, rounded as recorded).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from govtrain import units  # noqa: E402
from govtrain.accounting.accountants import Bucket, PLDAccountant  # noqa: E402
from govtrain.accounting.calibrate import analytic_gaussian_sigma, noise_multiplier_for  # noqa: E402
from govtrain.privatizers.mf import toeplitz  # noqa: E402
from govtrain.privatizers.mf.banded import BandedMF  # noqa: E402
from govtrain.privatizers.mf.blt import BLT  # noqa: E402

BANDS = (1, 4, 16, 64)
BUFFERS = (2, 4)
DELTA = 1e-5


def banded_error(bands: int, horizon: int) -> float:
    column = np.array(BandedMF(bands=bands, horizon=horizon).coefficients_p, dtype=np.float64) / units.PICO
    return toeplitz.prefix_error(toeplitz.inverse_column([1.0], column, horizon)) * float(np.dot(column, column))


def blt_error(buffers: int, horizon: int, separation: int) -> tuple[float, float]:
    """(err at unit noise, m) of the optimised BLT; err·m is its error at equal per-participation sensitivity."""
    blt = BLT(buffers=buffers, horizon=horizon, min_separation=separation)
    error = toeplitz.prefix_error(toeplitz.inverse_column([1.0], blt.column(horizon), horizon))
    return error, blt.factor_p / units.PICO


def error_table(horizons: list[int]) -> None:
    print("1. prefix-sum error / DP-SGD's at equal sensitivity (MSE ratio, RMS ratio)")
    print(f"{'strategy':<28}" + "".join(f"{'T=' + str(t):>20}" for t in horizons))
    rows = [(f"banded b={b}", lambda t, b=b: banded_error(b, t)) for b in BANDS]
    rows += [(f"BLT d={d} (1 participation)", lambda t, d=d: math.prod(blt_error(d, t, t))) for d in BUFFERS]
    rows += [(f"BLT d={d} (min sep 16)", lambda t, d=d: math.prod(blt_error(d, t, 16))) for d in BUFFERS]
    for label, error in rows:
        cells = []
        for horizon in horizons:
            ratio = error(horizon) / toeplitz.identity_error(horizon)
            cells.append(f"{ratio:>10.4f} {math.sqrt(ratio):>8.4f}")
        print(f"{label:<28}" + "".join(f"{c:>20}" for c in cells))


def epsilon_table(horizon: int, q_u: int) -> None:
    print(f"\n2. ε at equal σ (PLD, δ = {DELTA:g}, T = {horizon}, q = {q_u / units.MICRO:g})")
    print(f"{'σ':>6}{'DP-SGD':>10}" + "".join(f"{'banded b=' + str(b):>14}" for b in BANDS[1:]))
    pld = PLDAccountant()
    for sigma_u in (800_000, 1_000_000, 1_500_000, 3_000_000):
        dp_sgd = pld.epsilon([Bucket.from_micro(q_u, sigma_u, horizon)], DELTA).epsilon
        cells = []
        for bands in BANDS[1:]:
            charge = BandedMF(bands=bands, horizon=horizon).charge(sampling_rate_u=q_u, noise_multiplier_u=sigma_u,
                                                                   steps=horizon)
            bucket = Bucket.from_micro(charge.sampling_rate_u, charge.noise_multiplier_u, charge.rounds)
            cells.append(pld.epsilon([bucket], DELTA).epsilon)
        print(f"{sigma_u / units.MICRO:>6g}{dp_sgd:>10.3f}" + "".join(f"{e:>14.3f}" for e in cells))


def equal_epsilon_table(horizon: int, q_u: int) -> None:
    q = q_u / units.MICRO
    separation = round(1 / q)
    k = math.ceil(horizon / separation)
    print(f"\n3. RMS prefix-sum noise / DP-SGD's at equal ε (T = {horizon}, q = {q:g}, δ = {DELTA:g};"
          f" BLT at min separation {separation}, {k} participations, unamplified)")
    epsilons = (1.0, 3.0, 8.0)
    print(f"{'mechanism':<22}" + "".join(f"{'ε=' + format(e, 'g'):>16}" for e in epsilons))
    base = {}
    for e in epsilons:
        base[e] = noise_multiplier_for(e, DELTA, q, horizon, "pld").noise_multiplier * math.sqrt(
            toeplitz.identity_error(horizon))
    for bands in BANDS[1:]:
        error = banded_error(bands, horizon)
        cells = []
        for e in epsilons:
            rounds = math.ceil(horizon / bands)
            sigma = noise_multiplier_for(e, DELTA, min(1.0, bands * q), rounds, "pld").noise_multiplier
            cells.append(f"{sigma:7.3f} {sigma * math.sqrt(error) / base[e]:7.3f}")
        print(f"{'banded b=' + str(bands):<22}" + "".join(f"{c:>16}" for c in cells))
    for buffers in BUFFERS:
        error, m = blt_error(buffers, horizon, separation)
        cells = []
        for e in epsilons:
            sigma = analytic_gaussian_sigma(e, DELTA, math.sqrt(k * m))
            cells.append(f"{sigma:7.3f} {sigma * math.sqrt(error) / base[e]:7.3f}")
        print(f"{'BLT d=' + str(buffers):<22}" + "".join(f"{c:>16}" for c in cells))
    print("(each cell: σ, then the RMS ratio; DP-SGD's σ: "
          + ", ".join(f"{base[e] / math.sqrt(toeplitz.identity_error(horizon)):.3f}" for e in epsilons) + ")")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--horizons", type=int, nargs="+", default=[256, 1000, 4000])
    parser.add_argument("--q-u", type=int, default=4_000, help="the Poisson rate q in micro-units (default 0.004)")
    parser.add_argument("--skip-calibration", action="store_true")
    args = parser.parse_args()
    start = time.perf_counter()
    error_table(args.horizons)
    epsilon_table(1000, args.q_u)
    if not args.skip_calibration:
        equal_epsilon_table(1000, args.q_u)
    print(f"\n({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
