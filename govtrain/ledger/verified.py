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
  - the rows read are exactly the tree a checkpoint signs under the policy's ledger keys (`check_signed`, after
    the last row): a row past the latest signed checkpoint (`unsigned_tail`) is what a writer without keys
    appended, since the ledger signs every state it reaches in the transaction that writes it (`Ledger.append`),
    so a forged spend or summary there is never read as the ledger's; a checkpoint that signs more entries than
    are stored is `rollback`, another tree at the stored size `fork`. So a summary that lets a body-less row
    through is a signed one. A reader reads the pass to its end before it acts on what it read (a writer's early
    stop inside `Ledger.append` is covered by the signer's own check there, `signed_append.signed_prefix`).
Rows are read from `start` up, so a row stored below entry 0 (a plain INSERT at seq -1) is no entry: nothing here
counts it, as nothing counts epochs or any other privacy-relevant number by the kind column (`Ledger.epoch` is this
pass's count); the verifier refuses such a row (`sequence_gap`). A cell of a type no ledger writes is `bad_entry`.
What the pass cannot see is a tail deleted together with the checkpoint rows that signed it: the stored rows are
then a signed tree, an older one. A writer catches it where its signer signed that tail (`Ledger.append`:
`rollback`); a writer whose signer state did not sign it (another host, another $GOVTRAIN_SIGNER_STATE) and a
reader that writes nothing (`govtrain plan`) cannot tell it from a tail never written: only an auditor who pinned
the later checkpoint (`govtrain-verify --trusted-checkpoint`), or that tail's own signer's next write, shows it.
That one pass is as costly as the kind-filtered reads it replaces (each body was hashed and decoded there too,
and each leaf is folded once into the tree); a caller that needs two states of one moment feeds both from one
pass (`feed`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Iterator, NamedTuple

import ledger_store
from govtrain.errors import Code, IntegrityError
from govtrain.ledger.checkpoint import verify_checkpoint
from govtrain.ledger.entries import decode_entry, decode_stored
from govtrain.ledger.merkle import CompactRange
from govtrain.ledger.retention import RETIRED_KEYS, Redacted

if TYPE_CHECKING:
    from govtrain.policy.model import Policy

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
    summaries' record of the redacted entries (`redacted`, read the first time a body-less row is met). `policy`:
    the one whose ledger keys sign the latest checkpoint (default, or where its keys do not verify it: the policy
    chain's last, read from the store). `signed=False` (a writer about to sign, that reads only to refuse): no
    signed checkpoint is asked for, since the signer's own check (`Ledger.append`) refuses the same tree (`fork`)."""

    def __init__(self, store: ledger_store.LedgerStore, start: int = 1, *, policy: "Policy | None" = None,
                 signed: bool = True) -> None:
        self.store, self.start, self.policy, self.signed = store, start, policy, signed
        self._redacted: Redacted | None = None
        self.epochs = 0  # the epoch entries read, by their bodies: the current epoch once the pass is done

    @property
    def redacted(self) -> Redacted:
        if self._redacted is None:
            self._redacted = Redacted.read(self.store)
        return self._redacted

    def __iter__(self) -> Iterator[Verified]:
        expected, admitted = self.start, {}
        try:
            with self.store.snapshot():  # one moment: the rows, the summaries and the checkpoint that signs them
                tree = CompactRange()
                for leaf in self.store.leaf_hashes(0, self.start):
                    tree.append(leaf)
                if tree.size != self.start:
                    raise IntegrityError(Code.SEQUENCE_GAP, f"an entry before {self.start} is missing: {VERIFY}")
                for stored in self.store.entries(start=self.start):
                    if stored.seq != expected:
                        raise IntegrityError(Code.SEQUENCE_GAP, f"entry {expected} is missing: {VERIFY}")
                    expected += 1
                    tree.append(stored.leaf_hash)
                    if stored.body is None:
                        item = Verified(stored.seq, self._redacted_kind(stored), None, stored.leaf_hash)
                    else:  # the body hashes to its leaf, and states the kind its row states (else bad_entry)
                        entry = decode_stored(stored)
                        item = Verified(stored.seq, entry["kind"], entry, stored.leaf_hash)
                    if item.kind == "admit":
                        _check_new(admitted, item.seq, item.entry or self.redacted.admits[item.seq])
                    elif item.kind == "epoch":
                        self.epochs += 1
                    yield item
                if self.signed:
                    check_signed(self.store, tree, self.policy)
        except ledger_store.TamperedRow as e:  # as govtrain-verify reports it
            raise IntegrityError(Code.BAD_ENTRY, f"{e}: no ledger writes such a cell; {VERIFY}") from e

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


def verified_entries(store: ledger_store.LedgerStore, start: int = 1, *, policy: "Policy | None" = None,
                     signed: bool = True) -> VerifiedEntries:
    return VerifiedEntries(store, start, policy=policy, signed=signed)


def check_signed(store: ledger_store.LedgerStore, tree: CompactRange, policy: "Policy | None" = None) -> None:
    """Raise unless a stored checkpoint that verifies under the ledger keys signs exactly `tree` (the leaves of every
    stored entry, read in order): `unsigned_tail` where none signs that size (rows a writer without keys appended,
    or whose checkpoint rows it deleted), `rollback` where one signs more entries, `fork` where one of that size
    signs another root. `policy`: tried first; then the policy chain's last, read from the store (the policy may
    have changed since the caller read it)."""
    size, root = tree.size, tree.root()
    candidates = store.checkpoints_from(size)  # largest first; the size column is an index, the note decides
    for keys in _key_sets(store, policy):
        for stored in candidates:
            try:
                checkpoint = verify_checkpoint(stored.note, origin=keys[0], keys=keys[1])
            except IntegrityError:  # not a note of these keys (or not a note)
                continue
            if checkpoint.size > size:
                raise IntegrityError(Code.ROLLBACK, f"a signed checkpoint signs {checkpoint.size} entries, the ledger "
                                                    f"holds {size}: entries were removed; {VERIFY}")
            if checkpoint.size == size:
                if checkpoint.root != root:
                    raise IntegrityError(Code.FORK, f"the signed checkpoint of size {size} is not the stored tree: the "
                                                    f"ledger forked or was edited; {VERIFY}")
                return
    raise IntegrityError(Code.UNSIGNED_TAIL, f"no signed checkpoint covers the ledger's {size} entries: the latest "
                                             f"were written by no ledger key (or their checkpoints were deleted), and "
                                             f"are not read as the ledger's; {VERIFY}")


def _key_sets(store: ledger_store.LedgerStore, policy: "Policy | None") -> Iterator[tuple[str, list]]:
    """(origin, note keys) of `policy`, then of the store's policy chain's last policy."""
    from govtrain.ledger.policy_chain import note_keys, policy_chain

    if policy is not None:
        yield policy.origin, note_keys(policy)
    header = store.entry(0)
    if header is None or header.body is None or ledger_store.leaf_hash(header.body) != header.leaf_hash:
        raise IntegrityError(Code.BAD_LEDGER_HEADER, f"entry 0 is not the signed header: {VERIFY}")
    latest = policy_chain(store, decode_entry(header.body, seq=0, kind="header"))[-1][1]
    if policy is None or latest != policy:
        yield latest.origin, note_keys(latest)


def feed(entries: Iterable[Verified], *takers: Callable[[Verified], None]) -> None:
    """One pass over `entries`, each handed to every one of `takers` in order: two states read from one moment,
    each body hashed and decoded once."""
    for item in entries:
        for take in takers:
            take(item)
