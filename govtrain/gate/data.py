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

from govtrain.errors import AdmissionError, Code, ConfigError, GovtrainError

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


def read_rows(path: str | os.PathLike, raw: bytes | None = None) -> list[tuple[int, dict]]:
    """(line number, record) of every non-blank line of a JSON Lines file (only \\n ends a record); `raw` is
    the file's bytes when the caller has read them already (to hash them)."""
    path = Path(path)
    raw = path.read_bytes() if raw is None else raw
    rows = []
    for number, line in enumerate(raw.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (UnicodeDecodeError, ValueError) as e:
            raise ConfigError(Code.BAD_DATA, f"{path.name}:{number}: not JSON ({e.__class__.__name__})") from None
        if not isinstance(record, dict):
            raise ConfigError(Code.BAD_DATA, f"{path.name}:{number}: not a JSON object")
        rows.append((number, record))
    return rows
