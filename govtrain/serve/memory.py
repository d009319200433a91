"""What the gate has seen of its ledger, kept so that no later reading can unsee it (seed 004: withdrawals are
authoritative for inference gates).

A reading of the ledger is only as good as the database the policy names, and whoever can write that database
can put an older copy back. So the gate remembers, per ledger origin, the largest tree it has verified (its size
and root, from a checkpoint signed by a pinned ledger key) and, per release, every withdrawal since the release
it has read. A later reading must show a tree at least as large and consistent with the remembered one (RFC 9162
§2.1.4: the remembered tree is a prefix of the new one), else `rollback` or `fork` (the gate answers
`taint_unknown`); the withdrawals it reports are the union of those read now and those read before, so a
withdrawal is never dropped once seen.

The memory lives in the gate's SQLite store (the sessions file of inference.toml), so a restart remembers too;
triggers refuse an UPDATE that shrinks or changes a tree at one size, and every DELETE. What it cannot catch: a
ledger that was stale before this store first saw it (nothing remembered yet to compare with).
"""

from __future__ import annotations

import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from govtrain.errors import Code, IntegrityError

SCHEMA = """
CREATE TABLE IF NOT EXISTS gate_ledger_trees (
    origin TEXT PRIMARY KEY,
    size INTEGER NOT NULL CHECK (size > 0),
    root BLOB NOT NULL CHECK (length(root) = 32),
    seen_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS gate_withdrawals (
    release_sha256 BLOB NOT NULL,
    seq INTEGER NOT NULL,
    contribution_id TEXT NOT NULL,
    leaf_hash BLOB NOT NULL,
    time INTEGER NOT NULL,
    seen_at INTEGER NOT NULL,
    PRIMARY KEY (release_sha256, seq)
);
CREATE TRIGGER IF NOT EXISTS gate_ledger_trees_grow BEFORE UPDATE ON gate_ledger_trees
    WHEN NEW.size < OLD.size OR (NEW.size = OLD.size AND NEW.root IS NOT OLD.root) OR NEW.origin IS NOT OLD.origin
    BEGIN SELECT RAISE(ABORT, 'a remembered ledger tree only grows'); END;
CREATE TRIGGER IF NOT EXISTS gate_ledger_trees_no_delete BEFORE DELETE ON gate_ledger_trees
    BEGIN SELECT RAISE(ABORT, 'a remembered ledger tree is never forgotten'); END;
CREATE TRIGGER IF NOT EXISTS gate_withdrawals_no_update BEFORE UPDATE ON gate_withdrawals
    BEGIN SELECT RAISE(ABORT, 'a withdrawal seen is never changed'); END;
CREATE TRIGGER IF NOT EXISTS gate_withdrawals_no_delete BEFORE DELETE ON gate_withdrawals
    BEGIN SELECT RAISE(ABORT, 'a withdrawal seen is never forgotten'); END;
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class SeenWithdrawal:
    """A withdraw entry since a release, of a contribution the release trained on: its sequence number, leaf hash
    and ledger time."""

    contribution_id: str
    seq: int
    leaf_hash: bytes
    time: int


class LedgerMemory:
    """The largest verified tree per ledger origin and the withdrawals seen per release, in the SQLite file `path`
    (None: in this process only). One caller at a time per instance (the gate's `TaintWatch` holds a lock);
    processes sharing the file serialise on SQLite's write lock."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, busy_timeout_s: float = 60.0) -> None:
        if path is not None and not Path(path).exists():
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))  # beside the sessions: no one else reads it
        # check_same_thread off: readings run on the server's worker threads, one at a time
        self._db = sqlite3.connect(":memory:" if path is None else path, timeout=busy_timeout_s,
                                   isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA synchronous = FULL")
        self._db.executescript(f"BEGIN IMMEDIATE;\n{SCHEMA}\nCOMMIT;")

    def close(self) -> None:
        self._db.close()

    def advance(self, *, origin: str, size: int, root: bytes, consistency: Callable[[int], Sequence[bytes]],
                release_sha256: bytes, withdrawals: Sequence[SeenWithdrawal], now: int) -> tuple[SeenWithdrawal, ...]:
        """Take a verified reading: the ledger `origin`'s tree of `size` entries with `root` (a checkpoint signed by
        a pinned key), `consistency(old_size)` giving the proof that the tree of `old_size` entries is its prefix,
        and the withdrawals since the release `release_sha256` read from it. Refuses (`rollback`, `fork`; nothing
        remembered) a tree smaller than, or not an extension of, the largest one remembered; else remembers the
        larger tree and the withdrawals, and returns every withdrawal seen since that release, by sequence."""
        from govtrain.ledger.merkle import ProofError, verify_consistency

        db = self._db
        db.execute("BEGIN IMMEDIATE")  # the write lock before the read: one remembered tree, compared and moved
        try:
            held = db.execute("SELECT size, root FROM gate_ledger_trees WHERE origin = ?", (origin,)).fetchone()
            if held is not None:
                seen_size, seen_root = held[0], bytes(held[1])
                if size < seen_size:
                    raise IntegrityError(Code.ROLLBACK, f"the ledger's latest verified checkpoint signs {size} "
                                                        f"entries; this gate has verified {seen_size}: the ledger "
                                                        "was rolled back")
                try:
                    if size == seen_size and root != seen_root:
                        raise ProofError("another root at the same size")
                    if size > seen_size:
                        verify_consistency(seen_size, size, seen_root, root, consistency(seen_size))
                except ProofError as e:
                    raise IntegrityError(Code.FORK, f"the ledger's tree of {size} entries does not extend the tree "
                                                    f"of {seen_size} this gate has verified ({e.detail}): it "
                                                    "forked") from e
            if held is None:
                db.execute("INSERT INTO gate_ledger_trees (origin, size, root, seen_at) VALUES (?, ?, ?, ?)",
                           (origin, size, root, now))
            elif size > held[0]:
                db.execute("UPDATE gate_ledger_trees SET size = ?, root = ?, seen_at = ? WHERE origin = ?",
                           (size, root, now, origin))
            db.executemany(
                "INSERT OR IGNORE INTO gate_withdrawals (release_sha256, seq, contribution_id, leaf_hash, time, "
                "seen_at) VALUES (?, ?, ?, ?, ?, ?)",
                [(release_sha256, w.seq, w.contribution_id, w.leaf_hash, w.time, now) for w in withdrawals])
            rows = db.execute("SELECT contribution_id, seq, leaf_hash, time FROM gate_withdrawals WHERE "
                              "release_sha256 = ? ORDER BY seq", (release_sha256,)).fetchall()
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return tuple(SeenWithdrawal(contribution_id=r[0], seq=r[1], leaf_hash=bytes(r[2]), time=r[3]) for r in rows)

    def tree(self, origin: str) -> tuple[int, bytes] | None:
        """The largest tree remembered of the ledger `origin`: (size, root), or None."""
        row = self._db.execute("SELECT size, root FROM gate_ledger_trees WHERE origin = ?", (origin,)).fetchone()
        return None if row is None else (row[0], bytes(row[1]))
