"""The contribution data file: its SHA-256 and its records.

A data file is JSON Lines: one JSON object per non-blank line (for training,
``{"text": …, "label": …}``). The digest covers the file's exact bytes; records are
its non-blank lines. One streaming pass computes both and notes the first line that
is not a JSON object.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from govtrain.errors import AdmissionError, Code, GovtrainError

_CHUNK_LINES = 4096


@dataclass(frozen=True, slots=True)
class DataSummary:
    sha256: bytes
    records: int
    first_bad_line: int | None  # 1-based; None when every record is a JSON object
    bad_reason: str = ""


def inspect_data(path: str | os.PathLike, *, error: type[GovtrainError] = AdmissionError) -> DataSummary:
    path = Path(path)
    digest = hashlib.sha256()
    records = 0
    first_bad: int | None = None
    reason = ""
    try:
        with path.open("rb") as handle:
            for number, line in enumerate(handle, start=1):
                digest.update(line)
                if not line.strip():
                    continue
                records += 1
                if first_bad is None:
                    try:
                        value = json.loads(line)
                    except (UnicodeDecodeError, ValueError) as e:
                        first_bad, reason = number, f"not JSON ({e.__class__.__name__})"
                        continue
                    if not isinstance(value, dict):
                        first_bad, reason = number, "not a JSON object"
    except OSError as e:
        raise error(Code.DATA_UNREADABLE, f"cannot read data file {path}: {e.strerror or e}") from e
    return DataSummary(digest.digest(), records, first_bad, reason)
