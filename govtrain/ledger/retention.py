"""Retention (docs/design.md §6): what a compaction retires, the `summary` entries that record it, and the checks
that bind a summary to what it retired.

A compaction retires whole contributions: every admit, spend and withdraw entry of a contribution that
no entry names after the retention horizon. Each class's `summary` commits to its retired contributions
(`retired`: id, class, digests, records, withdrawal and every entry), so that once the bodies are dropped
the index rows can still be checked against it and a replay of a retired contribution still refused.

`Ledger.compact` builds summaries with `summarize`, and before it drops a body it re-checks what it
wrote with `check_structure`, `check_leaves`, `check_summary` and `check_compaction`: the functions the
verifier applies to every summary (the body checks whenever the bodies are still there). Finding what a
compaction retires, and dropping the bodies, is `compaction.py`; what the summaries retired, as the gate, the
spend rules and the verifier read it, is the last section here (`read_summaries`, `RetiredKeys`, `Redacted`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Mapping, NamedTuple, Sequence

import ledger_store
from govtrain.encoding import cbor
from govtrain.errors import Code, IntegrityError
from govtrain.ledger.entries import SPENT, decode_stored

REDACTABLE = ("admit", "spend", "withdraw")
# Summary fields that describe one class's retired contributions (the rest describe the whole compaction).
CLASS_FIELDS = ("entries", "admitted", "withdrawn", "spend_u", "entries_sha256", "retired")
# What a later admit may not share with a retired contribution.
RETIRED_KEYS = ("contribution_id", "descriptor_sha256", "attestation_sha256", "data_sha256")


class Summarized(NamedTuple):
    """An entry a summary retires, with its body decoded."""

    seq: int
    leaf_hash: bytes
    entry: dict


def _bad(detail: str) -> IntegrityError:
    return IntegrityError(Code.BAD_SUMMARY, detail)


def _digest(leaves: Iterable[bytes]) -> bytes:
    return hashlib.sha256(b"".join(leaves)).digest()


# -- building ---------------------------------------------------------------------------


def retired_record(entries: Sequence[Summarized]) -> dict:
    """The `retired` map of one contribution, from its entries' bodies (its admit entry first). Besides what
    its admit committed to, it keeps what the spend rules still read once the bodies are gone: its signed
    sigma, C and budget, every field of each spend the rules check (`SPENT`: so a redacted spend is checked as
    its body was, its run's lease and hold on the epoch, the schedule it justifies, a later tune's total) and
    its final cumulative epsilon."""
    admit = entries[0].entry
    withdrawals = [e.seq for e in entries if e.entry["kind"] == "withdraw"]
    spends = [{name: e.seq if name == "seq" else e.entry[name] for name in SPENT if name == "seq" or name in e.entry}
              for e in entries if e.entry["kind"] == "spend"]  # a spend before privatizers keeps none (SPENT_LATER)
    return {
        "contribution_id": admit["contribution_id"],
        "data_class": admit["data_class"],
        "admit_seq": entries[0].seq,
        "descriptor_sha256": admit["descriptor_sha256"],
        "attestation_sha256": admit["attestation_sha256"],
        "data_sha256": admit["data_sha256"],
        "records": admit["records"],
        "clip_norm_u": admit["clip_norm_u"],
        "noise_multiplier_u": admit["noise_multiplier_u"],
        "eps_budget_u": admit["eps_budget_u"],
        "withdraw_seq": withdrawals[-1] if withdrawals else None,
        "entry_seqs": [e.seq for e in entries],
        "spends": spends,
        "eps_u": spends[-1]["eps_u"] if spends else 0,
    }


def class_fields(contributions: Sequence[Sequence[Summarized]]) -> dict:
    """The per-class fields of a summary that retires `contributions` (all of one class)."""
    contributions = sorted(contributions, key=lambda c: c[0].seq)
    entries = sorted((e for c in contributions for e in c), key=lambda e: e.seq)
    spends = [[e.entry["eps_u"] for e in c if e.entry["kind"] == "spend"] for c in contributions]
    return {
        "entries": len(entries),
        "admitted": len(contributions),
        "withdrawn": sum(1 for e in entries if e.entry["kind"] == "withdraw"),
        "spend_u": sum(eps[-1] for eps in spends if eps),  # cumulative: each contribution's latest
        "entries_sha256": _digest(e.leaf_hash for e in entries),
        "retired": [retired_record(c) for c in contributions],
    }


def compaction_fields(leaves: Mapping[int, bytes]) -> dict:
    """The fields every summary of one compaction shares, over all the entries it retires (seq -> leaf)."""
    seqs = sorted(leaves)
    return {"first_seq": seqs[0], "last_seq": seqs[-1], "range_sha256": _digest(leaves[s] for s in seqs)}


def summarize(before_epoch: int, contributions: Sequence[Sequence[Summarized]]) -> list[dict]:
    """The summary fields (one map per class, by class name) that retire `contributions`, each a list of a
    contribution's entries, admit first. Classes come from the admit bodies, never from an index."""
    by_class: dict[str, list[Sequence[Summarized]]] = {}
    for contribution in contributions:
        by_class.setdefault(contribution[0].entry["data_class"], []).append(contribution)
    shared = compaction_fields({e.seq: e.leaf_hash for c in contributions for e in c})
    return [{"data_class": name, "before_epoch": before_epoch, **shared, **class_fields(by_class[name])}
            for name in sorted(by_class)]


# -- checking ---------------------------------------------------------------------------


def check_structure(summary: dict) -> None:
    """The rules a summary obeys on its own: its retired list is ordered, of its class, inside its range,
    and its counts are the list's."""
    first, last, retired = summary["first_seq"], summary["last_seq"], summary["retired"]
    if [r["admit_seq"] for r in retired] != sorted({r["admit_seq"] for r in retired}):
        raise _bad("retired is not sorted by admit_seq (or lists a contribution twice)")
    for index, r in enumerate(retired):
        seqs, where = r["entry_seqs"], f"retired[{index}] ({r['contribution_id']!r})"
        if r["data_class"] != summary["data_class"]:
            raise _bad(f"{where}.data_class is not the summary's class {summary['data_class']!r}")
        if not seqs or seqs[0] != r["admit_seq"] or any(a >= b for a, b in zip(seqs, seqs[1:])):
            raise _bad(f"{where}.entry_seqs must ascend from its admit_seq")
        if not (first <= seqs[0] and seqs[-1] <= last):
            raise _bad(f"{where}.entry_seqs reach outside first_seq..last_seq ({first}..{last})")
        if r["withdraw_seq"] is not None and (len(seqs) < 2 or r["withdraw_seq"] != seqs[-1]):
            raise _bad(f"{where}.withdraw_seq must be its last entry: nothing follows a withdrawal")
        spends = r["spends"]
        if [s["seq"] for s in spends] != [s for s in seqs[1:] if s != r["withdraw_seq"]]:
            raise _bad(f"{where}.spends must list every entry after its admit but the withdrawal, in order")
        if any(a["eps_u"] > b["eps_u"] for a, b in zip(spends, spends[1:])) or \
                r["eps_u"] != (spends[-1]["eps_u"] if spends else 0):
            raise _bad(f"{where}: cumulative ε falls along its spends, or eps_u is not the last one's")
    counts = {"entries": sum(len(r["entry_seqs"]) for r in retired), "admitted": len(retired),
              "withdrawn": sum(1 for r in retired if r["withdraw_seq"] is not None)}
    for name, value in counts.items():
        if summary[name] != value:
            raise _bad(f"{name} is {summary[name]}, but its retired list makes it {value}")


def check_leaves(summary: dict, leaves: Mapping[int, bytes]) -> None:
    """entries_sha256 against the leaf hashes of the entries the summary retires (kept after redaction)."""
    seqs = sorted(s for r in summary["retired"] for s in r["entry_seqs"])
    if summary["entries_sha256"] != _digest(leaves[s] for s in seqs):
        raise _bad("entries_sha256 is not the hash of the leaf hashes of the entries it retires")


def check_summary(summary: dict, bodies: Mapping[int, Summarized],
                  named: Mapping[str, tuple[int, int]]) -> None:
    """Every per-class field of `summary` recomputed from the bodies of what it retires (seq -> body).

    `named` maps each retired contribution id to (how many entries name it, the last of them), counted
    over the ledger up to now: a summary lists every entry of what it retires, and nothing names a
    retired contribution afterwards."""
    contributions = []
    for index, r in enumerate(summary["retired"]):
        where = f"retired[{index}] ({r['contribution_id']!r})"
        missing = [s for s in r["entry_seqs"] if s not in bodies]
        if missing:
            raise _bad(f"{where}.entry_seqs names entry {missing[0]}, whose body is not there to check")
        items = [bodies[s] for s in r["entry_seqs"]]
        admit = items[0]
        if admit.entry["kind"] != "admit":
            raise _bad(f"{where}.admit_seq is entry {admit.seq}, a {admit.entry['kind']} entry")
        for item in items[1:]:
            if (item.entry["kind"] not in ("spend", "withdraw")
                    or item.entry["contribution_id"] != admit.entry["contribution_id"]
                    or item.entry["admit_leaf"] != admit.leaf_hash):
                raise _bad(f"{where}.entry_seqs lists entry {item.seq}, which is not a spend or withdrawal "
                           "of that contribution")
        count, latest = named.get(admit.entry["contribution_id"], (0, -1))
        if (count, latest) != (len(items), items[-1].seq):
            raise _bad(f"{where}.entry_seqs lists {len(items)} entries up to {items[-1].seq}, but {count} entries "
                       f"name the contribution, the last being entry {latest}: a contribution is retired "
                       "whole, and only once nothing names it any more")
        contributions.append(items)
    expected = class_fields(contributions)
    for name in CLASS_FIELDS:
        if name == "retired":
            continue
        if summary[name] != expected[name]:
            raise _bad(f"{name} is {summary[name]!r}, but the entries it retires make it {expected[name]!r}")
    for index, (claimed, actual) in enumerate(zip(summary["retired"], expected["retired"])):
        for name, value in actual.items():
            if claimed[name] != value:
                raise _bad(f"retired[{index}].{name} differs from the admit entry {actual['admit_seq']} it retires")


def check_compaction(group: Sequence[dict], leaves: Mapping[int, bytes]) -> None:
    """The summaries one compaction wrote (one per class) share before_epoch, first_seq, last_seq and
    range_sha256, which describe every entry they retire together; no entry is retired twice."""
    seqs = [s for summary in group for r in summary["retired"] for s in r["entry_seqs"]]
    if len(set(seqs)) != len(seqs):
        raise _bad("an entry is retired twice")
    if not seqs:
        raise _bad("retires nothing")
    expected = compaction_fields({s: leaves[s] for s in seqs})
    for summary in group:
        if summary["before_epoch"] != group[0]["before_epoch"]:
            raise _bad("the summaries of one compaction disagree on before_epoch")
        for name, value in expected.items():
            if summary[name] != value:
                raise _bad(f"{name} does not describe the entries its compaction retires")
    if len({summary["data_class"] for summary in group}) != len(group):
        raise _bad("a compaction wrote two summaries for one class")


# -- reading ----------------------------------------------------------------------------


# A summary entry's body holds its kind as deterministic CBOR: the text "kind", then the text "summary".
_SUMMARY_KIND = cbor.encode("kind") + cbor.encode("summary")


def read_summaries(store: ledger_store.LedgerStore) -> list[tuple[int, dict]]:
    """(seq, decoded body) of every summary entry, found by its body (the database searches every body for a
    summary's kind field) as well as by its kind column: a summary relabelled in the kind column would otherwise
    hide what it retired from the readers that must honour it (`RetiredKeys`, `Redacted`). Each body must hash
    to its leaf and state the kind its row states (`bad_entry`: the database was edited)."""
    found = []
    for stored in store.entries_holding(_SUMMARY_KIND, kinds=("summary",)):
        if stored.body is None:
            raise IntegrityError(Code.BAD_ENTRY, f"summary entry {stored.seq} has no body: the ledger is damaged")
        entry = decode_stored(stored)  # its kind column must be its body's (else bad_entry)
        if entry["kind"] == "summary":  # not a body that merely holds those bytes (a withdrawal's reason)
            found.append((stored.seq, entry))
    return found


@dataclass(frozen=True, slots=True)
class RetiredKeys:
    """What every retired contribution committed to, read from the summaries' bodies (not the index rows,
    which a writer without the key can edit): (field, value) -> (admit seq, summary seq)."""

    keys: dict[tuple[str, object], tuple[int, int]]

    @classmethod
    def read(cls, store: ledger_store.LedgerStore) -> "RetiredKeys":
        keys: dict[tuple[str, object], tuple[int, int]] = {}
        for seq, summary in read_summaries(store):
            for r in summary["retired"]:
                for name in RETIRED_KEYS:
                    keys.setdefault((name, r[name]), (r["admit_seq"], seq))
        return cls(keys)

    def match(self, contribution_id: str, descriptor_sha256: bytes, attestation_sha256: bytes,
              data_sha256: bytes) -> tuple[str, int, int] | None:
        """(field, admit seq, summary seq) of a retired contribution sharing an id or a digest, else None."""
        for name, value in zip(RETIRED_KEYS, (contribution_id, descriptor_sha256, attestation_sha256, data_sha256)):
            found = self.keys.get((name, value))
            if found is not None:
                return name, *found
        return None

    def __contains__(self, contribution_id: str) -> bool:
        return ("contribution_id", contribution_id) in self.keys


@dataclass(frozen=True, slots=True)
class Redacted:
    """What the summaries committed to about each entry they retire, by seq: what the spend and tune rules
    still read once a body is dropped."""

    admits: dict[int, dict]  # admit seq -> its `retired` map
    withdrawals: dict[int, dict]  # withdraw seq -> the `retired` map of the contribution it withdrew
    spends: dict[int, tuple[dict, dict]]  # spend seq -> (the `retired` map, the SPENT map of that spend)

    @classmethod
    def of(cls, records: Iterable[dict]) -> "Redacted":
        admits, withdrawals, spends = {}, {}, {}
        for r in records:
            admits.setdefault(r["admit_seq"], r)
            if r["withdraw_seq"] is not None:
                withdrawals.setdefault(r["withdraw_seq"], r)
            for spent in r["spends"]:
                spends.setdefault(spent["seq"], (r, spent))
        return cls(admits, withdrawals, spends)

    @classmethod
    def read(cls, store: ledger_store.LedgerStore) -> "Redacted":
        return cls.of(r for _, summary in read_summaries(store) for r in summary["retired"])

    def spend_entry(self, seq: int, *, accountant: str, delta_p: int, privacy_unit: str) -> dict:
        """The body of the redacted spend entry `seq` as its summary recorded it, with the ledger's fixed
        accountant, delta and privacy unit (a policy may not change them): what the spend rules check."""
        r, spent = self.spends[seq]
        return {**{k: v for k, v in spent.items() if k != "seq"}, "kind": "spend", "seq": seq,
                "contribution_id": r["contribution_id"], "accountant": accountant, "delta_p": delta_p,
                "privacy_unit": privacy_unit}
