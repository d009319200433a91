"""What the resolver needs to know about a model: its trainable parameters by name and shape,
where its layer stack is, and its attention geometry. No torch import: `describe` reads a torch
module it is given; tests and `plan` may also build a `ModelLayout` from names alone.

Layer indices are read from Hugging Face module names: the first `<stack>.<N>.` segment where
<stack> is one of `layer`, `layers`, `h`, `block`, `blocks` (`encoder.layer.N` in BERT,
`model.layers.N` in Llama, `transformer.h.N` in GPT-2, `encoder.block.N` in T5). A model with
more than one such stack (an encoder-decoder) is refused: depth is ambiguous there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

from govtrain.errors import Code, ConfigError

STACK = re.compile(r"(?:^|\.)(?:layer|layers|h|block|blocks)\.(\d+)\.")
# peft wraps a target module's weights as `<module>.lora_A.<adapter>.weight`, and copies a module listed
# in modules_to_save as `<module>.modules_to_save.<adapter>.<param>` next to `<module>.original_module`.
PEFT_PART = re.compile(
    r"\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector|modules_to_save)\.([^.]+)(?:\.|$)")
# Attention projections whose output rows (q, k, v) or input columns (o) are laid out head by head.
QKV = re.compile(r"(?:^|\.)(query|key|value|q_proj|k_proj|v_proj)$")
# BERT's attention.output.dense, GPT-NeoX's attention.dense, GPT-2's attn.c_proj (not mlp.c_proj), Llama's o_proj.
OUT = re.compile(r"(?:^|\.)(?:attention\.output\.dense|attention\.dense|attn\.c_proj|o_proj|out_proj)$")
# Mixture of experts: an experts module holding fused [E, ...] parameters, one module per expert, a router.
EXPERTS = re.compile(r"(?:^|\.)experts$")
EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)(?:\.|$)")
ROUTER = re.compile(r"(?:^|\.)(?:gate|router)$")
FUSED = re.compile(r"(?:^|\.)(?:c_attn|qkv_proj|query_key_value|Wqkv|qkv)$")


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    shape: tuple[int, ...]
    trainable: bool = True

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class ParamRole:
    """Where a parameter sits: its layer (None outside the stack), its module, and its peft part."""

    layer: int | None
    module: str  # the module path with peft's wrapping removed
    peft_part: str | None  # lora_A, lora_B, modules_to_save, ... or None for a plain parameter
    adapter: str | None
    leaf: str  # weight, bias, ...


def role(name: str) -> ParamRole:
    layer_match = STACK.search(name)
    peft = PEFT_PART.search(name)
    if peft is not None:
        module, part, adapter = name[:peft.start()], peft.group(1), peft.group(2)
        leaf = name[peft.end():] or part  # lora_magnitude_vector.<adapter> has no trailing leaf
    else:
        module, _, leaf = name.rpartition(".")
        part = adapter = None
    module = module.replace(".base_layer", "").replace(".original_module", "")
    return ParamRole(int(layer_match.group(1)) if layer_match else None, module, part, adapter, leaf)


@dataclass(frozen=True)
class ModelLayout:
    params: tuple[Param, ...]
    num_layers: int
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    name: str = "model"
    # modules (peft's wrapping removed) whose weight is stored [in, out], as GPT-2's Conv1D: y = x W + b
    transposed: frozenset[str] = frozenset()
    num_experts: int | None = None  # experts per mixture-of-experts layer, None for a dense model
    # MoE routers found by their class (`…Router`, `…Gating`), besides the `gate`/`router` names ROUTER knows
    routers: frozenset[str] = frozenset()

    @classmethod
    def from_params(cls, params: Iterable[Param], *, num_layers: int | None = None, num_heads: int | None = None,
                    num_kv_heads: int | None = None, head_dim: int | None = None, name: str = "model",
                    transposed: Iterable[str] = (), num_experts: int | None = None,
                    routers: Iterable[str] = ()) -> "ModelLayout":
        params = tuple(params)
        stacks = {p.name[:STACK.search(p.name).start()] for p in params if STACK.search(p.name)}
        if len(stacks) > 1:
            raise ConfigError(Code.PROFILE_UNRESOLVABLE,
                              f"{name} has {len(stacks)} layer stacks ({', '.join(sorted(stacks))}); depth profiles "
                              "need a single stack of layers")
        indices = {role(p.name).layer for p in params} - {None}
        seen = max(indices) + 1 if indices else 0
        if num_layers is None:
            num_layers = seen
        elif seen > num_layers:
            raise ConfigError(Code.PROFILE_UNRESOLVABLE,
                              f"{name}: parameters name layer {seen - 1} but the config has {num_layers} layers")
        if num_heads is not None and num_kv_heads is None:
            num_kv_heads = num_heads
        return cls(params, num_layers, num_heads, num_kv_heads, head_dim, name, frozenset(transposed), num_experts,
                   frozenset(routers))

    def is_router(self, module: str) -> bool:
        """Whether `module` (peft's wrapping removed) is an MoE router or lies inside one (DBRX's router.layer)."""
        return bool(ROUTER.search(module)) or any(module == r or module.startswith(r + ".") for r in self.routers)

    def feature_dim(self, name: str, side: str) -> int:
        """The dimension of parameter `name` that runs over a module's `side` ("out" or "in") features: a
        Linear weight is [out, in], a Conv1D weight [in, out]; peft's LoRA factors are Linear either way."""
        r = role(name)
        flipped = r.module in self.transposed and r.leaf == "weight" and r.peft_part in (None, "modules_to_save")
        return (0 if side == "out" else 1) ^ int(flipped)

    def trainable(self) -> list[Param]:
        return [p for p in self.params if p.trainable]


def describe(model: Any, name: str | None = None) -> ModelLayout:
    """The layout of a torch model (a transformers `PreTrainedModel`, possibly peft-wrapped)."""
    params = [Param(n, tuple(p.shape), bool(p.requires_grad)) for n, p in model.named_parameters()]
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()

    def read(*keys: str) -> int | None:
        for key in keys:
            value = getattr(config, key, None)
            if isinstance(value, int):
                return value
        return None

    # Conv1D by name (no torch import here): transformers.pytorch_utils.Conv1D, whose weight is [in, out]
    transposed = {role(f"{n}.weight").module for n, m in model.named_modules() if type(m).__name__ == "Conv1D"}
    routers = {role(f"{n}.weight").module for n, m in model.named_modules()
               if type(m).__name__.endswith(("Router", "Gating"))}
    num_heads = read("num_attention_heads", "n_head", "num_heads")
    hidden = read("hidden_size", "n_embd", "d_model")
    head_dim = read("head_dim") or (hidden // num_heads if hidden and num_heads else None)
    return ModelLayout.from_params(
        params, num_layers=read("num_hidden_layers", "n_layer", "num_layers"), num_heads=num_heads,
        num_kv_heads=read("num_key_value_heads"), head_dim=head_dim,
        name=name or getattr(config, "_name_or_path", None) or type(model).__name__, transposed=transposed,
        num_experts=read("num_local_experts", "num_experts"), routers=routers)
