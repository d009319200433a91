"""What the gate has seen of its ledger, kept so that no later reading can unsee it (seed 004: withdrawals are
authoritative for inference gates).

A reading of the ledger is only as good as the database the policy names, and whoever can write that database
can put an older copy back. So the gate remembers, per ledger origin, the largest tree it has verified (its size
and root, from a checkpoint signed by a pinned ledger key) and, per release, every withdrawal it has read. A later
reading must show a tree at least as large and consistent with the remembered one (RFC 9162 §2.1.4: the
remembered tree is a prefix of the new one), else `rollback` or `fork` (the gate answers `taint_unknown`).

A withdrawal is remembered as one of two things, by where it stood in the reading (its sequence number against
the verified tree's size):
  * signed (`gate_signed_withdrawals`): covered by the verified tree, so its body, time included, is what the
    ledger's key signed. Kept for good; another version of a signed entry at the same sequence number means the
    ledger forked, and the reading is refused (`fork`, nothing remembered).
  * a sighting (`gate_tail_sightings`): read past the verified tree, in an unsigned tail. An honest ledger signs
    every state it writes, so a tail is deleted checkpoints or entries forged by a database writer without keys;
    the sighting counts as a withdrawal all the same (it cannot hide by deleting the checkpoints that sign it), but
    its body is nobody's statement. Each version seen at a sequence number is kept, with when it was first seen,
    until the verified tree covers that sequence number: then the signed entry there decides, `signed` (the same
    leaf: it becomes a signed withdrawal) or `refuted` (another entry: it was not the ledger's, and taints no
    more). A sighting that is no longer in the tail, or that another version at its sequence number contradicts,
    before the tree covers it is unresolved: the reading is refused (`unsigned_tail`, so `taint_unknown`) until a
    signed tree settles it; what was read is remembered all the same.
A withdrawal's time, from which a grace period counts, is never later than when this store first saw it (a
sighting's, or a signed entry's whose leaf was first a sighting): a time the ledger's signature does not cover
can only shorten the grace period, and a forged entry timed in 2100 does not stretch it.

The memory lives in the gate's SQLite store (the sessions file of inference.toml), so a restart remembers too;
triggers refuse an UPDATE that shrinks or changes a tree at one size, any change to a signed withdrawal, any change
to a sighting but its one resolution, and every DELETE. What it cannot catch: a ledger that was stale before this
store first saw it (nothing remembered yet to compare with).
"""

from __future__ import annotations

import logging
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from govtrain.errors import Code, IntegrityError

log = logging.getLogger("govtrain.serve")

SCHEMA = """
CREATE TABLE IF NOT EXISTS gate_ledger_trees (
    origin TEXT PRIMARY KEY,
    size INTEGER NOT NULL CHECK (size > 0),
    root BLOB NOT NULL CHECK (length(root) = 32),
    seen_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS gate_signed_withdrawals (
    release_sha256 BLOB NOT NULL,
    seq INTEGER NOT NULL,
    contribution_id TEXT NOT NULL,
    leaf_hash BLOB NOT NULL,
    time INTEGER NOT NULL,
    first_seen INTEGER NOT NULL,
    PRIMARY KEY (release_sha256, seq)
);
CREATE TABLE IF NOT EXISTS gate_tail_sightings (
    release_sha256 BLOB NOT NULL,
    seq INTEGER NOT NULL,
    leaf_hash BLOB NOT NULL,
    contribution_id TEXT NOT NULL,
    time INTEGER NOT NULL,
    seen_at INTEGER NOT NULL,
    resolved TEXT CHECK (resolved IS NULL OR resolved IN ('signed', 'refuted')),
    resolved_at INTEGER,
    PRIMARY KEY (release_sha256, seq, leaf_hash)
);
CREATE TRIGGER IF NOT EXISTS gate_ledger_trees_grow BEFORE UPDATE ON gate_ledger_trees
    WHEN NEW.size < OLD.size OR (NEW.size = OLD.size AND NEW.root IS NOT OLD.root) OR NEW.origin IS NOT OLD.origin
    BEGIN SELECT RAISE(ABORT, 'a remembered ledger tree only grows'); END;
CREATE TRIGGER IF NOT EXISTS gate_ledger_trees_no_delete BEFORE DELETE ON gate_ledger_trees
    BEGIN SELECT RAISE(ABORT, 'a remembered ledger tree is never forgotten'); END;
CREATE TRIGGER IF NOT EXISTS gate_signed_withdrawals_no_update BEFORE UPDATE ON gate_signed_withdrawals
    BEGIN SELECT RAISE(ABORT, 'a signed withdrawal seen is never changed'); END;
CREATE TRIGGER IF NOT EXISTS gate_signed_withdrawals_no_delete BEFORE DELETE ON gate_signed_withdrawals
    BEGIN SELECT RAISE(ABORT, 'a signed withdrawal seen is never forgotten'); END;
CREATE TRIGGER IF NOT EXISTS gate_tail_sightings_resolve_once BEFORE UPDATE ON gate_tail_sightings
    WHEN OLD.resolved IS NOT NULL OR NEW.resolved IS NULL OR NEW.resolved_at IS NULL
        OR NEW.release_sha256 IS NOT OLD.release_sha256 OR NEW.seq IS NOT OLD.seq
        OR NEW.leaf_hash IS NOT OLD.leaf_hash OR NEW.contribution_id IS NOT OLD.contribution_id
        OR NEW.time IS NOT OLD.time OR NEW.seen_at IS NOT OLD.seen_at
    BEGIN SELECT RAISE(ABORT, 'a sighting is only ever resolved, once'); END;
CREATE TRIGGER IF NOT EXISTS gate_tail_sightings_no_delete BEFORE DELETE ON gate_tail_sightings
    BEGIN SELECT RAISE(ABORT, 'a sighting is never forgotten'); END;
"""

# A store written before sightings were told from signed withdrawals kept one table of both; its rows are taken
# as sightings (the conservative reading), which the next reading resolves against the signed tree.
MIGRATE = """
INSERT OR IGNORE INTO gate_tail_sightings (release_sha256, seq, leaf_hash, contribution_id, time, seen_at)
    SELECT release_sha256, seq, leaf_hash, contribution_id, time, seen_at FROM gate_withdrawals;
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class SeenWithdrawal:
    """A withdraw entry of a contribution a release trained on: its sequence number, leaf hash and ledger time (as
    `LedgerMemory.advance` returns it: never later than when the memory first saw it)."""

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
        old = self._db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'gate_withdrawals'"
                               ).fetchone()
        self._db.executescript(f"BEGIN IMMEDIATE;\n{SCHEMA}\n{MIGRATE if old else ''}\nCOMMIT;")

    def close(self) -> None:
        self._db.close()

    def advance(self, *, origin: str, size: int, root: bytes, consistency: Callable[[int], Sequence[bytes]],
                release_sha256: bytes, withdrawals: Sequence[SeenWithdrawal], now: int) -> tuple[SeenWithdrawal, ...]:
        """Take a verified reading: the ledger `origin`'s tree of `size` entries with `root` (a checkpoint signed by
        a pinned key), `consistency(old_size)` giving the proof that the tree of `old_size` entries is its prefix,
        and the withdrawals of what the release `release_sha256` trained on read from it (those at or past `size`
        from its unsigned tail). Refuses (nothing remembered) a tree smaller than (`rollback`), or not an extension
        of (`fork`), the largest one remembered, and a signed withdrawal other than the one remembered at its
        sequence number (`fork`). Else remembers the larger tree and the withdrawals, resolves the sightings the
        tree now covers, and returns every withdrawal signed or still sighted, by sequence number; or, with all
        that remembered, refuses a sighting the reading neither shows nor settles (`unsigned_tail`)."""
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
            self._sign(release_sha256, [w for w in withdrawals if w.seq < size], now)
            self._resolve(release_sha256, size, now)
            db.executemany(
                "INSERT OR IGNORE INTO gate_tail_sightings (release_sha256, seq, leaf_hash, contribution_id, time, "
                "seen_at) VALUES (?, ?, ?, ?, ?, ?)",
                [(release_sha256, w.seq, w.leaf_hash, w.contribution_id, w.time, now)
                 for w in withdrawals if w.seq >= size])
            signed = db.execute("SELECT contribution_id, seq, leaf_hash, min(time, first_seen) FROM "
                                "gate_signed_withdrawals WHERE release_sha256 = ?", (release_sha256,)).fetchall()
            sighted = db.execute("SELECT contribution_id, seq, leaf_hash, min(time, seen_at) FROM "
                                 "gate_tail_sightings WHERE release_sha256 = ? AND resolved IS NULL",
                                 (release_sha256,)).fetchall()
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        tail = {(w.seq, w.leaf_hash) for w in withdrawals if w.seq >= size}
        unsettled = sorted({r[1] for r in sighted if (r[1], bytes(r[2])) not in tail})
        if unsettled:
            raise IntegrityError(Code.UNSIGNED_TAIL, (
                f"withdraw entr{'y' if len(unsettled) == 1 else 'ies'} {', '.join(map(str, unsettled))} this gate "
                f"read past the ledger's signed tree (of {size} entries) {'is' if len(unsettled) == 1 else 'are'} "
                "no longer there as read, and no signed checkpoint covers that sequence number yet: the ledger's "
                "database was edited; until a checkpoint signs past it, whether the release is tainted is not "
                "known; run govtrain-verify"))
        rows = sorted((*signed, *sighted), key=lambda r: (r[1], bytes(r[2])))
        return tuple(SeenWithdrawal(contribution_id=r[0], seq=r[1], leaf_hash=bytes(r[2]), time=r[3]) for r in rows)

    def _sign(self, release_sha256: bytes, signed: Sequence[SeenWithdrawal], now: int) -> None:
        """Remember the withdrawals the verified tree covers; another version of one remembered is a fork."""
        db = self._db
        for w in signed:
            held = db.execute("SELECT leaf_hash FROM gate_signed_withdrawals WHERE release_sha256 = ? AND seq = ?",
                              (release_sha256, w.seq)).fetchone()
            if held is not None:
                if bytes(held[0]) != w.leaf_hash:
                    log.error("the ledger signs two versions of withdraw entry %d", w.seq)
                    raise IntegrityError(Code.FORK, f"the signed withdraw entry {w.seq} read now is not the one this "
                                                    "gate read before under a signed checkpoint: the ledger forked; "
                                                    "run govtrain-verify")
                continue
            first = db.execute("SELECT min(seen_at) FROM gate_tail_sightings WHERE release_sha256 = ? AND seq = ? "
                               "AND leaf_hash = ?", (release_sha256, w.seq, w.leaf_hash)).fetchone()[0]
            db.execute("INSERT INTO gate_signed_withdrawals (release_sha256, seq, contribution_id, leaf_hash, time, "
                       "first_seen) VALUES (?, ?, ?, ?, ?, ?)",
                       (release_sha256, w.seq, w.contribution_id, w.leaf_hash, w.time,
                        now if first is None else min(first, now)))

    def _resolve(self, release_sha256: bytes, size: int, now: int) -> None:
        """Settle each open sighting the verified tree of `size` entries covers, by the signed entry there."""
        db = self._db
        for seq, leaf in db.execute("SELECT seq, leaf_hash FROM gate_tail_sightings WHERE release_sha256 = ? AND "
                                    "resolved IS NULL AND seq < ?", (release_sha256, size)).fetchall():
            held = db.execute("SELECT leaf_hash FROM gate_signed_withdrawals WHERE release_sha256 = ? AND seq = ?",
                              (release_sha256, seq)).fetchone()
            verdict = "signed" if held is not None and bytes(held[0]) == bytes(leaf) else "refuted"
            if verdict == "refuted":
                log.warning("withdraw entry %d read past the signed tree is not the entry the ledger signed there: "
                            "the ledger's database was edited; run govtrain-verify", seq)
            db.execute("UPDATE gate_tail_sightings SET resolved = ?, resolved_at = ? WHERE release_sha256 = ? AND "
                       "seq = ? AND leaf_hash = ?", (verdict, now, release_sha256, seq, leaf))

    def tree(self, origin: str) -> tuple[int, bytes] | None:
        """The largest tree remembered of the ledger `origin`: (size, root), or None."""
        row = self._db.execute("SELECT size, root FROM gate_ledger_trees WHERE origin = ?", (origin,)).fetchone()
        return None if row is None else (row[0], bytes(row[1]))
