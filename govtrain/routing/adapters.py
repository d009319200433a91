"""Per-example adapter routing: in a governed forward, each example passes only through the peft adapters its
class may reach.

A class whose depth profile is `adapter = "NAME"` trains only its own adapter, and the inference gate serves a
caller whose rights exclude that class with that adapter disabled, stating that the answer does not draw on it
(docs/serving.md). That holds only if no other class's training ever ran through the adapter: had every
example's forward passed through every adapter, the default adapter and the head that the other classes train
would be fitted to features that NAME's adapter, trained on NAME's rows, shaped (issue 22, the review's
`test_a_class_served_with_its_own_adapter_disabled_still_shaped_the_answer`). So, per example:

- the shared adapter, peft's `default` (`train/model.wrap_lora` gives it the heads, and every profile other than
  an adapter profile trains it): every example passes through it;
- a class adapter, any other adapter some class reaches: only the examples of the classes that reach one of
  its parameters (with `wrap_lora`'s model, the classes whose profile names it) pass through it.

An adapter no class reaches (frozen) is left as it is: it carries nothing this run trains.

How: a forward pre-hook on each LoRA layer's `lora_A[NAME]` zeroes the rows of the examples that may not pass
(`masked_fill` on the batch dimension, exact even for a non-finite input). peft's LoRA branch is
`lora_B(lora_A(dropout(x))) · scaling` with no bias, so such an example's branch output is exactly zero, no
gradient reaches the layers below through it, and the per-sample gradients the router forms for both factors
are exactly zero: they are Σ_t g_t a_tᵀ with a = 0 for `lora_A`, and a = lora_A(0) = 0 for `lora_B` (the
router's forward hooks see the input as the pre-hook left it). A class adapter whose branch is not that (a
bias on `lora_B`, DoRA or another peft LoRA variant, LoRA on an embedding or a parameter, a `modules_to_save`
copy of its own) is refused when the router is built (`routing_uncovered`); one merged into its base weight
is refused at the forward.

The router's `capture(classes)` sets the examples' classes for one forward (`routed`). Under `capture()`
without them, a forward with gradients enabled is refused: it would route every example through every
adapter. Outside a capture, and under `torch.no_grad()` without classes (the layout probe), every adapter is
active, as at full rights: evaluation and `govtrain.load` see the model the gate serves to a caller that may
draw on every class.

What this means for what is trained (docs/concepts.md): the default adapter and the head are trained only
on forwards that passed through no class adapter; each class adapter is trained on top of them, on its own
class's forwards. With two or more class adapters, the model at full rights (all of them active together)
is a combination no training forward ran.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

from govtrain.errors import Code, ConfigError
from govtrain.resolver.model import role

SHARED = "default"  # peft's name for the first adapter: the shared one, which `wrap_lora` gives the heads


def class_adapters(reach: Mapping[str, Iterable]) -> dict[str, frozenset[str]]:
    """Class -> the class adapters (every adapter but `SHARED`) its examples pass through: those it reaches a
    parameter of. `reach` is a resolution's class -> parts."""
    return {name: frozenset(role(part.name).adapter for part in parts) - {None, SHARED}
            for name, parts in reach.items()}


class AdapterRoutes:
    """The hooks that route each example of a governed forward through its class's adapters only."""

    def __init__(self, model: nn.Module, reach: Mapping[str, Iterable]) -> None:
        self.lanes = class_adapters(reach)
        self.adapters = tuple(sorted(set().union(*self.lanes.values())))  # the class adapters
        self._keep: dict[str, list[bool]] | None = None  # adapter -> which examples pass, during a routed forward
        self._on: dict[tuple[str, torch.device], Tensor] = {}  # the same, as a [B] bool tensor per device
        self._strict = False  # a forward with gradients enabled needs the examples' classes
        self._layers: list[tuple[str, nn.Module, str]] = []  # (path, LoRA layer, class adapter)
        self._handles: list = []
        if not self.adapters:
            return
        _check_parameters(model, self.adapters)
        for path, layer in model.named_modules():  # every layer checked before any hook: a refusal leaves none
            factors = getattr(layer, "lora_A", None)
            embedded = getattr(layer, "lora_embedding_A", None)
            for adapter in self.adapters:
                if isinstance(embedded, nn.ParameterDict) and adapter in embedded:
                    raise _refused(adapter, f"{path} is a LoRA embedding, whose factors are looked up, not called")
                if isinstance(factors, nn.ModuleDict) and adapter in factors:
                    _check_layer(path, layer, adapter)
                    self._layers.append((path, layer, adapter))
        self._handles = [layer.lora_A[adapter].register_forward_pre_hook(self._hook(path, adapter))
                         for path, layer, adapter in self._layers]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def examples(self, classes: Sequence[str], units: Sequence[int] | Tensor | None = None) -> list[str]:
        """Each example's class: `classes` per example, or per unit with `units` (one unit index per example)."""
        if units is None:
            return list(classes)
        indices = units.tolist() if isinstance(units, Tensor) else list(units)
        return [classes[int(u)] for u in indices]

    @contextlib.contextmanager
    def routed(self, classes: Sequence[str] | None) -> Iterator[None]:
        """During the block, example i passes through `SHARED` and the class adapters of `classes[i]` only.
        With `classes` None, a forward with gradients enabled is refused; one without runs every adapter."""
        if not self.adapters:
            yield
            return
        if classes is not None:
            unknown = sorted(set(classes) - self.lanes.keys())
            if unknown:
                raise ValueError(f"class {unknown[0]!r} has no resolved profile")
            merged = [(path, adapter) for path, layer, adapter in self._layers
                      if adapter in (getattr(layer, "merged_adapters", None) or ())]
            if merged:
                raise _refused(merged[0][1], f"it is merged into {merged[0][0]}'s weight, where no example can be "
                                             "routed around it: unmerge it")
            self._keep = {adapter: [adapter in self.lanes[c] for c in classes] for adapter in self.adapters}
        self._strict = True
        try:
            yield
        finally:
            self._keep, self._strict = None, False
            self._on.clear()

    def _hook(self, path: str, adapter: str):  # type: ignore[no-untyped-def]
        def before(module: nn.Module, args: tuple) -> tuple | None:
            keep = self._keep
            if keep is None:
                if self._strict and torch.is_grad_enabled():
                    raise RuntimeError(f"a forward with gradients enabled under the router's capture reached class "
                                       f"adapter {adapter!r} ({path}) without the examples' classes: it would run "
                                       "every example through every adapter; pass capture(classes, units)")
                return None  # outside a governed forward: every adapter, as at full rights
            x = args[0]
            rows = keep[adapter]
            if x.dim() < 2 or x.shape[0] != len(rows):
                raise ConfigError(Code.ROUTING_UNCOVERED, f"{path}: class adapter {adapter!r} is called on a tensor "
                                                          f"of shape {tuple(x.shape)}, whose first dimension is not "
                                                          f"the batch ({len(rows)}): its examples cannot be routed "
                                                          "one by one; remove it from lora.target_modules")
            at = (adapter, x.device)
            if at not in self._on:
                self._on[at] = torch.tensor(rows, dtype=torch.bool, device=x.device)
            cut = ~self._on[at].reshape(-1, *([1] * (x.dim() - 1)))
            return (x.masked_fill(cut, 0), *args[1:])

        return before


def _refused(adapter: str, why: str) -> ConfigError:
    return ConfigError(Code.ROUTING_UNCOVERED, f"class adapter {adapter!r}: {why}, so the examples of other classes "
                                               "cannot be kept out of it (their forwards must not pass through a "
                                               "class's own adapter); use plain LoRA on Linear modules for it")


def _check_parameters(model: nn.Module, adapters: tuple[str, ...]) -> None:
    """Every parameter of a class adapter is a LoRA factor's weight: no head copy, bias or DoRA magnitude."""
    for name, _ in model.named_parameters():
        r = role(name)
        if r.adapter in adapters and not (r.peft_part in ("lora_A", "lora_B") and r.leaf == "weight"):
            raise _refused(r.adapter, f"it holds {name}, which is not a LoRA factor's weight")


def _check_layer(path: str, layer: nn.Module, adapter: str) -> None:
    if type(layer).__name__ == "ParamWrapper":
        raise _refused(adapter, f"{path} puts LoRA on a parameter (peft target_parameters), multiplied into the "
                                "weight every example uses")
    if adapter in (getattr(layer, "lora_variant", None) or {}):
        raise _refused(adapter, f"{path} runs a LoRA variant (DoRA, ...), whose output is not its factors' product")
    lora_b = getattr(layer, "lora_B", None)
    if not isinstance(lora_b, nn.ModuleDict) or adapter not in lora_b:
        raise _refused(adapter, f"{path} has no lora_B for it")
    if getattr(lora_b[adapter], "bias", None) is not None:
        raise _refused(adapter, f"{path}'s lora_B has a bias (lora_bias), which every example would receive")
