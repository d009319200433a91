"""A contribution's data, as `attest`, the gate and training all see it: its digest, its records, its rows.

The one rule for all three: read the bytes once, digest them (`govtrain.data.digest`), and parse the rows
from those same bytes by the format the path names (`govtrain.data.formats`, `govtrain.data.dataset`). So
the record count a contributor signs, the count the gate checks and the rows a run trains on come from
one reading of the bytes the attestation binds, and a changed byte anywhere is `digest_mismatch`.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Iterable, Iterator

from govtrain.data.dataset import dataset_rows
from govtrain.data.digest import TREE_DOMAIN, Tree, file_sha256, read_tree
from govtrain.data.formats import JSON_LINES_SUFFIXES, BadData, Row, file_rows, json_lines_rows
from govtrain.errors import AdmissionError, Code, ConfigError, GovtrainError


@dataclass(frozen=True, slots=True)
class DataSummary:
    """What the gate checks against the descriptor: the digest, the record count, and the first problem."""

    sha256: bytes
    records: int
    problem: str | None = None  # "reviews.csv:12: 3 fields, the header has 2"; None when every record reads


@dataclass(frozen=True, slots=True)
class DataBytes:
    """A data file (`raw`) or dataset directory (`tree`), read once: the bytes digested are the bytes parsed."""

    path: Path
    sha256: bytes
    raw: bytes | None = None
    tree: Tree | None = None

    @property
    def name(self) -> str:
        """How errors name it: the file or directory name (of the working directory for ".")."""
        return self.path.name or self.path.absolute().name


def read_data(path: str | os.PathLike, *, error: type[GovtrainError] = ConfigError) -> DataBytes:
    """Read and digest a data file or dataset directory; `error` is the family of the one-line error."""
    path = Path(path)
    try:
        if path.is_dir():
            tree = read_tree(path)
            return DataBytes(path, tree.sha256, tree=tree)
        raw = path.read_bytes()
    except OSError as e:
        raise error(Code.DATA_UNREADABLE, f"cannot read data {path}: {e.strerror or e}") from e
    except BadData as e:
        raise error(Code.BAD_DATA, f"{e}; nothing was digested") from None
    return DataBytes(path, file_sha256(raw), raw=raw)


def data_rows(data: DataBytes, *, integer_columns: Collection[str] = ()) -> Iterator[Row]:
    """The rows of data read by `read_data`; raises `BadData` at the first record that cannot be read."""
    if data.tree is not None:
        return dataset_rows(data.tree, data.name)
    assert data.raw is not None
    _refuse_tree_domain(data.raw, data.name)
    return file_rows(data.raw, data.name, data.path.suffix, integer_columns)


def inspect_data(path: str | os.PathLike, *, error: type[GovtrainError] = AdmissionError) -> DataSummary:
    """Digest, record count and first problem of a data file or dataset directory (JSON Lines is streamed)."""
    path = Path(path)
    if path.suffix.lower() in JSON_LINES_SUFFIXES and not path.is_dir():
        return _inspect_json_lines(path, error)
    data = read_data(path, error=error)
    records, problem = _count(lambda: data_rows(data))
    return DataSummary(data.sha256, records, problem)


def _inspect_json_lines(path: Path, error: type[GovtrainError]) -> DataSummary:
    """One streaming pass computes the digest and the count, so a large file is never held in memory."""
    digest = hashlib.sha256()
    try:
        with path.open("rb") as handle:
            lines = _hashed(handle, digest)
            records, problem = _count(lambda: _checked_json_lines(lines, path.name))
            for _ in lines:  # past a bad line: the digest still covers every byte
                pass
    except OSError as e:
        raise error(Code.DATA_UNREADABLE, f"cannot read data {path}: {e.strerror or e}") from e
    return DataSummary(digest.digest(), records, problem)


def _checked_json_lines(lines: Iterator[bytes], name: str) -> Iterator[Row]:
    first = next(lines, b"")
    _refuse_tree_domain(first, name)  # TREE_DOMAIN holds no "\n": a file starts with it iff its first line does
    return json_lines_rows(itertools.chain([first], lines), name)


def _hashed(lines: Iterable[bytes], digest) -> Iterator[bytes]:  # type: ignore[no-untyped-def]
    for line in lines:
        digest.update(line)
        yield line


def _count(rows) -> tuple[int, str | None]:  # type: ignore[no-untyped-def]
    records = 0
    try:
        for _ in rows():
            records += 1
    except BadData as e:
        return records, str(e)
    return records, None


def _refuse_tree_domain(head: bytes, name: str) -> None:
    """Keeps file digests and tree hashes apart (see `govtrain.data.digest`)."""
    if head.startswith(TREE_DOMAIN):
        raise BadData(name, "begins with the tree-hash domain prefix, which no data file may")
