"""The tree hash of a model folder (`tree_sha256`): what a run entry records for its base model, and what
`govtrain.load` checks a base against before it loads it (`load.private_base`).

It sits in `release/`, below `train/`, because both sides read it: the run that records the hash and the loader
that checks it must hash alike, and the loader never imports the training code.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

# a run's resumable state (train/state_file.py STATE_FILE, its temporary, train/lease.py LOCK_FILE), which is
# deleted when the run ends: never part of a tree's hash
NOT_HASHED = ("run-state.safetensors", "run-state.safetensors.tmp", "run-state.lock")


def tree_sha256(folder: Path, *, copy_into: Path | None = None) -> bytes:
    """SHA-256 over (relative path, SHA-256 of bytes) of every file under `folder`, sorted (a run's
    resumable state, which is deleted when the run ends, is not part of the adapter). With `copy_into` (an empty
    folder), each file is also written there from the very bytes hashed, read once: a copy that is exactly what
    the hash covers, whatever happens to `folder` meanwhile."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in NOT_HASHED):
        name = path.relative_to(folder)
        file_digest = hashlib.sha256()
        with contextlib.ExitStack() as files:
            source = files.enter_context(path.open("rb"))
            target = None
            if copy_into is not None:
                (copy_into / name).parent.mkdir(parents=True, exist_ok=True)
                target = files.enter_context(os.fdopen(os.open(copy_into / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                                                               0o600), "wb"))
            while chunk := source.read(1 << 24):
                file_digest.update(chunk)
                if target is not None:
                    target.write(chunk)
        digest.update(str(name).encode() + b"\0" + file_digest.digest())
    return digest.digest()
