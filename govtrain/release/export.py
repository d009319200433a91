"""Writing a run's adapter folder (`Release`): peft's `save_pretrained`, then govtrain's own files, then a read of
all of it before its hash is recorded.

What the folder holds besides the weights is fixed when the run opens: the bytes `save_pretrained` writes for the
model as opened (each adapter's config), made portable (`artifact.portable_config`), the record
(`govtrain.json`) and the tokenizer's files as loaded, before any batch is encoded with it (a fast tokenizer
keeps the last call's truncation and padding, and would save them).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from govtrain.errors import Code, ConfigError
from govtrain.release.artifact import (ADAPTER_CONFIG, CARD, FORMAT, RECORD, STATE, VERSION, WEIGHTS, ArtifactRecord,
                                       BaseModelRecord, RunRecord, portable_config)
from govtrain.version import __version__

if TYPE_CHECKING:
    import torch
    from torch import nn


def artifact_record(section: Any, model: "nn.Module", *, model_spec: str, config_sha256: bytes, mechanism: str,
                    base: Path, base_sha256: bytes, run_id: str, origin: str) -> ArtifactRecord:
    """The `govtrain.json` of the run whose RUN.toml (of hash `config_sha256`) has the [model] `section` (task,
    pooling, num_labels, max_length) and names the base model `model_spec`, training `model` (peft, as
    `train.model.for_run` built it) on the base model in the folder `base` under `mechanism`: what reproduces its
    predictions (task, pooling, heads, labels, max length, every adapter), its base model by name and tree hash, and
    its run. The run hands these over, so that the release knows nothing of the training configuration."""
    from govtrain.resolver.load import base_model_source

    source = base_model_source(model_spec, base)
    classifier = section.task == "sequence-classification"
    labels = model.get_base_model().config.id2label if classifier else {}
    id2label = {str(i): str(labels[i]) for i in sorted(labels)}
    return ArtifactRecord(
        format=FORMAT, version=VERSION, task=section.task, pooling=section.pooling,
        num_labels=section.num_labels if classifier else None, id2label=id2label,
        label2id={name: int(i) for i, name in id2label.items()}, max_length=section.max_length, dtype="float32",
        heads=sorted(model.peft_config["default"].modules_to_save or ()), adapters=list(model.peft_config),
        base_model=BaseModelRecord(name=source.name, revision=source.revision, spec=source.spec,
                                   sha256=base_sha256.hex()),
        run=RunRecord(run_id=run_id, ledger_origin=origin, config_sha256=config_sha256.hex(), mechanism=mechanism),
        govtrain_version=__version__)


def tokenizer_files(tokenizer) -> dict[str, bytes]:  # type: ignore[no-untyped-def]
    """The files `tokenizer.save_pretrained` writes, by name."""
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


class Release:
    """What `save()` may write, taken when the run opens: the files `save_pretrained` writes for this model and
    their contents but the weights (each adapter's config), and the files govtrain adds (`extras`: the record and
    the tokenizer). `write` completes a folder `save_pretrained` wrote: peft's model cards (README.md: libraries
    add tags to them, TRL's SFTTrainer among them, so they are free text no check can pin) are taken out, each
    config made portable where it is still what the run opened with, and the extras written. `check` reads the
    folder as completed: exactly those files, those contents, and each adapter's tensors equal to the weights the
    last governed step left. Code of the loop's can run inside `save_pretrained` (a `peft_config` of its own is plain
    instance data the guard does not record) and files can be put in the folder beforehand; neither reaches the
    recorded adapter (review 9: a dict subclass as `peft_config` wrote admitted token ids into the saved
    weights, a sub-folder adapter written beforehand was hashed and loaded with it, admitted text was saved in
    `adapter_config.json` and `lora_alpha` rescaled)."""

    def __init__(self, model: "nn.Module", record: ArtifactRecord, extras: dict[str, bytes], *,
                 state_dict: dict | None = None) -> None:
        # `state_dict`: what save_pretrained saves instead of the model's own (a sharded model's, `distributed.fsdp`)
        with tempfile.TemporaryDirectory() as folder:
            model.save_pretrained(folder, **({} if state_dict is None else {"state_dict": state_dict}))
            root = Path(folder)
            self.cards = sorted(str(p.relative_to(root)) for p in root.rglob(CARD))
            self.saved = {str(p.relative_to(root)): (None if p.name == WEIGHTS else p.read_bytes())
                          for p in root.rglob("*") if p.is_file() and p.name != CARD}
        self.adapters = list(model.peft_config)
        self.record = record
        self.files: dict[str, bytes | None] = dict(self.saved)
        for name, data in self.saved.items():
            if Path(name).name == ADAPTER_CONFIG and data is not None:
                self.files[name] = portable_config(data, record, top=name == ADAPTER_CONFIG)
        clash = sorted(extras.keys() & self.files.keys())
        if clash:
            raise RuntimeError(f"govtrain's own files would overwrite what save_pretrained writes: {clash}")
        self.files.update(extras, **{RECORD: record.to_json()})

    def fix_schedule(self, schedule: dict) -> None:
        """Record the learning rates' schedule the run's steps followed (`Schedule.record()`: kind, warm-up) in the
        record: it is fixed only after the run opens (`set_schedule`), so it is written in when the run finishes."""
        from govtrain.release.artifact import ScheduleRecord

        run = self.record.run.model_copy(update={"schedule": ScheduleRecord(**schedule)})
        self.record = self.record.model_copy(update={"run": run})
        self.files[RECORD] = self.record.to_json()

    def write(self, output: Path) -> None:
        """Complete the folder `save_pretrained` just wrote: its model cards out, each adapter config that is still
        what the run opened with made portable (one that is not is left for `check` to refuse), the extras in."""
        for card in self.cards:
            (output / card).unlink(missing_ok=True)
        for name, data in self.saved.items():
            path = output / name
            if Path(name).name == ADAPTER_CONFIG and path.is_file() and path.read_bytes() == data:
                path.write_bytes(self.files[name])  # type: ignore[arg-type]
        for name, data in self.files.items():
            if name not in self.saved:
                path = output / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)  # type: ignore[arg-type]

    def check(self, output: Path, trainable: dict[str, "torch.Tensor"]) -> None:
        """Read the completed folder: exactly the files `write` leaves, byte for byte, and each adapter's tensors
        equal to `trainable` (the last governed step's weights); else `ungoverned_update`, nothing recorded."""
        import torch
        from safetensors.torch import load_file

        written = {str(p.relative_to(output)) for p in output.rglob("*") if p.is_file() and p.name not in STATE}
        problems = [f"{name} is not a file save() writes" for name in sorted(written - self.files.keys())]
        problems += [f"{name} is missing" for name in sorted(self.files.keys() - written)]
        problems += [f"{name} differs from what the run opened with" for name, data in sorted(self.files.items())
                     if data is not None and name in written and (output / name).read_bytes() != data]
        for adapter in self.adapters:
            name = WEIGHTS if adapter == "default" else f"{adapter}/{WEIGHTS}"
            if name not in written:
                continue
            expected = {key.replace(f".modules_to_save.{adapter}.", ".").replace(f".{adapter}.", "."): value
                        for key, value in trainable.items() if f".{adapter}." in key}
            saved = load_file(str(output / name))
            if saved.keys() != expected.keys() or any(not torch.equal(saved[k].cpu(), expected[k].cpu())
                                                      for k in saved):
                problems.append(f"{name} holds other tensors than the last governed step's weights")
        if problems:
            raise ConfigError(Code.UNGOVERNED_UPDATE, f"the adapter save() wrote in {output} is not the run's "
                                                      f"({'; '.join(problems[:3])}): nothing is recorded; leave the "
                                                      "output folder to the run and the model's adapter "
                                                      "configuration as it was opened")
