"""Batch independence (docs/design.md §5): an example's gradient must depend on that example alone.

Clipping bounds what one example adds to a step only if the other examples' gradients do not move when it
joins or leaves the batch. Left padding breaks that (an example's absolute positions then depend on the
longest example beside it), and so do a loss normalised over the batch (its token count, its mean), a model
that ignores `attention_mask` (real tokens attend to padding whose width the batch sets), position or rotary
offsets that depend on padding, and batch statistics. None of these shows in shapes, so the router's layout
probe cannot see them: this probe measures the property itself, before a run writes any spend.

    check_batch_independence(model, task, tokenizer, max_length, device)   # or ConfigError(BATCH_COUPLED)

The task's own public probe examples (`task.probe_examples()`: three lengths, no contribution's data, so a
refusal never depends on private content) are encoded with the task's own `encode`, so the real padding path
runs. Each example's gradient alone (batch of one, no padding) is compared with its gradient inside batches
that pad it to other widths, beside other companions, at other positions: `torch.autograd.grad` of its own
loss (the task's `per_example_loss`) with respect to the trainable parameters, `.grad` untouched. The model
runs in eval mode (dropout would make two forwards differ; BatchNorm in train mode is refused by the router)
and each module's mode is restored; no autocast, so the comparison is in the model's fp32.

Measured by `bench/independence.py` (CPU, fp32; the worst of the probe's five comparisons,
‖g_batch − g_alone‖ / max(‖g_batch‖, ‖g_alone‖); tiny random 6-layer models with LoRA r = 2, and the demo's
pretrained MiniLM with LoRA r = 8 on its top two layers):

- honest (right padding): classifiers BERT 2.7e-8, GPT-2 2.4e-7, Llama 2.4e-7; causal LMs Llama 4.1e-7, GPT-2
  2.5e-7; MiniLM 6.2e-7 with mean pooling, 5.3e-7 with its own pooler.
- coupled: padded left, GPT-2 0.96, BERT 0.11, MiniLM 0.60 (0.26 with its pooler); ignoring attention_mask,
  BERT 4.9e-3, MiniLM 0.66 (0.43); a causal loss divided by the batch's token count 0.95 (Llama and GPT-2), by
  the batch mean of the losses 1.0. A Llama classifier padded left is not coupled (rotary positions are
  relative): 3.3e-7, and it passes.

`TOLERANCE` = 1e-4 is 161 times the largest honest value and 1/49 of the smallest coupled one (a tiny random
BERT mixes its tokens little; trained models mix them far more). TF32 is turned off for the probe, as fp32 means.
The probe costs 0.04 s on the tiny models and 0.15-0.3 s on MiniLM (one thread).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch
from torch import nn

from govtrain.errors import Code, ConfigError

TOLERANCE = 1e-4  # honest: at most 6.2e-7; coupled: 4.9e-3 and more (module docstring)

# Batches of the probe examples (shortest first): each is compared at another position than alone (the
# middle one at two), the shortest padded to two other widths beside other companions, the longest unpadded
# beside padded ones. Five comparisons, eight backward passes: the probe runs at every run's start.
BATCHES = ((2, 0, 1), (1, 0))

CAUSES = ("left padding, a loss normalised over the batch (its token count or mean), a model that ignores "
          "attention_mask, position or rotary offsets that depend on padding, batch statistics")


@dataclass(frozen=True)
class Independence:
    """What the probe measured: the largest relative difference between a probe example's gradient alone and
    inside a batch (`worst`), where it was, and the trainable parameter whose part of the difference was
    largest (`share`: that part's norm, relative as `worst` is). `compared`: the comparisons with a gradient
    that is not zero (none: the probe could tell nothing)."""

    worst: float
    compared: int
    example: int = -1
    tokens: int = 0
    order: tuple[int, ...] = ()
    width: int = 0
    parameter: str = ""
    share: float = 0.0


def saved_modes(model: nn.Module) -> list[tuple[nn.Module, bool]]:
    """Each module's train/eval mode, in `modules()` order, for `restore_modes`."""
    return [(module, module.training) for module in model.modules()]


def restore_modes(model: nn.Module, saved: list[tuple[nn.Module, bool]]) -> None:
    """Put back the modes `saved_modes` took, as `module.train(mode)` on each saved module in turn did (each call sets
    the module's whole subtree as it is now; a later, deeper call overrides what an earlier one set below it).

    Where the tree is the one saved (the same modules in the same order, none at two places), no module has a `train`
    of its own on the instance, and every flag is a bool, each module's end state is its own saved flag: that is set
    in one pass instead of one walk per subtree, and a class that overrides `train` (transformers' models, peft's DoRA
    layers) still has it called, last with its saved flag (fewer times than the walks called it). Otherwise (a module
    added or shared since, a patched `train`, a flag not a bool) every saved module's `train` runs, as before."""
    plain = nn.Module.train
    now = [module for _, module in model.named_modules(remove_duplicate=False)]
    same = len(now) == len(saved) and all(map(operator.is_, now, (module for module, _ in saved)))
    if not same or any("train" in vars(module) or type(training) is not bool for module, training in saved):
        for module, training in saved:
            module.train(training)
        return
    for module, training in saved:
        if type(module).train is plain:
            module.training = training
        else:
            module.train(training)


def check_batch_independence(model: nn.Module, task: Any, tokenizer: Any, max_length: int, device: Any, *,
                             tolerance: float = TOLERANCE) -> Independence:
    """Refuse (`batch_coupled`) a model and task under which a probe example's gradient inside a batch differs
    from its gradient alone by more than `tolerance` relative, or under which every probe gradient is zero
    (nothing could be checked). Returns what was measured."""
    measured = measure_batch_independence(model, task, tokenizer, max_length, device)
    if not measured.compared:
        raise ConfigError(Code.BATCH_COUPLED, "the batch-independence probe is vacuous: every trainable parameter's "
                                              "gradient is zero for every probe example, so whether an example's "
                                              "gradient depends on its batch cannot be checked; give the adapter an "
                                              "initialisation a gradient reaches (peft's lora_B starts at zero, so "
                                              "lora_A gets none: train lora_B or a head too)")
    if not measured.worst <= tolerance:  # a NaN is refused too
        raise ConfigError(Code.BATCH_COUPLED, f"an example's gradient depends on the other examples in its batch: "
                                              f"probe example {measured.example + 1} ({measured.tokens} tokens) "
                                              f"alone and in a batch of {len(measured.order)} padded to "
                                              f"{measured.width} tokens differ by {measured.worst:.3g} relative "
                                              f"(at most {tolerance:g} passes), most in {measured.parameter} "
                                              f"({measured.share:.3g}); typical causes: {CAUSES}. Pad on the right "
                                              "and give each example a loss of its own: clipping cannot bound one "
                                              "example's effect otherwise")
    return measured


def measure_batch_independence(model: nn.Module, task: Any, tokenizer: Any, max_length: int,
                               device: Any) -> Independence:
    """Each probe example's gradient alone against the same example's gradient in every batch of `BATCHES`
    (module docstring); the model's modes are restored whatever happens."""
    examples = list(task.probe_examples())
    if len(examples) <= max(max(order) for order in BATCHES):
        raise ValueError(f"the batch-independence probe needs {max(map(max, BATCHES)) + 1} probe examples, "
                         f"got {len(examples)}")
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    modes = saved_modes(model)
    precision, cudnn_tf32 = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    model.eval()
    worst, compared = Independence(0.0, 0), 0
    try:
        torch.set_float32_matmul_precision("highest")  # no TF32: its rounding (~1e-3) is not the model's coupling
        torch.backends.cudnn.allow_tf32 = False
        with torch.enable_grad():
            alone = [_gradients(model, task, [example], tokenizer, max_length, device, params)[0][0]
                     for example in examples]
            for order in BATCHES:
                grads, batch = _gradients(model, task, [examples[i] for i in order], tokenizer, max_length, device,
                                          params)
                width = int(batch.inputs["input_ids"].shape[1])
                mask = batch.inputs.get("attention_mask")
                for position, index in enumerate(order):
                    found = _compare(alone[index], grads[position], params)
                    if found is None:
                        continue
                    compared += 1
                    relative, parameter, share = found
                    if relative != relative or relative > worst.worst:  # a NaN stays the worst
                        tokens = int(mask[position].sum()) if mask is not None else width
                        worst = Independence(relative, 0, index, tokens, order, width, parameter, share)
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.allow_tf32 = cudnn_tf32
        restore_modes(model, modes)
    return replace(worst, compared=compared)


def _gradients(model: nn.Module, task: Any, examples: Sequence[Any], tokenizer: Any, max_length: int, device: Any,
               params: list[tuple[str, nn.Parameter]]) -> tuple[list[list[torch.Tensor | None]], Any]:
    """Each example's gradient of its own loss in one batch of `examples`, and the batch."""
    batch = task.encode(examples, tokenizer, max_length, device)
    losses = task.per_example_loss(model(**batch.inputs), batch)
    if tuple(losses.shape) != (len(examples),):
        raise ValueError(f"the task's per_example_loss gave shape {tuple(losses.shape)} for {len(examples)} examples")
    grads = []
    for k in range(len(examples)):
        if not losses.requires_grad:
            grads.append([None] * len(params))
            continue
        grads.append(list(torch.autograd.grad(losses[k], [p for _, p in params], retain_graph=k < len(examples) - 1,
                                              allow_unused=True)))
    return grads, batch


def _compare(alone: list[torch.Tensor | None], inside: list[torch.Tensor | None],
             params: list[tuple[str, nn.Parameter]]) -> tuple[float, str, float] | None:
    """(‖inside − alone‖ / max(‖inside‖, ‖alone‖), the parameter with the largest part of the difference, that
    part's norm relative as well), or None when both gradients are zero."""
    squares = {"alone": 0.0, "inside": 0.0}
    parts: list[tuple[float, str]] = []
    total = 0.0
    for (name, _), a, b in zip(params, alone, inside):
        if a is None and b is None:
            continue
        a64 = a.double() if a is not None else torch.zeros_like(b, dtype=torch.float64)
        b64 = b.double() if b is not None else torch.zeros_like(a64)
        squares["alone"] += float(a64.pow(2).sum())
        squares["inside"] += float(b64.pow(2).sum())
        part = float((b64 - a64).pow(2).sum())
        total += part
        parts.append((part, name))
    scale = max(squares["alone"], squares["inside"]) ** 0.5
    if scale == 0:
        return None  # a NaN is compared, and refused
    part, name = max(parts)
    return total ** 0.5 / scale, name, part ** 0.5 / scale
