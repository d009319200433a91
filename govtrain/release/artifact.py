"""An adapter folder as a run releases it, readable with no RUN.toml and on no particular machine:

    adapter_model.safetensors       the default adapter: LoRA factors and the trained heads (peft's modules_to_save)
    adapter_config.json             its peft config, the base model named portably (`portable_config`)
    <class adapter>/...             one LoRA-only adapter per class with its own (policy `adapter = "..."`)
    tokenizer.json, ...             the tokenizer the run encoded with, as loaded (pad token set)
    govtrain.json                   `ArtifactRecord`: what reproduces the predictions, and whose run it is
    README.md                       the model card (`card.py`), written after the run entry it cites

The run entry's adapter hash (`adapter_sha256`) covers every file but README.md: the card states the run
entry's place in the ledger and the checkpoint that covers it, which exist only once the hash is recorded, and
the Hub edits cards (tags, widgets), which must not break the binding of the weights to the ledger.

Where plain transformers/peft cannot reproduce the run's predictions (mean pooling, which no transformers
classifier expresses; class adapters in sub-folders, which `from_pretrained` does not load), each
adapter_config.json carries a `task_type` that peft refuses when it reads the config (`PeftConfig.__post_init__`),
with a message naming `govtrain.load`. Every plain entry point (`PeftModel.from_pretrained`,
`AutoPeftModel*.from_pretrained`, transformers' `from_pretrained` and `load_adapter` on the folder, `pipeline`)
reads the config that way before any weight, so the folder loads right or not at all.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path, PurePosixPath
from typing import Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from govtrain.errors import Code, ConfigError
from govtrain.policy.config import first_error

FORMAT = "govtrain-adapter"
VERSION = 1
RECORD = "govtrain.json"
CARD = "README.md"
ADAPTER_CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
# a run's resumable state (`train/state_file.py`; run-state.pt: an earlier govtrain's): never the adapter's
STATE = ("run-state.safetensors", "run-state.safetensors.tmp", "run-state.pt", "run-state.pt.tmp", "run-state.lock")
PLAIN_PREFIX = "govtrain.load only: "  # how a refusing task_type starts
ADAPTER_NAME = re.compile(r"[A-Za-z0-9_-]+")  # a class adapter's sub-folder: never a path out of the folder
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")  # org/name

Hex = str


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class BaseModelRecord(_Strict):
    """The base model, never by a path of the machine that trained: `name` (a Hugging Face id, or a local
    folder's own name), `revision` (a cached snapshot's commit), `spec` (what finds it again: `minilm`, the
    Hugging Face id; None for a local folder) and `sha256`, its tree hash, which the run entry records too."""

    name: str = Field(min_length=1)
    revision: str | None
    spec: str | None
    sha256: Hex = Field(pattern=r"^[0-9a-f]{64}$")


class ScheduleRecord(_Strict):
    """The learning rates' schedule the run's steps followed (`GovernedRun.set_schedule`, a Trainer's
    `lr_scheduler_type` and warm-up): the one hyperparameter of the update that RUN.toml, whose hash the run entry
    records, does not fix; chosen in user code, so an auditor reads it here."""

    kind: Literal["constant", "constant_with_warmup", "linear", "cosine"]
    warmup: int = Field(ge=0)


class RunRecord(_Strict):
    """Whose adapter this is: the run entry for `run_id` in the ledger of `ledger_origin` records its hash; and the
    schedule its learning rates followed (absent from folders written before govtrain recorded it)."""

    run_id: str = Field(min_length=1)
    ledger_origin: str = Field(min_length=1)
    config_sha256: Hex = Field(pattern=r"^[0-9a-f]{64}$")
    mechanism: str
    schedule: ScheduleRecord | None = None


class ArtifactRecord(_Strict):
    """govtrain.json: everything that reproduces the adapter's predictions besides its weights and tokenizer."""

    format: Literal["govtrain-adapter"]
    version: Literal[1]
    task: Literal["sequence-classification", "causal-lm"]
    pooling: Literal["model", "mean"]  # "model" for a causal LM: it pools nothing
    num_labels: int | None = Field(ge=2)  # None for a causal LM
    id2label: dict[str, str]  # {} for a causal LM
    label2id: dict[str, int]
    max_length: int = Field(ge=1)  # the run's truncation: `govtrain eval` and `LoadedModel.predict` encode with it
    dtype: Literal["float32"]  # the base as training and evaluation load it, whatever its checkpoint holds
    heads: list[str]  # peft's modules_to_save of the default adapter: trained in full
    adapters: list[str]  # all active together; "default" at the top, each other in its sub-folder
    base_model: BaseModelRecord
    run: RunRecord
    govtrain_version: str

    @model_validator(mode="after")
    def _consistent(self) -> "ArtifactRecord":
        if self.task == "causal-lm" and (self.pooling != "model" or self.num_labels is not None or self.id2label):
            raise ValueError("a causal LM has no pooling and no labels")
        if self.task == "sequence-classification" and (
                self.num_labels is None or sorted(self.id2label, key=int) != [str(i) for i in range(self.num_labels)]
                or self.label2id != {name: int(i) for i, name in self.id2label.items()}):
            raise ValueError("id2label must name labels 0..num_labels-1 once each, and label2id invert it")
        if not self.adapters or self.adapters[0] != "default" or len(set(self.adapters)) != len(self.adapters):
            raise ValueError("adapters lists 'default' first, then each class adapter once")
        if any(not ADAPTER_NAME.fullmatch(name) for name in self.adapters):
            raise ValueError("an adapter is named by letters, digits, '_' and '-' only: its sub-folder of this one")
        from govtrain.resolver.load import SHORT_NAMES

        spec = self.base_model.spec
        if spec is not None and spec not in SHORT_NAMES and not HUB_ID.fullmatch(spec):
            raise ValueError("base_model.spec is a bundled model's short name or a Hugging Face id, never a path")
        return self

    def to_json(self) -> bytes:
        return (json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()

    @property
    def plain_refusal(self) -> str | None:
        """Why plain transformers/peft cannot reproduce this adapter's predictions, or None where it can."""
        reasons = []
        if self.pooling == "mean":
            reasons.append("it was trained on the masked mean of the token states (model.pooling = \"mean\"), which "
                           "no transformers classifier computes: loaded plainly it would pool [CLS] and predict wrong")
        if len(self.adapters) > 1:
            reasons.append(f"its {len(self.adapters)} adapters ({', '.join(self.adapters)}) are all active together, "
                           "and peft's from_pretrained loads one")
        return "; ".join(reasons) or None


def read_record(folder: Path) -> ArtifactRecord:
    """The record in `folder` (`govtrain.json`), validated."""
    path = Path(folder) / RECORD
    if not path.is_file():
        what = "an adapter written before govtrain records its artifacts (evaluate it with govtrain eval " \
               "--config RUN.toml)" if (Path(folder) / ADAPTER_CONFIG).is_file() else "no adapter"
        raise ConfigError(Code.ARTIFACT_UNREADABLE, f"{folder}: no {RECORD}, so not an adapter folder govtrain "
                                                    f"released ({what})")
    try:
        return ArtifactRecord.model_validate_json(path.read_bytes())
    except ValidationError as e:
        raise ConfigError(Code.ARTIFACT_UNREADABLE, f"{path}: {first_error(e, 'the file')} (format {FORMAT} version "
                                                    f"{VERSION} is what this govtrain reads)") from None
    except OSError as e:
        raise ConfigError(Code.ARTIFACT_UNREADABLE, f"{path}: {e.strerror}") from None


def refusing_task_type(reason: str) -> str:
    """The `task_type` peft refuses (not one of its TaskType values), its error then naming the way in."""
    return f"{PLAIN_PREFIX}{reason}. Load it with govtrain.load(folder)"


def portable_config(raw: bytes, record: ArtifactRecord, *, top: bool) -> bytes:
    """An adapter_config.json as peft wrote it, made portable: the base model by name and revision (not this
    machine's path), and, where plain peft cannot reproduce the predictions, a `task_type` it refuses. A class
    adapter's config (`top` False) always refuses: alone it is not the model. Written as peft writes configs."""
    config = json.loads(raw)
    config["base_model_name_or_path"] = record.base_model.name
    config["revision"] = record.base_model.revision
    reason = record.plain_refusal
    if not top:
        reason = reason or "it is one of the adapter's parts"
    if reason is not None:
        config["task_type"] = refusing_task_type(reason)
    return json.dumps(config, indent=2, sort_keys=True).encode()


def peft_config(raw: bytes) -> dict:
    """An adapter_config.json's fields as peft takes them, the refusing `task_type` put back to what the run
    trained with (none): what `govtrain.load` builds the adapter from."""
    config = json.loads(raw)
    if isinstance(config.get("task_type"), str) and config["task_type"].startswith(PLAIN_PREFIX):
        config["task_type"] = None
    return config


def adapter_sha256(folder: Path) -> bytes:
    """The adapter hash a run entry records: SHA-256 over (relative path, SHA-256 of bytes) of every file under
    `folder`, sorted, but the model card (README.md at the top) and a run's resumable state."""
    folder = Path(folder)
    return adapter_digest({path.relative_to(folder).as_posix(): hashlib.sha256(path.read_bytes()).digest()
                           for path in folder.rglob("*") if path.is_file()})


def adapter_digest(files: Mapping[str, bytes]) -> bytes:
    """The adapter hash over a folder's files given as {relative "/"-separated path: SHA-256 of its bytes}: the
    files in path order (component by component, as paths sort), but README.md at the top and a run's state. A
    release manifest's subjects give the same hash as the folder they list (`release/verification.py`)."""
    digest = hashlib.sha256()
    for name in sorted(files, key=lambda n: PurePosixPath(n).parts):
        path = PurePosixPath(name)
        if path.name in STATE or path == PurePosixPath(CARD):
            continue
        digest.update(name.encode() + b"\0" + files[name])
    return digest.digest()


def folder_files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder`, card included, as {relative "/"-separated path: SHA-256 of its bytes}: what a
    release manifest's subjects list. A link, or anything but a folder or a plain file, is refused: its bytes would
    be another file's."""
    folder = Path(folder)
    if not folder.is_dir() or folder.is_symlink():
        raise ConfigError(Code.ARTIFACT_UNREADABLE, f"{folder} is not a folder")
    files = {}
    for path in sorted(folder.rglob("*")):
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            raise ConfigError(Code.ARTIFACT_UNREADABLE, f"{path} is a link or a special file; an adapter folder holds "
                                                        "plain files only")
        if path.is_file():
            files[path.relative_to(folder).as_posix()] = hashlib.sha256(path.read_bytes()).digest()
    return files
