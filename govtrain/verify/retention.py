"""Steps 9 and 10 of the verifier (docs/design.md §6): retention, and the indexes that retention leaves behind.

A summary commits to the contributions it retires (`govtrain.ledger.retention`). The verifier reads
every summary before its pass (`RetentionAudit.read`), so that when the pass meets a redacted entry
it knows which contribution it belonged to; and it holds each summary to:

  9a. the retention horizon: before_epoch <= current epoch - retention_epochs where the summary stands,
      and everything it retires before the `epoch` entry that closes epoch before_epoch - 1;
  9b. whole contributions: each retired once, its entries all redacted or all present (never a mix),
      and no entry naming it after the last one listed; every redacted entry one that a summary retired;
  9c. its counts, entries_sha256 and its compaction's first_seq, last_seq and range_sha256, over the
      leaf hashes (always); every other field recomputed from the bodies while they are present;
  9d. no later admit sharing a retired contribution's id, descriptor, attestation or data digest;
 10.  every column of the admissions, withdrawals and summaries indexes: from the entry bodies, or for
      a redacted entry from what its summary committed to (the gate reads these rows).
"""

from __future__ import annotations

from typing import Mapping

import ledger_store
from govtrain.errors import Code, IntegrityError
from govtrain.ledger import retention
from govtrain.ledger.entries import decode_entry
from govtrain.policy.model import Policy
from govtrain.verify.report import _Failure


class RetentionAudit:
    def __init__(self, store: ledger_store.LedgerStore) -> None:
        self.store = store
        self.retired: dict[int, dict] = {}  # admit seq -> its summary's `retired` map, read before the pass
        self.summaries: dict[tuple[int, int], list[dict]] = {}  # (first_seq, last_seq) -> one compaction's
        self._claims: dict[int, int] = {}  # seq of every entry a summary lists -> its contribution's admit seq
        self._leaves: dict[int, bytes] = {}  # their leaf hashes
        self._gone: dict[int, str] = {}  # those redacted: seq -> kind
        self._held: dict[int, retention.Summarized] = {}  # those still present, until their summary is met
        self._named: dict[str, tuple[int, int]] = {}  # contribution id -> (entries naming it, the last one)
        self._retired_ids: dict[str, int] = {}  # contribution id -> admit seq, once the pass knows it retired
        self._retired_keys: dict[tuple[str, object], int] = {}  # (field, id or digest) -> admit seq
        self._summarized: set[int] = set()  # entries retired by the summaries met so far
        self._admission_rows: dict[int, tuple] = {}  # admit seq -> the admissions row its body implies
        self._epoch_seqs: list[int] = []  # seq of the entry closing each epoch

    def read(self) -> None:
        """`retired`, and the entries each summary lists, from the summaries' bodies. A body that does not
        hash to its leaf or does not decode is skipped here and reported when the pass reaches it."""
        for stored in self.store.entries(kinds=("summary",)):
            if stored.body is None or ledger_store.leaf_hash(stored.body) != stored.leaf_hash:
                continue
            try:
                entry = decode_entry(stored.body, seq=stored.seq, kind="summary")
            except IntegrityError:
                continue
            for r in entry["retired"]:
                if r["admit_seq"] not in self.retired:  # a second claim fails at its summary
                    self.retired[r["admit_seq"]] = r
                    for s in r["entry_seqs"]:
                        self._claims.setdefault(s, r["admit_seq"])

    # -- during the pass --------------------------------------------------------------------

    def redacted(self, stored: ledger_store.StoredEntry, admitted: Mapping[str, Mapping]) -> None:
        """A redacted entry (9b); `admitted` maps an admit field to the values live admits have used."""
        seq = stored.seq
        owner = self._claims.get(seq)
        if owner is None or (stored.kind == "admit") != (owner == seq):
            raise _Failure(Code.BAD_ENTRY, f"entry {seq} was redacted but no summary retires it", seq=seq)
        self._leaves[seq] = stored.leaf_hash
        self._gone[seq] = stored.kind
        if stored.kind == "admit":  # its body is gone: it, and what names it later, are held to its summary
            r = self.retired[seq]
            earlier = [name for name, seen in admitted.items() if r[name] in seen]
            earlier += [name for name in retention.RETIRED_KEYS if (name, r[name]) in self._retired_keys]
            if earlier:
                raise _Failure(Code.REPLAY, f"entry {seq} (redacted): its summary gives it the {earlier[0]} of an "
                               "earlier admission", seq=seq)
            self._retire(r)

    def names(self, stored: ledger_store.StoredEntry, entry: dict) -> None:
        """Every entry with a body: count the entries naming each contribution; none may name a retired one."""
        if stored.kind not in retention.REDACTABLE:
            return
        cid = entry["contribution_id"]
        if stored.kind != "admit" and cid in self._retired_ids:  # 9b.
            raise _Failure(Code.BAD_SUMMARY, f"entry {stored.seq} ({stored.kind}) names {cid!r}, which retention "
                           f"retired (admit entry {self._retired_ids[cid]}): a retired contribution never appears "
                           "again", seq=stored.seq)
        self._named[cid] = (self._named.get(cid, (0, -1))[0] + 1, stored.seq)
        if stored.seq in self._claims:
            self._held[stored.seq] = retention.Summarized(stored.seq, stored.leaf_hash, entry)
            self._leaves[stored.seq] = stored.leaf_hash

    def admit(self, seq: int, entry: dict) -> None:
        for name in retention.RETIRED_KEYS:  # 9d.
            retired = self._retired_keys.get((name, entry[name]))
            if retired is not None:
                raise _Failure(Code.REPLAY, f"entry {seq}: its {name} is that of the contribution admitted by entry "
                               f"{retired} and retired by retention; a retired contribution is never admitted again",
                               seq=seq)
        self._admission_rows[seq] = (entry["contribution_id"], seq, entry["data_class"], entry["descriptor_sha256"],
                                     entry["attestation_sha256"], entry["data_sha256"])

    def epoch(self, seq: int) -> None:
        self._epoch_seqs.append(seq)

    def summary(self, seq: int, entry: dict, policy: Policy, epoch: int) -> None:
        """A summary entry, in the policy and epoch in force where it stands."""

        def bad(detail: str) -> _Failure:
            return _Failure(Code.BAD_SUMMARY, f"summary entry {seq}: {detail}", seq=seq)

        # 9a.
        before, first, last = entry["before_epoch"], entry["first_seq"], entry["last_seq"]
        horizon = epoch - policy.retention_epochs
        if not 1 <= before <= horizon:
            raise bad(f"before_epoch {before} is beyond the retention horizon (epoch {epoch}, retention "
                      f"{policy.retention_epochs} epochs: at most {horizon})")
        if not first <= last < self._epoch_seqs[before - 1]:
            raise bad(f"summarizes {first}..{last}, not all before entry {self._epoch_seqs[before - 1]}, which "
                      f"closes epoch {before - 1}")
        # 9b.
        try:
            retention.check_structure(entry)
        except IntegrityError as e:
            raise bad(e.detail) from e
        present = []
        for r in entry["retired"]:
            seqs, cid = r["entry_seqs"], r["contribution_id"]
            if any(s in self._summarized or self._claims.get(s) != r["admit_seq"] for s in seqs):
                raise bad(f"retires an entry of {cid!r} that another summary retired")
            gone = [s in self._gone for s in seqs]
            if all(gone):
                kinds = ["admit"] + ["spend"] * (len(seqs) - 1)
                if r["withdraw_seq"] is not None:
                    kinds[-1] = "withdraw"
                if [self._gone[s] for s in seqs] != kinds:
                    raise bad(f"the redacted entries it lists for {cid!r} are not an admit, its spends and its "
                              "withdrawal")
            elif any(gone) or not all(s in self._held for s in seqs):
                raise bad(f"lists entries of {cid!r} that are neither all redacted nor all present admit, spend "
                          "and withdraw entries")
            else:
                present.append(r)
        if present and len(present) != len(entry["retired"]):
            raise bad("some of the contributions it retires were redacted and some were not")
        # 9c. (what the compaction shares is checked once all its summaries are met: `finish`)
        try:
            retention.check_leaves(entry, self._leaves)
            if present:
                named = {r["contribution_id"]: self._named.get(r["contribution_id"], (0, -1)) for r in present}
                retention.check_summary(entry, self._held, named)
        except IntegrityError as e:
            raise bad(e.detail) from e
        for r in entry["retired"]:
            self._retire(r)
            self._summarized.update(r["entry_seqs"])
            for s in r["entry_seqs"]:
                self._held.pop(s, None)
        self.summaries.setdefault((first, last), []).append({**entry, "seq": seq})

    def _retire(self, r: dict) -> None:
        self._retired_ids[r["contribution_id"]] = r["admit_seq"]
        for name in retention.RETIRED_KEYS:
            self._retired_keys.setdefault((name, r[name]), r["admit_seq"])

    # -- after the pass ---------------------------------------------------------------------

    def redactions(self, redacted: list[tuple[int, str, bytes]]) -> None:
        # 9b. Every redacted entry was retired by a summary the pass met; 9c. each compaction's shared fields.
        for seq, _, _ in redacted:
            if seq not in self._summarized:
                raise _Failure(Code.BAD_ENTRY, f"entry {seq} was redacted but no summary retires it", seq=seq)
        for group in self.summaries.values():
            try:
                retention.check_compaction(group, self._leaves)
            except IntegrityError as e:
                raise _Failure(Code.BAD_SUMMARY, f"summary entry {group[0]['seq']}: {e.detail}",
                               seq=group[0]["seq"]) from e

    def indexes(self, withdrawn: Mapping[str, int]) -> None:
        """10. `withdrawn`: contribution id -> seq of its withdraw entry, for the withdraw entries with bodies."""
        expected = dict(self._admission_rows)
        for seq, kind in self._gone.items():
            if kind == "admit":
                r = self.retired[seq]
                expected[seq] = (r["contribution_id"], seq, r["data_class"], r["descriptor_sha256"],
                                 r["attestation_sha256"], r["data_sha256"])
        actual = {(a.contribution_id, a.seq, a.data_class, a.descriptor_sha256, a.attestation_sha256, a.data_sha256)
                  for a in self.store.admissions()}
        differing = actual ^ set(expected.values())
        if differing:
            raise _Failure(Code.INDEX_MISMATCH, "the admissions index disagrees with the admit entries",
                           seq=min(row[1] for row in differing))
        rows = set(withdrawn.items()) | {(self.retired[self._claims[seq]]["contribution_id"], seq)
                                         for seq, kind in self._gone.items() if kind == "withdraw"}
        differing = set(self.store.withdrawals().items()) ^ rows
        if differing:
            raise _Failure(Code.INDEX_MISMATCH, "the withdrawals index disagrees with the withdraw entries",
                           seq=min(seq for _, seq in differing))
        differing = set(self.store.summaries()) ^ {(s["seq"], s["data_class"], s["first_seq"], s["last_seq"])
                                                   for group in self.summaries.values() for s in group}
        if differing:
            raise _Failure(Code.INDEX_MISMATCH, "the summaries index disagrees with the summary entries",
                           seq=min(row[0] for row in differing))
