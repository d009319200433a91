"""`bench/step.py --compiled`: the router's clipping stage compiled (`Router(compiled=True)`, `routing/compiled.py`)
against the hooks' eager stage, step and stage timed apart, per model and profile mix.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402

from harness import Governed, data_class, run_file  # noqa: E402
from step_models import SETTINGS, autocast, batch, build, build_tiny_bert, sync  # noqa: E402


class StageClock:
    """Wraps a router's clipping stage (`Router._clip`, or its compiled graph) and adds up the time it takes."""

    def __init__(self, stage, clock) -> None:
        self.stage, self.clock, self.seconds = stage, clock, 0.0

    def __call__(self, *args):
        start = self.clock()
        try:
            return self.stage(*args)
        finally:
            self.seconds += self.clock() - start


def compiled(args) -> None:
    """The compiled clipping stage against the hooks' eager one, step and stage, per model and profile mix."""
    clock = time.perf_counter if SETTINGS["device"].startswith("cuda") else time.process_time
    models = {"tiny BERT (random, 128 x 2)": (build_tiny_bert, 2), "MiniLM (all-MiniLM-L6-v2)": (build, 6)}
    unit = "wall seconds, synchronized" if SETTINGS["device"].startswith("cuda") else \
        f"CPU seconds, {torch.get_num_threads()} thread(s)"
    print(f"compiled clipping stage (aot_eager) against the hooks on {SETTINGS['device']}, batch {args.batch}, seq "
          f"{args.seq}, median of {args.repeats} rounds x {args.steps} steps ({unit} per step)")
    for label, (make, depth) in models.items():
        last = depth - 1
        mixes = {"one class, every layer": {"all": data_class("all", band=(0, last), head=True)},
                 "three profiles": {"public": data_class("public", fraction_u=(500_000, 1_000_000), head=True),
                                    "sensitive": data_class("sensitive", band=(last - 1, last) if last else (0, 0)),
                                    "heads": data_class("heads", band=(last, last), heads=((last, (0,)),))}}
        for mix, classes in mixes.items():
            pair = []
            for is_compiled in (False, True):
                variant = Governed(make(), classes, run_file("dpsgd"), name="compiled" if is_compiled else "hooks",
                                   autocast=autocast, compiled=is_compiled)
                router = variant.router
                if is_compiled:
                    router._compiled = StageClock(router._compiled, clock)
                else:
                    router._clip = StageClock(router._clip, clock)
                pair.append((variant, router._compiled if is_compiled else router._clip))
            inputs, labels = batch(args.batch, args.seq, 0)
            first = {}
            for variant, _ in pair:  # the first step: the compiled variant traces its graph here
                start = time.perf_counter()
                variant.step(inputs, labels)
                first[variant.name] = time.perf_counter() - start
            steps: dict[str, list[float]] = {v.name: [] for v, _ in pair}
            stages: dict[str, list[float]] = {v.name: [] for v, _ in pair}
            for round_ in range(args.repeats):
                for variant, stage in pair[round_ % 2:] + pair[:round_ % 2]:
                    sync()
                    stage.seconds, start = 0.0, clock()
                    for _ in range(args.steps):
                        variant.step(inputs, labels)
                    sync()
                    steps[variant.name].append((clock() - start) / args.steps)
                    stages[variant.name].append(stage.seconds / args.steps)
            step = {name: statistics.median(values) for name, values in steps.items()}
            stage = {name: statistics.median(values) for name, values in stages.items()}
            print(f"  {label}, {mix}:")
            print(f"    step   hooks {step['hooks']:8.4f} s   compiled {step['compiled']:8.4f} s   "
                  f"compiled / hooks {step['compiled'] / step['hooks']:5.2f}")
            print(f"    stage  hooks {stage['hooks']:8.4f} s   compiled {stage['compiled']:8.4f} s   "
                  f"compiled / hooks {stage['compiled'] / stage['hooks']:5.2f}")
            print(f"    first step (wall s, compiling included): hooks {first['hooks']:.2f}, "
                  f"compiled {first['compiled']:.2f}")
