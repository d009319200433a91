"""What the router records of each tapped module (`routing/router.py`): which modules hold the trainable
parameters (and which part of each a class reaches: `reach_masks`), the hooks that record their calls
(`Recorder`), what the calls leave in a chunk (inputs, shapes, output gradients, per-sample gradients formed
early), how a chunk's records are regrouped per contribution, and the per-sample sources (`persample.Calls`,
`persample.Shared`) that the clipping stage asks for norms and sums.

Apart from the router's class so that it reads as its step: the hooks here keep what a forward and a backward
leave, the router decides when they run and what is clipped and released.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from govtrain.errors import Code, ConfigError
from govtrain.resolver.profile import Resolution
from govtrain.routing import coverage, moe, persample


class Tap:
    """What one tapped module's calls left in a chunk. The forward hook keeps each call's input and the
    shapes; the output itself is not kept (it would hold activations autograd has freed). In the backward
    pass a hook on the output receives its gradient and either forms the call's per-sample gradients at
    once, where they are smaller than the input and output gradient they come from (a LoRA factor's, a
    LayerNorm's), dropping both, or keeps the pair for the book-keeping sum (`persample.Calls`)."""
    def __init__(self, name: str, module: nn.Module, leaves: dict[str, str]) -> None:
        self.name, self.module = name, module
        # an MoE router or experts module sees its block's tokens flattened: the block whose [B, T] it needs
        self.block = name.replace(".base_layer", "").rpartition(".")[0] if moe.is_moe(module) else None
        self.leaves = leaves  # leaf ("weight") -> full parameter name
        # peft's LoRA on this experts module's fused parameters: leaf ("lora_A:default:gate_up_proj") -> (its
        # ParamWrapper, adapter, fused parameter, "A" or "B"); formed from that parameter's per-sample gradient
        self.lora: dict[str, tuple[nn.Module, str, str, str]] = {}
        self.inputs: list[Tensor | None] = []
        self.shapes: list[tuple[torch.Size, torch.Size]] = []  # (input, output) of each call
        self.grads: list[Tensor | None] = []  # output gradient of each call kept for book-keeping
        self.edges: list[Any] = []  # the gradient edge of each call's output: what `_clipped_sum` differentiates
        self.formed: dict[str, Tensor] = {}  # leaf -> per-sample gradient, summed over the calls that formed it
        self.received = False  # an output gradient came in: this chunk's forward was already differentiated

    @property
    def outputs(self) -> list[torch.Size]:
        return [out for _, out in self.shapes]

    def clear(self) -> None:
        self.inputs.clear()
        self.shapes.clear()
        self.grads.clear()
        self.edges.clear()
        self.formed.clear()
        self.received = False


def tap_modules(model: nn.Module, params: dict[str, nn.Parameter], mechanism: str
                ) -> tuple[list[str], dict[str, Tap], set[str]]:
    """The model's trainable parameters, the modules to tap for them (module path -> `Tap`), and the parameters
    several modules hold (tied weights: formed whole per sample, `persample.Shared`). Refuses a trainable
    parameter no hook covers (`coverage.py`), and LoRA on fused expert parameters under prism."""
    # a trainable parameter -> every (module path, module, leaf) that holds it: one, or several for tied weights
    holders: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for module_name, module in model.named_modules():
        for leaf, param in module.named_parameters(recurse=False):
            if param.requires_grad:
                holders.setdefault(id(param), []).append((module_name, module, leaf))
    trainable = [n for n, p in params.items() if p.requires_grad]
    taps: dict[str, Tap] = {}
    shared: set[str] = set()  # parameters several modules hold: formed whole per sample (`persample.Shared`)
    checked: set[str] = set()
    owners = [(name, holder) for name in trainable for holder in holders[id(params[name])]]
    for name in trainable:
        if len(holders[id(params[name])]) > 1:
            coverage.check_shareable(name, holders[id(params[name])])
            shared.add(name)
    for name, (module_name, module, leaf) in owners:
        fused = coverage.fused_lora(model, module_name)
        if fused is not None:  # a LoRA factor peft multiplies into an experts module's fused parameter
            wrapper, path, adapter, factor = fused
            if mechanism == "prism":
                raise ConfigError(Code.ROUTING_UNCOVERED,
                                  f"trainable parameter {name}: LoRA on fused expert parameters holds one pair per "
                                  "expert side by side, not one rank-r pair: use dpsgd or dp-muon")
            module_name, module = path, moe.innermost(wrapper)
            coverage.check_covered(model, module_name, module, name, checked)
            tap = taps.setdefault(module_name, Tap(module_name, module, {}))
            leaf = f"lora_{factor}:{adapter}:{wrapper.parameter_name}"
            tap.lora[leaf] = (wrapper, adapter, wrapper.parameter_name, factor)
            tap.leaves[leaf] = name
            continue
        coverage.check_covered(model, module_name, module, name, checked)
        tap = taps.setdefault(module_name, Tap(module_name, module, {}))
        tap.leaves[leaf] = name
    return trainable, taps, shared


class Recorder:
    """The router's hooks on the model. A forward hook on each tapped module that holds a parameter some class
    reaches (only these are recorded: autograd then stops where the deepest reached parameter is, instead of
    differentiating layers no one may train) keeps its calls in its `Tap` while `recording` (the router's
    `capture`), and hooks each call's output gradient (`receive`, in `dtype`); a pre-hook on each MoE block keeps
    the [B, T] of its last input."""

    def __init__(self, model: nn.Module, taps: dict[str, Tap], reached: set[str], per_sample: str) -> None:
        self.per_sample = per_sample
        self.recording = False
        self.dtype = torch.float32  # what output gradients are formed in: the chunk's accumulator dtype
        self.handles = [tap.module.register_forward_hook(self._hook(tap)) for tap in taps.values()
                        if reached.intersection(tap.leaves.values())]
        self.grids: dict[str, tuple[int, ...]] = {}  # MoE block -> the [B, T] of its last input
        for block in {tap.block for tap in taps.values() if tap.block is not None}:
            self.handles.append(model.get_submodule(block).register_forward_pre_hook(
                lambda _, args, block=block: self.grids.__setitem__(block, tuple(args[0].shape[:-1]) if args else ())))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _hook(self, tap: Tap):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
            if self.recording:
                index = len(tap.inputs)
                if tap.block is not None:  # tokens flattened by the block: recorded against its [B, T]
                    saved, shapes, output = moe.record(module, args, output, self.grids.get(tap.block, ()))
                else:
                    saved, shapes = args[0].detach(), (args[0].shape, output.shape)
                tap.inputs.append(saved)
                tap.shapes.append(shapes)
                tap.grads.append(None)
                if output.requires_grad:
                    output.register_hook(lambda g: receive(tap, index, g, self.dtype, self.per_sample))
                    tap.edges.append(torch.autograd.graph.get_gradient_edge(output))

        return hook



def reach_masks(resolution: Resolution, params: dict[str, nn.Parameter]
                ) -> dict[str, dict[str, tuple[int, Tensor] | None]]:
    """What each class reaches of each parameter, as the clipping stage indexes it: class -> parameter -> None
    (all of it) or (dim, the indices along dim), on the parameter's device."""
    return {data_class: {part.name: None if part.dim is None else
                         (part.dim, torch.tensor(part.index, dtype=torch.long, device=params[part.name].device))
                         for part in parts}
            for data_class, parts in resolution.reach.items()}

def receive(tap: Tap, index: int, g: Tensor, dtype: torch.dtype, per_sample: str) -> None:
    """Backward hook on a tapped call's output: form its per-sample gradients now where they are smaller
    than what they are formed from (then keep neither), else keep the output gradient for later."""
    tap.received = True
    a = tap.inputs[index]
    if a is None:  # formed already: a second backward through the forward (`_clipped_sum` refuses the first)
        return
    module = tap.module
    if isinstance(module, nn.Embedding):
        tap.grads[index] = g.to(dtype)
        return
    if tap.block is not None:
        formed = moe.grads(module, a, g, tap.shapes[index], dtype, every=bool(tap.lora))
        for leaf, (wrapper, adapter, fused, factor) in tap.lora.items():  # the chain rule through W + s·B·A
            formed[leaf] = moe.lora_grads(wrapper, adapter, formed[fused])[factor]
        formed = {leaf: value for leaf, value in formed.items() if leaf in tap.leaves}
        for leaf, value in formed.items():
            tap.formed[leaf] = tap.formed[leaf] + value if leaf in tap.formed else value
        tap.inputs[index] = None
        return
    a, g = a.to(dtype), g.to(dtype)
    if isinstance(module, persample.LINEAR) and not persample.form_early(a, g, per_sample):
        tap.inputs[index], tap.grads[index] = a, g
        return
    formed = persample.grads_of(module, a, g)
    for leaf, value in formed.items():
        tap.formed[leaf] = tap.formed[leaf] + value if leaf in tap.formed else value
    tap.inputs[index] = None


def chunk_calls(taps: list[Tap], shared: set[str], per_sample: str
                ) -> dict[str, tuple[persample.Calls | persample.Shared, str]]:
    """Each parameter -> (the calls of its module in this chunk, its leaf name), the taps cleared: norms and sums
    are asked of them; no per-sample gradient is kept beyond this chunk (persample.Calls). A shared parameter's
    holders that were called are summed whole (`persample.Shared`)."""
    calls: dict[str, tuple[persample.Calls | persample.Shared, str]] = {}
    sources: dict[str, list[tuple[persample.Calls, str]]] = {}  # a shared parameter's holders that were called
    for tap in taps:
        kept = [(a, g) for a, g in zip(tap.inputs, tap.grads) if a is not None and g is not None]
        if not kept and not tap.formed:
            continue
        module_calls = persample.Calls(tap.module, [a for a, _ in kept], [g for _, g in kept],
                                       strategy=per_sample, formed=dict(tap.formed))
        tap.clear()
        for leaf, name in tap.leaves.items():
            if name in shared:
                sources.setdefault(name, []).append((module_calls, leaf))
            else:
                calls[name] = (module_calls, leaf)
    for name, held in sources.items():
        calls[name] = (persample.Shared(held), "")
    return calls


def group_calls(tap: Tap, units: Tensor, count: int) -> None:
    """Rewrite what one tapped module recorded so that row u holds unit u's examples: each call's input and
    output gradient [B, T, ...] become [U, M·T, ...] (a unit's examples side by side along the token axis,
    zero-padded to the largest unit's M examples; zero rows add nothing to a norm or a sum), and gradients
    already formed per example are summed per unit. Every per-sample rule then sees units as samples: the
    gradient of a Linear, LayerNorm or Embedding is a sum over tokens, and a unit's is the sum over its
    examples' tokens."""
    sizes = torch.bincount(units, minlength=count)
    order = torch.argsort(units, stable=True)
    slot = torch.empty_like(units)  # position of each example inside its unit
    slot[order] = torch.arange(units.shape[0], device=units.device) - (torch.cumsum(sizes, 0) - sizes)[units[order]]
    width = int(sizes.max()) if count else 0

    def regroup(x: Tensor, *, ids: bool = False) -> Tensor:
        out = x.new_zeros((count, width, *x.shape[1:]))
        out[units, slot] = x
        if ids:  # an embedding's token ids [B, T]: one row of M·T ids per unit
            return out.reshape(count, -1)
        return out if x.dim() == 2 else out.reshape(count, width * x.shape[1], *x.shape[2:])

    embedding = isinstance(tap.module, nn.Embedding)
    for index, (a, g) in enumerate(zip(tap.inputs, tap.grads)):
        if a is not None and g is not None:
            tap.inputs[index], tap.grads[index] = regroup(a, ids=embedding), regroup(g)
    for leaf, per in tap.formed.items():
        tap.formed[leaf] = per.new_zeros((count, *per.shape[1:])).index_add_(0, units, per)
