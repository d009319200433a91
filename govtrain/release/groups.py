"""What a run trained, part by part: its parameter groups, each with the classes that reached it, as the run's
resolver drew them (`resolver/profile.py`), for a release manifest's predicate.

The run resolved its policy's profiles against the model it trained: the base with every adapter of its folder,
all active, every LoRA factor and head copy trainable (`train.model.wrap_lora`). `adapter_layout` builds that model
again on PyTorch's meta device, from the base model's config and the folder's own adapter configs, so no weight is
read; `trained_groups` resolves the profiles against it. Coordinates reached by the same classes form one group
(its signature); the run's spend entries record the signatures its noise schedule used (`noise_groups`), and a
manifest is refused unless each of them is one the resolution gives: a folder or base other than the run's shows.

A group is described in the policy's own terms: the layers it holds, the attention heads or experts of a layer
where it holds only some (a `heads` or `experts` profile), the modules outside the layer stack (the classifier
head), and the peft adapters its parameters belong to ("default", or a class's own adapter).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

from govtrain.errors import Code, IntegrityError
from govtrain.policy.model import DataClass
from govtrain.release.artifact import ADAPTER_CONFIG, ArtifactRecord, peft_config
from govtrain.resolver.model import EXPERT, EXPERTS, OUT, QKV, ModelLayout, Param, role
from govtrain.resolver.profile import Part, resolve


@dataclass(frozen=True, kw_only=True)
class TrainedGroup:
    """One group of trained coordinates: the classes that reached it (all of them, charged or not), where it lies
    (`layers`; `heads` and `experts`: layer -> indices, where it holds only those of the layer; `outside`: modules
    outside the layer stack), the `adapters` its parameters belong to, and its size."""

    classes: tuple[str, ...]
    adapters: tuple[str, ...]
    layers: tuple[int, ...]
    heads: tuple[tuple[int, tuple[int, ...]], ...]
    experts: tuple[tuple[int, tuple[int, ...]], ...]
    outside: tuple[str, ...]
    tensors: int
    scalars: int


def adapter_layout(folder: Path, record: ArtifactRecord, base: Path) -> ModelLayout:
    """The layout of the model the run trained: the base at `base` (its config only, on the meta device) for the
    record's task, its pooling, and every adapter of `folder` built from the folder's adapter_config.json files,
    LoRA factors and head copies trainable."""
    import torch
    from peft import PeftConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from govtrain.resolver.model import describe
    from govtrain.models.loading import no_remote_code, quiet_loading

    os.environ["HF_HUB_OFFLINE"] = "1"
    configs = {}
    for name in record.adapters:
        place = folder if name == "default" else folder / name
        config = PeftConfig.from_peft_type(**peft_config((place / ADAPTER_CONFIG).read_bytes()))
        config.inference_mode = False
        config.base_model_name_or_path = str(base)  # where it is here (the folder names it portably)
        configs[name] = config
    classifier = record.task == "sequence-classification"
    with quiet_loading(), no_remote_code(base), torch.device("meta"):
        config = AutoConfig.from_pretrained(base, num_labels=record.num_labels or 2, local_files_only=True,
                                            trust_remote_code=False)
        model = (AutoModelForSequenceClassification if classifier else AutoModelForCausalLM).from_config(config)
        if classifier:
            from govtrain.models.pooling import use_pooling

            model = use_pooling(model, record.pooling)
        model = get_peft_model(model, configs["default"])
        for name in record.adapters[1:]:
            model.add_adapter(name, configs[name])
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name or ".modules_to_save." in name)
    return describe(model, name=record.base_model.name)


def trained_groups(classes: Mapping[str, DataClass], layout: ModelLayout,
                   recorded: Iterable[frozenset[str]] = ()) -> tuple[TrainedGroup, ...]:
    """The groups the classes' profiles reach on `layout` (frozen coordinates left out), each described. Raises
    `adapter_mismatch` unless every signature in `recorded` (the run's spend entries' noise groups) is one of them."""
    present = {role(p.name).adapter for p in layout.trainable()}
    layered = {n: c for n, c in classes.items() if c.profile.kind != "adapter" or c.profile.adapter in present}
    resolution = resolve(layered, layout)
    signatures = {group.classes for group in resolution.groups if group.classes}
    unknown = [sorted(s) for s in recorded if s not in signatures]
    if unknown:
        raise IntegrityError(Code.ADAPTER_MISMATCH, f"the run's spend entries charged noise on a group reached by "
                                                    f"classes {unknown[0]}, which the policy's profiles do not draw "
                                                    "on this adapter and base model: they are not the run's")
    params = {p.name: p for p in layout.trainable()}
    return tuple(_describe(group.classes, group.parts, params, layout)
                 for group in resolution.groups if group.classes)


def _describe(classes: frozenset[str], parts: tuple[Part, ...], params: Mapping[str, Param],
              layout: ModelLayout) -> TrainedGroup:
    layers: set[int] = set()
    heads: dict[int, set[int]] = {}
    experts: dict[int, set[int]] = {}
    outside: set[str] = set()
    adapters: set[str] = set()
    for part in parts:
        r = role(part.name)
        adapters.add(r.adapter or "default")
        if r.layer is None:
            outside.add(r.module.removeprefix("base_model.model."))
            continue
        layers.add(r.layer)
        item = EXPERT.search(r.module)
        if item is not None:
            experts.setdefault(r.layer, set()).add(int(item.group(1)))
        elif part.dim is not None:
            kind, found = _units(part, params[part.name], layout)
            (experts if kind == "experts" else heads).setdefault(r.layer, set()).update(found)
    return TrainedGroup(
        classes=tuple(sorted(classes)), adapters=tuple(sorted(adapters)), layers=tuple(sorted(layers)),
        heads=tuple((layer, tuple(sorted(found))) for layer, found in sorted(heads.items())),
        experts=tuple((layer, tuple(sorted(found))) for layer, found in sorted(experts.items())),
        outside=tuple(sorted(outside)), tensors=len({p.name for p in parts}),
        scalars=sum(part.numel(params[part.name]) for part in parts))


def _units(part: Part, param: Param, layout: ModelLayout) -> tuple[str, set[int]]:
    """("heads", the query heads) or ("experts", the experts) that the slice `part` of `param` belongs to: the
    inverse of the resolver's `_head_part` and `_expert_part`."""
    r = role(part.name)
    index = part.index or ()
    if EXPERTS.search(r.module):
        count = layout.num_experts or 1
        if r.peft_part == "lora_A":  # expert e: rows e·r … e·r+r−1
            rank = param.shape[0] // count
            return "experts", {i // rank for i in index}
        if r.peft_part == "lora_B":  # expert e: columns k·E+e
            return "experts", {i % count for i in index}
        return "experts", set(index)
    d = layout.head_dim or 1
    qkv = QKV.search(r.module)
    if qkv is not None and qkv.group(1) in ("key", "value", "k_proj", "v_proj") \
            and layout.num_kv_heads and layout.num_heads and layout.num_kv_heads != layout.num_heads:
        size = layout.num_heads // layout.num_kv_heads  # kv head j serves query heads j·size … (j+1)·size − 1
        return "heads", {h for j in {i // d for i in index} for h in range(j * size, (j + 1) * size)}
    if qkv is not None or OUT.search(r.module):
        return "heads", {i // d for i in index}
    raise IntegrityError(Code.ADAPTER_MISMATCH, f"{part.name}: a slice of a parameter that is neither an attention "
                                                "projection nor an experts module")
