"""The verifier's full pass (docs/design.md §6, steps 1 to 10 as `verifier.py` lists them): one pass over the
entries, checking each by its kind's rules (steps 1-5), the checkpoints as the pass reaches their sizes
(`checkpoint_audit.py`, steps 6-8) and retention (`retention.py`, steps 9-10). `verifier.inspect_ledger` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import ledger_store
from govtrain.privatizers.charges import check_record, spend_item
from govtrain.errors import Code, ConfigError, GovtrainError, IntegrityError
from govtrain.gate.gate import Gate
from govtrain.ledger.entries import DEVICE, PRECISIONS, decode_entry
from govtrain.ledger.policy_chain import fixed_terms_changed
from govtrain.ledger.retention import Redacted
from govtrain.ledger.spend_rules import SpendBook, SpendRuleError, min_sampling_rate_u
from govtrain.ledger.tuning import TuneBook, TuneRuleError
from govtrain.ledger.entries import MECHANISMS
from govtrain.policy.model import Policy
from govtrain.verify.checkpoint_audit import CheckpointAudit
from govtrain.verify.report import SpendAccountant, VerificationReport, _Failure
from govtrain.verify.retention import RetentionAudit

REDACTABLE = frozenset(("admit", "spend", "withdraw"))


@dataclass
class _Contribution:
    seq: int
    leaf: bytes
    data_class: str
    noise_multiplier_u: int
    eps_budget_u: int
    records: int
    withdrawn_at: int | None = None
    eps_u: int = 0
    epochs: set[int] = field(default_factory=set)
    history: list[tuple[int, int, int]] = field(default_factory=list)


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
        self.redacted: list[tuple[int, str, bytes]] = []
        self.retention = RetentionAudit(store)
        self.retired = self.retention.retired  # admit seq -> the `retired` map of its summary (read before the pass)
        self.redacted_index = Redacted.of(())  # the same maps by the seq of each entry they retire, once read
        self.retired_contributions: dict[str, _Contribution] = {}  # those whose admit body was dropped
        self.signed = CheckpointAudit(store, report)  # steps 6-8; the pass feeds its tree and policies
        self.tree, self.policies, self.unauthorised = self.signed.tree, self.signed.policies, self.signed.unauthorised
        self.book = SpendBook()
        self.tunes = TuneBook()
        self.live_records = 0  # records of the contributions admitted and not withdrawn, so far
        self.last_time = 0

    def run(self, trusted: Sequence[str]) -> None:
        checkpoints = self.store.checkpoints()
        self.report.checkpoints = len(checkpoints)
        for earlier, later in zip(checkpoints, checkpoints[1:]):
            if later.size < earlier.size:
                raise _Failure(Code.BAD_CHECKPOINT, f"checkpoint {later.id} (size {later.size}) is smaller than "
                               f"checkpoint {earlier.id} (size {earlier.size}): the log shrank", checkpoint=later.id)
        pending = list(checkpoints)
        position = 0
        self.retention.read()
        self.redacted_index = Redacted.of(self.retired.values())
        for stored in self.store.entries():
            self._entry(stored)
            while position < len(pending) and pending[position].size == self.tree.size:
                self._checkpoint(pending[position])
                position += 1
        self._epoch_schedule()  # the open epoch's
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
            self.retention.redacted(stored, {"contribution_id": self.contributions,
                                             "descriptor_sha256": self.descriptors, "data_sha256": self.data_files})
            self._redacted_entry(stored)
            return
        if ledger_store.leaf_hash(stored.body) != stored.leaf_hash:
            raise _Failure(Code.LEAF_HASH_MISMATCH, f"entry {seq}: stored leaf hash does not match its body", seq=seq)
        try:  # 3.
            entry = decode_entry(stored.body, seq=seq, kind=stored.kind)
        except IntegrityError as e:
            raise _Failure(e.code, e.detail, seq=seq) from e
        if entry["time"] != stored.time:
            raise _Failure(Code.BAD_ENTRY, f"entry {seq}: time column disagrees with the entry", seq=seq)
        if entry["time"] < self.last_time:
            raise _Failure(Code.TIME_REVERSED, f"entry {seq} is dated {entry['time']}, before the entry ahead of it "
                           f"({self.last_time}): a ledger's times never go back", seq=seq)
        self.last_time = entry["time"]
        if (seq == 0) != (stored.kind == "header"):  # 4.
            raise _Failure(Code.BAD_LEDGER_HEADER, f"entry {seq}: the header must be entry 0 and only entry 0", seq=seq)
        self.retention.names(stored, entry)  # 9. nothing names a retired contribution
        try:
            getattr(self, f"_{stored.kind}")(seq, entry, stored.leaf_hash)
        except _Failure:
            raise
        except GovtrainError as e:
            raise _Failure(e.code, f"entry {seq}: {e.detail}", seq=seq) from e

    def _redacted_entry(self, stored: ledger_store.StoredEntry) -> None:
        """A redacted entry counts, for the rules later entries meet (step 5), as its summary recorded it: a
        later spend or tune was written while its body was there, and the rules it met then still hold. An admit
        or withdrawal moves the live records that bound q, and an admit brings the signed bounds; a spend is
        checked as its body was (`_charge`: its lease, its hold on the epoch, steps, budget, the accountant, the
        schedule it justifies), and counts in a later tune's total."""
        index, seq = self.redacted_index, stored.seq
        if stored.kind == "admit" and seq in index.admits:
            r = index.admits[seq]
            self.live_records += self.policy.sampling_units(r["records"])
            self.book.admit(r["contribution_id"], r["data_class"], r["clip_norm_u"], r["noise_multiplier_u"])
            self.tunes.admit(r["data_sha256"])
            self.retired_contributions.setdefault(r["contribution_id"], _Contribution(
                seq, stored.leaf_hash, r["data_class"], r["noise_multiplier_u"], r["eps_budget_u"], r["records"]))
        elif stored.kind == "withdraw" and seq in index.withdrawals:
            r = index.withdrawals[seq]
            self.live_records -= self.policy.sampling_units(r["records"])
            retired = self.retired_contributions.get(r["contribution_id"])
            if retired is not None:
                retired.withdrawn_at = seq
        elif stored.kind == "spend" and seq in index.spends:  # held to every rule its body met
            r = index.spends[seq][0]
            c = self.retired_contributions.get(r["contribution_id"])
            if c is None:
                raise _Failure(Code.BAD_SUMMARY, f"entry {seq} (redacted) is a spend of {r['contribution_id']!r}, "
                               "whose admit entry its summary does not retire before it", seq=seq)
            entry = index.spend_entry(seq, accountant=self.policy.accountant, delta_p=self.policy.delta_p,
                                      privacy_unit=self.policy.privacy_unit)
            self._charge(seq, entry, c, f"entry {seq} (redacted, as its summary records it)")

    def _set_policy(self, seq: int, record: dict) -> None:
        previous = self.policy
        try:
            self.policy = Policy.from_record(record)
        except GovtrainError as e:
            raise _Failure(Code.BAD_LEDGER_HEADER, f"entry {seq}: policy: {e.detail}", seq=seq) from e
        fixed = fixed_terms_changed(previous, self.policy) if previous is not None else None
        if fixed is not None:
            raise _Failure(Code.POLICY_UNAUTHORISED, f"entry {seq}: a policy change may not change {fixed}", seq=seq)
        if previous is not None:
            self.unauthorised.append((seq, previous))  # step 6: the next checkpoint must carry its signature
        self.policies.append((seq, self.policy))
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
        self.retention.admit(seq, entry)  # 9. not a replay of a retired contribution
        for seen, key, what in ((self.contributions, entry["contribution_id"], "contribution id"),
                                (self.descriptors, entry["descriptor_sha256"], "descriptor"),
                                (self.data_files, entry["data_sha256"], "data file")):
            if key in seen:
                first = seen[key].seq if isinstance(seen[key], _Contribution) else seen[key]
                raise _Failure(Code.BAD_ADMISSION, f"entry {seq}: {what} already admitted by entry {first}", seq=seq)
        self.descriptors[entry["descriptor_sha256"]] = seq
        self.data_files[entry["data_sha256"]] = seq
        self.tunes.admit(entry["data_sha256"])
        self.contributions[entry["contribution_id"]] = _Contribution(
            seq, leaf, entry["data_class"], entry["noise_multiplier_u"], entry["eps_budget_u"], entry["records"])
        self.live_records += self.policy.sampling_units(entry["records"])
        self.book.admit(entry["contribution_id"], entry["data_class"], entry["clip_norm_u"], entry["noise_multiplier_u"])

    def _withdraw(self, seq: int, entry: dict, leaf: bytes) -> None:
        c = self.contributions.get(entry["contribution_id"])
        if c is None or c.leaf != entry["admit_leaf"]:
            raise _Failure(Code.BAD_WITHDRAWAL, f"entry {seq} withdraws a contribution the ledger did not admit "
                           "before it (or names the wrong admit leaf)", seq=seq)
        if c.withdrawn_at is not None:
            raise _Failure(Code.BAD_WITHDRAWAL, f"entry {seq}: already withdrawn by entry {c.withdrawn_at}", seq=seq)
        c.withdrawn_at = seq
        self.live_records -= self.policy.sampling_units(c.records)

    def _epoch(self, seq: int, entry: dict, leaf: bytes) -> None:
        if entry["epoch"] != self.epoch:
            raise _Failure(Code.BAD_EPOCH, f"entry {seq} closes epoch {entry['epoch']}, expected {self.epoch}", seq=seq)
        self._epoch_schedule()
        self.epoch += 1
        self.retention.epoch(seq)

    def _spend(self, seq: int, entry: dict, leaf: bytes) -> None:
        c = self.contributions.get(entry["contribution_id"])
        if c is None or c.leaf != entry["admit_leaf"]:
            raise _Failure(Code.BAD_SPEND, f"entry {seq}: spend for a contribution not admitted before it", seq=seq)
        self._charge(seq, entry, c, f"entry {seq}")

    def _charge(self, seq: int, entry: dict, c: _Contribution, where: str) -> None:
        """Every rule a spend of `c` meets (step 5): its body, or a redacted one as its summary recorded it."""
        assert self.policy is not None

        def bad(detail: str) -> _Failure:
            return _Failure(Code.BAD_SPEND, f"{where}: {detail}", seq=seq)

        if c.withdrawn_at is not None:
            raise bad(f"spend for a contribution withdrawn by entry {c.withdrawn_at}")
        if entry["accountant"] != self.policy.accountant or entry["delta_p"] != self.policy.delta_p:
            raise bad("accountant or delta differs from the policy's")
        if entry["privacy_unit"] != self.policy.privacy_unit:
            raise bad(f"privacy unit {entry['privacy_unit']!r} differs from the header's {self.policy.privacy_unit!r}")
        if self.policy.sampling_rate_u is not None and entry["sampling_rate_u"] != self.policy.sampling_rate_u:
            raise bad("sampling rate differs from the policy's")
        if entry["noise_multiplier_u"] < c.noise_multiplier_u:
            raise bad("effective noise multiplier is below the one the contributor signed")
        if entry["eps_u"] > c.eps_budget_u:
            raise bad(f"cumulative ε {entry['eps_u']} exceeds the signed budget {c.eps_budget_u}")
        try:  # the charge follows from the record, through its rule (privatizers/charges.py, privatizers/rules.py)
            item = spend_item(entry)
        except ConfigError as e:
            raise _Failure(Code.BAD_PRIVATIZER, f"{where}: {e.detail}", seq=seq) from e
        floor = (min_sampling_rate_u(self.policy.expected_batch_size, self.live_records)
                 if self.policy.expected_batch_size is not None else None)
        try:
            self.book.check(entry, ledger_epoch=self.epoch, steps_per_epoch=self.policy.steps_per_epoch,
                            min_rate_u=floor, classes=self.policy.classes)
            self.tunes.check_spend(entry)
        except (SpendRuleError, TuneRuleError) as e:
            raise bad(e.detail) from e
        self.book.add(entry, seq)
        self.tunes.spend(entry, c.data_class)
        c.history.append(item)
        if self.accountant is not None:
            implied = self._implied(seq, where, entry, c.history)
            if entry["eps_u"] < implied:
                raise bad(f"records ε {entry['eps_u']} but its parameters and privatizer imply at least {implied}")
            if entry["steps"] < entry["epoch_steps"]:  # charged for part of the epoch: only where it retires
                one_more = self._implied(seq, where, entry, [*c.history[:-1], spend_item(
                    {**entry, "steps": entry["steps"] + 1})])
                if one_more <= c.eps_budget_u:
                    raise bad(f"charged for {entry['steps']} of the epoch's {entry['epoch_steps']} steps, yet its budget "
                              f"allows another ({one_more} <= {c.eps_budget_u}): only a retiring contribution is "
                              "charged for part of an epoch")
        c.epochs.add(entry["epoch"])
        c.eps_u = entry["eps_u"]

    def _implied(self, seq: int, where: str, entry: dict, history: list) -> int:
        assert self.accountant is not None
        try:
            return self.accountant(entry["accountant"], entry["delta_p"], history)
        except ConfigError as e:  # a family this installation has no accountant for
            raise _Failure(Code.BAD_PRIVATIZER, f"{where}: {e.detail}", seq=seq) from e

    def _epoch_schedule(self) -> None:
        """Rule 7's bound on the current epoch's s_g, once all its spend is in (at its `epoch` entry, or at the end
        of the ledger for the open epoch); a failure names the epoch's first spend entry."""
        try:
            self.book.check_schedule(self.epoch)
        except SpendRuleError as e:
            seq = self.book.epochs[self.epoch].first_seq
            raise _Failure(Code.BAD_SPEND, f"entry {seq}: {e.detail}", seq=seq) from e

    def _summary(self, seq: int, entry: dict, leaf: bytes) -> None:
        assert self.policy is not None
        self.retention.summary(seq, entry, self.policy, self.epoch)

    def _run(self, seq: int, entry: dict, leaf: bytes) -> None:
        # Shape checked in step 3. Every mechanism releases one Gaussian mechanism per step with the
        # sensitivity and noise the spend entries charge; a run naming any other was not charged for.
        if entry["mechanism"] not in MECHANISMS:
            raise _Failure(Code.BAD_ENTRY, f"entry {seq}: run {entry['run_id']!r} names mechanism "
                           f"{entry['mechanism']!r}, which is none of {', '.join(MECHANISMS)}", seq=seq)
        if entry["precision"] not in PRECISIONS or not DEVICE.fullmatch(entry["device"]):
            raise _Failure(Code.BAD_ENTRY, f"entry {seq}: run {entry['run_id']!r} records device {entry['device']!r} "
                           f"and precision {entry['precision']!r}: cpu or cuda:N, and one of {', '.join(PRECISIONS)}",
                           seq=seq)
        try:  # the record's rule, torch-free (privatizers/rules.py); an entry without one is the i.i.d. Gaussian's
            if "privatizer" in entry:
                check_record(entry["privatizer"])
        except ConfigError as e:
            raise _Failure(Code.BAD_PRIVATIZER, f"entry {seq}: run {entry['run_id']!r}: {e.detail}", seq=seq) from e
        try:  # a run id is a one-time lease: one run entry, under the nonce its spend carries
            self.book.check_run(entry)
        except SpendRuleError as e:
            raise _Failure(Code.BAD_RUN, f"entry {seq}: {e.detail}", seq=seq) from e
        self.book.add_run(entry)
        self.tunes.run(entry)

    def _tune(self, seq: int, entry: dict, leaf: bytes) -> None:
        # The trials' spend entries were each checked above (step 5); the tune must say what they charged.
        try:
            self.tunes.check(entry)
        except TuneRuleError as e:
            raise _Failure(Code.BAD_TUNE, f"entry {seq}: {e.detail}", seq=seq) from e
        self.tunes.add(seq, entry)

    # -- steps 6-10 ---------------------------------------------------------------------

    def _checkpoint(self, stored: ledger_store.StoredCheckpoint) -> None:
        assert self.policy is not None
        self.signed.check(stored, self.policy)

    def policy_at(self, size: int) -> Policy:
        """The policy in force after the first `size` entries."""
        return self.signed.policy_at(size)

    def _last_good_size(self) -> int:
        return self.signed.last_good_size()

    def _trusted(self, notes: Sequence[str], total: int) -> None:
        assert self.policy is not None
        self.signed.trusted(notes, total)

    def _redactions(self) -> None:
        self.retention.redactions(self.redacted)

    def _indexes(self) -> None:
        self.retention.indexes({cid: c.withdrawn_at for cid, c in self.contributions.items()
                                if c.withdrawn_at is not None})
