"""Withdrawal: `Ledger.withdraw` appends a `withdraw` entry naming a contribution's admit entry.

The index tables (admissions, withdrawals) are asked first, for speed, but never trusted to refuse: a writer
without keys can delete or forge their rows, so where they would refuse, the signed entries decide
(`_admit_of`), and a withdrawal the index lost is found by its body (`_withdrawal_of`).
"""

from __future__ import annotations

import time as _time

import ledger_store
from govtrain.errors import Code, ConfigError, IntegrityError, RejectedError
from govtrain.ledger import retention
from govtrain.ledger.entries import decode_entry, decode_stored, withdraw_entry
from govtrain.ledger.signed_append import WritingLedger
from govtrain.ledger.verified import verified_entries


def withdraw(ledger: WritingLedger, contribution_id: str, reason: str,
             now: int | None = None) -> ledger_store.StoredEntry:
    """`Ledger.withdraw`: a `withdraw` entry; never removes or edits earlier entries, never refunds spend."""
    now = int(_time.time()) if now is None else now
    admit = _indexed_admit(ledger.store, contribution_id)
    if admit is not None and _withdrawal_of(ledger.store, contribution_id, admit.leaf_hash) is not None:
        admit = None  # the index lost the withdrawal's row: the entries decide (already_withdrawn)
    indexed = admit is not None
    if admit is None:  # the index says unknown or withdrawn, or points elsewhere: the entries decide
        admit = _admit_of(ledger.store, contribution_id)
    if admit.body is None or contribution_id in retention.RetiredKeys.read(ledger.store):
        raise RejectedError(Code.REDACTED, f"{contribution_id!r} was summarized by retention and is retired")
    if not reason.strip() or len(reason) > 1024:
        raise ConfigError(Code.BAD_ARGUMENT, "--reason must be 1-1024 characters")
    try:
        with ledger.append(now) as appender:
            t = ledger.dated(appender, now)
            stored = appender.add(
                "withdraw", t, lambda seq: withdraw_entry(seq, t, contribution_id, admit.leaf_hash, reason),
                # an index that hid the admission or forged a withdrawal gets no row: the entry is what counts
                withdrawal={"contribution_id": contribution_id} if indexed else None)
    except ledger_store.Conflict as e:
        raise RejectedError(Code.ALREADY_WITHDRAWN, f"{contribution_id!r} is already withdrawn") from e
    return stored


def _indexed_admit(store: ledger_store.LedgerStore, contribution_id: str) -> ledger_store.StoredEntry | None:
    """The admit entry of `contribution_id` where the index finds it (admitted, no withdrawal row) and it is that
    contribution's signed admit entry (its body hashes to its leaf and admits it, or retention dropped the body);
    else None: the index is not trusted to refuse a withdrawal."""
    admission = store.admission(contribution_id)
    if admission is None or contribution_id in store.withdrawals():
        return None
    admit = store.entry(admission.seq)
    if admit is None or admit.kind != "admit":
        return None
    if admit.body is not None and (ledger_store.leaf_hash(admit.body) != admit.leaf_hash or decode_entry(
            admit.body, seq=admit.seq, kind=None).get("contribution_id") != contribution_id):
        return None
    return admit


def _withdrawal_of(store: ledger_store.LedgerStore, contribution_id: str, admit_leaf: bytes) -> int | None:
    """The seq of a withdraw entry of `contribution_id`, found by its body (it holds its admit entry's leaf hash:
    one search of every body, as `policy_chain` finds policy entries), each body found checked against its leaf and
    its kind column (`decode_stored`); None where there is none. The `withdrawals` index is not trusted to say "not
    yet withdrawn": a deleted row would have the key sign a second withdrawal, which the verifier fails for good."""
    try:
        for stored in store.entries_holding(admit_leaf):
            if stored.seq < 0 or stored.body is None:  # a row below entry 0 is no entry
                continue
            entry = decode_stored(stored)
            if entry["kind"] == "withdraw" and entry["contribution_id"] == contribution_id:
                return stored.seq
    except ledger_store.TamperedRow as e:
        raise IntegrityError(Code.BAD_ENTRY, f"{e}: no ledger writes such a cell; run govtrain-verify") from e
    return None


def _admit_of(store: ledger_store.LedgerStore, contribution_id: str) -> ledger_store.StoredEntry:
    """The admit entry of `contribution_id`, from the verified entries (`verified`), where the index would refuse its
    withdrawal: a writer without keys can delete an admissions row, or forge a withdrawals row, to keep a
    contribution from withdrawing. `unknown_contribution` or `already_withdrawn` only where the entries say so."""
    admit = None
    entries = verified_entries(store)
    for item in entries:
        if item.kind in ("admit", "withdraw"):
            redacted = entries.redacted.admits if item.kind == "admit" else entries.redacted.withdrawals
            if (item.entry or redacted.get(item.seq, {})).get("contribution_id") == contribution_id:
                if item.kind == "withdraw":
                    raise RejectedError(Code.ALREADY_WITHDRAWN, f"{contribution_id!r} is already withdrawn")
                admit = item.seq
    if admit is None:
        raise RejectedError(Code.UNKNOWN_CONTRIBUTION, f"no admitted contribution {contribution_id!r}")
    stored = store.entry(admit)
    assert stored is not None
    return stored
