"""What the gate has seen of its ledger, kept so that no later reading can unsee it (seed 004: withdrawals are
authoritative for inference gates).

A reading of the ledger is only as good as the database the policy names, and whoever can write that database
can put an older copy back. So the gate remembers, per ledger origin, the largest tree it has verified (its size
and root, from a checkpoint signed by a pinned ledger key) and every withdrawal it has read. A later reading must
show a tree at least as large and consistent with the remembered one (RFC 9162 §2.1.4: the remembered tree is a
prefix of the new one), else `rollback` or `fork` (the gate answers `taint_unknown`).

A withdrawal is remembered as one of two things, by where it stood in the reading (its sequence number against
the verified tree's size):
  * signed (`gate_signed_withdrawals`): covered by the verified tree, so its body, time included, is what the
    ledger's key signed. Kept for good; another version of a signed entry at the same sequence number means the
    ledger forked (or this store was edited), and the reading is refused (`fork`, nothing remembered).
  * a sighting (`gate_tail_sightings`): read past the verified tree, in an unsigned tail. An honest ledger signs
    every state it writes, so a tail is deleted checkpoints or entries forged by a database writer without keys;
    the sighting counts as a withdrawal all the same (it cannot hide by deleting the checkpoints that sign it), but
    its body is nobody's statement. With it the store keeps a commitment to the tail it was read on (the leaf
    hashes from the verified tree's size up to the sighting, and their SHA-256). Every reading settles it again,
    from that commitment and the verified tree alone: `refuted` as soon as a signed entry at or before its
    sequence number is not the one its tail had there (that tail was not the ledger's: the first signed entry
    that differs refutes everything read after it); `signed` once the tree covers it as read; else open, and
    counted while the reading shows it. An open sighting the reading no longer shows is unresolved: the reading
    is refused (`unsigned_tail`, so `taint_unknown`) until a signed tree settles it; what was read is remembered
    all the same. The `resolved` column records the verdict for the operator; it is never read back as one.
A withdrawal's time, from which a grace period counts, is the earliest of the time its signed body states (read
again at every reading) and when this store first saw that entry (`gate_first_seen`: by ledger origin, sequence
number and leaf, whatever release it was read for, so that signing the same adapter again starts no new grace
period); a sighting's stated time is nobody's statement, and counts only where it is earlier. So a forged entry
timed in 2100, or a future-dated signed one, does not stretch a grace period.

The memory lives in the gate's SQLite store (the sessions file of inference.toml), so a restart remembers too;
triggers refuse an UPDATE that shrinks or changes a tree at one size, any change to a signed withdrawal, any change
to a sighting but the record of its resolution, a first sighting made later, and every DELETE. A row the gate did
not write (one INSERTed by whoever can write the gate's state folder) can only make the gate stricter: its times
count only where earlier, its resolution is never read, and a sighting's verdict comes from its commitment, so it
can open a refusal or shorten a grace period, never serve what the ledger taints. What it cannot catch: a ledger
that was stale before this store first saw it (nothing remembered yet to compare with), and a store whose rows
were deleted (its triggers dropped first): that is a store without its memory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from govtrain.errors import Code, ConfigError, IntegrityError

log = logging.getLogger("govtrain.serve")

SIGHTINGS = """
CREATE TABLE IF NOT EXISTS gate_tail_sightings (
    release_sha256 BLOB NOT NULL,
    seq INTEGER NOT NULL,
    leaf_hash BLOB NOT NULL,
    contribution_id TEXT NOT NULL,
    time INTEGER NOT NULL,
    seen_at INTEGER NOT NULL,
    resolved TEXT CHECK (resolved IS NULL OR resolved IN ('signed', 'refuted')),
    resolved_at INTEGER,
    tail_from INTEGER,
    tail BLOB,
    tail_sha256 BLOB NOT NULL DEFAULT x'',
    PRIMARY KEY (release_sha256, seq, leaf_hash, tail_sha256)
);
CREATE TRIGGER IF NOT EXISTS gate_tail_sightings_resolve_once BEFORE UPDATE ON gate_tail_sightings
    WHEN OLD.resolved IS NOT NULL OR NEW.resolved IS NULL OR NEW.resolved_at IS NULL
        OR NEW.release_sha256 IS NOT OLD.release_sha256 OR NEW.seq IS NOT OLD.seq
        OR NEW.leaf_hash IS NOT OLD.leaf_hash OR NEW.contribution_id IS NOT OLD.contribution_id
        OR NEW.time IS NOT OLD.time OR NEW.seen_at IS NOT OLD.seen_at OR NEW.tail_from IS NOT OLD.tail_from
        OR NEW.tail IS NOT OLD.tail OR NEW.tail_sha256 IS NOT OLD.tail_sha256
    BEGIN SELECT RAISE(ABORT, 'a sighting is only ever resolved, once'); END;
CREATE TRIGGER IF NOT EXISTS gate_tail_sightings_no_delete BEFORE DELETE ON gate_tail_sightings
    BEGIN SELECT RAISE(ABORT, 'a sighting is never forgotten'); END;
"""

SCHEMA = f"""
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
CREATE TABLE IF NOT EXISTS gate_first_seen (
    origin TEXT NOT NULL,
    seq INTEGER NOT NULL,
    leaf_hash BLOB NOT NULL,
    first_seen INTEGER NOT NULL,
    PRIMARY KEY (origin, seq, leaf_hash)
);
{SIGHTINGS}
CREATE TRIGGER IF NOT EXISTS gate_ledger_trees_grow BEFORE UPDATE ON gate_ledger_trees
    WHEN NEW.size < OLD.size OR (NEW.size = OLD.size AND NEW.root IS NOT OLD.root) OR NEW.origin IS NOT OLD.origin
    BEGIN SELECT RAISE(ABORT, 'a remembered ledger tree only grows'); END;
CREATE TRIGGER IF NOT EXISTS gate_ledger_trees_no_delete BEFORE DELETE ON gate_ledger_trees
    BEGIN SELECT RAISE(ABORT, 'a remembered ledger tree is never forgotten'); END;
CREATE TRIGGER IF NOT EXISTS gate_signed_withdrawals_no_update BEFORE UPDATE ON gate_signed_withdrawals
    BEGIN SELECT RAISE(ABORT, 'a signed withdrawal seen is never changed'); END;
CREATE TRIGGER IF NOT EXISTS gate_signed_withdrawals_no_delete BEFORE DELETE ON gate_signed_withdrawals
    BEGIN SELECT RAISE(ABORT, 'a signed withdrawal seen is never forgotten'); END;
CREATE TRIGGER IF NOT EXISTS gate_first_seen_earlier BEFORE UPDATE ON gate_first_seen
    WHEN NEW.first_seen >= OLD.first_seen OR NEW.origin IS NOT OLD.origin OR NEW.seq IS NOT OLD.seq
        OR NEW.leaf_hash IS NOT OLD.leaf_hash
    BEGIN SELECT RAISE(ABORT, 'a first sighting is only ever made earlier'); END;
CREATE TRIGGER IF NOT EXISTS gate_first_seen_no_delete BEFORE DELETE ON gate_first_seen
    BEGIN SELECT RAISE(ABORT, 'a first sighting is never forgotten'); END;
"""

# Each table's columns, in order: a store whose tables have another shape is not one this version reads.
COLUMNS = {
    "gate_ledger_trees": ("origin", "size", "root", "seen_at"),
    "gate_signed_withdrawals": ("release_sha256", "seq", "contribution_id", "leaf_hash", "time", "first_seen"),
    "gate_first_seen": ("origin", "seq", "leaf_hash", "first_seen"),
    "gate_tail_sightings": ("release_sha256", "seq", "leaf_hash", "contribution_id", "time", "seen_at", "resolved",
                            "resolved_at", "tail_from", "tail", "tail_sha256"),
}
# Earlier layouts, migrated on opening. The first kept one table of signed and tail withdrawals alike; its rows are
# taken as sightings (the conservative reading). The second kept sightings without the tail they were read on; its
# rows keep a commitment to their own entry only, which settles them no sooner than before.
OLD_WITHDRAWALS = ("release_sha256", "seq", "contribution_id", "leaf_hash", "time", "seen_at")
OLD_SIGHTINGS = COLUMNS["gate_tail_sightings"][:8]
MIGRATE_WITHDRAWALS = """
INSERT OR IGNORE INTO gate_tail_sightings (release_sha256, seq, leaf_hash, contribution_id, time, seen_at)
    SELECT release_sha256, seq, leaf_hash, contribution_id, time, seen_at FROM gate_withdrawals;
"""
MIGRATE_SIGHTINGS = f"""
DROP TRIGGER IF EXISTS gate_tail_sightings_resolve_once;
DROP TRIGGER IF EXISTS gate_tail_sightings_no_delete;
ALTER TABLE gate_tail_sightings RENAME TO gate_tail_sightings_before;
{SIGHTINGS}
INSERT INTO gate_tail_sightings ({', '.join(OLD_SIGHTINGS)}) SELECT {', '.join(OLD_SIGHTINGS)}
    FROM gate_tail_sightings_before;
DROP TABLE gate_tail_sightings_before;
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class SeenWithdrawal:
    """A withdraw entry of a contribution a release trained on: its sequence number, leaf hash and ledger time (as
    `LedgerMemory.advance` returns it: never later than when the memory first saw it)."""

    contribution_id: str
    seq: int
    leaf_hash: bytes
    time: int


def tail_commitment(start: int, leaves: Sequence[bytes]) -> bytes:
    """SHA-256 of a tail read from sequence number `start`: its start and its leaf hashes, in order."""
    return hashlib.sha256(start.to_bytes(8, "big") + b"".join(leaves)).digest()


class LedgerMemory:
    """The largest verified tree per ledger origin and the withdrawals seen per release, in the SQLite file `path`
    (None: in this process only). One caller at a time per instance (the gate's `TaintWatch` holds a lock);
    processes sharing the file serialise on SQLite's write lock. A file whose memory tables have another shape, or
    that is no SQLite database, is refused (`bad_argument`), and nothing is left open."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, busy_timeout_s: float = 60.0) -> None:
        if path is not None and not Path(path).exists():
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))  # beside the sessions: no one else reads it
        # check_same_thread off: readings run on the server's worker threads, one at a time
        self._db = sqlite3.connect(":memory:" if path is None else path, timeout=busy_timeout_s,
                                   isolation_level=None, check_same_thread=False)
        try:
            self._db.execute("PRAGMA synchronous = FULL")
            self._db.executescript(f"BEGIN IMMEDIATE;\n{self._schema(path)}\nCOMMIT;")
        except sqlite3.DatabaseError as e:
            self._db.close()
            raise ConfigError(Code.BAD_ARGUMENT, f"{path}: not a gate store this govtrain reads ({e})") from None
        except BaseException:
            self._db.close()
            raise

    def _schema(self, path: object) -> str:
        """The script that brings the store to this layout: its tables' shapes checked, earlier layouts migrated."""
        db = self._db
        shapes = {name: tuple(row[1] for row in db.execute(f"PRAGMA table_info({name})"))
                  for name in (*COLUMNS, "gate_withdrawals")}
        expected = {**COLUMNS, "gate_withdrawals": OLD_WITHDRAWALS}
        old_sightings = shapes["gate_tail_sightings"] == OLD_SIGHTINGS
        for name, columns in shapes.items():
            if columns and columns != expected[name] and not (name == "gate_tail_sightings" and old_sightings):
                raise ConfigError(Code.BAD_ARGUMENT, (
                    f"{path}: its table {name} has the columns {', '.join(columns)}, not those of a gate store this "
                    "govtrain reads; give the inference policy's sessions a store of this gate's own"))
        return "\n".join([MIGRATE_SIGHTINGS if old_sightings else "", SCHEMA,
                          MIGRATE_WITHDRAWALS if shapes["gate_withdrawals"] else ""])

    def close(self) -> None:
        self._db.close()

    def advance(self, *, origin: str, size: int, root: bytes, consistency: Callable[[int], Sequence[bytes]],
                release_sha256: bytes, withdrawals: Sequence[SeenWithdrawal], now: int,
                leaves: Sequence[bytes] | None = None) -> tuple[SeenWithdrawal, ...]:
        """Take a verified reading: the ledger `origin`'s tree of `size` entries with `root` (a checkpoint signed by
        a pinned key), `consistency(old_size)` giving the proof that the tree of `old_size` entries is its prefix,
        `leaves` the leaf hashes of every entry read (the first `size` fold into `root`; the rest are the unsigned
        tail, each checked against its body; None: only the withdrawals' own leaves are known, so a sighting commits
        to its own entry alone and is settled no sooner than by the signed entry at its sequence number), and the
        withdrawals of what the release `release_sha256` trained on read from them (those at or past `size` from
        the tail). Refuses (nothing remembered) a tree smaller than
        (`rollback`), or not an extension of (`fork`), the largest one remembered, and a signed withdrawal other than
        the one remembered at its sequence number (`fork`). Else remembers the larger tree and the withdrawals,
        settles every sighting against the tree, and returns every withdrawal signed or still sighted, by sequence
        number; or, with all that remembered, refuses a sighting the reading neither shows nor settles
        (`unsigned_tail`)."""
        from govtrain.ledger.merkle import ProofError, verify_consistency

        if leaves is not None and (len(leaves) < size or any(w.seq >= len(leaves) or leaves[w.seq] != w.leaf_hash
                                                             for w in withdrawals if w.seq >= size)):
            raise TypeError("advance: every withdrawal read past the signed tree must be among the leaves read")
        read = _Leaves(leaves, withdrawals)
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
            db.executemany("INSERT INTO gate_first_seen (origin, seq, leaf_hash, first_seen) VALUES (?, ?, ?, ?) "
                           "ON CONFLICT DO UPDATE SET first_seen = excluded.first_seen "
                           "WHERE excluded.first_seen < first_seen",
                           [(origin, w.seq, w.leaf_hash, now) for w in withdrawals])
            self._sign(release_sha256, [w for w in withdrawals if w.seq < size], now)
            tail = [w for w in withdrawals if w.seq >= size]
            unsettled = self._settle(release_sha256, size, read, tail, now)
            times = self._first_seen(origin, release_sha256)
            signed = db.execute("SELECT contribution_id, seq, leaf_hash, min(time, first_seen) FROM "
                                "gate_signed_withdrawals WHERE release_sha256 = ?", (release_sha256,)).fetchall()
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        if unsettled:
            raise IntegrityError(Code.UNSIGNED_TAIL, (
                f"withdraw entr{'y' if len(unsettled) == 1 else 'ies'} {', '.join(map(str, unsettled))} this gate "
                f"read past the ledger's signed tree (of {size} entries) {'is' if len(unsettled) == 1 else 'are'} "
                "no longer there as read, and no signed entry refutes the tail it was read on yet: the ledger's "
                "database was edited; until a checkpoint signs past it, whether the release is tainted is not "
                "known; run govtrain-verify"))
        found: dict[tuple[int, bytes], SeenWithdrawal] = {}
        # signed: the time its body states now (its row's only where earlier); sighted: the time it states only
        # where earlier than when this store first saw it
        for cid, seq, leaf, time in [*((w.contribution_id, w.seq, w.leaf_hash, w.time) for w in withdrawals),
                                     *((r[0], r[1], bytes(r[2]), r[3]) for r in signed)]:
            held_w = found.get((seq, leaf))
            time = min(time, times.get((seq, leaf), time), *(() if held_w is None else (held_w.time,)))
            found[(seq, leaf)] = SeenWithdrawal(contribution_id=cid, seq=seq, leaf_hash=leaf, time=time)
        return tuple(found[k] for k in sorted(found))

    def _first_seen(self, origin: str, release_sha256: bytes) -> dict[tuple[int, bytes], int]:
        """When this store first saw each withdraw entry of the ledger `origin` (any release), or this release's
        rows say it did (a store written before first sightings were kept by entry): the earliest of them."""
        times: dict[tuple[int, bytes], int] = {}
        for seq, leaf, time in [
                *self._db.execute("SELECT seq, leaf_hash, first_seen FROM gate_first_seen WHERE origin = ?",
                                  (origin,)),
                *self._db.execute("SELECT seq, leaf_hash, first_seen FROM gate_signed_withdrawals WHERE "
                                  "release_sha256 = ?", (release_sha256,)),
                *self._db.execute("SELECT seq, leaf_hash, seen_at FROM gate_tail_sightings WHERE release_sha256 = ?",
                                  (release_sha256,))]:
            key = (seq, bytes(leaf))
            times[key] = min(time, times.get(key, time))
        return times

    def _sign(self, release_sha256: bytes, signed: Sequence[SeenWithdrawal], now: int) -> None:
        """Remember the withdrawals the verified tree covers; another version of one remembered is a fork."""
        db = self._db
        for w in signed:
            held = db.execute("SELECT leaf_hash FROM gate_signed_withdrawals WHERE release_sha256 = ? AND seq = ?",
                              (release_sha256, w.seq)).fetchone()
            if held is not None:
                if bytes(held[0]) != w.leaf_hash:
                    log.error("the ledger signs another version of withdraw entry %d than this gate's store holds",
                              w.seq)
                    raise IntegrityError(Code.FORK, f"the signed withdraw entry {w.seq} read now is not the one this "
                                                    "gate's store holds as read before under a signed checkpoint: "
                                                    "the ledger forked, or the store was edited; run govtrain-verify")
                continue
            db.execute("INSERT INTO gate_signed_withdrawals (release_sha256, seq, contribution_id, leaf_hash, time, "
                       "first_seen) VALUES (?, ?, ?, ?, ?, ?)",
                       (release_sha256, w.seq, w.contribution_id, w.leaf_hash, w.time, now))

    def _settle(self, release_sha256: bytes, size: int, leaves: "_Leaves", tail: Sequence[SeenWithdrawal],
                now: int) -> list[int]:
        """Remember each withdrawal of `tail` with the tail it was read on (unless a sighting already commits to
        the same), settle every sighting of the release against the verified tree of `size` entries (module
        docstring), record each new verdict, and return the sequence numbers of those open and not shown."""
        db = self._db
        rows = db.execute("SELECT seq, leaf_hash, tail_from, tail, tail_sha256, resolved, contribution_id, time, "
                          "seen_at FROM gate_tail_sightings WHERE release_sha256 = ?", (release_sha256,)).fetchall()
        read = {(w.seq, w.leaf_hash): w for w in tail}
        committed: set[tuple[int, bytes]] = set()
        unsettled = set()
        for seq, leaf, start, chunks, digest, resolved, *_ in rows:
            leaf = bytes(leaf)
            committed_to = _committed(seq, leaf, start, chunks, digest)
            verdict = None
            for at, expected in enumerate(committed_to, start=seq + 1 - len(committed_to)):
                if at >= size:
                    break
                if leaves[at] != expected:
                    verdict = "refuted"
                    break
            else:
                verdict = "signed" if seq < size else None
            if verdict is None:  # open: counted while the reading shows it; committing to what is read now, too
                if leaves[seq] == leaf:
                    start_at = seq + 1 - len(committed_to)  # a commitment from the signed size on, as read now
                    if start_at <= size and leaves.span(size, seq + 1) == committed_to[size - start_at:]:
                        committed.add((seq, leaf))
                else:
                    unsettled.add(seq)
            elif resolved is None:
                if verdict == "refuted":
                    log.warning("withdraw entry %d read past the signed tree was read on a tail the ledger did not "
                                "sign: the ledger's database was edited; run govtrain-verify", seq)
                db.execute("UPDATE gate_tail_sightings SET resolved = ?, resolved_at = ? WHERE release_sha256 = ? "
                           "AND seq = ? AND leaf_hash = ? AND tail_sha256 = ?",
                           (verdict, now, release_sha256, seq, leaf, digest))
            if resolved is not None and resolved != verdict:
                log.warning("this gate's store records the sighting of withdraw entry %d as %s, which the signed tree "
                            "does not bear out (%s): the store was edited; the tree decides", seq, resolved,
                            verdict or "open")
        for (seq, leaf), w in read.items():
            if (seq, leaf) in committed:
                continue
            start = size if leaves.complete else seq
            chunk = leaves.span(start, seq + 1)
            db.execute("INSERT OR IGNORE INTO gate_tail_sightings (release_sha256, seq, leaf_hash, contribution_id, "
                       "time, seen_at, tail_from, tail, tail_sha256) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       (release_sha256, seq, leaf, w.contribution_id, w.time, now, start, b"".join(chunk),
                        tail_commitment(start, chunk)))
        return sorted(unsettled)

    def tree(self, origin: str) -> tuple[int, bytes] | None:
        """The largest tree remembered of the ledger `origin`: (size, root), or None."""
        row = self._db.execute("SELECT size, root FROM gate_ledger_trees WHERE origin = ?", (origin,)).fetchone()
        return None if row is None else (row[0], bytes(row[1]))


def _committed(seq: int, leaf: bytes, start: int | None, chunks: bytes | None, digest: bytes | None) -> list[bytes]:
    """The leaf hashes a sighting's row commits to, ending with its own: those of the tail it was read on where the
    row's commitment holds together (they end with its leaf and hash to its digest), else its own leaf alone (a row
    of an earlier layout, or one this gate did not write: settled no sooner than by its own entry)."""
    if start is not None and chunks is not None and digest is not None and 0 <= start <= seq \
            and len(chunks) == 32 * (seq - start + 1) and bytes(chunks[-32:]) == leaf:
        found = [bytes(chunks[i:i + 32]) for i in range(0, len(chunks), 32)]
        if tail_commitment(start, found) == bytes(digest):
            return found
    return [leaf]


class _Leaves:
    """The leaves of a reading by sequence number: None past its last entry, and, where only its withdrawals'
    leaves are known (`advance(leaves=None)`, not `complete`), at every other sequence number (equal to none)."""

    def __init__(self, leaves: Sequence[bytes] | None, withdrawals: Sequence[SeenWithdrawal]) -> None:
        self.complete = leaves is not None
        self._leaves = leaves if leaves is not None else ()
        self._known = {w.seq: w.leaf_hash for w in withdrawals}

    def __getitem__(self, seq: int) -> bytes | None:
        if self.complete:
            return self._leaves[seq] if 0 <= seq < len(self._leaves) else None
        return self._known.get(seq)

    def span(self, start: int, stop: int) -> list[bytes | None]:
        return [self[i] for i in range(start, stop)]
