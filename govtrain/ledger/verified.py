"""The ledger's entries as their signed leaves say, for a reader that acts on them: planning, the spend rules, a
withdrawal, the tune rules, a run's written-ahead plan.

    for item in verified_entries(store):      # every entry from 1, in order
        item.kind, item.entry                  # the kind its body states (a redacted one: its summary's), the body

The store's columns besides the leaf hash and the body are an index a database writer without keys can edit: a
`kind` column relabelled (a withdraw entry called a `tune`) or a row deleted would hide a withdrawal from the
planner, or a spend from the rules that bound the next one, while `govtrain-verify` still saw it, after the run had
trained. So nothing here selects rows by a column: every row is read, in order, and
  - the sequence numbers are dense from `start` (`sequence_gap`: a deleted row);
  - each body hashes to its stored leaf (`leaf_hash_mismatch`) and states the kind its row states (`bad_entry`: a
    relabelled row is an edit, refused, never a reason to pass over an entry);
  - a row whose body retention dropped is one exactly one summary records, as the kind its row states
    (`bad_summary`); the summaries are found by their bodies, not their kind column (`read_summaries`);
  - no admission shares an id or a digest with an earlier one (`bad_admission`): a replay the admissions index,
    whose rows were deleted, let through.
The leaves themselves are the signed tree's: a writer (`Ledger.append`) folds them into the tree its key signed
last before it signs more, so an edited leaf or a removed tail is refused there (`fork`, `rollback`). A reader that
writes nothing (`govtrain plan`) cannot tell a tail deleted with the checkpoint rows that signed it from one never
written; a run can, at its write-ahead, which comes before any step it trains. That one pass
is as costly as the kind-filtered reads it replaces (each body was hashed and decoded there too); a caller that
needs two states of one moment feeds both from one pass (`feed`).
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, NamedTuple

import ledger_store
from govtrain.errors import Code, IntegrityError
from govtrain.ledger.entries import decode_stored
from govtrain.ledger.retention import RETIRED_KEYS, Redacted

VERIFY = "the ledger was altered; run govtrain-verify"
_REDACTED_KINDS = ("admit", "spend", "withdraw")


class Verified(NamedTuple):
    """One entry as read: its kind (its body's, or its summary's where retention dropped the body), the decoded
    body (None where dropped: `redacted` says what its summary recorded), and its leaf hash."""

    seq: int
    kind: str
    entry: dict | None
    leaf_hash: bytes


class VerifiedEntries:
    """An iterable of `Verified` over `store` from `start` (entry 0, the header, is `Ledger.open`'s), with the
    summaries' record of the redacted entries (`redacted`, read the first time a body-less row is met)."""

    def __init__(self, store: ledger_store.LedgerStore, start: int = 1) -> None:
        self.store, self.start = store, start
        self._redacted: Redacted | None = None

    @property
    def redacted(self) -> Redacted:
        if self._redacted is None:
            self._redacted = Redacted.read(self.store)
        return self._redacted

    def __iter__(self) -> Iterator[Verified]:
        expected, admitted = self.start, {}
        with self.store.snapshot():  # one moment: the rows and the summaries that record the redacted ones
            for stored in self.store.entries(start=self.start):
                if stored.seq != expected:
                    raise IntegrityError(Code.SEQUENCE_GAP, f"entry {expected} is missing: {VERIFY}")
                expected += 1
                if stored.body is None:
                    item = Verified(stored.seq, self._redacted_kind(stored), None, stored.leaf_hash)
                else:  # the body hashes to its leaf, and states the kind its row states (else bad_entry)
                    entry = decode_stored(stored)
                    item = Verified(stored.seq, entry["kind"], entry, stored.leaf_hash)
                if item.kind == "admit":
                    _check_new(admitted, item.seq, item.entry or self.redacted.admits[item.seq])
                yield item

    def _redacted_kind(self, stored: ledger_store.StoredEntry) -> str:
        redacted = self.redacted
        kinds = [kind for kind, seqs in zip(_REDACTED_KINDS, (redacted.admits, redacted.spends, redacted.withdrawals))
                 if stored.seq in seqs]
        if kinds != [stored.kind]:
            found = f"a summary records it as {' and '.join(kinds)}" if kinds else "no summary records it"
            raise IntegrityError(Code.BAD_SUMMARY, f"entry {stored.seq} has no body and {found} (its kind column "
                                                   f"says {stored.kind!r}): {VERIFY}")
        return stored.kind


def _check_new(admitted: dict[tuple[str, object], int], seq: int, admit: dict) -> None:
    """An admission shares no id or digest with an earlier one (`bad_admission`): the writer refuses a replay by the
    admissions index's unique columns, and a writer without keys who deleted those rows could replay an
    attestation (its bytes are in the ledger) to have one contribution's data trained under two budgets."""
    for name in RETIRED_KEYS:
        first = admitted.setdefault((name, admit[name]), seq)
        if first != seq:
            raise IntegrityError(Code.BAD_ADMISSION, f"entry {seq}: its {name} was already admitted by entry {first}: "
                                                     f"{VERIFY}")


def verified_entries(store: ledger_store.LedgerStore, start: int = 1) -> VerifiedEntries:
    return VerifiedEntries(store, start)


def feed(entries: Iterable[Verified], *takers: Callable[[Verified], None]) -> None:
    """One pass over `entries`, each handed to every one of `takers` in order: two states read from one moment,
    each body hashed and decoded once."""
    for item in entries:
        for take in takers:
            take(item)
