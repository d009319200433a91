"""Writing inside one transaction: `Appender` adds entries, their index rows and the checkpoint that signs them,
and `NodeCache` holds the Merkle subtree hashes a writer computes, stored with the transaction that commits them."""

from __future__ import annotations

import hashlib
from typing import Callable, MutableMapping

from sqlalchemy import func, insert, select, update
from sqlalchemy.engine import Connection

from ledger_store.models import Admission, Checkpoint, Entry, Summary, TreeNode, Withdrawal
from ledger_store.rows import LEAF_PREFIX, PERSISTED_NODE_HEIGHT, StoredCheckpoint, StoredEntry, _checkpoint, _entry, \
    checked


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
