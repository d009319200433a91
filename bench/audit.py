"""The empirical privacy audit's table (docs/auditing.md): for each honest configuration (mechanism, privacy unit,
profile) at several claimed ε, and with --broken for each deliberately broken mechanism (tests/audit_faults.py),
the ε the ledger claims against the audit's 95% results: the one-run lower bound (any mechanism), whether the
f-DP test rejects the claimed mechanism's curve, and the f-DP family bound (valid for a subsampled Gaussian at the
run's q and steps), with the ceiling, m and the wall time.

    python bench/audit.py                 # every honest configuration at ε 2, 4, 8, and a black-box run
    python bench/audit.py --broken        # the four broken runs, each beside its honest twin
    python bench/audit.py --quick         # one honest row (a smoke test)
    python bench/audit.py --privatizers   # dpsgd with each privatizer (docs/privatizers.md) at ε 8

A privatizer's f-DP test is against the mechanism its charge claims (banded MF: a subsampled Gaussian at
min(1, b·q) over ⌈T/b⌉ rounds; BLT: unamplified at σ/√m); a noise family has none, and its row shows the one-run
bound alone ("-" in the f-DP columns).

Runs on 2 CPU cores: a tiny random BERT, m = 1000 canaries, a few steps each.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from govtrain.audit.audit import AuditConfig, run_audit  # noqa: E402

BASE = AuditConfig(m=1000, steps=10, q=0.5, seed=0)
HONEST = [
    ("dpsgd, example unit, head profile", {}),
    ("prism, example unit, head profile", {"mechanism": "prism"}),
    ("dp-muon, example unit, head profile", {"mechanism": "dp-muon"}),
    ("dpsgd, contribution unit, head profile", {"unit": "contribution"}),
    ("dpsgd, example unit, adapter profile (restricted)", {"profile": "adapter"}),
]


PRIVATIZERS = [
    ("dpsgd, banded-mf (b = 2)", {"privatizer": "banded-mf", "bands": 2}),
    ("dpsgd, blt (d = 2, min separation 2)", {"privatizer": "blt", "buffers": 2, "min_separation": 2}),
    ("dpsgd, laplace (L1, b = 16)", {"privatizer": "laplace"}),
    ("dpsgd, discrete-gaussian (b = 16)", {"privatizer": "discrete-gaussian"}),
    ("dpsgd, skellam (b = 8)", {"privatizer": "skellam"}),
]


def broken_runs():  # type: ignore[no-untyped-def]
    from tests import audit_faults

    wrong_q = {"q": 0.05}
    return [
        ("noise off", {}, audit_faults.noise_off),
        ("noise std / realised batch", {}, audit_faults.noise_over_realised_batch),
        ("clipping skipped (layer 0, adapter profile)", {"profile": "adapter"},
         lambda: audit_faults.clipping_skipped_for_layer(0)),
        ("sampled at 10q, charged q=0.05", wrong_q, lambda: audit_faults.sampled_at(10)),
    ]


def row(name: str, config: AuditConfig, fault=None) -> str:  # type: ignore[no-untyped-def]
    with tempfile.TemporaryDirectory() as folder, (fault() if fault else contextlib.nullcontext()):
        result = run_audit(config, Path(folder))
    b = result.bound
    rejected = "-" if b.fdp is None else "yes" if b.fdp.claim_rejected else "no"
    family = "-" if b.fdp is None else f"{b.fdp.epsilon:.2f}"
    return (f"| {name} | {config.kind} | {config.q:g} | {config.steps} | {result.claimed:.2f} | {b.canaries} | "
            f"{b.epsilon_one_run:.2f} | {rejected} | {family} | "
            f"{b.ceiling:.2f} | {'FAILED' if result.failed else 'passed'} | {result.seconds:.0f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broken", action="store_true", help="the four broken runs, each beside its honest twin")
    parser.add_argument("--quick", action="store_true", help="one honest row")
    parser.add_argument("--privatizers", action="store_true", help="dpsgd with each privatizer at ε 8")
    parser.add_argument("--epsilons", default="2,4,8", help="claimed ε targets of the honest rows")
    args = parser.parse_args()
    print("| configuration | canaries | q | steps | claimed ε | m | ε one-run | claim rejected (f-DP) | ε f-DP family "
          "| ceiling | audit | wall |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    if args.quick:
        print(row(HONEST[0][0], replace(BASE, epsilon=4.0)), flush=True)
        return
    if args.privatizers:
        for name, changes in PRIVATIZERS:
            print(row(name, replace(BASE, epsilon=8.0, **changes)), flush=True)
        return
    if args.broken:
        for name, changes, fault in broken_runs():
            config = replace(BASE, epsilon=2.0, **changes)
            print(row(f"honest twin of: {name}", config), flush=True)
            print(row(f"BROKEN: {name}", config, fault), flush=True)
        return
    for eps in (float(e) for e in args.epsilons.split(",")):
        for name, changes in HONEST:
            print(row(name, replace(BASE, epsilon=eps, **changes)), flush=True)
    print(row("dpsgd, example unit (black-box: mislabelled random text, loss score)",
              replace(BASE, epsilon=8.0, kind="black-box")), flush=True)


if __name__ == "__main__":
    main()
