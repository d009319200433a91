"""The run's model: the base model with its LoRA adapters, loaded quietly, on the device the run names.

How the model is loaded and where it runs never changes what a step releases (docs/design.md §5: hardware
never changes the mechanism); what is checked here is refused before any spend is written.
"""

from __future__ import annotations

import os
from pathlib import Path

from govtrain.errors import Code, ConfigError
from govtrain.models.loading import HEADS, load_pretrained, no_remote_code, quiet_loading, use_eos_for_padding
from govtrain.train.config import RunConfig


def wrap_lora(base, lora, adapters: list[str], heads: tuple[str, ...] = HEADS):
    """`base` with the run's LoRA: a default adapter holding the `heads` (peft's modules_to_save copy; none for
    a causal LM, whose LM head, often tied to the input embedding, stays frozen) and one LoRA-only adapter per
    `adapter` class, all active, every LoRA factor and head copy trainable. All active is the model at full rights
    (evaluation, `govtrain.load`); in a governed step the router runs each example through the default adapter and
    its own class's adapter only (`routing/adapters.py`)."""
    from peft import LoraConfig, get_peft_model

    settings = dict(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules))
    if lora.layers is not None:
        settings["layers_to_transform"] = sorted(lora.layers)
    # peft can have a modules_to_save copy active for one adapter at a time, so the head belongs to the
    # default adapter (and to the classes with head = true); a class's own adapter holds LoRA factors only.
    try:
        model = get_peft_model(base, LoraConfig(modules_to_save=list(heads) or None, **settings))
    except ValueError as e:  # peft: no module matched the targets (in those layers)
        where = f" in layers {sorted(lora.layers)}" if lora.layers is not None else ""
        raise ConfigError(Code.RUN_CONFIG_INVALID, f"lora: no module of the model matches target_modules "
                                                   f"{list(lora.target_modules)}{where} ({e.__class__.__name__}): "
                                                   "check the names and layer numbers") from None
    for name in adapters:
        model.add_adapter(name, LoraConfig(**settings))
    model.base_model.set_adapter(["default", *adapters])  # all active; a governed step routes each example
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name or ".modules_to_save." in name)
    return model


def for_run(base, file, adapters: list[str]):
    """`base` as the run trains it: the pooling of `[model]`, then the LoRA of `[lora]` (`wrap_lora`); a causal
    LM gets no pooling and no trainable head."""
    from govtrain.models.pooling import use_pooling

    if file.model.task == "causal-lm":
        return wrap_lora(base, file.lora, adapters, heads=())
    return wrap_lora(use_pooling(base, file.model.pooling), file.lora, adapters)


def load_tokenizer(config: RunConfig):
    """(tokenizer, folder of the base model): the tokenizer `[model]` names, as a run encodes with it (with a pad
    token: `use_eos_for_padding`)."""
    from transformers import AutoTokenizer

    from govtrain.resolver.load import model_path

    os.environ["HF_HUB_OFFLINE"] = "1"
    path = Path(model_path(config.model_spec))
    with quiet_loading(), no_remote_code(path):
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    use_eos_for_padding(tokenizer, path)
    return tokenizer, path


def load_base(config: RunConfig):
    """(base model, tokenizer, its folder): the model `[model]` names for its task (`load_pretrained`). Training
    and evaluation both start here."""
    tokenizer, path = load_tokenizer(config)
    section = config.file.model
    return load_pretrained(path, section.task, section.num_labels, tokenizer, section.pooling), tokenizer, path


def load_model(config: RunConfig, adapters: list[str]):
    """(model with LoRA, tokenizer, folder of the base model), on the CPU in fp32 and in eval mode."""
    base, tokenizer, path = load_base(config)
    with quiet_loading():
        model = for_run(base, config.file, adapters)
    model.eval()  # no dropout: the per-example loss must not depend on other examples or hidden randomness
    return model, tokenizer, path


def resolve_device(spec: str):
    """The torch device `training.device` names: auto is CUDA when available, else the CPU. A CUDA device this
    machine does not have is refused here, before anything is loaded or written."""
    import torch

    if spec == "auto":
        return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    index = int(spec.partition(":")[2] or 0)
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index >= available:
        raise ConfigError(Code.RUN_CONFIG_INVALID, f"training.device = {spec!r}, but this machine has "
                                                   f"{available or 'no'} CUDA device{'s' if available != 1 else ''}: "
                                                   "use cpu or auto")
    return torch.device("cuda", index)


def check_weight_decay(resolution, weight_decay: float) -> None:
    """Weight decay moves every coordinate of a parameter it is given, so a parameter that a class reaches
    only in part (attention-head rows or columns) would have its other coordinates shrunk without any
    gradient: refuse that combination instead of moving coordinates no class may reach."""
    partial = sorted({part.name for parts in resolution.reach.values() for part in parts if part.dim is not None})
    if weight_decay > 0 and partial:
        raise ConfigError(Code.RUN_CONFIG_INVALID, f"optimizer.weight_decay: {len(partial)} parameter(s) are reached "
                                                   f"only in part by a heads profile (e.g. {partial[0]}); weight decay "
                                                   "would move their unreached coordinates: set weight_decay = 0")
