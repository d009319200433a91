"""Tables of a govtrain ledger.

`entries` is the log itself: one canonical CBOR entry per row, its RFC 9162 leaf hash
and its dense sequence number, which is also its leaf index in the Merkle tree.
`checkpoints` holds the signed tree heads verbatim. `admissions`, `withdrawals` and
`summaries` index the entries of those kinds; their unique constraints make a replay
or a second withdrawal impossible even between racing writers. `tree_nodes` caches
perfect Merkle subtrees. All are append-only: database triggers refuse UPDATE and
DELETE, except the one change retention needs (dropping the body of an entry that a
summary covers, keeping its leaf hash). `settings` holds local, mutable configuration
(such as the path of the ledger's signing key) that is not part of the log.
"""

from __future__ import annotations

from sqlalchemy import Column, LargeBinary
from sqlmodel import Field, SQLModel

SCHEMA_VERSION = "1"


class Entry(SQLModel, table=True):
    __tablename__ = "entries"

    seq: int = Field(primary_key=True, sa_column_kwargs={"autoincrement": False})
    kind: str = Field(index=True, max_length=16)
    time: int
    leaf_hash: bytes = Field(sa_column=Column(LargeBinary(32), nullable=False))
    # Null only after retention redacts a summarized entry; its leaf hash stays.
    body: bytes | None = Field(default=None, sa_column=Column(LargeBinary, nullable=True))


class Admission(SQLModel, table=True):
    __tablename__ = "admissions"

    contribution_id: str = Field(primary_key=True, max_length=128)
    seq: int = Field(foreign_key="entries.seq", unique=True)
    data_class: str = Field(index=True, max_length=64)
    descriptor_sha256: bytes = Field(sa_column=Column(LargeBinary(32), nullable=False, unique=True))
    attestation_sha256: bytes = Field(sa_column=Column(LargeBinary(32), nullable=False, unique=True))
    data_sha256: bytes = Field(sa_column=Column(LargeBinary(32), nullable=False, unique=True))


class Setting(SQLModel, table=True):
    __tablename__ = "settings"

    name: str = Field(primary_key=True, max_length=64)
    value: str




class Checkpoint(SQLModel, table=True):
    """Signed checkpoint notes, stored verbatim, in the order they were signed."""

    __tablename__ = "checkpoints"

    id: int | None = Field(default=None, primary_key=True)
    size: int = Field(index=True)
    root: bytes = Field(sa_column=Column(LargeBinary(32), nullable=False))
    note: str
    time: int


class Withdrawal(SQLModel, table=True):
    """Index of withdraw entries; the primary key makes a second withdrawal impossible."""

    __tablename__ = "withdrawals"

    contribution_id: str = Field(primary_key=True, foreign_key="admissions.contribution_id", max_length=128)
    seq: int = Field(foreign_key="entries.seq", unique=True)


class Summary(SQLModel, table=True):
    """Index of summary entries: the ranges whose admit, spend and withdraw bodies may be redacted."""

    __tablename__ = "summaries"

    seq: int = Field(primary_key=True, foreign_key="entries.seq", sa_column_kwargs={"autoincrement": False})
    data_class: str = Field(max_length=64)
    first_seq: int
    last_seq: int


class TreeNode(SQLModel, table=True):
    """Hashes of perfect aligned Merkle subtrees (height, index): immutable once their leaves exist."""

    __tablename__ = "tree_nodes"

    height: int = Field(primary_key=True, sa_column_kwargs={"autoincrement": False})
    idx: int = Field(primary_key=True, sa_column_kwargs={"autoincrement": False})
    hash: bytes = Field(sa_column=Column(LargeBinary(32), nullable=False))


APPEND_ONLY_TABLES = ("admissions", "checkpoints", "withdrawals", "summaries", "tree_nodes")
REDACTABLE_KINDS = ("admit", "spend", "withdraw")
ALL_TABLES = [Entry.__table__, Admission.__table__, Setting.__table__, Checkpoint.__table__,
              Withdrawal.__table__, Summary.__table__, TreeNode.__table__]
