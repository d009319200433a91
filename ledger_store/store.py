"""An append-only store of ledger entries on SQLite (SQLModel / SQLAlchemy Core).

Writers take SQLite's write lock before they read the next sequence number
(``BEGIN IMMEDIATE``), so concurrent processes never assign the same number or skip
one; everything appended in one `append()` block commits or rolls back together.
The store hashes nothing but leaves (RFC 9162 §2.1.1) and knows nothing of entry
contents: encoding is govtrain's job.
"""

from __future__ import annotations

import hashlib
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from sqlalchemy import create_engine, event, func, insert, select
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, IntegrityError as SQLIntegrityError
from sqlmodel import SQLModel

from ledger_store.models import APPEND_ONLY_TABLES, Admission, Entry, Setting

LEAF_PREFIX = b"\x00"


class StoreError(Exception):
    """Base of ledger_store errors."""


class UnsupportedURL(StoreError):
    pass


class LedgerMissing(StoreError):
    pass


class LedgerExists(StoreError):
    pass


class Conflict(StoreError):
    """A unique constraint refused the write (a replay that raced another writer)."""


def leaf_hash(body: bytes) -> bytes:
    """RFC 9162 §2.1.1: SHA-256(0x00 ‖ entry bytes)."""
    return hashlib.sha256(LEAF_PREFIX + body).digest()


@dataclass(frozen=True, slots=True)
class StoredEntry:
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


def normalize_url(url: str) -> str:
    """A SQLAlchemy URL; a bare path means a SQLite file."""
    if "://" not in url:
        return f"sqlite:///{Path(url).expanduser()}"
    return url


def _sqlite_path(url: str) -> Path:
    try:
        parsed = make_url(url)
    except ArgumentError as e:
        raise UnsupportedURL(f"{url!r} is not a database URL (try sqlite:///ledger.db)") from e
    if parsed.get_backend_name() != "sqlite":
        raise UnsupportedURL(
            f"{parsed.get_backend_name()!r} ledgers are not supported yet; use sqlite:///PATH"
        )
    if not parsed.database or parsed.database == ":memory:":
        raise UnsupportedURL("a ledger needs a SQLite file, not an in-memory database")
    return Path(parsed.database)


_TRIGGERS = [
    f"""CREATE TRIGGER IF NOT EXISTS {table}_no_{verb.lower()} BEFORE {verb} ON {table}
        BEGIN SELECT RAISE(ABORT, 'govtrain ledger: {table} are append-only'); END"""
    for table in APPEND_ONLY_TABLES
    for verb in ("UPDATE", "DELETE")
]


def _engine(url: str) -> Engine:
    engine = create_engine(url)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:
        # Let SQLAlchemy's "begin" event below issue BEGIN itself.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=60000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


class Appender:
    """Adds entries inside one write transaction; sequence numbers are dense and in order."""

    def __init__(self, connection, next_seq: int) -> None:
        self._connection = connection
        self.next_seq = next_seq
        self._entries: list[dict] = []
        self._admissions: list[dict] = []
        self.added: list[StoredEntry] = []

    def add(self, kind: str, time: int, build: Callable[[int], bytes],
            admission: dict | None = None) -> StoredEntry:
        """Append the entry `build(seq)` returns; `admission` (contribution_id, data_class, hashes) indexes it."""
        seq = self.next_seq
        body = build(seq)
        stored = StoredEntry(seq, kind, time, leaf_hash(body), body)
        self._entries.append({"seq": seq, "kind": kind, "time": time, "leaf_hash": stored.leaf_hash, "body": body})
        if admission is not None:
            self._admissions.append({**admission, "seq": seq})
        self.added.append(stored)
        self.next_seq += 1
        return stored

    def flush(self) -> None:
        for table, rows in ((Entry.__table__, self._entries), (Admission.__table__, self._admissions)):
            if not rows:
                continue
            if self._connection.dialect.paramstyle == "qmark":
                # SQLite: hand the driver plain tuples; SQLAlchemy's per-value processing costs more
                # than the insert itself on large batches.
                columns = list(rows[0])
                statement = (f"INSERT INTO {table.name} ({', '.join(columns)}) "
                             f"VALUES ({', '.join('?' * len(columns))})")
                self._connection.exec_driver_sql(statement, [tuple(row[c] for c in columns) for row in rows])
            else:
                self._connection.execute(insert(table), rows)
        self._entries, self._admissions = [], []


class LedgerStore:
    def __init__(self, url: str, engine: Engine) -> None:
        self.url = url
        self.engine = engine

    # -- lifecycle -----------------------------------------------------------------------

    @classmethod
    def create(cls, url: str) -> "LedgerStore":
        """Create the schema (idempotent); refuse a ledger that already has entries."""
        url = normalize_url(url)
        path = _sqlite_path(url)
        path.parent.mkdir(parents=True, exist_ok=True)
        store = cls(url, _engine(url))
        with store.engine.begin() as connection:
            SQLModel.metadata.create_all(connection, tables=[Entry.__table__, Admission.__table__,
                                                            Setting.__table__])
            for statement in _TRIGGERS:
                connection.exec_driver_sql(statement)
        if store.size() > 0:
            store.close()
            raise LedgerExists(f"{url} already holds a ledger")
        os.chmod(path, 0o600)
        return store

    @classmethod
    def open(cls, url: str) -> "LedgerStore":
        """Open an existing ledger; never creates a file."""
        url = normalize_url(url)
        path = _sqlite_path(url)
        if not path.is_file():
            raise LedgerMissing(f"no ledger at {url}; create one with `govtrain init`")
        store = cls(url, _engine(url))
        with store.engine.connect() as connection:
            tables = {row[0] for row in connection.exec_driver_sql(
                "SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "entries" not in tables:
            store.close()
            raise LedgerMissing(f"{url} is not a govtrain ledger")
        return store

    def close(self) -> None:
        self.engine.dispose()

    # -- writing -------------------------------------------------------------------------

    @contextmanager
    def append(self) -> Iterator[Appender]:
        """One write transaction. Raises `Conflict` (and writes nothing) if a unique constraint refuses it."""
        try:
            with self.engine.begin() as connection:
                next_seq = connection.execute(select(func.coalesce(func.max(Entry.seq) + 1, 0))).scalar_one()
                appender = Appender(connection, next_seq)
                yield appender
                appender.flush()
        except SQLIntegrityError as e:
            raise Conflict(str(e.orig)) from e

    def set_setting(self, name: str, value: str) -> None:
        with self.engine.begin() as connection:
            connection.execute(Setting.__table__.delete().where(Setting.name == name))
            connection.execute(insert(Setting.__table__), {"name": name, "value": value})

    def setting(self, name: str) -> str | None:
        with self.engine.connect() as connection:
            return connection.execute(select(Setting.value).where(Setting.name == name)).scalar_one_or_none()

    # -- reading -------------------------------------------------------------------------

    def size(self) -> int:
        with self.engine.connect() as connection:
            return connection.execute(select(func.count()).select_from(Entry)).scalar_one()

    def head(self) -> StoredEntry | None:
        with self.engine.connect() as connection:
            row = connection.execute(select(Entry.__table__).order_by(Entry.seq.desc()).limit(1)).first()
        return StoredEntry(*row) if row is not None else None

    def entry(self, seq: int) -> StoredEntry | None:
        with self.engine.connect() as connection:
            row = connection.execute(select(Entry.__table__).where(Entry.seq == seq)).first()
        return StoredEntry(*row) if row is not None else None

    def entries(self, start: int = 0, batch: int = 10_000) -> Iterator[StoredEntry]:
        """Entries in sequence order (including any gaps a tampered store may have)."""
        position = start
        while True:
            with self.engine.connect() as connection:
                rows = connection.execute(
                    select(Entry.__table__).where(Entry.seq >= position).order_by(Entry.seq).limit(batch)
                ).all()
            for row in rows:
                yield StoredEntry(*row)
            if len(rows) < batch:
                return
            position = rows[-1][0] + 1

    def count_kind(self, kind: str) -> int:
        with self.engine.connect() as connection:
            return connection.execute(select(func.count()).select_from(Entry).where(Entry.kind == kind)).scalar_one()

    def admission_conflicts(self, contribution_ids: list[str], descriptor_hashes: list[bytes],
                            data_hashes: list[bytes]) -> list[AdmissionRow]:
        """Admissions sharing an id, a descriptor hash or a data hash with any of the candidates."""
        if not contribution_ids:
            return []
        table = Admission.__table__
        with self.engine.connect() as connection:
            rows = connection.execute(
                select(table).where(
                    table.c.contribution_id.in_(contribution_ids)
                    | table.c.descriptor_sha256.in_(descriptor_hashes)
                    | table.c.data_sha256.in_(data_hashes)
                )
            ).all()
        return [self._admission(row) for row in rows]

    def admissions(self) -> list[AdmissionRow]:
        with self.engine.connect() as connection:
            rows = connection.execute(select(Admission.__table__).order_by(Admission.seq)).all()
        return [self._admission(row) for row in rows]

    @staticmethod
    def _admission(row) -> AdmissionRow:
        m = row._mapping
        return AdmissionRow(m["contribution_id"], m["seq"], m["data_class"], m["descriptor_sha256"],
                            m["attestation_sha256"], m["data_sha256"])
