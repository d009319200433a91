"""Contribution data for a run: the files of the data folder whose SHA-256 matches an admit entry.

Only admitted bytes are trained on: a file is matched to its contribution by the digest the
attestation signed, never by its name. Files that match nothing are listed and skipped; an
admitted contribution with no file is not eligible (and is reported). Each row becomes an example
of the run's task (`govtrain.tasks`), which refuses a row it cannot use.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from govtrain.errors import Code, ConfigError
from govtrain.gate.data import read_rows


@dataclass(frozen=True)
class Examples:
    items: list[Any]  # the task's examples
    owner: list[str]  # contribution id of each example
    unmatched_files: list[str]
    missing: list[str]  # admitted contributions without a file

    def __len__(self) -> int:
        return len(self.items)


def load_examples(folder: Path, digests: Mapping[bytes, str], task) -> Examples:  # type: ignore[no-untyped-def]
    """`digests` maps each admitted contribution's data SHA-256 to its id; `task` makes each row an example."""
    if not folder.is_dir():
        raise ConfigError(Code.RUN_CONFIG_INVALID, f"training.data: {folder} is not a folder")
    items: list[Any] = []
    owner: list[str] = []
    unmatched: list[str] = []
    found: set[str] = set()
    # An attestation kept beside its data (`admit --batch` reads X.cose with X) is never data itself.
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.suffix != ".cose"):
        raw = path.read_bytes()
        contribution = digests.get(hashlib.sha256(raw).digest())
        if contribution is None or contribution in found:
            unmatched.append(path.name)
            continue
        found.add(contribution)
        for number, row in read_rows(path, raw):
            items.append(task.example(row, f"{path.name}:{number}"))
            owner.append(contribution)
    missing = sorted(set(digests.values()) - found)
    return Examples(items, owner, unmatched, missing)
