"""An append-only store of ledger entries (SQLModel / SQLAlchemy Core).

Writers take the database's write lock before they read the next sequence number (SQLite:
``BEGIN IMMEDIATE``), so concurrent processes never assign the same number or skip one.
Everything appended in one `append()` block, the checkpoint that signs it included, commits
or rolls back together: a crash leaves either all of it or none of it. The store hashes
nothing but leaves (RFC 9162 §2.1.1) and knows nothing of entry contents.

`LedgerStore` (here) opens a ledger and reads it; a write transaction's `Appender` is `appender.py`; URLs and
engines are `engines.py`, the row types and column checks `rows.py`, and what the store raises `errors.py`.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Iterator

from sqlalchemy import LargeBinary, bindparam, func, insert, inspect, or_, select, text, tuple_
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DatabaseError
from sqlalchemy.exc import IntegrityError as SQLIntegrityError
from sqlmodel import SQLModel

from ledger_store.appender import Appender, NodeCache, _leaf_hashes, _node
from ledger_store.engines import (ADVISORY_LOCK, _backend, _engine, _sqlite_path, _unopenable, normalize_url,
                                  redacted_url)
from ledger_store.errors import Conflict, LedgerExists, LedgerMissing
from ledger_store.models import (
    ALL_TABLES,
    Admission,
    Checkpoint,
    Entry,
    Setting,
    Summary,
    TreeNode,
    Withdrawal,
)
from ledger_store.rows import _ADMISSION, AdmissionRow, StoredCheckpoint, StoredEntry, _checkpoint, _entry, checked
from ledger_store.schema import postgresql_triggers, sqlite_triggers


class LedgerStore:
    def __init__(self, url: str, engine: Engine, backend: str = "sqlite") -> None:
        self.url = url
        self.engine = engine
        self.backend = backend
        self._pinned = threading.local()  # this thread's snapshot connection, while `snapshot()` holds one
        # How long a PostgreSQL writer waits for the write lock (None: as long as it takes). A holder that hangs
        # (stopped, or a backend whose client is partitioned away) must not hold every writer past its retries.
        self.lock_wait_s: float | None = None

    @contextmanager
    def snapshot(self) -> Iterator[None]:
        """Every read this thread makes inside sees the ledger as one moment: one connection in one read
        transaction (SQLite: a WAL read transaction, fixed at its first read; PostgreSQL: REPEATABLE READ). A
        verifier reads entries, checkpoints and index rows in many queries; without it, a writer committing in
        between shows it entries no checkpoint it read covers, or an admit its index query did not see."""
        if getattr(self._pinned, "connection", None) is not None:
            yield
            return
        with self.engine.connect() as connection:
            if self.backend == "postgresql":
                connection.execution_options(isolation_level="REPEATABLE READ")
            with connection.begin():
                self._pinned.connection = connection
                try:
                    yield
                finally:
                    self._pinned.connection = None

    @contextmanager
    def _reading(self) -> Iterator[Connection]:
        pinned = getattr(self._pinned, "connection", None)
        if pinned is not None:
            yield pinned
            return
        with self.engine.connect() as connection:
            yield connection

    # -- lifecycle -----------------------------------------------------------------------

    @classmethod
    def create(cls, url: str) -> "LedgerStore":
        """Create the schema (idempotent); refuse a ledger that already has entries."""
        url = normalize_url(url)
        backend = _backend(url)
        if backend == "sqlite":
            _sqlite_path(url).parent.mkdir(parents=True, exist_ok=True)
        store = cls(url, _engine(url, backend), backend)
        try:
            with store._write() as connection:
                SQLModel.metadata.create_all(connection, tables=ALL_TABLES)
                triggers = sqlite_triggers() if backend == "sqlite" else postgresql_triggers()
                for statement in triggers:
                    connection.exec_driver_sql(statement)
        except DatabaseError as e:
            store.close()
            raise _unopenable(url, e) from e
        if store.size() > 0:
            store.close()
            raise LedgerExists(f"{redacted_url(url)} already holds a ledger")
        if backend == "sqlite":
            os.chmod(_sqlite_path(url), 0o600)
        return store

    @classmethod
    def open(cls, url: str) -> "LedgerStore":
        """Open an existing ledger; never creates a file or a table."""
        url = normalize_url(url)
        backend = _backend(url)
        if backend == "sqlite" and not _sqlite_path(url).is_file():
            raise LedgerMissing(f"no ledger at {redacted_url(url)}; create one with `govtrain init`")
        store = cls(url, _engine(url, backend), backend)
        try:
            present = inspect(store.engine).has_table("entries")
        except DatabaseError as e:
            store.close()
            raise _unopenable(url, e) from e
        if not present:
            store.close()
            raise LedgerMissing(f"{redacted_url(url)} is not a govtrain ledger; create one with `govtrain init`")
        return store

    def close(self) -> None:
        self.engine.dispose()

    # -- writing -------------------------------------------------------------------------

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        """A write transaction holding the database's write lock from its first statement."""
        with self.engine.connect() as connection:
            connection.info["writer"] = True
            try:
                with connection.begin():
                    if self.backend == "postgresql":
                        if self.lock_wait_s is not None:  # 0 would mean no limit to PostgreSQL: 1 ms at least
                            connection.exec_driver_sql(
                                f"SET LOCAL lock_timeout = {max(1, round(self.lock_wait_s * 1000))}")
                        connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({ADVISORY_LOCK})")
                    yield connection
            finally:
                connection.info["writer"] = False

    @contextmanager
    def append(self) -> Iterator[Appender]:
        """One write transaction. Raises `Conflict` (and writes nothing) if a unique constraint refuses it."""
        try:
            with self._write() as connection:
                next_seq = connection.execute(select(func.coalesce(func.max(Entry.seq) + 1, 0))).scalar_one()
                appender = Appender(connection, next_seq)
                yield appender
                appender.flush()
        except SQLIntegrityError as e:
            raise Conflict(str(e.orig)) from e

    def set_setting(self, name: str, value: str) -> None:
        with self._write() as connection:
            connection.execute(Setting.__table__.delete().where(Setting.name == name))
            connection.execute(insert(Setting.__table__), {"name": name, "value": value})

    def setting(self, name: str) -> str | None:
        with self._reading() as connection:
            row = connection.execute(select(Setting.name, Setting.value).where(Setting.name == name)).first()
        return checked("settings", ("name", "value"), tuple(row))[1] if row is not None else None

    # -- reading -------------------------------------------------------------------------

    def size(self) -> int:
        """How many entries the table holds (a full count: what a verifier compares against)."""
        with self._reading() as connection:
            return connection.execute(select(func.count()).select_from(Entry)).scalar_one()

    def next_seq(self) -> int:
        """One past the highest sequence number: the tree size of an intact ledger, by primary key."""
        with self._reading() as connection:
            return connection.execute(select(func.coalesce(func.max(Entry.seq) + 1, 0))).scalar_one()

    def head(self) -> StoredEntry | None:
        with self._reading() as connection:
            row = connection.execute(select(Entry.__table__).order_by(Entry.seq.desc()).limit(1)).first()
        return _entry(row) if row is not None else None

    def entry(self, seq: int) -> StoredEntry | None:
        with self._reading() as connection:
            row = connection.execute(select(Entry.__table__).where(Entry.seq == seq)).first()
        return _entry(row) if row is not None else None

    def entries(self, start: int = 0, batch: int = 10_000, kinds: tuple[str, ...] | None = None
                ) -> Iterator[StoredEntry]:
        """Entries in sequence order (including any gaps a tampered store may have)."""
        position = start
        while True:
            query = select(Entry.__table__).where(Entry.seq >= position)
            if kinds is not None:
                query = query.where(Entry.kind.in_(kinds))
            with self._reading() as connection:
                rows = connection.execute(query.order_by(Entry.seq).limit(batch)).all()
            for row in rows:
                yield _entry(row)
            if len(rows) < batch:
                return
            position = rows[-1][0] + 1

    def entries_holding(self, pattern: bytes, kinds: tuple[str, ...] = ()) -> list[StoredEntry]:
        """The entries whose body holds the bytes `pattern`, or whose kind column is one of `kinds`, in sequence
        order: a reader that must find entries by their bodies, whatever their kind column says, asks the
        database to search every body (byte for byte: SQLite's instr, PostgreSQL's position on bytea)."""
        if not pattern:
            raise ValueError("an empty pattern matches every body")
        if self.backend == "sqlite":
            found = func.instr(Entry.body, pattern) > 0
        else:
            found = text("position(:pattern in entries.body) > 0").bindparams(
                bindparam("pattern", pattern, type_=LargeBinary))
        condition = or_(found, Entry.kind.in_(kinds)) if kinds else found
        with self._reading() as connection:
            rows = connection.execute(select(Entry.__table__).where(condition).order_by(Entry.seq)).all()
        return [_entry(row) for row in rows]

    def entries_at(self, seqs: list[int], batch: int = 500) -> list[StoredEntry]:
        """The entries with these sequence numbers (those that exist), in sequence order."""
        found: list[StoredEntry] = []
        with self._reading() as connection:
            for start in range(0, len(seqs), batch):
                chunk = seqs[start:start + batch]
                rows = connection.execute(select(Entry.__table__).where(Entry.seq.in_(chunk))).all()
                found.extend(_entry(row) for row in rows)
        return sorted(found)

    def leaf_hashes(self, start: int, stop: int) -> list[bytes]:
        with self._reading() as connection:
            return _leaf_hashes(connection, start, stop)

    def leaf_rows(self, batch: int = 100_000, *, with_kind: bool = False) -> Iterator[list[tuple]]:
        """Batches of (seq, leaf hash, body) for every entry in order, and its kind column last if
        `with_kind`: the bulk path auditors use. The cells are as the driver returns them, unchecked (a
        caller meeting a cell of the wrong type names it with `checked`)."""
        columns = [Entry.seq, Entry.leaf_hash, Entry.body] + ([Entry.kind] if with_kind else [])
        with self._reading() as connection:
            if self.backend == "sqlite":  # the driver's own cursor: no per-row Python objects in between
                cursor = connection.connection.dbapi_connection.cursor()
                cursor.execute(f"SELECT {', '.join(c.name for c in columns)} FROM entries ORDER BY seq")
                while rows := cursor.fetchmany(batch):
                    yield rows
                cursor.close()
                return
            result = connection.execution_options(stream_results=True).execute(
                select(*columns).order_by(Entry.seq))
            while rows := result.fetchmany(batch):
                yield [tuple(row) for row in rows]

    def node_cache(self) -> NodeCache:
        def lookup(height: int, idx: int) -> bytes | None:
            with self._reading() as connection:
                return _node(connection, height, idx)

        def lookup_many(keys: list[tuple[int, int]]) -> dict[tuple[int, int], bytes]:
            with self._reading() as connection:
                rows = connection.execute(select(TreeNode.height, TreeNode.idx, TreeNode.hash).where(
                    tuple_(TreeNode.height, TreeNode.idx).in_(keys))).all()
            return {(h, i): v for h, i, v in (checked("tree_nodes", ("height", "idx", "hash"), tuple(r)) for r in rows)}

        return NodeCache(lookup, lookup_many)

    def count_kind(self, kind: str) -> int:
        """Entries of `kind` (from entry 0: a row below it is no entry). An index count: nothing privacy-relevant is
        decided by it (`govtrain.ledger.verified` counts from the entries' bodies)."""
        with self._reading() as connection:
            return connection.execute(select(func.count()).select_from(Entry).where(
                Entry.kind == kind, Entry.seq >= 0)).scalar_one()

    def checkpoints(self) -> list[StoredCheckpoint]:
        with self._reading() as connection:
            rows = connection.execute(select(Checkpoint.__table__).order_by(Checkpoint.id)).all()
        return [_checkpoint(r) for r in rows]

    def latest_checkpoint(self) -> StoredCheckpoint | None:
        with self._reading() as connection:
            row = connection.execute(select(Checkpoint.__table__).order_by(Checkpoint.id.desc()).limit(1)).first()
        return _checkpoint(row) if row is not None else None

    def checkpoints_from(self, size: int) -> list[StoredCheckpoint]:
        """The checkpoints stored whose size column is `size` or more, the largest first."""
        with self._reading() as connection:
            rows = connection.execute(select(Checkpoint.__table__).where(Checkpoint.size >= size)
                                      .order_by(Checkpoint.size.desc(), Checkpoint.id.desc())).all()
        return [_checkpoint(r) for r in rows]

    def checkpoint_covering(self, seq: int) -> StoredCheckpoint | None:
        """The first checkpoint stored whose tree includes entry `seq`."""
        with self._reading() as connection:
            row = connection.execute(select(Checkpoint.__table__).where(Checkpoint.size > seq)
                                     .order_by(Checkpoint.id).limit(1)).first()
        return _checkpoint(row) if row is not None else None

    def admission_conflicts(self, contribution_ids: list[str], descriptor_hashes: list[bytes], data_hashes: list[bytes],
                            attestation_hashes: list[bytes] | None = None) -> list[AdmissionRow]:
        """Admissions sharing an id, a descriptor, data or attestation hash with any of the candidates."""
        if not contribution_ids:
            return []
        table = Admission.__table__
        with self._reading() as connection:
            rows = connection.execute(
                select(table).where(
                    table.c.contribution_id.in_(contribution_ids)
                    | table.c.descriptor_sha256.in_(descriptor_hashes)
                    | table.c.data_sha256.in_(data_hashes)
                    | table.c.attestation_sha256.in_(attestation_hashes or [])
                )
            ).all()
        return [self._admission(row) for row in rows]

    def admission(self, contribution_id: str) -> AdmissionRow | None:
        with self._reading() as connection:
            row = connection.execute(select(Admission.__table__).where(
                Admission.contribution_id == contribution_id)).first()
        return self._admission(row) if row is not None else None

    def admissions(self) -> list[AdmissionRow]:
        with self._reading() as connection:
            rows = connection.execute(select(Admission.__table__).order_by(Admission.seq)).all()
        return [self._admission(row) for row in rows]

    def withdrawals(self) -> dict[str, int]:
        """contribution id -> seq of its withdraw entry."""
        with self._reading() as connection:
            rows = connection.execute(select(Withdrawal.contribution_id, Withdrawal.seq)).all()
        return dict(checked("withdrawals", ("contribution_id", "seq"), tuple(row)) for row in rows)

    def summaries(self) -> list[tuple[int, str, int, int]]:
        """(seq, class, first_seq, last_seq) of every summary entry."""
        with self._reading() as connection:
            rows = connection.execute(
                select(Summary.seq, Summary.data_class, Summary.first_seq, Summary.last_seq).order_by(Summary.seq)).all()
        return [checked("summaries", ("seq", "data_class", "first_seq", "last_seq"), tuple(r)) for r in rows]

    @staticmethod
    def _admission(row) -> AdmissionRow:
        m = row._mapping
        return AdmissionRow(*checked("admissions", _ADMISSION, tuple(m[column] for column in _ADMISSION)))
