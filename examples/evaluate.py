"""Held-out accuracy for the demo: a governed adapter, and a non-private LoRA run of the same length.

    python examples/evaluate.py --config examples/run.toml --heldout demo-out/data/heldout.jsonl \
        --adapter demo-out/adapter [--nonprivate-steps 300 --batch 18 --train demo-out/data]

With --adapter it loads MiniLM plus every adapter saved there (all active, as in training) and prints
its accuracy. With --nonprivate-steps it also trains the run config's LoRA (same targets, rank,
optimizer and learning rate) without privacy on the same contribution files, uniformly sampled
batches of --batch, for that many steps, and prints that accuracy next to it. Reference only: the
non-private run is not governed and writes nothing to any ledger.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from govtrain.mechanisms.update import make_optimizer  # noqa: E402
from govtrain.train.config import load_run_config  # noqa: E402
from govtrain.train.model import for_run, load_base, quiet_loading  # noqa: E402
from govtrain.train.pooling import use_pooling  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # as training.device = "auto"


def read(path: Path) -> tuple[list[str], list[int]]:
    texts, labels = [], []
    for line in path.read_bytes().split(b"\n"):
        if line.strip():
            record = json.loads(line)
            texts.append(record["text"])
            labels.append(record["label"])
    return texts, labels


def base_model(config):
    model, tokenizer, _ = load_base(config)  # as `govtrain train` loads it: fp32, quietly
    return model, tokenizer


@torch.no_grad()
def accuracy(model, tokenizer, texts, labels, max_length: int) -> float:
    model.eval()
    device = next(model.parameters()).device
    correct = 0
    for start in range(0, len(texts), 64):
        batch = tokenizer(texts[start:start + 64], padding=True, truncation=True, max_length=max_length,
                          return_tensors="pt").to(device)
        predicted = model(**batch).logits.argmax(-1).cpu()
        correct += int((predicted == torch.tensor(labels[start:start + 64])).sum())
    return correct / len(texts)


def governed(config, adapter: Path):
    from peft import PeftModel

    model, tokenizer = base_model(config)
    with quiet_loading():
        model = PeftModel.from_pretrained(use_pooling(model, config.file.model.pooling), adapter)
        names = ["default"]
        for sub in sorted(p for p in adapter.iterdir() if (p / "adapter_config.json").is_file()):
            model.load_adapter(sub, adapter_name=sub.name)
            names.append(sub.name)
    model.base_model.set_adapter(names)
    return model.to(DEVICE), tokenizer


def nonprivate(config, train_dir: Path, steps: int, batch: int, seed: int = 0):
    torch.manual_seed(seed)
    model, tokenizer = base_model(config)
    with quiet_loading():
        model = for_run(model, config.file, []).to(DEVICE)  # the run's pooling and LoRA: every factor, the head
    texts, labels = [], []
    for path in sorted(train_dir.glob("contrib-*.jsonl")):
        t, l = read(path)
        texts += t
        labels += l
    optimizer = make_optimizer(config.file.optimizer, {n: p for n, p in model.named_parameters() if p.requires_grad})
    rng = random.Random(seed)
    model.eval()  # as the governed run trains: no dropout
    for _ in range(steps):
        chosen = rng.sample(range(len(texts)), batch)
        inputs = tokenizer([texts[i] for i in chosen], padding=True, truncation=True,
                           max_length=config.file.model.max_length, return_tensors="pt").to(DEVICE)
        loss = F.cross_entropy(model(**inputs).logits, torch.tensor([labels[i] for i in chosen], device=DEVICE))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, tokenizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--heldout", type=Path, required=True)
    parser.add_argument("--adapter", type=Path)
    parser.add_argument("--nonprivate-steps", type=int, default=0)
    parser.add_argument("--batch", type=int, default=18)
    parser.add_argument("--train", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    config = load_run_config(args.config)
    texts, labels = read(args.heldout)
    length = config.file.model.max_length
    print(f"held-out: {len(texts)} snippets from movies no contribution holds")
    if args.adapter:
        model, tokenizer = governed(config, args.adapter)
        print(f"  governed DP-LoRA ({args.adapter}):          accuracy {accuracy(model, tokenizer, texts, labels, length):.3f}")
    if args.nonprivate_steps:
        model, tokenizer = nonprivate(config, args.train, args.nonprivate_steps, args.batch)
        print(f"  non-private LoRA, {args.nonprivate_steps} steps of {args.batch}:     "
              f"accuracy {accuracy(model, tokenizer, texts, labels, length):.3f}")
    majority = max(labels.count(0), labels.count(1)) / len(labels)
    print(f"  always the majority label:               accuracy {majority:.3f}")


if __name__ == "__main__":
    main()
