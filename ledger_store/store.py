"""An append-only store of ledger entries (SQLModel / SQLAlchemy Core).

Writers take the database's write lock before they read the next sequence number (SQLite:
``BEGIN IMMEDIATE``), so concurrent processes never assign the same number or skip one.
Everything appended in one `append()` block, the checkpoint that signs it included, commits
or rolls back together: a crash leaves either all of it or none of it. The store hashes
nothing but leaves (RFC 9162 §2.1.1) and knows nothing of entry contents.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, MutableMapping, NamedTuple

from sqlalchemy import (LargeBinary, bindparam, create_engine, event, func, insert, inspect, or_, select, text,
                        tuple_, update)
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, DatabaseError, OperationalError
from sqlalchemy.exc import IntegrityError as SQLIntegrityError
from sqlmodel import SQLModel

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
from ledger_store.schema import postgresql_triggers, sqlite_triggers

LEAF_PREFIX = b"\x00"
PERSISTED_NODE_HEIGHT = 8  # subtrees of 256 leaves and up are stored; smaller ones are cheap to recompute


class StoreError(Exception):
    """Base of ledger_store errors."""


class UnsupportedURL(StoreError):
    pass


class LedgerMissing(StoreError):
    pass


class LedgerExists(StoreError):
    pass


class NotADatabase(StoreError):
    """A file SQLite cannot read as a database (a data file, a key, a policy given as the ledger)."""


class Unavailable(StoreError):
    """The database server could not be reached (down, restarting, refusing connections) or stayed locked."""


class AccessDenied(StoreError):
    """The database refused these credentials or this role (a wrong or rotated password, no pg_hba entry, no
    privilege): waiting cannot help, the URL or the database's grants must change."""


class Conflict(StoreError):
    """A unique constraint refused the write (a replay, or a second withdrawal, that raced another writer)."""


class TamperedRow(StoreError):
    """A cell that does not hold its column's type (SQLite keeps whatever type is written: a TEXT body, a TEXT
    seq): no ledger writer wrote it. `table`, `column` and `key` (the row's seq, id or name) say where."""

    def __init__(self, table: str, column: str, key: object, value: object) -> None:
        where = repr(key) if len(repr(key)) <= 80 else repr(key)[:77] + "..."
        super().__init__(f"{table}.{column} of row {where} holds {type(value).__name__}, not the column's type")
        self.table, self.column, self.key = table, column, key


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


# PostgreSQL's refusals of a connection carry no SQLSTATE (libpq reports them as text); these are the server's.
_ACCESS_DENIED = re.compile(r"authentication failed|no pg_hba\.conf entry|permission denied|is not permitted to log in"
                            r"|role \"[^\"]*\" does not exist|no password supplied")


def access_denied(error: BaseException) -> bool:
    """Whether a driver error is PostgreSQL refusing who connects: SQLSTATE class 28 (invalid authorization,
    a wrong password) or 42501 (insufficient privilege), or a refused connection saying so."""
    sqlstate = getattr(error, "sqlstate", None)
    if sqlstate:
        return sqlstate.startswith("28") or sqlstate == "42501"
    return type(error).__module__.startswith("psycopg") and _ACCESS_DENIED.search(str(error)) is not None


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


def normalize_url(url: str) -> str:
    """A SQLAlchemy URL; a bare path means a SQLite file (a relative one with a folder gets its explicit `./`)."""
    if "://" not in url:
        path = str(Path(url).expanduser())
        return f"sqlite:///{path}" if os.path.isabs(path) or "/" not in path else f"sqlite:///./{path}"
    return url


def redacted_url(url: str) -> str:
    """`url` with its password replaced by `***`: the only form of a URL a message, a log line or an answer holds
    (the password can write the ledger). Everything between the user name and the last `@` goes, and any
    `password=` query parameter: a password holding characters a URL should have escaped is hidden whole, at
    worst with part of what follows it."""
    scheme, sep, rest = url.partition("://")
    if sep:
        userinfo, at, host = rest.rpartition("@")
        if at and ":" in userinfo:
            rest = f"{userinfo.split(':', 1)[0]}:***@{host}"
    return re.sub(r"(?i)([?&]password=)[^&]*", r"\1***", f"{scheme}{sep}{rest}")


def _check_sqlite_path(url: str, database: str) -> None:
    """Refuse `sqlite:///tmp/x.db`: three slashes make `tmp/x.db` relative to the working directory, which is
    rarely what was meant. A relative path with a folder must say so (`./`, `../`); a bare file name need not."""
    if os.path.isabs(database) or "/" not in database or database.startswith(("./", "../")):
        return
    raise UnsupportedURL(f"{redacted_url(url)} names the relative path {database} (three slashes before a relative "
                         f"path, four before an absolute one): write sqlite:////{database} for /{database}, or "
                         f"sqlite:///./{database} for ./{database}")


ADVISORY_LOCK = 0x67766E74  # "gvnt": PostgreSQL writers serialize on this transaction-scoped lock


def _backend(url: str) -> str:
    """'sqlite' or 'postgresql'; anything else is refused with what to use instead."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as e:  # ValueError: a port that is not a number
        raise UnsupportedURL(f"{redacted_url(url)!r} is not a database URL (try sqlite:///ledger.db)") from None
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        if not parsed.database or parsed.database == ":memory:":
            raise UnsupportedURL("a ledger needs a SQLite file, not an in-memory database")
        _check_sqlite_path(url, parsed.database)
        return backend
    if backend == "postgresql":
        if parsed.get_driver_name() != "psycopg":
            raise UnsupportedURL("PostgreSQL ledgers use psycopg 3: postgresql+psycopg://USER:PASS@HOST/DB")
        return backend
    raise UnsupportedURL(f"{backend!r} ledgers are not supported; use sqlite:///PATH or postgresql+psycopg://…")


def _sqlite_path(url: str) -> Path:
    return Path(make_url(url).database)


def _unopenable(url: str, error: DatabaseError) -> StoreError:
    """What a failure to open or create the ledger at `url` means to its user."""
    if access_denied(error.orig):
        return AccessDenied(f"{redacted_url(url)} refused this connection ({str(error.orig).splitlines()[0]}): "
                            "check the user and password in the URL and the database's grants")
    if isinstance(error, OperationalError):
        return Unavailable(f"cannot reach {redacted_url(url)}: {str(error.orig).splitlines()[0]}")
    return _not_a_database(url, error)


def _not_a_database(url: str, error: DatabaseError) -> StoreError:
    where = make_url(url)
    if where.get_backend_name() != "sqlite":
        return LedgerMissing(f"cannot read {redacted_url(url)}: "
                             f"{str(error.orig).splitlines()[0]}")
    return NotADatabase(f"{where.database} is not a SQLite database ({str(error.orig).splitlines()[0]}): --ledger "
                        "names the ledger file `govtrain init` created")


def _engine(url: str, backend: str) -> Engine:
    if backend == "postgresql":
        return create_engine(url, pool_pre_ping=True)
    engine = create_engine(url)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:
        dbapi_connection.isolation_level = None  # SQLAlchemy's "begin" event below issues BEGIN itself
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=60000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection) -> None:
        # Writers take the write lock before reading the next sequence number; readers do not wait.
        connection.exec_driver_sql("BEGIN IMMEDIATE" if connection.info.get("writer") else "BEGIN")

    return engine


def _insert_rows(connection: Connection, table, rows: list[dict], *, ignore_existing: bool = False) -> None:
    if not rows:
        return
    if connection.dialect.paramstyle == "qmark":
        # SQLite: plain tuples to the driver; SQLAlchemy's per-value processing costs more than the insert.
        columns = list(rows[0])
        verb = "INSERT OR IGNORE" if ignore_existing else "INSERT"
        statement = f"{verb} INTO {table.name} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"
        connection.exec_driver_sql(statement, [tuple(row[c] for c in columns) for row in rows])
    elif ignore_existing:
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        connection.execute(pg_insert(table).on_conflict_do_nothing(), rows)
    else:
        connection.execute(insert(table), rows)


def _leaf_hashes(connection: Connection, start: int, stop: int) -> list[bytes]:
    rows = connection.execute(
        select(Entry.seq, Entry.leaf_hash).where(Entry.seq >= start, Entry.seq < stop).order_by(Entry.seq)
    ).all()
    return [checked("entries", ("seq", "leaf_hash"), tuple(row))[1] for row in rows]


def _node(connection: Connection, height: int, idx: int) -> bytes | None:
    row = connection.execute(select(TreeNode.height, TreeNode.idx, TreeNode.hash).where(
        TreeNode.height == height, TreeNode.idx == idx)).first()
    return checked("tree_nodes", ("height", "idx", "hash"), tuple(row))[2] if row is not None else None


class NodeCache(MutableMapping):
    """Perfect-subtree hashes for `govtrain.ledger.merkle.MerkleTree`, persisted in `tree_nodes`.

    Reads go to memory, then `lookup` (the table). Hashes computed inside a write transaction stay
    pending until `flush` stores them and `commit` (after the transaction committed) makes them
    readable from memory; `rollback` forgets them, so a failed append can never leave behind the hash
    of leaves that do not exist. Only heights >= PERSISTED_NODE_HEIGHT reach the table.
    """

    def __init__(self, lookup: Callable[[int, int], bytes | None],
                 lookup_many: Callable[[list[tuple[int, int]]], dict[tuple[int, int], bytes]] | None = None) -> None:
        self.lookup = lookup
        self.lookup_many = lookup_many
        self._memory: dict[tuple[int, int], bytes] = {}
        self._pending: dict[tuple[int, int], bytes] = {}

    def __getitem__(self, key: tuple[int, int]) -> bytes:
        found = self._memory.get(key) or self._pending.get(key)
        if found is None and key[0] >= PERSISTED_NODE_HEIGHT:
            found = self.lookup(*key)
            if found is not None:
                self._memory[key] = found
        if found is None:
            raise KeyError(key)
        return found

    def get(self, key, default=None):  # type: ignore[override]
        try:
            return self[key]
        except KeyError:
            return default

    def prefetch(self, keys: list[tuple[int, int]]) -> None:
        """Load many stored hashes in one query (a proof needs a dozen)."""
        wanted = [k for k in keys if k[0] >= PERSISTED_NODE_HEIGHT and k not in self._memory
                  and k not in self._pending]
        if wanted and self.lookup_many is not None:
            self._memory.update(self.lookup_many(wanted))

    def __setitem__(self, key: tuple[int, int], value: bytes) -> None:
        self._pending[key] = value

    def __delitem__(self, key: tuple[int, int]) -> None:
        raise TypeError("Merkle subtree hashes are immutable")

    def __iter__(self):
        return iter(self._memory)

    def __len__(self) -> int:
        return len(self._memory)

    def flush(self, connection: Connection) -> None:
        """Store the pending hashes (inside the caller's write transaction)."""
        rows = [{"height": h, "idx": i, "hash": v} for (h, i), v in self._pending.items()
                if h >= PERSISTED_NODE_HEIGHT]
        _insert_rows(connection, TreeNode.__table__, rows, ignore_existing=True)

    def commit(self) -> None:
        self._memory.update(self._pending)
        self._pending.clear()

    def rollback(self) -> None:
        self._pending.clear()


class Appender:
    """Adds entries (and the index rows and checkpoint that go with them) inside one write transaction."""

    _ENTRY_COLUMNS = ("seq", "kind", "time", "leaf_hash", "body")

    def __init__(self, connection: Connection, next_seq: int) -> None:
        self.connection = connection
        self.first_seq = next_seq
        self.next_seq = next_seq
        self._rows: list[tuple] = []  # entry rows not yet inserted, as (seq, kind, time, leaf, body)
        self._leaves: list[bytes] = []  # leaf hashes of everything this transaction added, in order
        self._index: dict[str, list[dict]] = {"admissions": [], "withdrawals": [], "summaries": []}
        self.added: list[StoredEntry] = []

    def add(self, kind: str, time: int, build: Callable[[int], bytes], admission: dict | None = None,
            withdrawal: dict | None = None, summary: dict | None = None) -> StoredEntry:
        """Append the entry `build(seq)` returns, with the index rows that describe it."""
        seq = self.next_seq
        body = build(seq)
        leaf = hashlib.sha256(LEAF_PREFIX + body).digest()
        self._rows.append((seq, kind, time, leaf, body))
        self._leaves.append(leaf)
        if admission is not None or withdrawal is not None or summary is not None:
            for name, row in (("admissions", admission), ("withdrawals", withdrawal), ("summaries", summary)):
                if row is not None:
                    self._index[name].append({**row, "seq": seq})
        stored = StoredEntry(seq, kind, time, leaf, body)
        self.added.append(stored)
        self.next_seq = seq + 1
        return stored

    def flush(self) -> None:
        if self._rows:
            if self.connection.dialect.paramstyle == "qmark":
                self.connection.exec_driver_sql(
                    "INSERT INTO entries (seq, kind, time, leaf_hash, body) VALUES (?, ?, ?, ?, ?)", self._rows)
            else:
                self.connection.execute(insert(Entry.__table__),
                                        [dict(zip(self._ENTRY_COLUMNS, row)) for row in self._rows])
            self._rows = []
        for table in (Admission.__table__, Withdrawal.__table__, Summary.__table__):
            _insert_rows(self.connection, table, self._index[table.name])
        self._index = {name: [] for name in self._index}

    def leaf_hashes(self, start: int, stop: int) -> list[bytes]:
        """Leaf hashes as this transaction sees them: its own from memory, earlier ones from the table."""
        first = self.first_seq
        if start >= first:
            return self._leaves[start - first : stop - first]
        self.flush()
        if stop <= first:
            return _leaf_hashes(self.connection, start, stop)
        return _leaf_hashes(self.connection, start, first) + self._leaves[: stop - first]

    def node(self, height: int, idx: int) -> bytes | None:
        """A stored subtree hash, as this transaction sees it."""
        return _node(self.connection, height, idx)

    def count_kind(self, kind: str) -> int:
        """Entries of `kind` (from entry 0: a row below it is no entry), as this transaction (holding the write
        lock) sees them. An index count: nothing privacy-relevant is decided by it."""
        self.flush()
        return self.connection.execute(
            select(func.count()).select_from(Entry).where(Entry.kind == kind, Entry.seq >= 0)).scalar_one()

    def latest_checkpoint(self) -> "StoredCheckpoint | None":
        """The last checkpoint stored, as this transaction (holding the write lock) sees it."""
        row = self.connection.execute(select(Checkpoint.__table__).order_by(Checkpoint.id.desc()).limit(1)).first()
        return _checkpoint(row) if row is not None else None

    def entries(self, start: int, stop: int) -> list[StoredEntry]:
        """The stored entries from `start` to `stop` (exclusive), as this transaction sees them."""
        self.flush()
        rows = self.connection.execute(select(Entry.__table__).where(Entry.seq >= start, Entry.seq < stop)
                                       .order_by(Entry.seq)).all()
        return [_entry(row) for row in rows]

    def checkpoints_after(self, checkpoint_id: int) -> list[StoredCheckpoint]:
        """The checkpoints stored after the one with `checkpoint_id`, as this transaction sees them."""
        rows = self.connection.execute(select(Checkpoint.__table__).where(Checkpoint.id > checkpoint_id)
                                       .order_by(Checkpoint.id)).all()
        return [_checkpoint(r) for r in rows]

    def last_time(self) -> int | None:
        """The time of the entry before this transaction's first one (read once: the lock is held)."""
        if self.first_seq == 0:
            return None
        if not hasattr(self, "_last_time"):
            self._last_time = self.connection.execute(
                select(Entry.time).where(Entry.seq == self.first_seq - 1)).scalar_one_or_none()
        return self._last_time

    def add_checkpoint(self, size: int, root: bytes, note: str, time: int) -> None:
        self.flush()
        _insert_rows(self.connection, Checkpoint.__table__,
                     [{"size": size, "root": root, "note": note, "time": time}])

    def redact(self, seqs: list[int]) -> None:
        """Drop the bodies of summarized entries (the triggers refuse anything else)."""
        self.flush()
        for start in range(0, len(seqs), 500):
            self.connection.execute(update(Entry.__table__).where(Entry.seq.in_(seqs[start:start + 500]))
                                    .values(body=None))


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
