"""The white-box audit's power (docs/auditing.md, "Power"): how often it catches a mechanism that adds less noise
or clips larger than the ledger charges for, and how often it rejects an honest run, over seeds.

    python bench/audit_power.py                                   # m = 10000, seeds 0-9, ε 2 and 4, every fault
    python bench/audit_power.py --epsilons 2 --faults honest,noise0.5 --seeds 10
    python bench/audit_power.py --table-only                      # the table from the records so far
    python bench/audit_power.py --synthetic 100                   # no training: the mechanism's own model

Each (claim, fault, seed) is one governed audit (dpsgd, example unit, head profile, q = 0.5, 10 steps) with the
fault of tests/audit_faults.py patched in: `noise<f>` scales every group's noise std by f, `clip<f>` clips every
unit to f·C (both charged as honest). One run is bounded several ways, from the values each canary's coordinate
released at every step (`AuditResult.released`):

- "steps, m": the step likelihood-ratio score on all m canaries (the audit's default, `scores.py`);
- "displacement, m": the last iterate's displacement on all m;
- "steps, 1000" and "displacement, 1000": the same on the first 1000 canaries alone. A white-box canary's
  released values do not depend on how many other canaries there are (each owns its coordinate; the noise at it
  and its clipped Dirac are in units of C whatever the batch), so these are the m = 1000 audit's statistics:
  "displacement, 1000" is the audit before this change.

A run is caught when the one-run bound exceeds the ledger's claim or the f-DP test rejects the claimed curve
(`AuditResult.failed`); for an honest run that is a false rejection, which the 95% confidence allows in at most
5% of runs. The true ε is the subsampled Gaussian's at the noise multiplier actually applied to a canary
(σ·f for noise, σ/f for clip). CPU seconds are this process's (time.process_time) per audit: training, the
default score and its bounds. Records are appended to --out (JSON lines) as each run ends, and a run already
recorded there is skipped, so an interrupted sweep resumes; the table is printed from every record in the file.
Run it niced on a shared machine: `OMP_NUM_THREADS=1 nice -n 15 python bench/audit_power.py`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FAULTS = ("honest", "noise0.5", "noise0.7", "clip2", "clip4")
SUBSET = 1000  # the audit before this change: m = 1000 canaries
VARIANTS = (("steps", None), ("displacement", None), ("steps", SUBSET), ("displacement", SUBSET))


def _factors(name: str) -> tuple[float, float]:
    """(noise factor, clip factor) of a fault's name: honest, noise<f> or clip<f>."""
    try:
        if name == "honest":
            return 1.0, 1.0
        if name.startswith("noise"):
            return float(name[len("noise"):]), 1.0
        if name.startswith("clip"):
            return 1.0, float(name[len("clip"):])
    except ValueError:
        pass
    raise SystemExit(f"error: unknown fault {name!r}: one of {', '.join(FAULTS)} (or noise<f>, clip<f>)")


def _fault(name: str):  # type: ignore[no-untyped-def]
    """(the patch, the factor on the canaries' effective noise multiplier)."""
    import contextlib

    from tests import audit_faults

    noise, clip = _factors(name)
    if name == "honest":
        return contextlib.nullcontext(), 1.0
    if name.startswith("noise"):
        return audit_faults.noise_scaled(noise), noise
    return audit_faults.clip_scaled(clip), 1 / clip


def one(epsilon: float, fault: str, seed: int, m: int) -> dict:
    """One audit and its bounds under each scoring variant."""
    from govtrain.audit.audit import AuditConfig, run_audit, score
    from govtrain.audit.bounds import audit_scores

    config = AuditConfig(mechanism="dpsgd", epsilon=epsilon, m=m, steps=10, q=0.5, seed=seed)
    patch, effective = _fault(fault)
    started = time.process_time()
    with tempfile.TemporaryDirectory() as folder, patch:
        result = run_audit(config, Path(folder))
    cpu = time.process_time() - started
    sigma = result.mechanism.noise_multiplier
    true = result.mechanism.with_noise(sigma * effective).epsilon(config.delta)
    record = {"epsilon": epsilon, "fault": fault, "seed": seed, "m": m, "claimed": result.claimed,
              "true": true, "cpu": cpu, "variants": {}}
    for name, size in VARIANTS:
        keep = slice(None) if size is None else slice(0, size)
        if size is None and name == config.score:
            bound = result.bound
        else:
            from dataclasses import replace

            scores = score(replace(config, score=name), sigma, result.released[keep])
            bound = audit_scores(scores, result.included[keep], delta=config.delta, claim=result.mechanism)
        caught = bound.epsilon_one_run > result.claimed or bound.fdp.claim_rejected
        record["variants"][f"{name}, {'m' if size is None else size}"] = {
            "one_run": bound.epsilon_one_run, "fdp_rejected": bound.fdp.claim_rejected,
            "fdp_epsilon": bound.fdp.epsilon, "caught": caught}
    return record


def synthetic(trials: int, sizes: list[int], faults: list[str], epsilons: list[float],
              fractions: list[float] | None = None) -> None:
    """The same audits on the mechanism's own model instead of a training run: canary i releases
    y[i, t] = s·b[i, t] + σ'·z[i, t] at each step (scores.py), with σ' and s the fault's (noise f: σ' = f·σ;
    clip f: s = f), σ calibrated as the audit calibrates it. `bounds.audit_scores`' default guess counts and
    Bonferroni levels (or k = each of `fractions` of m), with the claimed curve computed once per claim. Seconds
    per trial, not minutes: many trials, for the rates the real runs can only sample."""
    import numpy as np

    from govtrain.accounting.calibrate import noise_multiplier_for
    from govtrain.audit.bounds import _fdp_rejects, default_guess_counts, one_run_epsilon
    from govtrain.audit.scores import displacement_scores, step_likelihood_scores
    from govtrain.audit.tradeoff import SubsampledGaussian

    q, steps, delta = 0.5, 10, 1e-5
    lines = ["| fault | target ε | claimed ε | true ε | m | trials | caught (steps) | caught (displacement) | "
             "mean one-run (steps) |", "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for eps in epsilons:
        sigma = noise_multiplier_for(eps, delta, q, steps, "rdp").noise_multiplier
        claim = SubsampledGaussian(noise_multiplier=sigma, sampling_rate=q, steps=steps)
        curve, claimed = claim.curve(), claim.epsilon(delta)
        for fault in faults:
            noise_factor, clip_factor = _factors(fault)
            noise, signal = sigma * noise_factor, clip_factor
            true = claim.with_noise(noise / signal).epsilon(delta)
            for m in sizes:
                counts = default_guess_counts(m) if fractions is None else \
                    sorted({max(1, round(m * f)) for f in fractions})
                alpha = 0.05 / len(counts)
                caught = {"steps": 0, "displacement": 0}
                bounds = []
                for trial in range(trials):
                    rng = np.random.default_rng(trial)
                    included = rng.random(m) < 0.5
                    drawn = (rng.random((m, steps)) < q) & included[:, None]
                    released = signal * drawn + noise * rng.standard_normal((m, steps))
                    for name, scores in (("steps", step_likelihood_scores(released, noise_multiplier=sigma,
                                                                          sampling_rate=q)),
                                         ("displacement", displacement_scores(released))):
                        order = np.argsort(scores, kind="stable")
                        best, rejected = 0.0, False
                        for k in counts:
                            right = int((~included[order[:k]]).sum() + included[order[m - k:]].sum())
                            best = max(best, one_run_epsilon(canaries=m, guesses=2 * k, correct=right, delta=delta,
                                                             confidence=1 - alpha))
                            rejected = rejected or _fdp_rejects(m, 2 * k, right, curve, alpha)
                        caught[name] += rejected or best > claimed
                        if name == "steps":
                            bounds.append(best)
                lines.append(f"| {fault} | {eps:g} | {claimed:.2f} | {true:.2f} | {m} | {trials} | "
                             f"{caught['steps']}/{trials} | {caught['displacement']}/{trials} | "
                             f"{sum(bounds) / trials:.2f} |")
                print(lines[-1], flush=True)


def table(records: list[dict]) -> str:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["epsilon"], r["m"], r["fault"])].append(r)
    names = [f"{n}, {'m' if s is None else s}" for n, s in VARIANTS]
    lines = ["| fault | target ε | claimed ε | true ε | m | seeds | " + " | ".join(
        f"caught ({n})" for n in names) + " | mean one-run (steps, m) | f-DP rejects (steps, m) | CPU s per audit |",
        "|---" * (9 + len(names)) + "|"]
    order = {f: i for i, f in enumerate(FAULTS)}
    for (eps, m, fault), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], order.get(kv[0][2], 99))):
        n = len(rs)
        caught = [f"{sum(r['variants'][v]['caught'] for r in rs)}/{n}" for v in names]
        main = [r["variants"][names[0]] for r in rs]
        lines.append(f"| {fault} | {eps:g} | {sum(r['claimed'] for r in rs) / n:.2f} | "
                     f"{sum(r['true'] for r in rs) / n:.2f} | {m} | {n} | " + " | ".join(caught) + " | "
                     f"{sum(v['one_run'] for v in main) / n:.2f} | {sum(v['fdp_rejected'] for v in main)}/{n} | "
                     f"{sum(r['cpu'] for r in rs) / n:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=10000, help="canaries per audit")
    parser.add_argument("--seeds", type=int, default=10, help="seeds 0 .. N-1")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--epsilons", default="2,4", help="target ε (the ledger then claims a little less)")
    parser.add_argument("--faults", default=",".join(FAULTS), help="honest, noise<f>, clip<f>, comma-separated")
    parser.add_argument("--out", type=Path, default=Path("bench-out/audit_power.jsonl"), help="records (JSON lines)")
    parser.add_argument("--table-only", action="store_true", help="print the table from --out and stop")
    parser.add_argument("--synthetic", type=int, metavar="TRIALS",
                        help="no training: TRIALS seeded trials of the mechanism's own model per row (--sizes)")
    parser.add_argument("--sizes", default="1000,10000", help="canary counts of the synthetic rows")
    parser.add_argument("--fractions", help="synthetic: guess counts k as fractions of m, comma-separated "
                                            "(default: bounds.default_guess_counts)")
    args = parser.parse_args()
    if args.synthetic:
        synthetic(args.synthetic, [int(m) for m in args.sizes.split(",")], args.faults.split(","),
                  [float(e) for e in args.epsilons.split(",")],
                  None if args.fractions is None else [float(f) for f in args.fractions.split(",")])
        return
    import torch

    torch.set_num_threads(1)
    records = [json.loads(line) for line in args.out.read_text().splitlines() if line.strip()] \
        if args.out.exists() else []
    if not args.table_only:
        done = {(r["epsilon"], r["fault"], r["seed"], r["m"]) for r in records}
        faults = args.faults.split(",")
        for fault in faults:
            _fault(fault)  # refuse an unknown name before any run
        # seeds outermost within a claim: an interrupted sweep has every fault at the seeds it reached
        for eps in (float(e) for e in args.epsilons.split(",")):
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                for fault in faults:
                    if (eps, fault, seed, args.m) in done:
                        continue
                    record = one(eps, fault, seed, args.m)
                    records.append(record)
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    with args.out.open("a") as out:
                        out.write(json.dumps(record) + "\n")
                    main_variant = record["variants"]["steps, m"]
                    print(f"ε {eps:g} {fault} seed {seed}: claimed {record['claimed']:.2f}, true "
                          f"{record['true']:.2f}, one-run {main_variant['one_run']:.2f}, f-DP rejects "
                          f"{main_variant['fdp_rejected']}, caught {main_variant['caught']}, "
                          f"{record['cpu']:.0f} CPU s", flush=True)
    print(table(records))


if __name__ == "__main__":
    main()
