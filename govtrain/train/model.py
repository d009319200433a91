"""The run's model: the base model with its LoRA adapters, loaded quietly, on the device the run names.

How the model is loaded and where it runs never changes what a step releases (docs/design.md §5: hardware
never changes the mechanism); what is checked here is refused before any spend is written.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path
from typing import Iterator

from govtrain.errors import Code, ConfigError
from govtrain.train.config import RunConfig


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """transformers' weight-loading bar and load report (a newly initialized classifier head is what a
    run trains, not news) and the FutureWarnings of loading and wrapping, silenced for this block only:
    the caller's own transformers verbosity, progress bars and warning filters are restored after it."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            # peft switches a GPT-2 Conv1D target to fan_in_fan_out itself, as it must: not news either
            warnings.filterwarnings("ignore", message="fan_in_fan_out is set to False", category=UserWarning)
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


HEADS = ("classifier", "score")  # a sequence classifier's new head, trained in full (peft's modules_to_save)


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
    from govtrain.train.pooling import use_pooling

    if file.model.task == "causal-lm":
        return wrap_lora(base, file.lora, adapters, heads=())
    return wrap_lora(use_pooling(base, file.model.pooling), file.lora, adapters)


@contextlib.contextmanager
def no_remote_code(path: Path) -> Iterator[None]:
    """A model folder whose config names code that transformers needs to build it (auto_map, an unknown
    model_type) is refused: every load passes trust_remote_code=False, and govtrain runs no code from a folder."""
    try:
        yield
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise ConfigError(Code.MODEL_UNREADABLE, f"{path}: its config names code to run to build the model "
                                                 "(auto_map); govtrain runs no code from a model folder") from None


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


def load_pretrained(path: Path, task: str, num_labels: int | None, tokenizer, pooling: str = "model"):
    """The model in the folder `path` for `task` (a sequence classifier with `num_labels` labels, or a causal LM
    with its own LM head), on the CPU in fp32 (whatever dtype its checkpoint holds), loaded quietly. A run's base
    and the one `govtrain.load` rebuilds under a trained adapter are both loaded here, so they are the same model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    with quiet_loading(), no_remote_code(path):
        if task == "causal-lm":
            base, info = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32,
                                                              trust_remote_code=False, output_loading_info=True)
        else:
            base, info = AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=num_labels, local_files_only=True, dtype=torch.float32, trust_remote_code=False,
                output_loading_info=True)
    check_initialised(path, task, pooling, info.get("missing_keys", ()))
    if task == "causal-lm":
        return base
    if base.config.pad_token_id is None:  # a decoder classifier finds each example's last token by it
        base.config.pad_token_id = tokenizer.pad_token_id
    return base


def check_initialised(path: Path, task: str, pooling: str, missing) -> None:  # type: ignore[no-untyped-def]
    """Refuse a base whose checkpoint lacks weights the model needs besides the new classifier head (HEADS): transformers
    fills them with fresh random values at every load (DeBERTa's ContextPooler, a BERT saved without its pooler), so
    no adapter could reproduce the predictions of the model it trained. The pooler a mean-pooling run replaces
    (`pooling.use_pooling`) is dropped whatever its weights; a head is trained and saved in full (peft's
    modules_to_save matches its name as a suffix: `pre_classifier` too)."""
    replaced = pooling == "mean"  # the pooler's weights are never used
    unexpected = sorted(k for k in missing if not k.split(".")[0].endswith(HEADS)  # peft's suffix match saves them
                        and not (replaced and ".pooler." in f".{k}"))
    if unexpected:
        first = unexpected[0]
        raise ConfigError(Code.MODEL_UNREADABLE, f"{path}: its checkpoint lacks {len(unexpected)} weight(s) "
                                                 f"the model needs (e.g. {first}), which transformers initialises at "
                                                 "random on every load, so no saved adapter reproduces its predictions: "
                                                 "use a checkpoint that holds them (or pooling = \"mean\" where the "
                                                 "missing module is the pooler)")


def use_eos_for_padding(tokenizer, path: Path) -> None:
    """GPT-2 and Llama tokenizers have no pad token: pad with EOS, as is usual. A padded position has its
    attention mask off and is never a target (the causal-LM task marks targets by position, not by id), so
    which id fills it changes nothing; a sequence classifier with no pad id of its own is given the same one
    (`load_base`), and pools each example's last token before the padding. A tokenizer with neither token
    cannot pad: refused."""
    if tokenizer.pad_token is not None:
        return
    if tokenizer.eos_token is None:
        raise ConfigError(Code.RUN_CONFIG_INVALID, f"{path}: the tokenizer has neither a pad nor an EOS token, so "
                                                   "batches cannot be padded: set pad_token in tokenizer_config.json")
    tokenizer.pad_token = tokenizer.eos_token


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
