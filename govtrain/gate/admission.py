"""Admission: the gate's verdict made durable as an `admit` entry, or nothing written at all.

`admit` handles one attestation; `admit_many` verifies many and commits the admitted
ones in batches, one transaction per batch. Replays are refused twice over: by a
lookup before the write, and by the store's unique constraints if a concurrent
writer got there first. The lookup reads the admit entries themselves besides the admissions index
(`Admitted`: one verified pass per call, which the epoch count reads too): a writer without keys who deleted an
index row would otherwise have the gate sign a second admission of one attestation, which the verified pass
then refuses for good (`bad_admission`): every later plan stopped. A contribution that retention retired is
refused (`replay`) by what its summary entry committed to, not only by its index rows.
"""

from __future__ import annotations

import time as _time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import ledger_store
from govtrain.errors import AdmissionError, Code, GovtrainError
from govtrain.gate.gate import Gate, VerifiedAttestation
from govtrain.ledger import availability
from govtrain.ledger.entries import admit_entry
from govtrain.ledger.ledger import Ledger
from govtrain.ledger.retention import RETIRED_KEYS, RetiredKeys
from govtrain.ledger.verified import verified_entries


class Admitted:
    """Every admission the verified entries hold (retired ones are `RetiredKeys`'), by each key a replay could
    share with it, read in one pass with the ledger's epoch: what the admissions index should say, decided by the
    entries."""

    def __init__(self, ledger: Ledger) -> None:
        self.rows: dict[tuple[str, object], ledger_store.AdmissionRow] = {}
        # A refusal is all this reads for (and the epoch the gate checks against): the append that follows is the
        # signer's, which refuses a tree other than the one it signed (`fork`), an unsigned tail included.
        entries = verified_entries(ledger.store, policy=ledger.policy, signed=False)
        for item in entries:
            if item.kind == "admit" and item.entry is not None:
                self.add(ledger_store.AdmissionRow(item.entry["contribution_id"], item.seq, item.entry["data_class"],
                                                   item.entry["descriptor_sha256"], item.entry["attestation_sha256"],
                                                   item.entry["data_sha256"]))
        self.epoch = entries.epochs

    def add(self, row: ledger_store.AdmissionRow) -> None:
        for name in RETIRED_KEYS:
            self.rows.setdefault((name, getattr(row, name)), row)

    def conflicts(self, verified_list: "list[VerifiedAttestation]") -> list[ledger_store.AdmissionRow]:
        found = {}
        for v in verified_list:
            for key in (("contribution_id", v.descriptor.contribution_id), ("descriptor_sha256", v.descriptor_sha256),
                        ("attestation_sha256", v.attestation_sha256), ("data_sha256", v.descriptor.data_sha256)):
                if key in self.rows:
                    found[self.rows[key].seq] = self.rows[key]
        return [found[seq] for seq in sorted(found)]


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmitReceipt:
    contribution_id: str
    data_class: str
    contributor: str
    records: int
    seq: int
    leaf_hash: bytes
    descriptor_sha256: bytes
    attestation_sha256: bytes

    def as_json(self) -> dict:
        return {
            "ok": True,
            "contribution_id": self.contribution_id,
            "data_class": self.data_class,
            "contributor": self.contributor,
            "records": self.records,
            "seq": self.seq,
            "leaf_hash": self.leaf_hash.hex(),
            "descriptor_sha256": self.descriptor_sha256.hex(),
            "attestation_sha256": self.attestation_sha256.hex(),
        }


@dataclass(frozen=True, slots=True)
class AdmitOutcome:
    source: str
    receipt: AdmitReceipt | None = None
    error: GovtrainError | None = None


def _replay_error(verified: VerifiedAttestation, row: ledger_store.AdmissionRow) -> AdmissionError:
    d = verified.descriptor
    if row.descriptor_sha256 == verified.descriptor_sha256 or row.attestation_sha256 == verified.attestation_sha256:
        return AdmissionError(Code.REPLAY, f"this descriptor was already admitted as entry {row.seq}")
    if row.contribution_id == d.contribution_id:
        return AdmissionError(
            Code.ID_REUSED, f"contribution id {d.contribution_id!r} is already taken by entry {row.seq}"
        )
    return AdmissionError(
        Code.DUPLICATE_DATA,
        f"this data file was already admitted as {row.contribution_id!r} (entry {row.seq}); "
        "admitting it twice would double its examples' weight",
    )


def _conflict(verified: VerifiedAttestation, rows: Iterable[ledger_store.AdmissionRow],
              retired: RetiredKeys) -> AdmissionError | None:
    d = verified.descriptor
    found = retired.match(d.contribution_id, verified.descriptor_sha256, verified.attestation_sha256, d.data_sha256)
    if found is not None:
        name, admit_seq, summary_seq = found
        return AdmissionError(Code.REPLAY, f"its {name} is that of the contribution admitted as entry {admit_seq} and "
                                           f"retired by retention (summary entry {summary_seq}); a retired "
                                           "contribution is never admitted again")
    # Report the most specific match first: same descriptor (or attestation), then same id, then same data.
    matches = [r for r in rows if r.descriptor_sha256 == verified.descriptor_sha256
               or r.attestation_sha256 == verified.attestation_sha256]
    matches += [r for r in rows if r.contribution_id == d.contribution_id]
    matches += [r for r in rows if r.data_sha256 == d.data_sha256]
    return _replay_error(verified, matches[0]) if matches else None


def _admission_row(verified: VerifiedAttestation) -> dict:
    d = verified.descriptor
    return {
        "contribution_id": d.contribution_id,
        "data_class": d.data_class,
        "descriptor_sha256": verified.descriptor_sha256,
        "attestation_sha256": verified.attestation_sha256,
        "data_sha256": d.data_sha256,
    }


def _receipt(verified: VerifiedAttestation, stored: ledger_store.StoredEntry) -> AdmitReceipt:
    d = verified.descriptor
    return AdmitReceipt(
        contribution_id=d.contribution_id,
        data_class=d.data_class,
        contributor=d.contributor,
        records=d.records,
        seq=stored.seq,
        leaf_hash=stored.leaf_hash,
        descriptor_sha256=verified.descriptor_sha256,
        attestation_sha256=verified.attestation_sha256,
    )


def _write(ledger: Ledger, batch: list[VerifiedAttestation], now: int, gate: Gate
           ) -> list[ledger_store.StoredEntry | GovtrainError]:
    """Append the batch's admit entries; each in input order gets its stored entry, or the error that kept it
    out. An entry is dated no earlier than the one before it (`Ledger.dated`): where that is later than
    `now`, each attestation's validity window is checked again at the entry's own time, as the verifier will."""
    outcome: list[ledger_store.StoredEntry | GovtrainError] = []
    with ledger.append(now) as appender:
        t = ledger.dated(appender, now)
        for verified in batch:
            try:
                if t != now:
                    gate.check_policy(verified, t)
            except GovtrainError as e:
                outcome.append(e)
                continue
            outcome.append(appender.add("admit", t, lambda seq, v=verified: admit_entry(seq, t, v),
                                        _admission_row(verified)))
    return outcome


def _settle(source: str, verified: VerifiedAttestation,
            stored: ledger_store.StoredEntry | GovtrainError) -> AdmitOutcome:
    if isinstance(stored, GovtrainError):
        return AdmitOutcome(source, error=stored)
    return AdmitOutcome(source, receipt=_receipt(verified, stored))


def admit(ledger: Ledger, raw: bytes, data: str | Path, *, now: int | None = None,
          gate: Gate | None = None) -> AdmitReceipt:
    """Gate one attestation and its data file; on success append its `admit` entry."""
    outcome = admit_many(ledger, [(str(data), raw, Path(data))], now=now, gate=gate)[0]
    if outcome.error is not None:
        raise outcome.error
    assert outcome.receipt is not None
    return outcome.receipt


def admit_many(ledger: Ledger, items: Iterable[tuple[str, bytes, Path]], *, now: int | None = None,
               gate: Gate | None = None, batch_size: int = 1000) -> list[AdmitOutcome]:
    """Admit (source name, `.cose` bytes, data path) items, committing every `batch_size` admitted ones.

    Each item is judged on its own: a rejection writes nothing and does not stop the others.
    Outcomes come back in input order.
    """
    now = int(_time.time()) if now is None else now
    gate = gate if gate is not None else Gate(ledger.policy)
    admitted = Admitted(ledger)  # the entries' admissions and epoch count: never the index alone, nor the kind column
    epoch = admitted.epoch
    retired = RetiredKeys.read(ledger.store)
    outcomes: list[AdmitOutcome] = []
    pending: list[tuple[int, str, VerifiedAttestation]] = []

    def flush() -> None:
        # Run again after a lost write, it judges only what is still open: an item this call has already
        # written (or refused) keeps its outcome, and is not looked up again to find itself a replay.
        pending[:] = [p for p in pending if outcomes[p[0]].receipt is None and outcomes[p[0]].error is None]
        if not pending:
            return
        verified_list = [v for _, _, v in pending]
        rows = ledger.store.admission_conflicts(
            [v.descriptor.contribution_id for v in verified_list],
            [v.descriptor_sha256 for v in verified_list],
            [v.descriptor.data_sha256 for v in verified_list],
            [v.attestation_sha256 for v in verified_list],
        )
        indexed = {row.seq for row in rows}
        rows += [row for row in admitted.conflicts(verified_list) if row.seq not in indexed]
        accepted: list[tuple[int, str, VerifiedAttestation]] = []
        seen_ids: set[str] = set()
        seen_descriptors: set[bytes] = set()
        seen_data: set[bytes] = set()
        for index, source, verified in pending:
            d = verified.descriptor
            error = _conflict(verified, rows, retired)
            if error is None and verified.descriptor_sha256 in seen_descriptors:
                error = AdmissionError(Code.REPLAY, "this descriptor appears twice in one batch")
            elif error is None and d.contribution_id in seen_ids:
                error = AdmissionError(Code.ID_REUSED, f"contribution id {d.contribution_id!r} appears twice")
            elif error is None and d.data_sha256 in seen_data:
                error = AdmissionError(Code.DUPLICATE_DATA, "the same data file appears twice in one batch")
            if error is not None:
                outcomes[index] = AdmitOutcome(source, error=error)
                continue
            seen_ids.add(d.contribution_id)
            seen_descriptors.add(verified.descriptor_sha256)
            seen_data.add(d.data_sha256)
            accepted.append((index, source, verified))
        try:
            stored = _write(ledger, [v for _, _, v in accepted], now, gate)
            for (index, source, verified), entry in zip(accepted, stored):
                outcomes[index] = _settle(source, verified, entry)
                if not isinstance(entry, GovtrainError):
                    admitted.add(ledger_store.AdmissionRow(seq=entry.seq, **_admission_row(verified)))
        except ledger_store.Conflict:
            # A concurrent writer admitted one of these after our lookup: redo them one by one.
            for index, source, verified in accepted:
                try:
                    (entry,) = _write(ledger, [verified], now, gate)
                    outcomes[index] = _settle(source, verified, entry)
                except ledger_store.Conflict:
                    rows_now = ledger.store.admission_conflicts(
                        [verified.descriptor.contribution_id], [verified.descriptor_sha256],
                        [verified.descriptor.data_sha256], [verified.attestation_sha256])
                    error = _conflict(verified, rows_now, retired) or AdmissionError(Code.REPLAY, "already admitted")
                    outcomes[index] = AdmitOutcome(source, error=error)
        pending.clear()

    items = list(items)
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        verdicts = gate.verify_many([raw for _, raw, _ in chunk], now=now, epoch=epoch)
        for (source, _, data), verdict in zip(chunk, verdicts):
            index = len(outcomes)
            outcomes.append(AdmitOutcome(source))
            try:
                if isinstance(verdict, GovtrainError):
                    raise verdict
                gate.check_data(verdict, data)
            except GovtrainError as e:
                outcomes[index] = AdmitOutcome(source, error=e)
                continue
            pending.append((index, source, verdict))
        availability.retrying(flush, retry_s=ledger.retry_s)  # a batch lost with the connection runs again
    return outcomes
