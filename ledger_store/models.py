"""Tables of a govtrain ledger.

`entries` is the log itself: one canonical CBOR entry per row, its RFC 9162 leaf hash
and its dense sequence number, which is also its leaf index in the Merkle tree.
`admissions` is an index over admit entries that makes replay checks one lookup and,
through its unique constraints, makes a replay impossible even between racing
writers. Both are append-only: database triggers refuse UPDATE and DELETE.
`settings` holds local, mutable configuration (such as the path of the ledger's
signing key) that is not part of the log.
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
    leaf_hash: bytes = Field(sa_column=Column(LargeBinary(32), nullable=False, unique=True))
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


APPEND_ONLY_TABLES = ("entries", "admissions")
