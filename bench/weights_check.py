"""What the check that only governed steps move the weights costs (`governed.py`, `Weights`), on the bundled
MiniLM with the demo's LoRA (r = 8 on all six projections, the head trainable), against a governed step.

    .venv/bin/python bench/weights_check.py [--repeats 7] [--batch 32] [--seq 48]

A governed step runs the check once before its draw, once per physical chunk's forward and once before its
update, and keeps a copy of the trainable weights after it (`update`). One thread; each figure is the median
over --repeats rounds, the check and the step interleaved in one process.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import step as bench_step  # noqa: E402
from harness import data_class  # noqa: E402

from govtrain.train.weights import Weights  # noqa: E402


def median_seconds(work, repeats: int, inner: int) -> float:
    rounds = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(inner):
            work()
        rounds.append((time.perf_counter() - started) / inner)
    return statistics.median(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = bench_step.build()
    weights = Weights(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    governed = bench_step.governed(model, {"all": data_class("all", band=(0, 5), head=True)}, "govtrain")
    inputs, labels = bench_step.batch(args.batch, args.seq, 0)
    governed.step(inputs, labels)  # warm up
    weights.update()
    step = median_seconds(lambda: governed.step(inputs, labels), args.repeats, 1)
    weights.update()
    check = median_seconds(weights.changed, args.repeats, 20)
    update = median_seconds(weights.update, args.repeats, 20)
    assert weights.changed() is None
    per_step = 3 * check + update  # before the draw, at the one chunk's forward, before the update; then the copy
    print(f"MiniLM, {trainable:,} trainable parameters in {len(weights.trainable)} tensors, "
          f"{sum(1 for _ in model.parameters())} parameters in all")
    print(f"Weights.changed(): {check * 1e3:.3f} ms; Weights.update(): {update * 1e3:.3f} ms")
    print(f"governed step (batch {args.batch} x {args.seq}, full band): {step * 1e3:.1f} ms; the checks of one "
          f"step: {per_step * 1e3:.3f} ms = {100 * per_step / step:.2f}% of it")


if __name__ == "__main__":
    main()
