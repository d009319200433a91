"""Loading a pretrained base model from its folder, the same way wherever it is loaded: for a run to train
(`train/model.py`), for `govtrain.load` to rebuild under a trained adapter (`release/load.py`), and for inference.

It sits below `train/` and `release/` because both load the base: one loader, so the model trained and the model
reloaded are the same model. Nothing here runs code from a model folder (`no_remote_code`).
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Iterator

from govtrain.errors import Code, ConfigError


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
