"""The models, batches, variants and timing that `bench/step.py`'s modes share: the bundled MiniLM (or a random
BERT-base, ~1.1B Llama, tiny BERT or causal Llama) with the bench's LoRA, random batches, the non-private, governed
and Opacus steps on them, and the interleaved median of seconds per step. `SETTINGS` (model, device, precision) is
set once by `step.py`'s `main()`.
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

from harness import TARGETS, Governed, NonPrivate, OpacusStep, data_class, run_file  # noqa: E402
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


def variant_makers(args, full=None) -> dict:
    last = layers() - 1
    top2 = {"sensitive": data_class("sensitive", band=(last - 1, last), head=True)}
    full = full or {"all": data_class("all", band=(0, last), head=True)}
    return {"non-private": lambda: non_private(build()),
            "govtrain top-2 band": lambda: governed(build(), top2, "govtrain top-2 band"),
            "govtrain full band": lambda: governed(build(), full, "govtrain full band"),
            "opacus": lambda: opacus(build(), args.batch)}


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
