"""Held-out accuracy of the three mechanisms on the demo's task, at equal steps and equal privacy.

    .venv/bin/python bench/mechanisms.py [--steps 300] [--batch 64] [--epsilons 3 8] [--runs dpsgd prism dp-muon]

The demo's task: Rotten Tomatoes snippets (fresh/rotten) on the bundled MiniLM with the demo's LoRA
(r = 8 on all six projections, max_length 48). Movies are split by hash: one bucket of 20 is held out,
the rest is training data, all of one class with the demo's `sensitive` depth (layers 4-5) plus the
classifier head (without the head nothing could learn the labels), C = 0.5 as the demo's sensitive
contributions sign. For each ε the noise multiplier is calibrated with the PLD accountant at
δ = 1e-5, q = batch / N, for exactly --steps steps: every mechanism gets the same σ, q and steps, so the
same ledger charge (DP-Muon's per-matrix clipping splits C, it does not multiply it). Each run goes
through the routing layer and `Update` exactly as `govtrain train` does (Poisson batches divided by the
expected batch size; noise-only steps when a batch is empty), without a ledger. The non-private
reference trains the same reach with plain mean-loss AdamW on uniformly drawn batches of --batch.

Learning rates are the RUN.toml defaults unless given (--lr dpsgd=0.002 prism=0.002 dp-muon=0.01).
Seeds are fixed (`insecure_seed`) so that the runs are comparable: a benchmark, not a private run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from govtrain.accounting.calibrate import noise_multiplier_for  # noqa: E402
from govtrain.mechanisms.update import Update  # noqa: E402
from govtrain.policy.model import DataClass, DepthProfile  # noqa: E402
from govtrain.resolver.model import describe  # noqa: E402
from govtrain.resolver.profile import resolve  # noqa: E402
from govtrain.routing.router import Router  # noqa: E402
from govtrain.routing.sampler import PoissonSampler  # noqa: E402
from govtrain.train.config import RunFile  # noqa: E402
from evaluate import accuracy  # noqa: E402  (examples/evaluate.py)

TARGETS = ["query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense"]
CLIP = 0.5
DELTA = 1e-5
LENGTH = 48


def split(buckets: int = 20):
    from prepare_data import LABELS, bucket, load_rows

    train, heldout = ([], []), ([], [])
    for row in load_rows():
        side = heldout if bucket(row["movie_name"], buckets) == buckets - 1 else train
        side[0].append(row["text"])
        side[1].append(LABELS[row["category"]])
    return train, heldout


def build(seed: int, targets: list[str]):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from govtrain.resolver.load import model_path
    from govtrain.train.loop import wrap_lora

    torch.manual_seed(seed)
    path = model_path("minilm")
    base = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2, local_files_only=True)
    run = run_file("dpsgd", 0.002, targets)
    model = wrap_lora(base, run.lora, [])
    model.eval()
    return model, AutoTokenizer.from_pretrained(path, local_files_only=True)


def run_file(mechanism: str, lr: float, targets: list[str], floor: float = 1.0) -> RunFile:
    sections = {"prism": {"prism": {"lr": lr, "floor": floor}}, "dp-muon": {"muon": {"lr": lr}}}.get(mechanism, {})
    return RunFile.model_validate({
        "model": {"base": "minilm", "max_length": LENGTH}, "lora": {"r": 8, "alpha": 16, "target_modules": targets},
        "optimizer": {"name": "adamw", "lr": 0.002 if mechanism != "dpsgd" else lr},
        "training": {"mechanism": mechanism, "steps": 1, "data": "d", "output": "o"}, **sections})


def sensitive() -> dict[str, DataClass]:
    profile = DepthProfile(kind="band", band=(4, 5), head=True)
    return {"sensitive": DataClass(name="sensitive", clip_norm_u=500_000, min_noise_multiplier_u=0,
                                   eps_budget_u=1, max_eps_budget_u=1, profile=profile)}


def freeze_unreached(model, resolution) -> None:
    """Parameters no class reaches are frozen by the router anyway (no gradient, no noise); freezing them
    here lets the non-private reference train exactly the same reach."""
    reached = {part.name for parts in resolution.reach.values() for part in parts}
    for name, param in model.named_parameters():
        if name not in reached:
            param.requires_grad_(False)


def private_run(mechanism: str, lr: float, sigma: float, args, train, heldout) -> float:
    model, tokenizer = build(args.seed, args.targets)
    resolution = resolve(sensitive(), describe(model))
    freeze_unreached(model, resolution)
    resolution = resolve(sensitive(), describe(model))
    router = Router(model, resolution, mechanism=mechanism, insecure_seed=args.seed)
    update = Update.build(model, run_file(mechanism, lr, args.targets, args.prism_floor))
    group_std = {g.classes: sigma * CLIP for g in resolution.groups if g.classes}
    q = args.batch / len(train[0])
    sampler = PoissonSampler(q, insecure_seed=args.seed)
    everyone = list(range(len(train[0])))
    for step in range(args.steps):
        if args.eval_every and step and step % args.eval_every == 0:
            print(f"    step {step}: held-out accuracy {accuracy(model, tokenizer, *heldout, LENGTH):.3f}", flush=True)
        chosen = sampler.sample(everyone)
        if len(chosen) == 0:
            router.noise_only(group_std, float(args.batch))
        else:
            inputs = tokenizer([train[0][i] for i in chosen], padding=True, truncation=True, max_length=LENGTH,
                               return_tensors="pt")
            with router.capture():
                logits = model(**inputs).logits
            losses = F.cross_entropy(logits, torch.tensor([train[1][i] for i in chosen]), reduction="none")
            router.privatize(losses, ["sensitive"] * len(chosen), [CLIP] * len(chosen), group_std, float(args.batch))
        update.step(router.noise_std)
        update.zero_grad()
    router.close()
    return accuracy(model, tokenizer, *heldout, LENGTH)


def nonprivate_run(args, train, heldout) -> float:
    model, tokenizer = build(args.seed, args.targets)
    freeze_unreached(model, resolve(sensitive(), describe(model)))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.002)
    rng = random.Random(args.seed)
    for _ in range(args.steps):
        chosen = rng.sample(range(len(train[0])), args.batch)
        inputs = tokenizer([train[0][i] for i in chosen], padding=True, truncation=True, max_length=LENGTH,
                           return_tensors="pt")
        F.cross_entropy(model(**inputs).logits, torch.tensor([train[1][i] for i in chosen])).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return accuracy(model, tokenizer, *heldout, LENGTH)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64, help="expected (Poisson) batch size")
    parser.add_argument("--epsilons", type=float, nargs="+", default=[3.0, 8.0])
    parser.add_argument("--runs", nargs="+", default=["nonprivate", "dpsgd", "prism", "dp-muon"])
    parser.add_argument("--lr", nargs="*", default=[], help="mechanism=lr, e.g. prism=0.004")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--control", action="store_true", help="also run each mechanism with sigma = 0 (not private)")
    parser.add_argument("--prism-floor", type=float, default=1.0, help="[prism] floor")
    parser.add_argument("--targets", nargs="+", default=TARGETS, help="LoRA target modules (default: the demo's six)")
    parser.add_argument("--eval-every", type=int, default=0, help="also print held-out accuracy every N steps")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lrs = {"dpsgd": 0.002, "prism": 0.002, "dp-muon": 0.01}
    lrs.update({k: float(v) for k, v in (item.split("=") for item in args.lr)})
    train, heldout = split()
    q = args.batch / len(train[0])
    majority = max(heldout[1].count(0), heldout[1].count(1)) / len(heldout[1])
    print(f"train {len(train[0])} snippets, held-out {len(heldout[0])} (majority label {majority:.3f}); "
          f"{args.steps} steps, expected batch {args.batch} (q = {q:.5f}), C = {CLIP}, delta = {DELTA}")
    rows = []
    if "nonprivate" in args.runs:
        started = time.perf_counter()
        rows.append(("non-private LoRA", "-", "-", "-", nonprivate_run(args, train, heldout)))
        print(f"  {rows[-1][0]:<18} accuracy {rows[-1][-1]:.3f}  ({time.perf_counter() - started:.0f} s)", flush=True)
    settings = [(f"{e:g}", noise_multiplier_for(e, DELTA, q, args.steps, "pld").noise_multiplier) for e in args.epsilons]
    if args.control:
        settings.append(("none (σ = 0: clipping only, a control)", 0.0))
    for epsilon, sigma in settings:
        for mechanism in (m for m in ("dpsgd", "prism", "dp-muon") if m in args.runs):
            started = time.perf_counter()
            value = private_run(mechanism, lrs[mechanism], sigma, args, train, heldout)
            rows.append((mechanism, epsilon, f"{sigma:.4f}", f"{lrs[mechanism]:g}", value))
            print(f"  {mechanism:<18} eps {epsilon} (sigma {sigma:.4f}, lr {lrs[mechanism]:g}) accuracy {value:.3f}"
                  f"  ({time.perf_counter() - started:.0f} s)", flush=True)
    print("\n| run | ε | σ | lr | held-out accuracy |\n|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(str(x) if not isinstance(x, float) else f"{x:.3f}" for x in row) + " |")
    print(json.dumps({"majority": majority, "rows": rows}))


if __name__ == "__main__":
    main()
