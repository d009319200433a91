"""Class -> depth profile -> the exact trainable parameters (or parts of them) of a model it may reach.

Rules (docs/design.md §4-5), each chosen so that an unclear case reaches *less*:

- `band = [a, b]` reaches layers a..b; `layers = [...]` exactly those; an index the model does not
  have is an error, not a silent clip.
- `fraction = [lo, hi]` gives layer i (of L) the depth interval [i/L, (i+1)/L] and reaches it only if
  that interval lies inside [lo, hi]: layers ceil(lo*L) .. floor(hi*L) - 1, computed in exact integer
  arithmetic on the policy's micro-units (the policy already narrowed lo up and hi down). On 6 layers,
  [0.5, 1.0] is layers 3-5 and [0.7, 1.0] is layer 5 alone (4.2 rounds up to 5).
- `heads = {layer: [h, ...]}` restricts a named layer to those attention heads: the output rows of the
  q/k/v projections (weight, bias, and peft's `lora_B`) and the input columns of the output projection
  (weight and `lora_A`) that belong to them. Nothing else in that layer is reached: the MLP, the layer
  norms, the output projection's bias and the LoRA factors that mix heads (`lora_A` of q/k/v, `lora_B` of
  the output projection). Fused qkv projections (GPT-2's c_attn, GPT-NeoX's query_key_value) cannot be
  split this way and are refused. A GPT-2 Conv1D stores its weight [in, out], so there a head's input
  features are rows of `attn.c_proj` (`ModelLayout.feature_dim`).
- Grouped-query attention (Llama, Mistral, Qwen2 with num_key_value_heads < num_attention_heads): key/value
  head j serves query heads j·g .. j·g + g - 1 (g = heads / kv heads, as transformers' `repeat_kv` lays
  them out). A heads profile reaches key/value head j only if it reaches every query head that shares it:
  heads [0] on 4 query / 2 kv heads reaches no row of k_proj or v_proj (kv head 0 also serves query head
  1), heads [0, 1] reaches kv head 0's rows. Never more than the profile says: a kv head's gradient
  carries the signal of every query head that reads it.
- `experts = {layer: [e, ...]}` restricts a named layer of a mixture-of-experts model to those experts:
  their slices (dimension 0) of an experts module's fused parameters ([E, ...], Mixtral's gate_up_proj and
  down_proj), or their whole modules where each expert is its own module (`experts.3.w1`, LoRA included).
  Nothing else in that layer is reached (attention only through `heads` on the same layer). peft's LoRA on
  a fused expert parameter (target_parameters) keeps one factor pair per expert side by side: a class
  reaches its experts' rows of lora_A and columns of lora_B (`_expert_part`).
- Routers (an MoE block's `gate`/`router`) are reached only with `router = true`, whatever the depth
  profile: a router's gradient carries every expert's signal, as the head carries every layer's.
- `adapter = "name"` reaches exactly the trainable parameters of that peft adapter (its LoRA factors
  and its `modules_to_save` copies); no other class reaches them.
- Trainable parameters outside the layer stack (embeddings, pooler, final norm, the classifier head)
  are reached only by classes with `head = true`.
- A class whose profile reaches no trainable parameter is an error. A trainable parameter that no class
  reaches is reported as frozen: it gets neither gradient nor noise.

Noise groups: coordinates reached by the same set of classes form one group (its signature); the
noise schedule gives each group one standard deviation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from govtrain import units
from govtrain.errors import Code, ConfigError
from govtrain.policy.model import DataClass, DepthProfile
from govtrain.resolver.model import EXPERT, EXPERTS, FUSED, OUT, QKV, ModelLayout, Param, role


@dataclass(frozen=True, slots=True)
class Part:
    """A parameter, or the indices `index` along dimension `dim` of it (None: the whole parameter)."""

    name: str
    dim: int | None = None
    index: tuple[int, ...] | None = None

    def numel(self, param: Param) -> int:
        if self.dim is None:
            return param.numel
        return param.numel // param.shape[self.dim] * len(self.index)

    def describe(self) -> str:
        if self.dim is None:
            return self.name
        named = role(self.name)
        what = ("experts" if EXPERTS.search(named.module) and named.peft_part is None else
                "rows" if self.dim == 0 else "columns")
        return f"{self.name}[{what} {format_ranges(self.index)}]"


@dataclass(frozen=True, slots=True)
class Group:
    classes: frozenset[str]  # who reaches these coordinates; empty: frozen
    parts: tuple[Part, ...]
    numel: int


@dataclass(frozen=True)
class Resolution:
    layout: ModelLayout
    reach: Mapping[str, tuple[Part, ...]]  # class -> parts it reaches
    layers: Mapping[str, tuple[int, ...]]  # class -> layers it reaches (empty for adapter profiles)
    groups: tuple[Group, ...]  # every trainable coordinate in exactly one group; frozen ones included
    _params: Mapping[str, Param] = field(repr=False, default_factory=dict)

    def class_groups(self) -> dict[str, list[frozenset[str]]]:
        """Class -> the signatures of the groups it reaches (the g in P(i) of docs/design.md §5)."""
        out: dict[str, list[frozenset[str]]] = {name: [] for name in self.reach}
        for group in self.groups:
            for name in group.classes:
                out[name].append(group.classes)
        return out

    def frozen(self) -> list[Part]:
        return [part for group in self.groups if not group.classes for part in group.parts]

    def numel(self, data_class: str) -> int:
        return sum(part.numel(self._params[part.name]) for part in self.reach[data_class])


def profile_layers(profile: DepthProfile, num_layers: int, where: str = "profile") -> tuple[int, ...]:
    """The absolute layer indices a band, fraction or layers profile names on a model of `num_layers`."""
    if profile.kind == "adapter":
        return ()
    if profile.kind == "fraction":
        low_u, high_u = profile.fraction_u
        first = -(-low_u * num_layers // units.MICRO)  # ceil
        stop = high_u * num_layers // units.MICRO  # floor: layer i needs i + 1 <= hi * L
        if first >= stop:
            raise ConfigError(Code.PROFILE_UNMATCHED,
                              f"{where}: fraction [{units.format_micro(low_u)}, {units.format_micro(high_u)}] "
                              f"contains no whole layer of a {num_layers}-layer model")
        return tuple(range(first, stop))
    indices = tuple(range(profile.band[0], profile.band[1] + 1)) if profile.kind == "band" else profile.layers
    outside = [i for i in indices if i >= num_layers]
    if outside:
        raise ConfigError(Code.PROFILE_OUT_OF_RANGE,
                          f"{where}: names layer {outside[0]} but the model has {num_layers} layers (0-{num_layers - 1})")
    return tuple(indices)


def resolve(classes: Mapping[str, DataClass], layout: ModelLayout) -> Resolution:
    params = {p.name: p for p in layout.trainable()}
    claimed = {cls.profile.adapter for cls in classes.values() if cls.profile.kind == "adapter"}
    adapters = {role(n).adapter for n in params} - {None}
    reach: dict[str, tuple[Part, ...]] = {}
    layers: dict[str, tuple[int, ...]] = {}
    for name, cls in classes.items():
        where = f"class {name!r} ({describe_profile(cls.profile)})"
        profile = cls.profile
        if profile.kind == "adapter":
            parts = tuple(Part(n) for n in params if role(n).adapter == profile.adapter)
            if not parts:
                known = ", ".join(sorted(adapters)) or "none"
                raise ConfigError(Code.PROFILE_UNMATCHED,
                                  f"{where}: {layout.name} has no trainable parameter of adapter "
                                  f"{profile.adapter!r} (its adapters: {known})")
            reach[name], layers[name] = parts, ()
            continue
        chosen = profile_layers(profile, layout.num_layers, where)
        heads, experts = dict(profile.heads or ()), dict(profile.experts or ())
        _check_experts(experts, layout, where)
        parts_list: list[Part] = []
        for pname, param in params.items():
            r = role(pname)
            if r.adapter in claimed:
                continue
            if r.layer is None:
                if profile.head:
                    parts_list.append(Part(pname))
            elif r.layer in chosen:
                part = _layer_part(pname, param, profile, heads.get(r.layer), experts.get(r.layer), layout, where)
                if part is not None:
                    parts_list.append(part)
        if not parts_list:
            holding = sorted({role(n).layer for n in params} - {None})
            raise ConfigError(Code.PROFILE_UNMATCHED,
                              f"{where}: reaches no trainable parameter of {layout.name} (layers {list(chosen)}"
                              f"{', heads restricted' if heads else ''}{', experts restricted' if experts else ''}; "
                              "trainable parameters sit in layers "
                              f"{format_ranges(holding) or 'none'}{' and outside the stack' if _outside(params) else ''})")
        reach[name], layers[name] = tuple(parts_list), chosen
    return Resolution(layout, reach, layers, _groups(params, reach), params)


def _layer_part(name: str, param: Param, profile: DepthProfile, heads: tuple[int, ...] | None,
                experts: tuple[int, ...] | None, layout: ModelLayout, where: str) -> Part | None:
    """What of parameter `name`, in one of the profile's layers, the profile reaches. A layer named in heads or
    experts reaches only those heads' and experts' parts; a router only with `router = true`."""
    r = role(name)
    if layout.is_router(r.module):  # granted by router = true, in a layer whose MoE block the profile reaches
        return Part(name) if profile.router and (heads is None or experts is not None) else None
    if experts is not None and (EXPERT.search(r.module) or EXPERTS.search(r.module)):
        return _expert_part(name, param, experts, layout)
    if heads is not None:
        return _head_part(name, param, heads, layout, where)
    return None if experts is not None else Part(name)


def _check_experts(experts: Mapping[int, tuple[int, ...]], layout: ModelLayout, where: str) -> None:
    if experts and layout.num_experts is None:
        raise ConfigError(Code.PROFILE_UNRESOLVABLE, f"{where}: experts need a mixture-of-experts model "
                                                     f"(num_local_experts or num_experts), which {layout.name} is not")
    too_big = [e for chosen in experts.values() for e in chosen if e >= (layout.num_experts or 0)]
    if too_big:
        raise ConfigError(Code.PROFILE_OUT_OF_RANGE,
                          f"{where}: names expert {too_big[0]} but the model has {layout.num_experts} experts")


def _expert_part(name: str, param: Param, experts: tuple[int, ...], layout: ModelLayout) -> Part | None:
    """One expert's module (`experts.3.w1`, its LoRA included) is reached whole or not at all; the fused
    parameters of an experts module ([E, ...]: Mixtral's gate_up_proj, down_proj) by their expert slices
    along dimension 0. peft's LoRA on a fused parameter (target_parameters) keeps one pair per expert side by
    side, lora_A [E·r, in] (expert e: rows e·r … e·r+r−1) and lora_B [out, r·E] (expert e: columns k·E+e): a
    class reaches its experts' rows and columns of them."""
    r = role(name)
    item = EXPERT.search(r.module)
    if item is not None:
        return Part(name) if int(item.group(1)) in experts else None
    count = layout.num_experts or 0
    if r.peft_part in ("lora_A", "lora_B") and len(param.shape) == 2:
        dim = 0 if r.peft_part == "lora_A" else 1
        if count < 1 or param.shape[dim] % count:
            return None
        rank = param.shape[dim] // count
        index = ([e * rank + k for e in experts for k in range(rank)] if dim == 0 else
                 [k * count + e for k in range(rank) for e in experts])
        return Part(name, dim, tuple(sorted(index)))
    if r.peft_part is not None or not param.shape or param.shape[0] != count:
        return None
    return Part(name, 0, tuple(experts))


def _head_part(name: str, param: Param, heads: tuple[int, ...], layout: ModelLayout, where: str) -> Part | None:
    r = role(name)
    if FUSED.search(r.module):
        raise ConfigError(Code.PROFILE_UNRESOLVABLE,
                          f"{where}: heads cannot be separated in the fused attention projection {r.module}")
    if layout.num_heads is None or layout.head_dim is None:
        raise ConfigError(Code.PROFILE_UNRESOLVABLE, f"{where}: heads need the model's attention geometry "
                                                     "(num_attention_heads, head_dim), which it does not declare")
    too_big = [h for h in heads if h >= layout.num_heads]
    if too_big:
        raise ConfigError(Code.PROFILE_OUT_OF_RANGE,
                          f"{where}: names head {too_big[0]} but the model has {layout.num_heads} heads")
    d = layout.head_dim
    qkv = QKV.search(r.module)
    if qkv is not None:
        if r.peft_part in ("lora_A", "lora_embedding_A", "lora_embedding_B"):
            return None  # lora_A of q/k/v feeds every head's output
        # weight, bias, lora_B and a DoRA magnitude are all laid out by output row
        kind = qkv.group(1)
        if kind in ("key", "value", "k_proj", "v_proj") and layout.num_kv_heads != layout.num_heads:
            if layout.num_heads % layout.num_kv_heads:
                raise ConfigError(Code.PROFILE_UNRESOLVABLE,
                                  f"{where}: {layout.num_heads} query heads cannot share {layout.num_kv_heads} "
                                  "key/value heads in equal groups")
            size = layout.num_heads // layout.num_kv_heads  # kv head j serves query heads j*size .. (j+1)*size - 1
            units_ = [j for j in range(layout.num_kv_heads) if all(h in heads for h in range(j * size, (j + 1) * size))]
            expected = layout.num_kv_heads * d
        else:
            units_, expected = list(heads), layout.num_heads * d
        dim = layout.feature_dim(name, "out")
        if param.shape[dim] != expected:
            raise ConfigError(Code.PROFILE_UNRESOLVABLE, f"{where}: {name} has {param.shape[dim]} output features, "
                                                         f"not the {expected} its heads imply")
        rows = tuple(i for j in units_ for i in range(j * d, (j + 1) * d))
        return Part(name, dim, rows) if rows else None
    if OUT.search(r.module):
        if not (r.peft_part == "lora_A" or r.peft_part in (None, "modules_to_save") and r.leaf == "weight"):
            return None  # its bias, lora_B and magnitude mix every head's input
        dim = layout.feature_dim(name, "in")  # a Conv1D's input features are its rows
        if len(param.shape) != 2 or param.shape[dim] != layout.num_heads * d:
            raise ConfigError(Code.PROFILE_UNRESOLVABLE, f"{where}: {name} does not have the "
                                                         f"{layout.num_heads * d} input features its heads imply")
        return Part(name, dim, tuple(i for h in heads for i in range(h * d, (h + 1) * d)))
    return None  # MLP, norms and anything else in a head-restricted layer


def _groups(params: Mapping[str, Param], reach: Mapping[str, tuple[Part, ...]]) -> tuple[Group, ...]:
    by_param: dict[str, dict[str, Part]] = {}
    for cls, parts in reach.items():
        for part in parts:
            by_param.setdefault(part.name, {})[cls] = part
    grouped: dict[frozenset[str], list[Part]] = {}
    numel: dict[frozenset[str], int] = {}
    for pname, param in params.items():
        reached = by_param.get(pname, {})
        dims = {part.dim for part in reached.values() if part.dim is not None}
        if not dims:
            pieces = [(frozenset(reached), Part(pname))]
        else:
            (dim,) = dims  # a parameter's head layout fixes the one dimension it is sliced along
            signature_of: dict[int, frozenset[str]] = {}
            for i in range(param.shape[dim]):
                signature_of[i] = frozenset(c for c, part in reached.items() if part.dim is None or i in part.index)
            by_signature: dict[frozenset[str], list[int]] = {}
            for i, signature in signature_of.items():
                by_signature.setdefault(signature, []).append(i)
            pieces = [(s, Part(pname, dim, tuple(idx))) for s, idx in by_signature.items()]
        for signature, part in pieces:
            grouped.setdefault(signature, []).append(part)
            numel[signature] = numel.get(signature, 0) + part.numel(param)
    order = sorted(grouped, key=lambda s: (not s, sorted(s)))
    return tuple(Group(s, tuple(grouped[s]), numel[s]) for s in order)


def describe_profile(profile: DepthProfile) -> str:
    if profile.kind == "band":
        text = f"band {list(profile.band)}"
    elif profile.kind == "fraction":
        text = f"fraction [{units.format_micro(profile.fraction_u[0])}, {units.format_micro(profile.fraction_u[1])}]"
    elif profile.kind == "layers":
        text = f"layers {list(profile.layers)}"
    else:
        return f"adapter {profile.adapter!r}"
    for what, mask in (("heads", profile.heads), ("experts", profile.experts)):
        if mask:
            text += f", {what} {{{', '.join(f'{layer}: {list(i)}' for layer, i in mask)}}}"
    return text + (", head" if profile.head else "") + (", router" if profile.router else "")


def _outside(params: Mapping[str, Param]) -> bool:
    return any(role(n).layer is None for n in params)


def format_ranges(indices) -> str:
    indices = sorted(indices)
    out, start = [], None
    for i, value in enumerate(indices):
        if start is None:
            start = value
        if i + 1 == len(indices) or indices[i + 1] != value + 1:
            out.append(str(start) if start == value else f"{start}-{value}")
            start = None
    return ",".join(out)
