"""A ledger read as its checkpoints signed it, for a reader that must not trust the database: a release's facts,
and its check against a live ledger (`release/facts.py`). Whoever can write the database file can edit any column,
drop the triggers, and insert or delete checkpoint rows; without a ledger key they cannot sign a tree.

    log = read_log(store, origin=origin, keys=pinned)
    log.checkpoint                        # the largest checkpoint that verifies, and is the stored tree at its size
    log.of_kind("withdraw", start=n)      # kinds from the bodies, never from the kind column

Read in order; each step raises `IntegrityError` with its code, and tells the reader to run govtrain-verify:
  1. every row, from 0 and dense (`sequence_gap`), entry 0 the header (`bad_ledger_header`);
  2. each body hashes to its row's leaf hash (`leaf_hash_mismatch`) and is decoded with the kind it states
     (`bad_entry`); a kind or time column that says otherwise is refused (`bad_entry`): a relabelled row is an
     edit, never a reason to pass over an entry;
  3. the leaves fold into the tree at every checkpoint row's size, in memory (no stored subtree hash is read);
     the policy chain is read from the policy entries' bodies (`policy_chain`), each change authorised by the first
     checkpoint that covers it, which must be the stored tree at its size (`fork`);
  4. the checkpoint is the largest of those rows that verifies under the pinned keys or the ledger keys of the
     policy in force at its size: by size, not by row order, so a copy of an old note inserted last changes
     nothing. It must be the stored tree at its size (`fork`) and sign no more entries than are stored
     (`rollback`: entries were removed). Checkpoints the caller trusts (a release's) count too, once the stored
     entries extend them (`rollback`, `fork`);
  5. a row whose body retention dropped has the kind that a summary the checkpoint signs records for its sequence
     number, and its kind column must say the same (`bad_summary`).
Entries past the checkpoint (an unsigned tail) are read by steps 1-2 too, and kept: the ledger signs every state
it reaches in the transaction that writes it (`Ledger.append`), so a tail means checkpoint rows were deleted, a
checkpoint is by a key the reader does not trust, or a writer without keys forged entries. A withdrawal there is
reported all the same (`SignedLog.tail` counts them): it cannot hide by deleting the checkpoints that sign it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple, Sequence

import ledger_store
from govtrain.errors import Code, IntegrityError, RejectedError
from govtrain.ledger.checkpoint import Checkpoint, NoteKey, verify_checkpoint
from govtrain.ledger.entries import decode_entry
from govtrain.ledger.merkle import CompactRange, MerkleTree
from govtrain.ledger.policy_chain import UnauthorisedPolicy, note_keys, policy_chain
from govtrain.ledger.retention import Redacted
from govtrain.policy.model import Policy

VERIFY = "run govtrain-verify"


class LogEntry(NamedTuple):
    seq: int
    kind: str  # its body's (a redacted entry's: its summary's)
    leaf_hash: bytes
    entry: dict | None  # the decoded body; None where retention dropped it
    body: bytes | None  # as stored and hashed into its leaf


@dataclass(frozen=True, kw_only=True)
class SignedLog:
    """Every stored entry, read and checked (`read_log`), and the largest checkpoint that signs them."""

    checkpoint: Checkpoint
    entries: tuple[LogEntry, ...]  # every stored entry, those past the checkpoint included
    redacted: Redacted  # what the signed summaries record of each entry they retire
    chain: tuple[tuple[int, Policy], ...]  # (seq, policy): the header's and each authorised change
    roots: Mapping[int, bytes]  # the stored tree's root at each checkpoint row's size

    @property
    def size(self) -> int:
        """How many entries the checkpoint signs."""
        return self.checkpoint.size

    @property
    def tail(self) -> int:
        """How many entries are stored past the checkpoint (0 in a ledger as it writes itself)."""
        return len(self.entries) - self.checkpoint.size

    def leaves(self, size: int) -> list[bytes]:
        return [e.leaf_hash for e in self.entries[:size]]

    def tree(self, size: int) -> MerkleTree:
        """The tree of the first `size` entries, from their leaves in memory (no stored subtree hash)."""
        return MerkleTree(self.leaves(size), size)

    def policy_at(self, seq: int) -> Policy:
        """The policy that governs entry `seq` (the last one recorded before it)."""
        return [policy for at, policy in self.chain if at < max(seq, 1)][-1]

    def of_kind(self, *kinds: str, start: int = 0, stop: int | None = None) -> list[LogEntry]:
        """The entries of `kinds` (their bodies' kinds) in [start, stop)."""
        return [e for e in self.entries[start:stop] if e.kind in kinds]


def read_log(store: ledger_store.LedgerStore, *, origin: str, keys: Callable[[str], list[NoteKey]] | None = None,
             trusted: Sequence[Checkpoint] = ()) -> SignedLog:
    """The entries of `store` as the ledger `origin` signed them: steps 1-5 of the
    module's docstring. `keys(note)`: the ledger keys the caller pins, as verifier keys for that note, trusted besides
    those of the policy chain; `trusted`:
    checkpoints the caller verified (a release's), which the stored entries must extend (`rollback`, `fork`), and
    which count as signed."""
    rows = list(store.entries())
    # 1-2.
    entries: list[LogEntry] = []
    for stored in rows:
        entries.append(_read(stored, len(entries)))
    if not entries or entries[0].kind != "header":
        raise IntegrityError(Code.BAD_LEDGER_HEADER, f"entry 0 is not a header: the ledger is damaged; {VERIFY}")
    header = entries[0].entry
    checkpoints = store.checkpoints()
    # 3.
    sizes = {c.size for c in checkpoints if c.size <= len(entries)}
    roots, tree = {}, CompactRange()
    if 0 in sizes:
        roots[0] = tree.root()
    for entry in entries:
        tree.append(entry.leaf_hash)
        if tree.size in sizes:
            roots[tree.size] = tree.root()

    def covering(seq: int) -> str | None:
        found = store.checkpoint_covering(seq)
        if found is not None and roots.get(found.size) != found.root:
            raise IntegrityError(Code.FORK, f"the checkpoint that first covers policy entry {seq} is not the stored "
                                            f"tree at its size: the ledger was edited; {VERIFY}")
        return found.note if found is not None else None

    policies = [(e.seq, e.entry) for e in entries if e.kind == "policy"]
    try:
        chain = policy_chain(store, header, signed=policies, covering=covering)
    except UnauthorisedPolicy as e:
        raise IntegrityError(e.code, f"{e.detail}; {VERIFY}") from e
    # 4.
    chosen = None
    for stored in sorted(checkpoints, key=lambda c: c.size, reverse=True):
        policy = [p for at, p in chain if at < max(min(stored.size, len(entries)), 1)][-1]
        try:
            pinned = keys(stored.note) if keys is not None else []
            checkpoint = verify_checkpoint(stored.note, origin=origin, keys=[*pinned, *note_keys(policy)])
        except IntegrityError:  # a note that does not parse, or verify: not a checkpoint of this ledger's keys
            continue
        if checkpoint.size > len(entries):
            raise IntegrityError(Code.ROLLBACK, f"a signed checkpoint signs {checkpoint.size} entries, the ledger "
                                                f"holds {len(entries)}: entries were removed; {VERIFY}")
        if roots.get(checkpoint.size) != checkpoint.root:
            raise IntegrityError(Code.FORK, f"a signed checkpoint of size {checkpoint.size} is not the stored tree "
                                            f"at that size: the ledger forked or was edited; {VERIFY}")
        chosen = checkpoint
        break
    for checkpoint in trusted:
        _check_extends(entries, roots, checkpoint)
        chosen = checkpoint if chosen is None or checkpoint.size > chosen.size else chosen
    if chosen is None and not checkpoints:
        raise RejectedError(Code.NO_CHECKPOINT, "the ledger has no checkpoint yet")
    if chosen is None:
        raise IntegrityError(Code.BAD_CHECKPOINT, f"no checkpoint of the ledger verifies under its ledger keys; "
                                                  f"{VERIFY}")
    # 5.
    redacted = Redacted.of(r for e in entries[:chosen.size] if e.kind == "summary" for r in e.entry["retired"])
    resolved = tuple(_redacted(e, rows[e.seq].kind, redacted) if e.entry is None else e for e in entries)
    return SignedLog(checkpoint=chosen, entries=resolved, redacted=redacted, chain=tuple(chain), roots=roots)


def _check_extends(entries: Sequence[LogEntry], roots: Mapping[int, bytes], checkpoint: Checkpoint) -> None:
    """Raise unless the stored entries extend the tree `checkpoint` signs: `rollback` where fewer are stored,
    `fork` where the first `checkpoint.size` hash to another root."""
    if len(entries) < checkpoint.size:
        raise IntegrityError(Code.ROLLBACK, f"the ledger holds {len(entries)} entries, a checkpoint you trust signs "
                                            f"{checkpoint.size}: it was rolled back; {VERIFY}")
    root = roots.get(checkpoint.size)
    if root is None:
        tree = CompactRange()
        for entry in entries[:checkpoint.size]:
            tree.append(entry.leaf_hash)
        root = tree.root()
    if root != checkpoint.root:
        raise IntegrityError(Code.FORK, f"the ledger's first {checkpoint.size} entries are not the tree a checkpoint "
                                        f"you trust signs: it forked or was edited; {VERIFY}")


def _read(stored: ledger_store.StoredEntry, expected: int) -> LogEntry:
    if stored.seq != expected:
        raise IntegrityError(Code.SEQUENCE_GAP, f"entry {expected} is missing from the ledger; {VERIFY}")
    if stored.body is None:
        return LogEntry(stored.seq, "", stored.leaf_hash, None, None)  # its kind: its summary's (step 5)
    if ledger_store.leaf_hash(stored.body) != stored.leaf_hash:
        raise IntegrityError(Code.LEAF_HASH_MISMATCH, f"entry {stored.seq} does not hash to its signed leaf: the "
                                                      f"database was edited; {VERIFY}")
    try:
        entry = decode_entry(stored.body, seq=stored.seq, kind=None)
    except IntegrityError as e:
        raise IntegrityError(e.code, f"{e.detail}; {VERIFY}") from e
    if entry["kind"] != stored.kind or entry["time"] != stored.time:
        raise IntegrityError(Code.BAD_ENTRY, f"entry {stored.seq} is a {entry['kind']} entry of time {entry['time']}, "
                                             f"its row says {stored.kind!r} at {stored.time}: the database was "
                                             f"edited; {VERIFY}")
    return LogEntry(stored.seq, entry["kind"], stored.leaf_hash, entry, stored.body)


def _redacted(entry: LogEntry, column: str, redacted: Redacted) -> LogEntry:
    kinds = [kind for kind, seqs in (("admit", redacted.admits), ("spend", redacted.spends),
                                     ("withdraw", redacted.withdrawals)) if entry.seq in seqs]
    if len(kinds) != 1 or kinds[0] != column:
        found = f"a summary records it as {' and '.join(kinds)}" if kinds else "no signed summary records it"
        raise IntegrityError(Code.BAD_SUMMARY, f"entry {entry.seq} has no body and {found} (its kind column says "
                                               f"{column!r}); {VERIFY}")
    return entry._replace(kind=kinds[0])
