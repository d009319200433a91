"""The structural half of verification, in bulk: sequence, leaf hashes, roots, checkpoint signatures.

Used by `verifier.inspect_ledger(..., integrity_only=True)` for millions of entries (no entry is
decoded), and for the tree arithmetic the full pass shares.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Sequence

import ledger_store
from govtrain.errors import Code, IntegrityError
from govtrain.ledger.checkpoint import NoteError, verify_checkpoint
from govtrain.ledger.entries import decode_entry
from govtrain.ledger.ledger import note_keys
from govtrain.ledger.merkle import node_hash
from govtrain.policy.model import Policy

if TYPE_CHECKING:
    from govtrain.verify.verifier import VerificationReport


class _Failure(IntegrityError):
    def __init__(self, code: Code, detail: str, *, seq: int | None = None, checkpoint: int | None = None) -> None:
        super().__init__(code, detail)
        self.seq = seq
        self.checkpoint = checkpoint


class _CompactRange:
    """Roots of every prefix of a log, one leaf at a time: a stack of perfect subtrees (RFC 9162)."""

    def __init__(self) -> None:
        self.stack: list[bytes] = []
        self.size = 0

    def append(self, leaf: bytes) -> None:
        self.stack.append(leaf)
        self.size += 1
        for _ in range((self.size & -self.size).bit_length() - 1):
            right = self.stack.pop()
            self.stack[-1] = node_hash(self.stack[-1], right)

    def root(self) -> bytes:
        if not self.stack:
            return hashlib.sha256(b"").digest()
        root = self.stack[-1]
        for left in reversed(self.stack[:-1]):
            root = node_hash(left, root)
        return root


class _Levels:
    """Every level of the tree over all leaves, built in bulk; roots of any prefix in O(log n)."""

    def __init__(self, leaves: list[bytes]) -> None:
        self.levels = [leaves]
        level = leaves
        sha256 = hashlib.sha256
        while len(level) > 1:
            level = [sha256(b"\x01" + level[i] + level[i + 1]).digest() for i in range(0, len(level) - 1, 2)]
            self.levels.append(level)

    def root(self, size: int) -> bytes:
        if size == 0:
            return hashlib.sha256(b"").digest()
        # The perfect subtrees of a prefix are given by the bits of its size, largest first (RFC 9162 split).
        parts, start = [], 0
        for height in range(size.bit_length() - 1, -1, -1):
            if size >> height & 1:
                parts.append(self.levels[height][start >> height])
                start += 1 << height
        root = parts[-1]
        for left in reversed(parts[:-1]):
            root = node_hash(left, root)
        return root


def _integrity(store: ledger_store.LedgerStore, report: VerificationReport, trusted: Sequence[str]) -> None:
    """Steps 1, 2, 6, 7, 8 in bulk (no entry is decoded)."""
    leaves: list[bytes] = []
    sha256 = hashlib.sha256
    for seq, leaf, body in store.leaf_rows():
        if seq != len(leaves):
            raise _Failure(Code.SEQUENCE_GAP, f"entry {len(leaves)} is missing (next stored is {seq})", seq=len(leaves))
        if body is not None and sha256(b"\x00" + body).digest() != leaf:
            raise _Failure(Code.LEAF_HASH_MISMATCH, f"entry {seq}: stored leaf hash does not match its body", seq=seq)
        leaves.append(leaf)
    total = report.entries = len(leaves)
    if total == 0:
        raise _Failure(Code.BAD_LEDGER_HEADER, "the ledger is empty: entry 0 (header) is missing", seq=0)
    first = store.entry(0)
    header = decode_entry(first.body, seq=0, kind="header") if first and first.body else None
    if header is None:
        raise _Failure(Code.BAD_LEDGER_HEADER, "entry 0 is not a header", seq=0)
    policies = [(0, Policy.from_record(header["policy"]))]
    for stored in store.entries(kinds=("policy",)):
        if stored.body is not None:
            policies.append((stored.seq, Policy.from_record(decode_entry(stored.body, seq=stored.seq,
                                                                         kind="policy")["policy"])))
    levels = _Levels(leaves)
    checkpoints = store.checkpoints()
    report.checkpoints = len(checkpoints)
    good = 0
    previous = 0
    for stored in checkpoints:
        if stored.size < previous:
            raise _Failure(Code.BAD_CHECKPOINT, f"checkpoint {stored.id} is smaller than the one before it",
                           checkpoint=stored.id)
        previous = stored.size
        if stored.size > total:
            raise _Failure(Code.TRUNCATED, f"checkpoint {stored.id} signs {stored.size} entries but the ledger "
                           f"holds {total}", seq=total, checkpoint=stored.id)
        policy = [p for seq, p in policies if seq < stored.size][-1]
        try:
            checkpoint = verify_checkpoint(stored.note, origin=policy.origin, keys=note_keys(policy))
        except NoteError as e:
            raise _Failure(Code.BAD_CHECKPOINT, f"checkpoint {stored.id}: {e.detail}", checkpoint=stored.id,
                           seq=good) from e
        if checkpoint.size != stored.size or levels.root(stored.size) != checkpoint.root:
            raise _Failure(Code.BAD_CHECKPOINT, f"checkpoint {stored.id}: the root of the first {stored.size} "
                           "entries is not the signed root", checkpoint=stored.id, seq=good)
        good = stored.size
    if good < total:
        raise _Failure(Code.UNSIGNED_TAIL, f"entries {good}..{total - 1} are covered by no signed checkpoint",
                       seq=good)
    policy = policies[-1][1]
    agreed = 0
    for note in trusted:
        try:
            checkpoint = verify_checkpoint(note, origin=policy.origin, keys=note_keys(policy))
        except NoteError as e:
            raise _Failure(Code.FORK, f"a trusted checkpoint is not signed by this ledger's key ({e.detail})") from e
        if checkpoint.size > total:
            raise _Failure(Code.ROLLBACK, f"a trusted checkpoint signs {checkpoint.size} entries but this ledger "
                           f"holds {total}", seq=total)
        if levels.root(checkpoint.size) != checkpoint.root:
            raise _Failure(Code.FORK, f"the first {checkpoint.size} entries are not the ones the trusted "
                           "checkpoint signed", seq=agreed)
        agreed = max(agreed, checkpoint.size)
    report.trusted_checkpoints = len(trusted)
