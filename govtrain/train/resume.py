"""What a resumed run may trust of its output folder and its ledger (docs/budget-safety.md).

Two things a kill leaves that someone who can write the folder or the database may have replaced meanwhile:

- a file's temporary (`run-state.safetensors.tmp`, a tune's `trial-<k>.json.tmp`): `write_whole` removes whatever is
  at that name and creates the file anew (never through a link planted there: the run state holds the sampling key);
- a run entry that the run's own lease recorded before the kill (`recorded_entry`, `check_recorded_entry`,
  `read_recorded_adapter`): the run is then finished without training or recording, so the entry must be one that
  a checkpoint signs, for this config and base model, and the folder must be the adapter it records.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Callable

from govtrain.errors import Code, ConfigError, IntegrityError, RejectedError

if TYPE_CHECKING:
    from torch import nn

    from govtrain.ledger.ledger import Ledger
    from govtrain.mechanisms.update import Update
    from govtrain.release.artifact import ArtifactRecord
    from govtrain.train.config import RunConfig

TEMPORARY = ".tmp"  # + a file's name: where it is written before it is renamed into place
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)


def write_whole(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write `path` (mode 0600) whole or not at all: `write(handle)` fills `<path>.tmp`, which is then renamed over
    `path`. Whatever is at the temporary's name (a kill's leftover, or a link planted there) is removed first, and
    the temporary is created anew (O_EXCL, O_NOFOLLOW): never written, nor its mode changed, through a link. A
    folder at that name is refused (`output_taken`)."""
    temporary = path.with_name(path.name + TEMPORARY)
    try:
        temporary.unlink(missing_ok=True)
        handle = os.fdopen(os.open(temporary, _CREATE, 0o600), "wb")
    except OSError as e:
        if temporary.is_dir() and not temporary.is_symlink():  # unlink: EISDIR on Linux, EPERM elsewhere
            raise ConfigError(Code.OUTPUT_TAKEN, f"{temporary} is a folder: govtrain writes {path.name} there first; "
                                                 f"move it out of {path.parent}") from None
        if isinstance(e, FileExistsError):  # made again between the unlink and the open
            raise ConfigError(Code.OUTPUT_TAKEN, f"{temporary} was made again while govtrain wrote {path.name}: "
                                                 "another process writes this folder; stop it, then run again") \
                from None
        raise
    with handle:
        write(handle)
    os.replace(temporary, path)


def recorded_entry(ledger: "Ledger", run_id: str) -> dict:
    """The run entry of `run_id` as the ledger's checkpoints sign it (`ledger/signed.py`). Refused (`fork`) where
    entries are stored past the latest checkpoint that verifies: the ledger signs every state it reaches, so such a
    tail is what a database writer without keys forged (or checkpoints deleted), and a run entry there finishes
    nothing."""
    from govtrain.ledger.signed import VERIFY, read_log

    log = read_log(ledger.store, origin=ledger.policy.origin)
    if log.tail:
        raise IntegrityError(Code.FORK, f"the ledger stores {log.tail} entr{'y' if log.tail == 1 else 'ies'} past its "
                                        f"latest signed checkpoint (size {log.size}): no checkpoint signs them, so run "
                                        f"{run_id!r}'s run entry is not taken as recorded; {VERIFY}")
    entry = next((e.entry for e in log.of_kind("run", start=1) if e.entry["run_id"] == run_id), None)
    if entry is None:
        raise IntegrityError(Code.FORK, f"the ledger's rows record a run entry for run {run_id!r} that its signed "
                                        f"entries do not: the database was edited; {VERIFY}")
    return entry


def check_recorded_entry(entry: dict, *, config: "RunConfig", base_sha256: bytes, run_nonce: bytes | None,
                         state_path: Path) -> None:
    """Refuse to finish, from the run state at `state_path`, a run whose signed run `entry` is not this run's: another
    lease (`run_id_taken`), another config (`output_taken`: the state file is another run's, whatever config hash it
    states), another base model (`base_model_mismatch`)."""
    run_id = entry["run_id"]
    if entry["run_nonce"] != run_nonce:
        raise RejectedError(Code.RUN_ID_TAKEN, f"run {run_id!r}'s run entry was recorded under another lease than "
                                               f"{state_path} holds: another run took this id; move the state file "
                                               "away")
    if entry["config_sha256"] != config.sha256:
        raise ConfigError(Code.OUTPUT_TAKEN, f"{state_path} holds the state of run {run_id!r}, whose run entry records "
                                             f"another config ({entry['config_sha256'].hex()[:16]}…, not this one's "
                                             f"{config.sha256.hex()[:16]}…): training.output is that run's; give "
                                             "this run another training.output")
    if entry["base_model_sha256"] != base_sha256:
        raise ConfigError(Code.BASE_MODEL_MISMATCH, f"run {run_id!r}'s run entry records base model "
                                                    f"{entry['base_model_sha256'].hex()[:16]}…, but model.base now "
                                                    f"hashes to {base_sha256.hex()[:16]}…: finish it with the base "
                                                    "model it was trained on")


def read_recorded_adapter(output: Path, entry: dict) -> tuple[bytes, "ArtifactRecord"]:
    """(the adapter hash, its govtrain.json) of `output`, each file read once: refused (`adapter_mismatch`) unless it
    is the adapter the run `entry` records. The record is parsed from the very bytes hashed, so the card written
    from it describes the recorded adapter, not the config that resumed it."""
    from pydantic import ValidationError

    from govtrain.release.artifact import RECORD, ArtifactRecord, adapter_digest

    output = Path(output)
    digests, record = {}, None
    for path in (p for p in output.rglob("*") if p.is_file()):
        name = path.relative_to(output).as_posix()
        data = path.read_bytes()
        digests[name] = hashlib.sha256(data).digest()
        if name == RECORD:
            record = data
    found, recorded = adapter_digest(digests), entry["adapter_sha256"]
    if found != recorded:
        raise IntegrityError(Code.ADAPTER_MISMATCH, f"run {entry['run_id']!r} recorded its adapter before it was "
                                                    f"stopped, but {output} now hashes to {found.hex()[:16]}…, not "
                                                    f"the {recorded.hex()[:16] if recorded else 'none'}… its run "
                                                    "entry records: restore the folder as it was saved")
    try:
        return found, ArtifactRecord.model_validate_json(record or b"")
    except ValidationError:
        raise ConfigError(Code.ARTIFACT_UNREADABLE, f"{output / RECORD}: missing or not govtrain's, though the "
                                                    "folder is the adapter the run entry records") from None


__all__ = ["TEMPORARY", "write_whole", "recorded_entry", "check_recorded_entry", "read_recorded_adapter"]


def check_state_shapes(state: dict, model: "nn.Module", update: "Update", path: Path) -> None:
    """A run state's trainable weights and optimizer moments are of this run's parameters' names and (global) shapes,
    or it is refused with one line (`output_taken`) before anything is put back: a state edited by hand, or another
    run's, would otherwise stop every rank with a traceback, or be broadcast into shapes it does not have."""
    import torch

    held = {name: tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad}
    trainable = state.get("trainable")
    problem = None
    if not isinstance(trainable, dict) or {n: tuple(getattr(v, "shape", ())) for n, v in trainable.items()} != held:
        problem = "trainable weights of other names or shapes than this run's model's"
    saved = (state.get("update") or {}).get("optimizer")
    if problem is None and saved is not None and update.optimizer is not None:
        from govtrain.mechanisms.update import saved_params

        param_of = saved_params(saved, update.optimizer)
        if param_of is None:
            problem = "an optimizer state of another number of parameters"
        else:
            for index, entries in saved.get("state", {}).items():
                for key, value in entries.items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0 and (
                            index not in param_of or tuple(value.shape) != tuple(param_of[index].shape)):
                        problem = f"an optimizer moment ({key}) of another shape than its parameter's"
    if problem is not None:
        raise ConfigError(Code.OUTPUT_TAKEN, f"{path} holds {problem}: training.output is another run's, or the "
                                             "state was edited; give this run another training.output")
