"""Which contributions are withdrawn, as a running step learns it: from the withdraw entries' bodies.

    seen = Withdrawn(ledger.store)
    gone = seen.read()        # each step: the entries appended since the last read, decoded

The `withdrawals` table is an index a database writer without keys can edit: a deleted row would hide a
withdrawal from training while `govtrain-verify` still saw the withdraw entry. A step reads the entries instead,
and only those appended since its last read (one query that finds nothing on most steps). Each body must hash to
its stored leaf and state the kind its row states (`entries.decode_stored`), the sequence numbers must be dense
(`sequence_gap`), and a body that retention dropped must be one a summary records (`bad_summary`): a relabelled,
edited or deleted withdraw entry stops the run with its code rather than let it draw a withdrawn contribution.
"""

from __future__ import annotations

import ledger_store
from govtrain.errors import Code, IntegrityError
from govtrain.ledger.entries import decode_stored
from govtrain.ledger.retention import Redacted

VERIFY = "the ledger was altered; run govtrain-verify"


class Withdrawn:
    """The withdrawn contribution ids of one ledger, read forward from entry 1 as the ledger grows."""

    def __init__(self, store: ledger_store.LedgerStore) -> None:
        self._store = store
        self._next = 1  # entry 0 is the header
        self._ids: set[str] = set()

    def read(self) -> frozenset[str]:
        """Every contribution a withdraw entry stored so far names (those appended since the last read decoded)."""
        redacted: Redacted | None = None
        for stored in self._store.entries(start=self._next):
            if stored.seq != self._next:
                raise IntegrityError(Code.SEQUENCE_GAP, f"entry {self._next} is missing: {VERIFY}")
            if stored.body is None:  # retention dropped it: its summary says what it was
                redacted = redacted or Redacted.read(self._store)
                if stored.seq in redacted.withdrawals:
                    self._ids.add(redacted.withdrawals[stored.seq]["contribution_id"])
                elif stored.seq not in redacted.admits and stored.seq not in redacted.spends:
                    raise IntegrityError(Code.BAD_SUMMARY, f"entry {stored.seq} ({stored.kind}) has no body and no "
                                                           f"summary records it: {VERIFY}")
            else:
                entry = decode_stored(stored)
                if entry["kind"] == "withdraw":
                    self._ids.add(entry["contribution_id"])
            self._next = stored.seq + 1
        return frozenset(self._ids)
