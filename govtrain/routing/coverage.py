"""What the routing layer covers, and what it refuses before a run spends anything (`routing_uncovered`).

A trainable parameter is covered when its module has an exact per-sample rule: Linear, Conv1D, Embedding and
LayerNorm (`TAPPED`), an RMSNorm that a probe confirms computes weight × norm(x), Mixtral-style MoE blocks
whose token → sample map a probe confirms, and peft's LoRA factors on fused experts (`fused_lora`). A
parameter several modules hold is covered when every holder is one of the plain kinds (`check_shareable`).
A BatchNorm that mixes the examples of a batch is refused wherever it is (`check_batch_norms`). `Router`
(`router.py`) calls these when it is built, and the BatchNorm check again at every step.
"""

from __future__ import annotations

from typing import Iterable

from torch import nn

from govtrain.errors import Code, ConfigError
from govtrain.routing import moe, persample

TAPPED = (*persample.LINEAR, nn.Embedding, nn.LayerNorm)  # and RMSNorms that pass `persample.check_rms_norm`


def check_batch_norms(batch_norms: Iterable[tuple[str, nn.Module]]) -> None:
    """Refuse (`routing_uncovered`) a BatchNorm that is not a fixed map of each example alone.

    BatchNorm (any `_BatchNorm`: 1d, 2d, 3d, SyncBatchNorm) normalizes with the batch's statistics in
    train mode, and in eval mode too when it keeps no running statistics (`track_running_stats=False`).
    Such a BatchNorm mixes the examples of a batch wherever it is, above or below the trainable
    parameters: example i's loss then depends on the other examples, so its clipped gradient is no
    longer its own (removing example j moves every other example's contribution, and the sensitivity is
    no longer C_i), and in train mode its running statistics, released with the model, are an unnoised
    average of the private data. One with a trainable weight or bias has no per-sample rule either.

    Allowed: a frozen BatchNorm in eval mode with running statistics, anywhere in the model. It is then
    a fixed per-channel affine map of each example, and gradients that flow through it stay per-sample.
    The check runs when the router is built and again at every step (`model.train()` may come later);
    it looks at every BatchNorm the model holds, called in the forward pass or not."""
    for name, module in batch_norms:
        trainable = [leaf for leaf, p in module.named_parameters(recurse=False) if p.requires_grad]
        if trainable:
            why = f"has a trainable {' and '.join(trainable)}"
        elif module.training or module.running_mean is None:
            why = "normalizes with the batch's statistics (" + (
                "train mode" if module.training else "track_running_stats=False") + ")"
        else:
            continue
        raise ConfigError(Code.ROUTING_UNCOVERED,
                          f"{type(module).__name__} {name} {why}: BatchNorm mixes examples in a batch, so "
                          "per-sample gradients are not per-sample; replace it with GroupNorm or LayerNorm, or "
                          "freeze it and put it in eval mode")


def check_shareable(name: str, holders: list[tuple[str, nn.Module, str]]) -> None:
    """A trainable parameter several modules hold (tied embeddings: an Embedding and the output Linear) is
    routed only where every holder is a plain Linear, Conv1D, Embedding, LayerNorm or RMSNorm: each holder's
    hook forms its part of a sample's gradient and `persample.Shared` sums the parts before the norm. A LoRA
    factor, an MoE module or any other holder is refused: its per-sample rule cannot be summed that way."""
    paths = [f"{module_name}.{leaf}" if module_name else leaf for module_name, _, leaf in holders]
    for (module_name, module, _), path in zip(holders, paths):
        if ".lora_" in module_name or moe.is_moe(module) or not (isinstance(module, TAPPED)
                                                                 or persample.is_rms_norm(module)):
            raise ConfigError(Code.ROUTING_UNCOVERED,
                              f"trainable parameter {name} is also {', '.join(p for p in paths if p != name)} (tied "
                              f"weights) and {path} is a {type(module).__name__}: a shared parameter's per-sample "
                              "gradient is formed only across Linear, Conv1D, Embedding, LayerNorm and RMSNorm "
                              "modules; freeze it or untie it")


def fused_lora(model: nn.Module, module_name: str) -> tuple[nn.Module, str, str, str] | None:
    """(its ParamWrapper, the experts module's path, adapter, "A" or "B") for a LoRA factor module that peft's
    target_parameters put on a Mixtral-layout experts module's fused parameter; None for any other module."""
    if ".lora_A." not in module_name and ".lora_B." not in module_name:
        return None
    head, factor, adapter = module_name.rpartition(".lora_")[0], module_name.rpartition(".lora_")[2][0], \
        module_name.rpartition(".")[2]
    wrapper = model.get_submodule(head)
    if not moe.is_fused_lora(wrapper):
        return None
    path = head
    while type(model.get_submodule(path)).__name__ == "ParamWrapper":
        path += ".base_layer"
    return wrapper, path, adapter, factor


def check_covered(model: nn.Module, module_name: str, module: nn.Module, name: str, checked: set[str]) -> None:
    """Refuse (`routing_uncovered`) a trainable parameter whose module has no exact per-sample rule: checks
    that run a probe (RMSNorm, MoE blocks) run once per module or block (`checked`)."""
    if ".lora_" in module_name:
        layer = model.get_submodule(module_name.rpartition(".lora_")[0])
        if type(layer).__name__ == "ParamWrapper":  # peft's target_parameters: factors multiplied, never called
            raise ConfigError(Code.ROUTING_UNCOVERED,
                              f"trainable parameter {name} is a LoRA factor on a parameter (peft target_parameters), "
                              "which no routing hook covers: target modules instead, or freeze it")
    if isinstance(module, TAPPED):
        if isinstance(module, nn.Embedding):
            persample.check_embedding(module, name)
        return
    if moe.is_moe(module):
        block = module_name.replace(".base_layer", "").rpartition(".")[0]
        if block not in checked:
            try:
                moe.check_block(model.get_submodule(block), block)
            except persample.Mismatch as e:
                raise ConfigError(Code.ROUTING_UNCOVERED, f"trainable parameter {name}: {e}, so no routing hook "
                                                          "covers it: freeze it") from e
            checked.add(block)
        return
    if persample.is_rms_norm(module):
        try:
            persample.check_rms_norm(module, name)
        except persample.Mismatch as e:
            raise ConfigError(Code.ROUTING_UNCOVERED, f"trainable parameter {e}, so no routing hook covers it: "
                                                      "freeze it") from e
        return
    raise ConfigError(Code.ROUTING_UNCOVERED,
                      f"trainable parameter {name} belongs to a {type(module).__name__}, which no routing hook covers: "
                      "freeze it or use Linear, Conv1D, Embedding, LayerNorm, RMSNorm and Mixtral-style MoE modules")
