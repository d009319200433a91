"""The auditor's verifier (DESIGN §6). It never imports torch and trusts nothing it reads.

Steps, in the order an auditor would check them:
  1. sequence numbers are dense from 0 (no entry removed or inserted);
  2. every leaf hash is SHA-256(0x00 ‖ body) of the stored body (RFC 9162 §2.1.1);
  3. every body is deterministic CBOR with the envelope of its row and the exact fields of its kind;
  4. entry 0, and only entry 0, is the header; its policy is well formed and its keys are screened;
  5. every admit entry carries an attestation that the header's trust store verifies, whose
     descriptor matches the entry field by field and was admissible at the entry's time;
  6. no contribution id, descriptor or data file is admitted twice;
  7. the store's admissions index says exactly what the admit entries say.
Merkle roots, signed checkpoints, withdrawals, summaries and recomputed spend join these steps
as those entries are introduced.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ledger_store
from govtrain.errors import Code, GovtrainError, IntegrityError
from govtrain.gate.gate import Gate
from govtrain.ledger.entries import decode_entry
from govtrain.ledger.ledger import store_errors
from govtrain.policy.model import Policy


@dataclass
class VerificationReport:
    url: str
    entries: int = 0
    admissions: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    error: GovtrainError | None = None
    bad_seq: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def as_json(self) -> dict:
        report = {"ok": self.ok, "ledger": self.url, "entries": self.entries, "admissions": self.admissions,
                  "by_kind": dict(sorted(self.by_kind.items()))}
        if self.error is not None:
            report.update(code=self.error.code.value, detail=self.error.detail, first_bad_entry=self.bad_seq)
        return report


def _fail(code: Code, seq: int | None, detail: str) -> IntegrityError:
    error = IntegrityError(code, detail)
    error.seq = seq  # type: ignore[attr-defined]
    return error


def verify_ledger(url: str) -> VerificationReport:
    """Audit the ledger at `url`. Raises `IntegrityError` naming the first bad entry."""
    report = inspect_ledger(url)
    if report.error is not None:
        raise report.error
    return report


def inspect_ledger(url: str) -> VerificationReport:
    """Audit the ledger at `url` and return a report for display (the error, if any, inside it)."""
    with store_errors():
        store = ledger_store.LedgerStore.open(url)
    report = VerificationReport(url=store.url)
    try:
        _verify(store, report)
    except IntegrityError as e:
        report.error = e
        report.bad_seq = getattr(e, "seq", None)
    finally:
        store.close()
    return report


def _verify(store: ledger_store.LedgerStore, report: VerificationReport) -> None:
    gate: Gate | None = None
    policy: Policy | None = None
    admitted: dict[str, int] = {}
    descriptors: dict[bytes, int] = {}
    data_files: dict[bytes, int] = {}
    index_expected: dict[str, tuple] = {}
    expected_seq = 0
    for stored in store.entries():
        seq = stored.seq
        # 1. Dense sequence numbers.
        if seq != expected_seq:
            raise _fail(Code.SEQUENCE_GAP, expected_seq, f"entry {expected_seq} is missing (next stored is {seq})")
        expected_seq += 1
        # 2. Leaf hash of the stored body.
        if stored.body is None:
            raise _fail(Code.BAD_ENTRY, seq, f"entry {seq} has no body and no summary covers it")
        if ledger_store.leaf_hash(stored.body) != stored.leaf_hash:
            raise _fail(Code.LEAF_HASH_MISMATCH, seq, f"entry {seq}: stored leaf hash does not match its body")
        # 3. Strict decoding and the exact fields of its kind.
        try:
            entry = decode_entry(stored.body, seq=seq, kind=stored.kind)
        except IntegrityError as e:
            raise _fail(e.code, seq, e.detail) from e
        if entry["time"] != stored.time:
            raise _fail(Code.BAD_ENTRY, seq, f"entry {seq}: time column disagrees with the entry")
        report.by_kind[stored.kind] = report.by_kind.get(stored.kind, 0) + 1
        # 4. The header, first and only once.
        if (seq == 0) != (stored.kind == "header"):
            raise _fail(Code.BAD_LEDGER_HEADER, seq, f"entry {seq}: the header must be entry 0 and only entry 0")
        if seq == 0:
            try:
                policy = Policy.from_record(entry["policy"])
            except GovtrainError as e:
                raise _fail(Code.BAD_LEDGER_HEADER, 0, f"header policy: {e.detail}") from e
            gate = Gate(policy)
            continue
        assert gate is not None
        if stored.kind == "admit":
            # 5. The attestation verifies under the header's trust store and matches the entry.
            try:
                verified = gate.verify(entry["attestation"], now=entry["time"])
            except GovtrainError as e:
                raise _fail(Code.BAD_ADMISSION, seq, f"entry {seq}: attestation rejected: "
                                                      f"error[{e.code.value}] {e.detail}") from e
            d = verified.descriptor
            expected = {
                "contribution_id": d.contribution_id, "contributor": d.contributor, "data_class": d.data_class,
                "kid": verified.kid, "descriptor_sha256": verified.descriptor_sha256,
                "attestation_sha256": verified.attestation_sha256, "data_sha256": d.data_sha256,
                "records": d.records, "clip_norm_u": d.clip_norm_u, "noise_multiplier_u": d.noise_multiplier_u,
                "eps_budget_u": d.eps_budget_u, "not_before": d.not_before, "not_after": d.not_after,
            }
            for name, value in expected.items():
                if entry[name] != value:
                    raise _fail(Code.BAD_ADMISSION, seq, f"entry {seq}: {name} differs from the signed descriptor")
            # 6. No replay.
            for seen, key, what in ((admitted, d.contribution_id, "contribution id"),
                                    (descriptors, verified.descriptor_sha256, "descriptor"),
                                    (data_files, d.data_sha256, "data file")):
                if key in seen:
                    raise _fail(Code.BAD_ADMISSION, seq, f"entry {seq}: {what} already admitted by entry {seen[key]}")
                seen[key] = seq
            index_expected[d.contribution_id] = (seq, d.data_class, verified.descriptor_sha256,
                                                 verified.attestation_sha256, d.data_sha256)
    report.entries = expected_seq
    report.admissions = len(admitted)
    if expected_seq == 0:
        raise _fail(Code.BAD_LEDGER_HEADER, 0, "the ledger is empty: entry 0 (header) is missing")
    # 7. The admissions index mirrors the admit entries exactly.
    rows = store.admissions()
    actual = {r.contribution_id: (r.seq, r.data_class, r.descriptor_sha256, r.attestation_sha256, r.data_sha256)
              for r in rows}
    if actual != index_expected or len(rows) != len(index_expected):
        differing = sorted(set(actual.items()) ^ set(index_expected.items()))
        seq = differing[0][1][0] if differing else None
        raise _fail(Code.INDEX_MISMATCH, seq, "the admissions index disagrees with the admit entries")
