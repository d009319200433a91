"""Which contributions are withdrawn, as a running step learns it: from the withdraw entries' bodies, as signed.

    seen = Withdrawn(ledger.store, policy=ledger.policy)
    gone = seen.read()        # each step: the entries appended since the last read, decoded

The `withdrawals` table is an index a database writer without keys can edit: a deleted row would hide a
withdrawal from training while `govtrain-verify` still saw the withdraw entry. A step reads the entries instead,
and only those appended since its last read (one query that finds nothing on most steps). Each body must hash to
its stored leaf and state the kind its row states (`entries.decode_stored`), the sequence numbers must be dense
(`sequence_gap`), and a body that retention dropped must be one a summary records (`bad_summary`): a relabelled,
edited or deleted withdraw entry stops the run with its code rather than let it draw a withdrawn contribution.
The leaves read so far are folded into the tree as they come (`CompactRange`, kept between reads), and where a read
found new rows a signed checkpoint must sign exactly that tree (`verified.check_signed`): a row no ledger key
signed (`unsigned_tail`) is what a writer without keys appended, such as a summary that passes a withdrawal off as
another contribution's retired admission. Every writer signs the state it leaves in the transaction that writes it,
so honest rows are never read unsigned. A step that finds nothing new costs one query, as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import ledger_store
from govtrain.errors import Code, IntegrityError
from govtrain.ledger.entries import decode_stored
from govtrain.ledger.merkle import CompactRange
from govtrain.ledger.retention import Redacted
from govtrain.ledger.verified import check_signed

if TYPE_CHECKING:
    from govtrain.policy.model import Policy

VERIFY = "the ledger was altered; run govtrain-verify"


class Withdrawn:
    """The withdrawn contribution ids of one ledger, read forward from entry 1 as the ledger grows. `policy`: the one
    whose keys sign its checkpoints (else, or after a change, the store's policy chain's last)."""

    def __init__(self, store: ledger_store.LedgerStore, *, policy: "Policy | None" = None) -> None:
        self._store, self._policy = store, policy
        self._next = 1  # entry 0 is the header
        self._ids: set[str] = set()
        self._tree: CompactRange | None = None  # the leaves of entries 0.._next-1

    def read(self) -> frozenset[str]:
        """Every contribution a withdraw entry stored so far names (those appended since the last read decoded)."""
        try:
            with self._store.snapshot():  # the rows and the checkpoint that signs them, at one moment
                return self._read()
        except ledger_store.TamperedRow as e:  # as govtrain-verify reports it
            raise IntegrityError(Code.BAD_ENTRY, f"{e}: no ledger writes such a cell; {VERIFY}") from e

    def _read(self) -> frozenset[str]:
        if self._tree is None:
            self._tree = CompactRange()
            for leaf in self._store.leaf_hashes(0, 1):
                self._tree.append(leaf)
        redacted: Redacted | None = None
        tree, ids, position = self._tree.copy(), set(self._ids), self._next
        for stored in self._store.entries(start=position):
            if stored.seq != position:
                raise IntegrityError(Code.SEQUENCE_GAP, f"entry {position} is missing: {VERIFY}")
            tree.append(stored.leaf_hash)
            if stored.body is None:  # retention dropped it: its summary says what it was
                redacted = redacted or Redacted.read(self._store)
                if stored.seq in redacted.withdrawals:
                    ids.add(redacted.withdrawals[stored.seq]["contribution_id"])
                elif stored.seq not in redacted.admits and stored.seq not in redacted.spends:
                    raise IntegrityError(Code.BAD_SUMMARY, f"entry {stored.seq} ({stored.kind}) has no body and no "
                                                           f"summary records it: {VERIFY}")
            else:
                entry = decode_stored(stored)
                if entry["kind"] == "withdraw":
                    ids.add(entry["contribution_id"])
            position = stored.seq + 1
        if position != self._next:  # new rows: taken only as a signed checkpoint signs them (the summaries too)
            check_signed(self._store, tree, self._policy)
            self._tree, self._ids, self._next = tree, ids, position
        return frozenset(self._ids)
