"""`govtrain.load(folder)`: a released adapter as the model that made its predictions, with no RUN.toml.

    loaded = govtrain.load("adapter")          # base model found by its record, bound by its tree hash
    loaded.predict(["a fine film"])            # label ids, as `govtrain eval` scores them
    loaded.model, loaded.tokenizer             # a peft PeftModel (eval mode) and the run's tokenizer

The model is built the way training built it, from the folder's `govtrain.json`: the base loaded in fp32 for its
task (`models.loading.load_pretrained`), its pooling (`models.pooling`), then every adapter in the folder, all active.
`govtrain eval` loads through here, so the two give the same logits.

The base model is loaded from exactly the bytes its tree hash was checked over: each file is read once, hashed and
written to a private temporary folder (`private_base`), the model is loaded from that copy, and every tensor is
then copied out of the file mapping transformers reads safetensors through (`hold_in_memory`). A base folder
rewritten after the check (in place, or swapped) changes nothing that was loaded. The cost is one copy of the base
on the temporary disk while it loads.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from govtrain.errors import Code, ConfigError
from govtrain.release.artifact import ADAPTER_CONFIG, WEIGHTS, ArtifactRecord, peft_config, read_record
from govtrain.release.tree import tree_sha256


@dataclass(frozen=True)
class LoadedModel:
    """A released adapter, loaded: `model` (peft's `PeftModel` over transformers' Auto class for the task, in eval
    mode), `tokenizer` (the one the run encoded with) and `record` (the folder's govtrain.json)."""

    model: Any
    tokenizer: Any
    record: ArtifactRecord

    def encode(self, texts: Sequence[str]) -> dict[str, Any]:
        """The model's inputs for `texts`, as training and `govtrain eval` encode them: padded on the right, cut at
        the run's max length, on the model's device."""
        from govtrain.tasks.classification import Classification, Labelled

        if isinstance(texts, str):
            raise TypeError("pass a list of texts, not one string")
        device = next(self.model.parameters()).device
        # the classifier's encode: right padding and truncation; the label it carries is not an input
        batch = Classification(num_labels=2).encode([Labelled(t, 0) for t in texts], self.tokenizer,
                                                    self.record.max_length, device)
        return batch.inputs

    def logits(self, texts: Sequence[str], *, batch_size: int = 32) -> Any:
        """The model's logits for `texts` ([len(texts), num_labels] for a classifier), in batches, without
        gradients."""
        import torch

        parts = []
        with torch.no_grad():
            for start in range(0, len(texts), batch_size):
                parts.append(self.model(**self.encode(texts[start:start + batch_size])).logits)
        return torch.cat(parts) if parts else torch.zeros(0)

    def predict(self, texts: Sequence[str], *, batch_size: int = 32) -> list[int]:
        """The predicted label id of each text (`record.id2label` names them)."""
        if self.record.task != "sequence-classification":
            raise TypeError("predict() is for a sequence classifier; a causal LM generates: loaded.model.generate(...)")
        return self.logits(texts, batch_size=batch_size).argmax(-1).tolist()


def load(folder: str | os.PathLike[str], *, base: str | os.PathLike[str] | None = None,
         device: str = "cpu") -> LoadedModel:
    """The adapter govtrain released in `folder`, on its base model, ready for inference.

    The base model is `base` (`minilm`, a Hugging Face id in the local cache, or a local directory), by default
    the one the folder's record names where it can be found again (a bundled model, a Hugging Face id at the
    revision it was trained on, whatever refs/main names now). Its tree
    hash must be the one the record holds (`base_model_mismatch`). Nothing is downloaded."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    folder = Path(folder)
    record = read_record(folder)
    with private_base(folder, record, base) as path:
        try:
            tokenizer = read_tokenizer(folder)
            model = build(folder, record, path, tokenizer)
        except ConfigError:
            raise
        except Exception as e:  # a damaged folder: not JSON, a truncated tensor file, a head of another size
            raise ConfigError(Code.ARTIFACT_UNREADABLE, f"{folder}: cannot be loaded as the model its govtrain.json "
                                                        f"describes ({type(e).__name__}: "
                                                        f"{str(e).splitlines()[0][:200]})") from None
        hold_in_memory(model)
    return LoadedModel(model=model.to(device).eval(), tokenizer=tokenizer, record=record)


def locate_base(folder: Path, record: ArtifactRecord, base: str | os.PathLike[str] | None = None) -> Path:
    """The folder of the base model the adapter in `folder` was trained on: `base` (`minilm`, a Hugging Face id in
    the local cache, or a local directory), by default the one `record` names where it can be found again. Not
    checked: `private_base` checks its tree hash. Nothing is downloaded."""
    from govtrain.resolver.load import SHORT_NAMES, hub_snapshot, model_path

    os.environ["HF_HUB_OFFLINE"] = "1"
    named = record.base_model
    if base is None and named.spec is None:
        raise ConfigError(Code.MODEL_UNREADABLE, f"{folder}: its base model is a local folder, {named.name!r} (tree "
                                                 f"hash {named.sha256}), which only its owner can point to: pass "
                                                 "base=\"PATH\" to govtrain.load")
    if base is not None:
        return Path(model_path(str(base)))
    # the record's spec: a bundled model, or a Hub id in the cache at the revision trained on (not refs/main)
    return Path(model_path(named.spec) if named.spec in SHORT_NAMES else hub_snapshot(named.spec, named.revision))


@contextlib.contextmanager
def private_base(folder: Path, record: ArtifactRecord,
                 base: str | os.PathLike[str] | None = None) -> Iterator[Path]:
    """`locate_base`'s folder, copied into a private temporary folder (0700) as its tree hash is computed (each
    file read once: the copy is exactly the bytes hashed) and checked against the record's (`base_model_mismatch`);
    yields the copy, deleted when the block ends. Load from it, then `hold_in_memory`."""
    path = locate_base(folder, record, base)
    with tempfile.TemporaryDirectory(prefix="govtrain-base-") as private:
        _check_tree_hash(folder, record, path, tree_sha256(path, copy_into=Path(private)).hex())
        yield Path(private)


def hold_in_memory(model: Any) -> None:
    """Copy every parameter and buffer of `model` out of the file mappings transformers loads safetensors through
    (the tensors of a float32 checkpoint loaded as float32 are views of the mapped file): the model then holds
    what was read, no later write to that file reaches it, and the file, once deleted, frees its disk. Tied
    weights stay tied (a shared parameter is one object, given one copy)."""
    import itertools

    import torch

    with torch.no_grad():
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            tensor.data = tensor.data.clone()


def _check_tree_hash(folder: Path, record: ArtifactRecord, path: Path, found: str) -> None:
    named = record.base_model
    if found != named.sha256:
        raise ConfigError(Code.BASE_MODEL_MISMATCH, f"{path} has tree hash {found}, but {folder} was trained on "
                                                    f"{named.name} with tree hash {named.sha256} (govtrain.json): "
                                                    "another model or revision; give the base it was trained on")


_HASHED: dict[tuple, str] = {}  # tree hashes of base models this process read, by their files' stat


def _tree_hash(path: Path) -> str:
    """The base model's tree hash (`release.tree.tree_sha256`, as the run entry records it), read once per process
    while no file of it changes size or time: a tune scores every trial on the same base, which may be large."""
    files = sorted((str(p), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)  # ctime: a restored mtime shows
                   for p in Path(path).rglob("*") if p.is_file() for st in (p.stat(),))
    key = (str(Path(path).resolve()), tuple(files))
    if key not in _HASHED:
        _HASHED[key] = tree_sha256(path).hex()
    return _HASHED[key]


def read_tokenizer(folder: Path):  # type: ignore[no-untyped-def]
    """The tokenizer the run encoded with, saved in the adapter folder (pad token set; no code run)."""
    from transformers import AutoTokenizer

    from govtrain.models.loading import quiet_loading, use_eos_for_padding

    for name in ("tokenizer_config.json", "config.json"):
        if (folder / name).is_file() and b'"auto_map"' in (folder / name).read_bytes():
            raise ConfigError(Code.ARTIFACT_UNREADABLE, f"{folder / name}: names code to run (auto_map); govtrain "
                                                        "writes no such file and runs no code from a folder")
    with quiet_loading():
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    use_eos_for_padding(tokenizer, folder)  # saved with its pad token: this changes nothing, unless edited
    return tokenizer


def build(folder: Path, record: ArtifactRecord, base: Path, tokenizer):  # type: ignore[no-untyped-def]
    """The run's model: the base at `base` as training loaded it, its pooling, and every adapter of `folder` (the
    default one at the top, each other in its sub-folder), all active, each holding exactly the saved tensors."""
    from peft import PeftConfig, PeftModel

    from govtrain.models.loading import load_pretrained, quiet_loading
    from govtrain.models.pooling import use_pooling

    model = load_pretrained(base, record.task, record.num_labels, tokenizer, record.pooling)
    if record.task == "sequence-classification":
        model = use_pooling(model, record.pooling)
    places = {name: folder if name == "default" else folder / name for name in record.adapters}
    for name, place in places.items():
        if not (place / ADAPTER_CONFIG).is_file() or not (place / WEIGHTS).is_file():
            raise ConfigError(Code.ARTIFACT_UNREADABLE, f"{place}: adapter {name!r} of {folder} has no "
                                                        f"{ADAPTER_CONFIG} and {WEIGHTS}")
    configs = {}
    for name, place in places.items():
        config = PeftConfig.from_peft_type(**peft_config((place / ADAPTER_CONFIG).read_bytes()))
        config.inference_mode = True
        configs[name] = config
    with quiet_loading():
        model = PeftModel.from_pretrained(model, folder, config=configs["default"])
        for name in record.adapters[1:]:
            model.add_adapter(name, configs[name])  # with our config: load_adapter then reads only the weights
            model.load_adapter(str(places[name]), adapter_name=name)
    model.base_model.set_adapter(list(record.adapters))
    _check_weights(model, places)
    return model


def _check_weights(model, places: dict[str, Path]) -> None:  # type: ignore[no-untyped-def]
    """Each adapter holds exactly its file's tensors (peft only warns about keys it did not load)."""
    import torch
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    for name, place in places.items():
        saved = load_file(str(place / WEIGHTS))
        held = get_peft_model_state_dict(model, adapter_name=name, save_embedding_layers=False)  # no Hub lookup
        if saved.keys() != held.keys() or any(not torch.equal(saved[k], held[k].cpu()) for k in saved):
            missing = sorted(saved.keys() ^ held.keys())
            raise ConfigError(Code.ARTIFACT_UNREADABLE, f"{place / WEIGHTS}: adapter {name!r} does not fit the model "
                                                        "its govtrain.json describes"
                                                        f"{f' (e.g. {missing[0]})' if missing else ''}")
