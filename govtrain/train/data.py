"""Contribution data for a run: the files of the data folder whose SHA-256 matches an admit entry.

Only admitted bytes are trained on: a file is matched to its contribution by the digest the
attestation signed, never by its name. Files that match nothing are listed and skipped; an
admitted contribution with no file is not eligible (and is reported).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from govtrain.errors import Code, ConfigError


@dataclass(frozen=True)
class Examples:
    texts: list[str]
    labels: list[int]
    owner: list[str]  # contribution id of each example
    unmatched_files: list[str]
    missing: list[str]  # admitted contributions without a file


def load_examples(folder: Path, digests: Mapping[bytes, str], num_labels: int) -> Examples:
    """`digests` maps each admitted contribution's data SHA-256 to its id."""
    if not folder.is_dir():
        raise ConfigError(Code.RUN_CONFIG_INVALID, f"training.data: {folder} is not a folder")
    texts: list[str] = []
    labels: list[int] = []
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
        for number, line in enumerate(raw.split(b"\n"), 1):  # JSON Lines: only \n ends a record
            if not line.strip():
                continue
            record = json.loads(line)
            label = record.get("label")
            if not isinstance(record.get("text"), str) or not isinstance(label, int) or not 0 <= label < num_labels:
                raise ConfigError(Code.BAD_DATA, f"{path.name}:{number}: need {{\"text\": str, \"label\": int in "
                                                 f"[0, {num_labels})}}")
            texts.append(record["text"])
            labels.append(label)
            owner.append(contribution)
    missing = sorted(set(digests.values()) - found)
    return Examples(texts, labels, owner, unmatched, missing)
