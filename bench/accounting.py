"""Accounting figures for issue 4.

1. Per-contribution spend for 100,000 contributions over 10 ledger epochs, through the noise schedule
   (s_g, sigma_eff, retirement) and the cached spend calculator, with each accountant. The corpus is
   the demo policy's three classes. Two corpora: every contributor signs its class's preset (the
   depth-routing seed's model), and 15% sign stricter bounds or different budgets from a short menu;
   0.3% withdraw each epoch. The result is a
   100,000 x 10 array of cumulative epsilon; a sample of rows is checked against a direct accountant
   call on that contribution's own history.
2. The time of one `privacy epsilon` evaluation per accountant on the 27-point grid of issue 4.

    .venv/bin/python bench/accounting.py [--contributions N] [--epochs E] [--skip-grid] [--workers W]

Wall-clock time on this shared 2-core VM varies by tens of percent between runs; each figure is the
median of --repeat runs, each with a cold cache.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from govtrain.accounting import Bucket, get_accountant  # noqa: E402
from govtrain.accounting.spend import SpendCalculator, default_workers  # noqa: E402
from govtrain.resolver.schedule import Member, Scheduler, cohorts_of, disjoint_groups  # noqa: E402

DELTA_P = 10_000_000  # 1e-5
Q_U = 10_000  # q = 0.01
STEPS_PER_EPOCH = 100
# class: (share, clip_norm_u, min sigma_u, default budget_u, max budget_u)
CLASSES = {
    "public": (0.6, 1_000_000, 600_000, 8_000_000, 10_000_000),
    "sensitive": (0.3, 500_000, 1_000_000, 3_000_000, 4_000_000),
    "restricted": (0.1, 500_000, 1_500_000, 1_000_000, 2_000_000),
}


def corpus(n: int, stricter: float, seed: int = 7) -> list[Member]:
    rng = random.Random(seed)
    names = list(CLASSES)
    weights = [CLASSES[c][0] for c in names]
    members = []
    for i in range(n):
        name = rng.choices(names, weights)[0]
        _, clip, sigma, budget, max_budget = CLASSES[name]
        if rng.random() < stricter:  # a stricter signer
            clip = rng.choice([clip, clip // 2])
            sigma = sigma + rng.choice([0, 200_000, 500_000])
            budget = rng.choice([budget, max_budget, budget // 2])
        members.append(Member(f"c{i:06d}", name, clip, sigma, budget))
    return members


def spend_run(members: list[Member], epochs: int, accountant: str, workers: int, seed: int = 11):
    """Returns (seconds, eps array [n, epochs], calculator, cohorts)."""
    rng = np.random.default_rng(seed)
    ids = [m.contribution_id for m in members]
    eps = np.zeros((len(members), epochs), dtype=np.int64)
    calculator = SpendCalculator(accountant, DELTA_P, workers=workers, share=False)  # timed: nothing from an earlier run
    start = time.perf_counter()
    cohorts = cohorts_of(members)
    cohort_of = {c: i for i, cohort in enumerate(cohorts) for c in cohort.members}
    row_cohort = np.array([cohort_of[c] for c in ids])
    alive = np.ones(len(members), dtype=bool)
    scheduler = Scheduler(calculator, disjoint_groups(CLASSES), sampling_rate_u=Q_U, steps_per_epoch=STEPS_PER_EPOCH)
    for epoch in range(epochs):
        # Withdrawals before the epoch: those members leave their cohorts and keep the epsilon they had.
        candidates = np.flatnonzero(alive)
        for row in rng.choice(candidates, len(candidates) * 3 // 1000, replace=False):
            alive[row] = False
            cohorts[row_cohort[row]].members.discard(ids[row])
        scheduler.plan_epoch(cohorts, epoch, epoch * STEPS_PER_EPOCH)
        cohort_eps = np.array([c.eps_u for c in cohorts], dtype=np.int64)
        eps[:, epoch] = np.where(alive, cohort_eps[row_cohort], eps[:, epoch - 1] if epoch else 0)
    seconds = time.perf_counter() - start
    calculator.close()
    return seconds, eps, calculator, cohorts


def check_rows(members, cohorts, eps, accountant: str, sample: int = 5) -> None:
    """Each sampled cohort's final epsilon equals a direct accountant call on its own history."""
    direct = get_accountant(accountant)
    index = {m.contribution_id: i for i, m in enumerate(members)}
    candidates = [c for c in cohorts if c.members and c.history]
    for cohort in random.Random(3).sample(candidates, min(sample, len(candidates))):
        buckets = [Bucket.from_micro(*b) for b in cohort.history]
        expected = direct.epsilon(buckets, DELTA_P / 1e12).epsilon_u
        row = eps[index[min(cohort.members)]]
        assert row[-1] == cohort.eps_u == expected, (row[-1], cohort.eps_u, expected)
        assert cohort.eps_u <= cohort.eps_budget_u


def _cold() -> None:
    """Forget every cached PLD and RDP curve, so each timed call pays for everything it needs."""
    from govtrain.accounting import accountants

    accountants._one_step_pld.cache_clear()
    accountants._rdp_curve.cache_clear()
    accountants._fallback_pld.cache_clear()
    accountants._rdp_of.cache_clear()


def grid_times() -> None:
    print("\none `privacy epsilon` evaluation per accountant (s, one cold call each)")
    print(f"{'q':>6} {'sigma':>5} {'T':>6} | {'prv':>7} {'pld':>7} {'rdp':>7} | note")
    for q in (0.001, 0.01, 0.1):
        for sigma in (0.6, 1.0, 2.0):
            for steps in (100, 1000, 10000):
                row, note = [], ""
                for name in ("prv", "pld", "rdp"):
                    accountant = get_accountant(name)
                    _cold()
                    t = time.perf_counter()
                    result = accountant.epsilon([Bucket(q, sigma, steps)], 1e-5)
                    row.append(time.perf_counter() - t)
                    if result.fallback:
                        note = "prv fell back to pld"
                print(f"{q:>6} {sigma:>5} {steps:>6} | {row[0]:7.3f} {row[1]:7.3f} {row[2]:7.3f} | {note}")


def search_times() -> None:
    """A run's planner asks `prv` for k = 1, 2, ... steps at one (q, sigma) (`SpendCalculator.max_steps`): each call
    builds its own prv-accountant, whose domain bound evaluates the mechanism's RDP at 150 orders (the part
    `accountants._rdp_of` remembers per (q, sigma)). The first call pays for it, the later ones reuse it; "library" is
    each call with that part evaluated again, as prv-accountant alone does."""
    from prv_accountant import PoissonSubsampledGaussianMechanism
    from prv_accountant import PRVAccountant as Library

    print("\nthe planner's step search under prv at q = 0.25, sigma = 1.0, k = 1..16 (ms per call)")
    _cold()
    accountant, ours = get_accountant("prv"), []
    for k in range(1, 17):
        t = time.perf_counter()
        accountant.epsilon([Bucket(0.25, 1.0, k)], 1e-5)
        ours.append(1000 * (time.perf_counter() - t))
    library = []
    for k in range(1, 17):
        t = time.perf_counter()
        Library(prvs=[PoissonSubsampledGaussianMechanism(noise_multiplier=1.0, sampling_probability=0.25)],
                max_self_compositions=[k], eps_error=0.01, delta_error=1e-10).compute_epsilon(
            delta=1e-5, num_self_compositions=[k])
        library.append(1000 * (time.perf_counter() - t))
    print(f"  first call {ours[0]:.0f}; later calls: median {statistics.median(ours[1:]):.0f} "
          f"(library, each call afresh: median {statistics.median(library[1:]):.0f})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contributions", type=int, default=100_000)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workers", type=int, default=default_workers())
    parser.add_argument("--accountants", default="pld,prv,rdp")
    parser.add_argument("--skip-grid", action="store_true")
    parser.add_argument("--skip-scale", action="store_true")
    args = parser.parse_args()

    import dp_accounting.pld.privacy_loss_distribution  # noqa: F401  (imports are paid once per process,
    import dp_accounting.rdp.rdp_privacy_accountant  # noqa: F401   not per ledger epoch: keep them out
    import prv_accountant  # noqa: F401                              of the timed region)

    print(f"{args.contributions:,} contributions x {args.epochs} ledger epochs of {STEPS_PER_EPOCH} steps, q = "
          f"{Q_U / 1e6}, delta = 1e-5, {args.workers} worker process(es)")
    runs = [] if args.skip_scale else [(s, a) for s in (0.0, 0.15) for a in args.accountants.split(",")]
    for stricter, accountant in runs:
        if accountant == "prv" and stricter == 0.0:
            continue
        members = corpus(args.contributions, stricter)
        if accountant == args.accountants.split(",")[0]:  # a heading per corpus
            print(f"- {'every contributor signs its class preset' if not stricter else f'{stricter:.0%} sign stricter bounds or budgets'}")
        times = []
        for _ in range(args.repeat):
            seconds, eps, calculator, cohorts = spend_run(members, args.epochs, accountant, args.workers)
            times.append(seconds)
        check_rows(members, cohorts, eps, accountant)
        retired = sum(len(c.members) for c in cohorts if c.retired_at is not None)
        print(f"  {accountant}: {statistics.median(times):6.2f} s median of {args.repeat} "
              f"(min {min(times):.2f}, max {max(times):.2f}); {calculator.calls} accountant evaluations for "
              f"{calculator.lookups:,} lookups; {len(cohorts)} cohorts; {retired:,} retired; "
              f"final epsilon median {np.median(eps[:, -1]) / 1e6:.3f}, max {eps[:, -1].max() / 1e6:.3f}")
    if not args.skip_grid:
        grid_times()
    search_times()


if __name__ == "__main__":
    main()
