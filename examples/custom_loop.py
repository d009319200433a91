"""Governed training from your own loop: the library API that `govtrain train` itself runs.

Try it in a scratch workspace (`make scratch`: a ledger of its own with the demo's keys and a few of its
contributions, no real budget), into a folder of its own:

    .venv/bin/python examples/scratch.py
    .venv/bin/python examples/custom_loop.py --config scratch/run.toml --ledger sqlite:///./scratch/ledger.db \
        --key scratch/keys/ledger.key --output scratch/custom-adapter

The run (`govtrain.GovernedRun`) owns the sampling: `run.batches()` plans each ledger epoch, writes its spend
ahead, and hands out every logical Poisson batch in physical chunks. Your code runs the forward and gives one
loss per example; `run.step` clips each example's gradient to its contribution's bound and, after a logical
step's last chunk, adds the noise once and moves the parameters. Here the loss is your own: cross-entropy
with reduction="none" (one value per example), in float32. The first batch is the rehearsal
(`batch.rehearsal`): synthetic rows, before any spend, so a bug here costs nothing; `run.step` returns None for
it. The test suite runs this file on a tiny model.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch.nn.functional as F  # noqa: E402

import govtrain  # noqa: E402

if TYPE_CHECKING:
    from govtrain.train.config import RunConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="run config (RUN.toml), a classification task")
    parser.add_argument("--ledger", required=True, help="ledger URL")
    parser.add_argument("--key", default=None, help="the ledger's signing key")
    parser.add_argument("--output", default=None, help="where to save the adapter (default: training.output)")
    args = parser.parse_args(argv)

    if args.output is not None:
        args.config = with_output(args.config, args.output)

    with govtrain.GovernedRun.open(args.config, args.ledger, key=args.key) as run:
        for batch in run.batches():  # Poisson over the eligible data; withdrawals take effect
            out = run.model(**batch.inputs)
            losses = F.cross_entropy(out.logits.float(), batch.targets, reduction="none")  # one per example
            loss = run.step(losses)  # clip; after the logical step's last chunk: noise once, update
            if loss is not None and run.steps % 10 == 0:
                spent = ", ".join(f"{name} ε {eps:.3f}" for name, eps in sorted(run.epsilons().items()))
                print(f"step {run.steps}/{run.total_steps}: loss {loss:.3f} | {spent}")
        result = run.save()  # the adapter, and the run entry in the ledger

    print(f"{result.run_id}: {result.steps} steps; adapter {result.adapter_sha256.hex()[:16]}… saved to "
          f"{run.config.output_dir}" + (" (every contribution's budget ran out first)" if result.exhausted else ""))
    return 0


def with_output(path: str, output: str) -> "RunConfig":
    """The config at `path` as a dict, its training.output replaced: another run, in a folder of its own."""
    import tomllib

    from govtrain.train.config import run_config

    with open(path, "rb") as handle:
        document = tomllib.load(handle)
    document["training"]["output"] = str(Path(output).resolve())
    return run_config(document, base=Path(path).resolve().parent)


if __name__ == "__main__":
    sys.exit(main())
