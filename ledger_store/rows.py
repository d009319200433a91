"""What the ledger store reads back: its row types, the type every column's cells must hold (`checked`: a cell of
another type is a row no ledger wrote), and the leaf hash, the only hash the store computes."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import NamedTuple

from ledger_store.errors import TamperedRow

LEAF_PREFIX = b"\x00"
PERSISTED_NODE_HEIGHT = 8  # subtrees of 256 leaves and up are stored; smaller ones are cheap to recompute


_NONE = type(None)
# The Python type each column's cells read back as, by table (column order as in ledger_store.models).
COLUMN_TYPES: dict[str, dict[str, tuple[type, ...]]] = {
    "entries": {"seq": (int,), "kind": (str,), "time": (int,), "leaf_hash": (bytes,), "body": (bytes, _NONE)},
    "admissions": {"contribution_id": (str,), "seq": (int,), "data_class": (str,), "descriptor_sha256": (bytes,),
                   "attestation_sha256": (bytes,), "data_sha256": (bytes,)},
    "checkpoints": {"id": (int,), "size": (int,), "root": (bytes,), "note": (str,), "time": (int,)},
    "withdrawals": {"contribution_id": (str,), "seq": (int,)},
    "summaries": {"seq": (int,), "data_class": (str,), "first_seq": (int,), "last_seq": (int,)},
    "tree_nodes": {"height": (int,), "idx": (int,), "hash": (bytes,)},
    "settings": {"name": (str,), "value": (str,)},
}


def checked(table: str, columns: tuple[str, ...], row: tuple) -> tuple:
    """`row` (cells of `columns`, the first its key) as read, or `TamperedRow` at the first cell of a type its
    column does not hold. `type(v) in` rather than isinstance: a bool is no INTEGER cell."""
    types = COLUMN_TYPES[table]
    for column, value in zip(columns, row):
        if type(value) not in types[column]:
            raise TamperedRow(table, column, row[0], value)
    return row


_ENTRY = tuple(COLUMN_TYPES["entries"])
_CHECKPOINT = tuple(COLUMN_TYPES["checkpoints"])
_ADMISSION = tuple(COLUMN_TYPES["admissions"])


def _entry(row) -> "StoredEntry":  # type: ignore[no-untyped-def]
    return StoredEntry(*checked("entries", _ENTRY, tuple(row)))


def _checkpoint(row) -> "StoredCheckpoint":  # type: ignore[no-untyped-def]
    return StoredCheckpoint(*checked("checkpoints", _CHECKPOINT, (row.id, row.size, row.root, row.note, row.time)))


def leaf_hash(body: bytes) -> bytes:
    """RFC 9162 §2.1.1: SHA-256(0x00 ‖ entry bytes)."""
    return hashlib.sha256(LEAF_PREFIX + body).digest()


class StoredEntry(NamedTuple):
    """One row of the log (a tuple: millions are made when a ledger is read or written in bulk)."""

    seq: int
    kind: str
    time: int
    leaf_hash: bytes
    body: bytes | None


@dataclass(frozen=True, slots=True)
class AdmissionRow:
    contribution_id: str
    seq: int
    data_class: str
    descriptor_sha256: bytes
    attestation_sha256: bytes
    data_sha256: bytes


@dataclass(frozen=True, slots=True)
class StoredCheckpoint:
    id: int
    size: int
    root: bytes
    note: str
    time: int
