"""The auditor's verifier (DESIGN §6). It never imports torch and trusts nothing it reads.

One pass over the entries, in the order an auditor would check them:
  1. sequence numbers are dense from 0 (nothing removed or inserted);
  2. every body hashes to its stored leaf hash (RFC 9162 §2.1.1); a body may be missing only
     where a summary redacted it (step 9);
  3. every body is deterministic CBOR with its row's envelope and the exact fields of its kind;
  4. the header is entry 0 and only entry 0; it and every later `policy` entry is well formed,
     with screened keys; each governs the entries after it;
  5. per kind: every admit's attestation verifies under the trust store and matches the entry
     (unless `attestations=False`); withdrawals name an admitted, not yet withdrawn contribution
     and its admit leaf; epochs count up from 0; spends name an eligible contribution, carry the
     policy's accountant, δ and q, σ_eff at least the signed σ, a cumulative ε that never falls and
     never exceeds the signed budget, and, given an accountant, at least what the recorded history
     implies (the seam `SpendAccountant`);
  6. the root of every checkpointed prefix equals the checkpoint's root, and every checkpoint is a
     signed note by a ledger key of the policy in force, for the policy's origin;
  7. the last checkpoint covers every entry (the ledger signs each state it reaches: an unsigned
     tail is a forgery) and no checkpoint covers entries the ledger lacks (truncation);
  8. every checkpoint the auditor already trusts is signed by the ledger's key and is a prefix of
     this ledger (else rollback or fork);
  9. exactly the entries each compaction summarized were redacted (range hash and count);
 10. the admissions, withdrawals and summaries indexes say exactly what the entries say.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import ledger_store
from govtrain.errors import Code, GovtrainError, IntegrityError
from govtrain.gate.gate import Gate
from govtrain.ledger.checkpoint import Checkpoint, NoteError, verify_checkpoint
from govtrain.ledger.entries import decode_entry
from govtrain.ledger.ledger import note_keys, store_errors
from govtrain.mechanisms import MECHANISMS
from govtrain.policy.model import Policy
from govtrain.ledger.merkle import CompactRange, root_of
from govtrain.verify.integrity import NOT_CHECKED, _Failure, _integrity

# (accountant name, delta_p, [(sampling_rate_u, noise_multiplier_u, steps), ...]) -> epsilon in
# micro-units, rounded up. Issue 4's accountants plug in here.
SpendAccountant = Callable[[str, int, Sequence[tuple[int, int, int]]], int]

REDACTABLE = frozenset(("admit", "spend", "withdraw"))


@dataclass
class VerificationReport:
    url: str
    entries: int = 0
    admissions: int = 0
    withdrawals: int = 0
    checkpoints: int = 0
    epochs: int = 0
    redacted: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    attestations_verified: bool = True
    spend_recomputed: bool = False
    trusted_checkpoints: int = 0
    error: GovtrainError | None = None
    bad_seq: int | None = None
    bad_checkpoint: int | None = None
    not_checked: tuple[str, ...] = ()  # what an integrity-only pass leaves to the full pass

    @property
    def ok(self) -> bool:
        return self.error is None

    def as_json(self) -> dict:
        report = {
            "ok": self.ok, "ledger": self.url, "entries": self.entries, "admissions": self.admissions,
            "withdrawals": self.withdrawals, "checkpoints": self.checkpoints, "epochs": self.epochs,
            "redacted": self.redacted, "by_kind": dict(sorted(self.by_kind.items())),
            "attestations_verified": self.attestations_verified, "spend_recomputed": self.spend_recomputed,
            "trusted_checkpoints": self.trusted_checkpoints,
        }
        if self.not_checked:
            report["not_checked"] = list(self.not_checked)
        if self.error is not None:
            report.update(code=self.error.code.value, detail=self.error.detail, first_bad_entry=self.bad_seq,
                          bad_checkpoint=self.bad_checkpoint)
        return report


@dataclass
class _Contribution:
    seq: int
    leaf: bytes
    data_class: str
    noise_multiplier_u: int
    eps_budget_u: int
    withdrawn_at: int | None = None
    eps_u: int = 0
    epochs: set[int] = field(default_factory=set)
    history: list[tuple[int, int, int]] = field(default_factory=list)


def verify_ledger(url: str, **options) -> VerificationReport:
    """Audit the ledger at `url`; raises `IntegrityError` naming the first bad entry or checkpoint."""
    report = inspect_ledger(url, **options)
    if report.error is not None:
        raise report.error
    return report


def recorded_accountant(accountant: str, delta_p: int, history: Sequence[tuple[int, int, int]]) -> int:
    """The default `SpendAccountant`: govtrain's own accountants, cached across contributions."""
    from govtrain.accounting.accountants import spend_epsilon_u

    return spend_epsilon_u(accountant, delta_p, history)


def inspect_ledger(url: str, *, trusted_checkpoints: Sequence[str] = (), attestations: bool = True,
                   accountant: SpendAccountant | None = recorded_accountant,
                   integrity_only: bool = False) -> VerificationReport:
    """Audit the ledger at `url` and return a report for display (the error, if any, inside it).

    Every recorded spend is recomputed from its recorded parameters with the recorded accountant
    (`accountant`; pass None to skip that, the one step that costs accountant time).

    `integrity_only` checks steps 1, 2, 6, 7 and 8 (sequence, leaf hashes, roots, checkpoint signatures,
    truncation, unsigned tails, trusted checkpoints) and each body's kind against its row, without decoding
    entries: the structure an auditor can check for millions of entries in seconds. What it leaves to the
    full pass is listed in the report (`integrity.NOT_CHECKED`).
    """
    with store_errors():
        store = ledger_store.LedgerStore.open(url)
    report = VerificationReport(url=store.url, attestations_verified=attestations and not integrity_only,
                                spend_recomputed=accountant is not None and not integrity_only,
                                not_checked=NOT_CHECKED if integrity_only else ())
    try:
        if integrity_only:
            _integrity(store, report, trusted_checkpoints)
        else:
            _Audit(store, report, attestations, accountant).run(trusted_checkpoints)
    except _Failure as e:
        report.error, report.bad_seq, report.bad_checkpoint = e, e.seq, e.checkpoint
    except IntegrityError as e:
        report.error = e
    finally:
        store.close()
    return report


class _Audit:
    def __init__(self, store: ledger_store.LedgerStore, report: VerificationReport, attestations: bool,
                 accountant: SpendAccountant | None) -> None:
        self.store, self.report = store, report
        self.attestations, self.accountant = attestations, accountant
        self.policy: Policy | None = None
        self.gate: Gate | None = None
        self.contributions: dict[str, _Contribution] = {}
        self.descriptors: dict[bytes, int] = {}
        self.data_files: dict[bytes, int] = {}
        self.epoch = 0
        self.summaries: dict[tuple[int, int], list[dict]] = {}
        self.redacted: list[tuple[int, str, bytes]] = []
        self.tree = CompactRange()
        self.verified_checkpoints: list[tuple[int, bytes]] = []  # (size, root) that matched

    def run(self, trusted: Sequence[str]) -> None:
        checkpoints = self.store.checkpoints()
        self.report.checkpoints = len(checkpoints)
        for earlier, later in zip(checkpoints, checkpoints[1:]):
            if later.size < earlier.size:
                raise _Failure(Code.BAD_CHECKPOINT, f"checkpoint {later.id} (size {later.size}) is smaller than "
                               f"checkpoint {earlier.id} (size {earlier.size}): the log shrank", checkpoint=later.id)
        pending = list(checkpoints)
        position = 0
        for stored in self.store.entries():
            self._entry(stored)
            while position < len(pending) and pending[position].size == self.tree.size:
                self._checkpoint(pending[position])
                position += 1
        total = self.tree.size
        self.report.entries = total
        if total == 0:
            raise _Failure(Code.BAD_LEDGER_HEADER, "the ledger is empty: entry 0 (header) is missing", seq=0)
        # 7. Truncation and unsigned tails.
        if position < len(pending):
            raise _Failure(Code.TRUNCATED, f"checkpoint {pending[position].id} signs {pending[position].size} "
                           f"entries but the ledger holds {total}: entries from {total} on were removed",
                           seq=total, checkpoint=pending[position].id)
        signed = checkpoints[-1].size if checkpoints else 0
        if signed < total:
            raise _Failure(Code.UNSIGNED_TAIL, f"entries {signed}..{total - 1} are covered by no signed "
                           "checkpoint: the ledger signs every state it reaches, so they were not written by it",
                           seq=signed)
        self._trusted(trusted, total)
        self._redactions()
        self._indexes()
        self.report.admissions = len(self.contributions)
        self.report.withdrawals = sum(1 for c in self.contributions.values() if c.withdrawn_at is not None)
        self.report.epochs = self.epoch
        self.report.redacted = len(self.redacted)

    # -- steps 1-5 ----------------------------------------------------------------------

    def _entry(self, stored: ledger_store.StoredEntry) -> None:
        seq = stored.seq
        if seq != self.tree.size:  # 1.
            raise _Failure(Code.SEQUENCE_GAP, f"entry {self.tree.size} is missing (next stored is {seq})",
                           seq=self.tree.size)
        self.tree.append(stored.leaf_hash)
        self.report.by_kind[stored.kind] = self.report.by_kind.get(stored.kind, 0) + 1
        if stored.body is None:  # 2. (checked against summaries in step 9)
            if stored.kind not in REDACTABLE:
                raise _Failure(Code.BAD_ENTRY, f"entry {seq} ({stored.kind}) has no body; only admit, spend and "
                               "withdraw entries may be redacted", seq=seq)
            self.redacted.append((seq, stored.kind, stored.leaf_hash))
            return
        if ledger_store.leaf_hash(stored.body) != stored.leaf_hash:
            raise _Failure(Code.LEAF_HASH_MISMATCH, f"entry {seq}: stored leaf hash does not match its body", seq=seq)
        try:  # 3.
            entry = decode_entry(stored.body, seq=seq, kind=stored.kind)
        except IntegrityError as e:
            raise _Failure(e.code, e.detail, seq=seq) from e
        if entry["time"] != stored.time:
            raise _Failure(Code.BAD_ENTRY, f"entry {seq}: time column disagrees with the entry", seq=seq)
        if (seq == 0) != (stored.kind == "header"):  # 4.
            raise _Failure(Code.BAD_LEDGER_HEADER, f"entry {seq}: the header must be entry 0 and only entry 0", seq=seq)
        try:
            getattr(self, f"_{stored.kind}")(seq, entry, stored.leaf_hash)
        except _Failure:
            raise
        except GovtrainError as e:
            raise _Failure(e.code, f"entry {seq}: {e.detail}", seq=seq) from e

    def _set_policy(self, seq: int, record: dict) -> None:
        try:
            self.policy = Policy.from_record(record)
        except GovtrainError as e:
            raise _Failure(Code.BAD_LEDGER_HEADER, f"entry {seq}: policy: {e.detail}", seq=seq) from e
        self.gate = Gate(self.policy)

    def _header(self, seq: int, entry: dict, leaf: bytes) -> None:
        self._set_policy(seq, entry["policy"])

    def _policy(self, seq: int, entry: dict, leaf: bytes) -> None:
        self._set_policy(seq, entry["policy"])

    def _admit(self, seq: int, entry: dict, leaf: bytes) -> None:
        assert self.gate is not None and self.policy is not None
        # Floors and class bounds from the recorded fields, whether or not attestations are re-verified.
        policy, cls = self.policy, self.policy.classes.get(entry["data_class"])
        if (cls is None or not entry["clip_norm_u"] <= cls.clip_norm_u <= policy.floor_max_clip_norm_u
                or not entry["noise_multiplier_u"] >= cls.min_noise_multiplier_u >= policy.floor_min_noise_multiplier_u
                or entry["eps_budget_u"] > cls.max_eps_budget_u):
            raise _Failure(Code.BAD_ADMISSION, f"entry {seq}: recorded bounds are looser than its class and the "
                           "corpus floors allow", seq=seq)
        if self.attestations:
            try:
                verified = self.gate.verify(entry["attestation"], now=entry["time"])
            except GovtrainError as e:
                raise _Failure(Code.BAD_ADMISSION, f"entry {seq}: attestation rejected: "
                               f"error[{e.code.value}] {e.detail}", seq=seq) from e
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
                    raise _Failure(Code.BAD_ADMISSION, f"entry {seq}: {name} differs from the signed descriptor",
                                   seq=seq)
        for seen, key, what in ((self.contributions, entry["contribution_id"], "contribution id"),
                                (self.descriptors, entry["descriptor_sha256"], "descriptor"),
                                (self.data_files, entry["data_sha256"], "data file")):
            if key in seen:
                first = seen[key].seq if isinstance(seen[key], _Contribution) else seen[key]
                raise _Failure(Code.BAD_ADMISSION, f"entry {seq}: {what} already admitted by entry {first}", seq=seq)
        self.descriptors[entry["descriptor_sha256"]] = seq
        self.data_files[entry["data_sha256"]] = seq
        self.contributions[entry["contribution_id"]] = _Contribution(
            seq, leaf, entry["data_class"], entry["noise_multiplier_u"], entry["eps_budget_u"])

    def _withdraw(self, seq: int, entry: dict, leaf: bytes) -> None:
        c = self.contributions.get(entry["contribution_id"])
        if c is None or c.leaf != entry["admit_leaf"]:
            raise _Failure(Code.BAD_WITHDRAWAL, f"entry {seq} withdraws a contribution the ledger did not admit "
                           "before it (or names the wrong admit leaf)", seq=seq)
        if c.withdrawn_at is not None:
            raise _Failure(Code.BAD_WITHDRAWAL, f"entry {seq}: already withdrawn by entry {c.withdrawn_at}", seq=seq)
        c.withdrawn_at = seq

    def _epoch(self, seq: int, entry: dict, leaf: bytes) -> None:
        if entry["epoch"] != self.epoch:
            raise _Failure(Code.BAD_EPOCH, f"entry {seq} closes epoch {entry['epoch']}, expected {self.epoch}", seq=seq)
        self.epoch += 1

    def _spend(self, seq: int, entry: dict, leaf: bytes) -> None:
        assert self.policy is not None
        c = self.contributions.get(entry["contribution_id"])

        def bad(detail: str) -> _Failure:
            return _Failure(Code.BAD_SPEND, f"entry {seq}: {detail}", seq=seq)

        if c is None or c.leaf != entry["admit_leaf"]:
            raise bad("spend for a contribution not admitted before it")
        if c.withdrawn_at is not None:
            raise bad(f"spend for a contribution withdrawn by entry {c.withdrawn_at}")
        if entry["epoch"] != self.epoch or entry["epoch"] in c.epochs:
            raise bad(f"spend for epoch {entry['epoch']} written during epoch {self.epoch}, or twice")
        if entry["accountant"] != self.policy.accountant or entry["delta_p"] != self.policy.delta_p:
            raise bad("accountant or delta differs from the policy's")
        if self.policy.sampling_rate_u is not None and entry["sampling_rate_u"] != self.policy.sampling_rate_u:
            raise bad("sampling rate differs from the policy's")
        if entry["noise_multiplier_u"] < c.noise_multiplier_u:
            raise bad("effective noise multiplier is below the one the contributor signed")
        if entry["eps_u"] < c.eps_u:
            raise bad("cumulative epsilon went down: spend is never refunded")
        if entry["eps_u"] > c.eps_budget_u:
            raise bad(f"cumulative epsilon {entry['eps_u']} exceeds the signed budget {c.eps_budget_u}")
        c.history.append((entry["sampling_rate_u"], entry["noise_multiplier_u"], entry["steps"]))
        if self.accountant is not None:
            implied = self.accountant(entry["accountant"], entry["delta_p"], c.history)
            if entry["eps_u"] < implied:
                raise bad(f"records epsilon {entry['eps_u']} but its parameters imply at least {implied}")
        c.epochs.add(entry["epoch"])
        c.eps_u = entry["eps_u"]

    def _summary(self, seq: int, entry: dict, leaf: bytes) -> None:
        if not entry["first_seq"] <= entry["last_seq"] < seq or entry["before_epoch"] > self.epoch:
            raise _Failure(Code.BAD_SUMMARY, f"entry {seq} summarizes a range or epoch not behind it", seq=seq)
        self.summaries.setdefault((entry["first_seq"], entry["last_seq"]), []).append({**entry, "seq": seq})

    def _run(self, seq: int, entry: dict, leaf: bytes) -> None:
        # Shape checked in step 3. Every mechanism releases one Gaussian mechanism per step with the
        # sensitivity and noise the spend entries charge; a run naming any other was not charged for.
        if entry["mechanism"] not in MECHANISMS:
            raise _Failure(Code.BAD_ENTRY, f"entry {seq}: run {entry['run_id']!r} names mechanism "
                           f"{entry['mechanism']!r}, which is none of {', '.join(MECHANISMS)}", seq=seq)

    # -- steps 6-10 ---------------------------------------------------------------------

    def _checkpoint(self, stored: ledger_store.StoredCheckpoint) -> None:
        assert self.policy is not None
        try:
            checkpoint = verify_checkpoint(stored.note, origin=self.policy.origin, keys=note_keys(self.policy))
        except NoteError as e:
            raise _Failure(Code.BAD_CHECKPOINT, f"checkpoint {stored.id} (size {stored.size}): {e.detail}",
                           checkpoint=stored.id, seq=self._last_good_size()) from e
        root = self.tree.root()
        if checkpoint.size != stored.size or checkpoint.root != stored.root or root != checkpoint.root:
            raise _Failure(Code.BAD_CHECKPOINT, f"checkpoint {stored.id}: the root of the first {stored.size} "
                           f"entries is not the signed root; an entry from {self._last_good_size()} on was altered",
                           checkpoint=stored.id, seq=self._last_good_size())
        self.verified_checkpoints.append((stored.size, root))

    def _last_good_size(self) -> int:
        return self.verified_checkpoints[-1][0] if self.verified_checkpoints else 0

    def _trusted(self, notes: Sequence[str], total: int) -> None:
        assert self.policy is not None
        roots = dict(self.verified_checkpoints)
        agreed = 0
        parsed: list[Checkpoint] = []
        for note in notes:
            try:
                parsed.append(verify_checkpoint(note, origin=self.policy.origin, keys=note_keys(self.policy)))
            except NoteError as e:
                raise _Failure(Code.FORK, f"a trusted checkpoint is not signed by this ledger's key for its "
                               f"origin ({e.detail}): this is not the ledger it came from") from e
        self.report.trusted_checkpoints = len(parsed)
        for checkpoint in sorted(parsed, key=lambda c: c.size):
            if checkpoint.size > total:
                raise _Failure(Code.ROLLBACK, f"a trusted checkpoint signs {checkpoint.size} entries but this "
                               f"ledger holds {total}: it was rolled back", seq=total)
            root = roots.get(checkpoint.size)
            if root is None:
                root = root_of(self.store.leaf_hashes(0, checkpoint.size))
            if root != checkpoint.root:
                raise _Failure(Code.FORK, f"the first {checkpoint.size} entries are not the ones the trusted "
                               f"checkpoint signed: the ledger forked after entry {agreed - 1}", seq=agreed)
            agreed = checkpoint.size

    def _redactions(self) -> None:
        ranges = sorted(self.summaries)
        for seq, kind, _ in self.redacted:
            if not any(first <= seq <= last for first, last in ranges):
                raise _Failure(Code.BAD_ENTRY, f"entry {seq} was redacted but no summary covers it", seq=seq)
        for (first, last), group in self.summaries.items():
            inside = [(seq, leaf) for seq, _, leaf in self.redacted if first <= seq <= last]
            digest = hashlib.sha256(b"".join(leaf for _, leaf in inside)).digest()
            if any(s["range_sha256"] != digest for s in group) or sum(s["entries"] for s in group) != len(inside):
                raise _Failure(Code.BAD_SUMMARY, f"summary entry {group[0]['seq']}: the entries redacted in "
                               f"{first}..{last} are not the ones it summarized", seq=group[0]["seq"])

    def _indexes(self) -> None:
        # Index rows for redacted entries cannot be checked against a body; they must point at a
        # redacted entry of their kind, one row each.
        redacted = {kind: {seq for seq, k, _ in self.redacted if k == kind} for kind in ("admit", "withdraw")}
        admissions = {r.contribution_id: r.seq for r in self.store.admissions()}
        live = {cid: c.seq for cid, c in self.contributions.items()}
        gone = {cid: seq for cid, seq in admissions.items() if cid not in live}
        if ({cid: admissions.get(cid) for cid in live} != live or set(gone.values()) != redacted["admit"]
                or len(gone) != len(redacted["admit"])):
            differing = set(admissions.values()) ^ (set(live.values()) | redacted["admit"])
            raise _Failure(Code.INDEX_MISMATCH, "the admissions index disagrees with the admit entries",
                           seq=min(differing, default=None))
        withdrawals = self.store.withdrawals()
        expected = {cid: c.withdrawn_at for cid, c in self.contributions.items() if c.withdrawn_at is not None}
        if ({cid: withdrawals.get(cid) for cid in expected} != expected
                or {seq for cid, seq in withdrawals.items() if cid not in expected} != redacted["withdraw"]):
            raise _Failure(Code.INDEX_MISMATCH, "the withdrawals index disagrees with the withdraw entries")
        summaries = {(seq, cls, first, last) for seq, cls, first, last in self.store.summaries()}
        if summaries != {(s["seq"], s["data_class"], s["first_seq"], s["last_seq"])
                         for group in self.summaries.values() for s in group}:
            raise _Failure(Code.INDEX_MISMATCH, "the summaries index disagrees with the summary entries")
