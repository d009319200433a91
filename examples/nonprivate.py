"""The demo's reference: the run config's LoRA trained without privacy, saved as an adapter for `govtrain eval`.

    python examples/nonprivate.py --config examples/run.toml --train demo-out/data --steps 50 --batch 237 \
        --out demo-out/nonprivate
    govtrain eval --config examples/run.toml --data demo-out/data/heldout.jsonl --adapter demo-out/nonprivate

Same model, pooling, LoRA targets, rank, optimizer and learning rates as the governed run (`for_run`,
`make_optimizer`), on the same contribution files, uniformly sampled batches of --batch for --steps steps, each
step the mean of the task's per-example losses. It is scored by `govtrain eval`, exactly as the governed adapter
is. Reference only: this run is not governed and writes nothing to any ledger.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402

from govtrain.mechanisms.update import make_optimizer  # noqa: E402
from govtrain.tasks import task_for  # noqa: E402
from govtrain.train.config import load_run_config  # noqa: E402
from govtrain.train.evaluate import read_examples  # noqa: E402
from govtrain.train.model import load_model, resolve_device  # noqa: E402
from govtrain.train.progress import ProgressLines  # noqa: E402


def train_nonprivate(config, files: list[Path], steps: int, batch: int, seed: int = 0, progress=None):
    """The run's model (no adapter classes), trained without privacy: (model, tokenizer). `progress`, a
    `ProgressLines`, is told of each step."""
    torch.manual_seed(seed)
    task = task_for(config.file)
    examples = [e for path in files for e in read_examples(path, task, (config.file.data.label_column,))]
    model, tokenizer, _ = load_model(config, [])  # the run's pooling and LoRA, in eval mode: no dropout
    device = resolve_device(config.file.training.device)
    model.to(device)
    optimizer = make_optimizer(config.file.optimizer, {n: p for n, p in model.named_parameters() if p.requires_grad})
    rng = random.Random(seed)
    for step in range(steps):
        chosen = rng.sample(range(len(examples)), min(batch, len(examples)))
        inputs = task.encode([examples[i] for i in chosen], tokenizer, config.file.model.max_length, device)
        loss = task.per_example_loss(model(**inputs.inputs), inputs).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if progress is not None:
            progress.update(step + 1, lambda: [f"loss {loss.item():.3f}"])
    return model, tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--train", type=Path, required=True, help="folder of contrib-*.jsonl files")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batch", type=int, default=18)
    parser.add_argument("--out", type=Path, required=True, help="where the adapter is saved")
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    config = load_run_config(args.config)
    files = sorted(args.train.glob("contrib-*.jsonl"))
    if not files:
        parser.error(f"no contrib-*.jsonl files in {args.train}")
    progress = ProgressLines(lambda line: print(line, flush=True), args.steps)  # a line every 30 s: it takes minutes
    model, _ = train_nonprivate(config, files, args.steps, args.batch, progress=progress)
    model.save_pretrained(args.out)
    print(f"non-private LoRA, {args.steps} steps of {args.batch}: adapter saved to {args.out}")


if __name__ == "__main__":
    main()
