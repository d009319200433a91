"""The structural half of verification, in bulk: sequence, leaf hashes, roots, checkpoint signatures.

Used by `verifier.inspect_ledger(..., integrity_only=True)` for millions of entries (no entry is
decoded), and for the tree arithmetic the full pass shares.
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Sequence

import ledger_store
from govtrain.errors import Code, IntegrityError
from govtrain.ledger.checkpoint import NoteError, verify_checkpoint
from govtrain.ledger.entries import decode_entry
from govtrain.ledger.ledger import UnauthorisedPolicy, note_keys, policy_chain
from govtrain.ledger.merkle import fold_right
from govtrain.policy.model import Policy

if TYPE_CHECKING:
    from govtrain.verify.verifier import VerificationReport


class _Failure(IntegrityError):
    def __init__(self, code: Code, detail: str, *, seq: int | None = None, checkpoint: int | None = None) -> None:
        super().__init__(code, detail)
        self.seq = seq
        self.checkpoint = checkpoint


def fork_detail(size: int, agreed: int) -> str:
    """What a trusted checkpoint that this ledger contradicts says about where the two differ."""
    where = (f"entries 0..{size - 1}" if agreed == 0 else
             f"entries {agreed}..{size - 1} (the first {agreed} agree with an earlier trusted checkpoint)")
    return (f"the first {size} entries are not the ones the trusted checkpoint signed: the ledger forked; the first "
            f"differing entry is among {where}")


def _build_levels(leaves: list[bytes]) -> list[list[bytes]]:
    levels = [leaves]
    level = leaves
    sha256 = hashlib.sha256
    while len(level) > 1:
        level = [sha256(b"\x01" + level[i] + level[i + 1]).digest() for i in range(0, len(level) - 1, 2)]
        levels.append(level)
    return levels


def _check_rows(rows: list, start: int) -> list[bytes]:
    """Sequence numbers and leaf hashes of one batch, as list comparisons; raises at the first mismatch."""
    seqs, stored, bodies = zip(*rows)
    if list(seqs) != list(range(start, start + len(rows))):
        missing = next(start + i for i, seq in enumerate(seqs) if seq != start + i)
        raise _Failure(Code.SEQUENCE_GAP, f"entry {missing} is missing", seq=missing)
    sha256 = hashlib.sha256
    computed = [leaf if body is None else sha256(b"\x00" + body).digest() for leaf, body in zip(stored, bodies)]
    if computed != list(stored):
        bad = next(start + i for i, (a, b) in enumerate(zip(computed, stored)) if a != b)
        raise _Failure(Code.LEAF_HASH_MISMATCH, f"entry {bad}: stored leaf hash does not match its body", seq=bad)
    return list(stored)


def prefix_parts(size: int) -> list[tuple[int, int]]:
    """(height, index) of the perfect subtrees whose right fold is the root of the first `size` leaves."""
    parts, start = [], 0
    for height in range(size.bit_length() - 1, -1, -1):
        if size >> height & 1:
            parts.append((height, start >> height))
            start += 1 << height
    return parts


def _extract(levels: list[list[bytes]], offset: int, wanted: Sequence[tuple[int, int]]) -> dict:
    """The wanted nodes (global coordinates) that lie in a subtree starting at leaf `offset`."""
    found = {}
    for height, index in wanted:
        local = index - (offset >> height)
        if height < len(levels) and 0 <= local < len(levels[height]) and (index << height) >= offset:
            found[(height, index)] = levels[height][local]
    return found


def _sqlite_half(path: str, start: int, stop: int, wanted: list[tuple[int, int]]) -> tuple[str, object]:
    """Worker: check entries [start, stop) of a SQLite ledger; return the wanted subtree hashes."""
    import sqlite3

    connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        leaves: list[bytes] = []
        cursor = connection.execute("SELECT seq, leaf_hash, body FROM entries WHERE seq >= ? AND seq < ? "
                                    "ORDER BY seq", (start, stop))
        while rows := cursor.fetchmany(100_000):
            leaves += _check_rows(rows, start + len(leaves))
        if len(leaves) != stop - start:
            missing = start + len(leaves)
            return "error", (Code.SEQUENCE_GAP.value, f"entry {missing} is missing", missing)
        return "ok", _extract(_build_levels(leaves), start, wanted)
    except _Failure as e:
        return "error", (e.code.value, e.detail, e.seq)
    finally:
        connection.close()


def _tree_nodes(store: ledger_store.LedgerStore, total: int, wanted: list[tuple[int, int]]) -> dict:
    """Check every leaf and return the wanted perfect-subtree hashes. A large SQLite ledger is split at
    a power of two between two processes; other ledgers are checked in this one."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from sqlalchemy.engine import make_url

    if store.backend != "sqlite" or total < 1 << 16 or (os.cpu_count() or 1) < 2:
        leaves: list[bytes] = []
        for rows in store.leaf_rows():
            leaves += _check_rows(rows, len(leaves))
        if len(leaves) != total:
            raise _Failure(Code.SEQUENCE_GAP, f"entry {len(leaves)} is missing", seq=len(leaves))
        return _extract(_build_levels(leaves), 0, wanted)
    split = 1 << (total - 1).bit_length() - 1
    path = make_url(store.url).database
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork")) as pool:
        halves = list(pool.map(_sqlite_half, [path, path], [0, split], [split, total], [wanted, wanted]))
    nodes: dict = {}
    for status, value in halves:
        if status == "error":
            code, detail, seq = value
            raise _Failure(Code(code), detail, seq=seq)
        nodes.update(value)
    return nodes


def _integrity(store: ledger_store.LedgerStore, report: VerificationReport, trusted: Sequence[str]) -> None:
    """Steps 1, 2, 6, 7, 8 in bulk (no entry is decoded)."""
    total = report.entries = store.size()
    if total == 0:
        raise _Failure(Code.BAD_LEDGER_HEADER, "the ledger is empty: entry 0 (header) is missing", seq=0)
    first = store.entry(0)
    header = decode_entry(first.body, seq=0, kind="header") if first and first.body else None
    if header is None:
        raise _Failure(Code.BAD_LEDGER_HEADER, "entry 0 is not a header", seq=0)
    try:
        policies = policy_chain(store, header)  # each change authorised by the policy before it
    except UnauthorisedPolicy as e:
        raise _Failure(e.code, e.detail, seq=e.seq) from e
    keys = {id(p): note_keys(p) for _, p in policies}

    def policy_at(size: int) -> Policy:
        return [p for seq, p in policies if seq < max(min(size, total), 1)][-1]

    # 6. Signatures first (cheap), so that the sizes whose roots must be checked are known.
    checkpoints = store.checkpoints()
    report.checkpoints = len(checkpoints)
    signed = []
    previous = 0
    for stored in checkpoints:
        if stored.size < previous:
            raise _Failure(Code.BAD_CHECKPOINT, f"checkpoint {stored.id} is smaller than the one before it",
                           checkpoint=stored.id)
        previous = stored.size
        policy = policy_at(stored.size)
        try:
            checkpoint = verify_checkpoint(stored.note, origin=policy.origin, keys=keys[id(policy)])
        except NoteError as e:
            good = signed[-1][0].size if signed else 0
            raise _Failure(Code.BAD_CHECKPOINT, f"checkpoint {stored.id}: {e.detail}", checkpoint=stored.id,
                           seq=good) from e
        signed.append((stored, checkpoint))
    trusted_checkpoints = []
    for note in trusted:
        try:
            size = int(note.split("\n")[1])
        except (IndexError, ValueError):
            size = total
        policy = policy_at(size)
        try:
            trusted_checkpoints.append(verify_checkpoint(note, origin=policy.origin, keys=keys[id(policy)]))
        except NoteError as e:
            raise _Failure(Code.FORK, f"a trusted checkpoint is not signed by a ledger key in force at its size "
                                      f"({e.detail})") from e
    sizes = {c.size for _, c in signed if c.size <= total} | {c.size for c in trusted_checkpoints if c.size <= total}
    wanted = sorted({part for size in sizes if size for part in prefix_parts(size)})

    # 1-2. Every leaf, in bulk; the subtree hashes the checkpointed roots need come back.
    nodes = _tree_nodes(store, total, wanted)

    def root(size: int) -> bytes:
        return fold_right([nodes[part] for part in prefix_parts(size)])

    # 6-7. Roots, truncation, unsigned tail.
    good = 0
    for stored, checkpoint in signed:
        if stored.size > total:
            raise _Failure(Code.TRUNCATED, f"checkpoint {stored.id} signs {stored.size} entries but the ledger "
                           f"holds {total}", seq=total, checkpoint=stored.id)
        if checkpoint.size != stored.size or root(stored.size) != checkpoint.root:
            raise _Failure(Code.BAD_CHECKPOINT, f"checkpoint {stored.id}: the root of the first {stored.size} "
                           "entries is not the signed root", checkpoint=stored.id, seq=good)
        good = stored.size
    if good < total:
        raise _Failure(Code.UNSIGNED_TAIL, f"entries {good}..{total - 1} are covered by no signed checkpoint",
                       seq=good)
    # 8. Trusted checkpoints.
    agreed = 0
    for checkpoint in sorted(trusted_checkpoints, key=lambda c: c.size):
        if checkpoint.size > total:
            raise _Failure(Code.ROLLBACK, f"a trusted checkpoint signs {checkpoint.size} entries but this ledger "
                           f"holds {total}", seq=total)
        if root(checkpoint.size) != checkpoint.root:
            raise _Failure(Code.FORK, fork_detail(checkpoint.size, agreed), seq=agreed)
        agreed = checkpoint.size
    report.trusted_checkpoints = len(trusted_checkpoints)
