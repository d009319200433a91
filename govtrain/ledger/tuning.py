"""The rules a `tune` entry must meet given the entries before it, in one place: `Ledger.record_tune`
computes its totals and refuses an entry that breaks them, and the verifier fails one that does.

A tune binds K governed runs (its trials) into one hyperparameter search. Its privacy cost is what the
trials' spend entries already charged: each trial is a DP mechanism on the same contributions, and the
accountant composes every step of every trial into each contribution's cumulative ε (plain adaptive
composition). Selecting a trial by its score on data that no contribution admitted is post-processing.
So the entry states, per class, the largest cumulative ε after the last trial of any contribution a trial
charged, and the rules tie that statement to the ledger:

1. The tune id is new; the trials are `<tune_id>-trial-0`, `-1`, … in order, at most `MAX_TRIALS`: no
   other run can be listed, none twice, none by two tunes; and every run so named before the tune is
   listed (none omitted).
2. Each trial has exactly one `run` entry before the tune, recording the trial's config hash, and wrote
   spend; no spend names a trial of a recorded tune after it, listed or not (the total would no longer hold).
3. The selection file is no admitted contribution's data.
4. The selected run is one of the trials, with the adapter hash its run entry recorded (or both null).
5. `eps_by_class` and `eps_u` are exactly what the spend entries before the tune imply. A spend entry that
   retention redacted counts as its summary recorded it (`retired[].spends`: its run and cumulative ε), so
   a tune recorded after a compaction states the same totals as before it; a redacted spend no summary
   records refuses the tune.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable

from govtrain.errors import Code, IntegrityError
from govtrain.ledger import retention
from govtrain.ledger.verified import verified_entries

if TYPE_CHECKING:
    import ledger_store

ACCOUNTING = ("composition",)
METRICS = ("accuracy", "loss")
MAX_TRIALS = 64
TUNE_ID = re.compile(r"[A-Za-z0-9._:-]{1,100}")
TRIAL_RUN_ID = re.compile(r"(.+)-trial-[0-9]+")


def trial_run_id(tune_id: str, index: int) -> str:
    return f"{tune_id}-trial-{index}"


class TuneRuleError(Exception):
    def __init__(self, code: Code, detail: str) -> None:
        super().__init__(detail)
        self.code, self.detail = code, detail


@dataclass
class TuneBook:
    """The state the rules read, fed every admit, spend, run and tune entry in ledger order."""

    runs: dict[str, list[tuple[bytes, bytes | None]]] = field(default_factory=dict)  # run -> (config, adapter)
    charged: dict[str, set[str]] = field(default_factory=dict)  # run -> contributions its spend charged
    run_eps: dict[str, int] = field(default_factory=dict)  # run -> largest cumulative eps_u it recorded
    spent: dict[str, tuple[str, int]] = field(default_factory=dict)  # contribution -> (class, latest eps_u)
    data: set[bytes] = field(default_factory=set)  # admitted data digests
    tunes: dict[str, int] = field(default_factory=dict)  # tune id -> seq
    tuned: dict[str, str] = field(default_factory=dict)  # trial run id -> its tune id

    @classmethod
    def read(cls, store: "ledger_store.LedgerStore", *, until: int | None = None) -> "TuneBook":
        """The runs, their spend and the tunes recorded in `store`, in ledger order (up to entry `until`, where
        given), from the verified entries (`verified`: every row, its kind its body's, never selected by an index
        column). A spend retention redacted counts as its summary recorded it; one no summary records refuses every
        tune (`bad_summary`)."""
        book, classes = cls(), {}
        entries = verified_entries(store)
        for item in entries:
            if until is not None and item.seq > until:
                break
            book.take(item, classes, lambda: entries.redacted)
        return book

    @classmethod
    def of(cls, entries: "Iterable[tuple[int, str, dict | None]]", redacted: retention.Redacted) -> "TuneBook":
        """The same state from entries already read and checked, in ledger order (`ledger/signed.py`): (seq, kind,
        body or None where retention dropped it), each kind its body's (or its summary's), never a kind column;
        the admissions from the admit entries themselves (a redacted one as its summary recorded it)."""
        book, classes = cls(), {}
        for seq, kind, entry in entries:
            book.take((seq, kind, entry), classes, lambda: redacted)
        return book

    def take(self, item: "tuple[int, str, dict | None]", classes: dict[str, str],
             redacted: "Callable[[], retention.Redacted]") -> None:
        """Feed one checked entry (seq, kind, body or None), its kind its body's or its summary's; `classes`: the
        admissions' classes so far, filled as admit entries pass."""
        seq, kind, entry = item[:3]
        if kind == "admit":
            admit = entry if entry is not None else redacted().admits[seq]
            self.admit(admit["data_sha256"])
            classes[admit["contribution_id"]] = admit["data_class"]
        elif kind in ("spend", "run", "tune"):
            self._feed(seq, kind, entry, classes, redacted() if entry is None else None)

    def _feed(self, seq: int, kind: str, entry: dict | None, classes: dict[str, str],
              redacted: retention.Redacted) -> None:
        if entry is None:
            if seq not in redacted.spends:
                raise IntegrityError(Code.BAD_SUMMARY, f"spend entry {seq} was redacted, but no summary records its "
                                                       "run and ε: no tune total can be stated over it; run "
                                                       "govtrain-verify")
            r, spent = redacted.spends[seq]
            self.spend({**spent, "contribution_id": r["contribution_id"]}, r["data_class"])
        elif kind == "spend":
            self.spend(entry, classes[entry["contribution_id"]])
        elif kind == "run":
            self.run(entry)
        else:
            self.add(seq, entry)

    def admit(self, data_sha256: bytes) -> None:
        self.data.add(data_sha256)

    def check_spend(self, entry: dict) -> None:
        tune = self.tuned.get(entry["run_id"])
        named = TRIAL_RUN_ID.fullmatch(entry["run_id"])
        if tune is None and named is not None and named.group(1) in self.tunes:
            tune = named.group(1)
        if tune is not None:
            raise TuneRuleError(Code.BAD_TUNE, f"spend for run {entry['run_id']!r}, a trial of tune {tune!r} "
                                               "recorded before it: that tune's total would no longer hold")

    def spend(self, entry: dict, data_class: str) -> None:
        run, cid = entry["run_id"], entry["contribution_id"]
        self.charged.setdefault(run, set()).add(cid)
        self.run_eps[run] = max(self.run_eps.get(run, 0), entry["eps_u"])
        self.spent[cid] = (data_class, entry["eps_u"])

    def run(self, entry: dict) -> None:
        self.runs.setdefault(entry["run_id"], []).append((entry["config_sha256"], entry["adapter_sha256"]))

    def totals(self, run_ids: list[str]) -> tuple[int, list[dict]]:
        """(eps_u, eps_by_class) over the contributions the runs `run_ids` charged, as of now."""
        by_class: dict[str, int] = {}
        for cid in set().union(*(self.charged.get(run, set()) for run in run_ids)):
            data_class, eps_u = self.spent[cid]
            by_class[data_class] = max(by_class.get(data_class, 0), eps_u)
        return max(by_class.values(), default=0), [{"data_class": name, "eps_u": eps_u}
                                                   for name, eps_u in sorted(by_class.items())]

    def check(self, entry: dict) -> None:
        """Raise `TuneRuleError` if the tune entry (decoded, or its fields) breaks a rule."""
        tune_id, trials = entry["tune_id"], entry["trials"]

        def bad(detail: str) -> TuneRuleError:
            return TuneRuleError(Code.BAD_TUNE, f"tune {tune_id!r}: {detail}")

        # 1.
        if not TUNE_ID.fullmatch(tune_id):
            raise bad("a tune id is 1-100 characters of [A-Za-z0-9._:-]")
        if tune_id in self.tunes:
            raise TuneRuleError(Code.TUNE_EXISTS,
                                f"tune {tune_id!r} is already recorded by entry {self.tunes[tune_id]}")
        if entry["accounting"] not in ACCOUNTING or entry["metric"] not in METRICS:
            raise bad(f"accounting {entry['accounting']!r} and metric {entry['metric']!r}: one of "
                      f"{', '.join(ACCOUNTING)}, and one of {', '.join(METRICS)}")
        for name in ("config_sha256", "grid_sha256", "selection_sha256"):
            if len(entry[name]) != 32:
                raise bad(f"{name} must be 32 bytes")
        if not 1 <= len(trials) <= MAX_TRIALS:
            raise bad(f"lists {len(trials)} trials; a tune has 1 to {MAX_TRIALS}")
        run_ids = []
        for index, trial in enumerate(trials):
            run_id = trial["run_id"]
            if run_id != trial_run_id(tune_id, index):
                raise bad(f"trial {index} is run {run_id!r}, not {trial_run_id(tune_id, index)!r}: a tune lists its "
                          "own trials, in order, and no other run")
            # 2.
            recorded = self.runs.get(run_id, [])
            if len(recorded) != 1:
                raise bad(f"trial run {run_id!r} has {len(recorded)} run entries before the tune; it needs exactly one")
            if recorded[0][0] != trial["config_sha256"]:
                raise bad(f"trial run {run_id!r}: its run entry records another config than the tune lists")
            if not self.charged.get(run_id):
                raise bad(f"trial run {run_id!r} wrote no spend")
            run_ids.append(run_id)
        omitted = sorted(run for run in {*self.runs, *self.charged} if run not in run_ids
                         and (m := TRIAL_RUN_ID.fullmatch(run)) is not None and m.group(1) == tune_id)
        if omitted:
            raise bad(f"omits run {omitted[0]!r}, a trial of this tune by its name")
        # 3.
        if entry["selection_sha256"] in self.data:
            raise TuneRuleError(Code.SELECTION_ADMITTED, f"tune {tune_id!r}: the selection file is an admitted "
                                                         "contribution's data; selecting on it is not post-processing")
        # 4.
        selected, adapter = entry["selected_run_id"], entry["adapter_sha256"]
        if selected is None:
            if adapter is not None:
                raise bad("an adapter hash without a selected run")
        elif selected not in run_ids:
            raise bad(f"selects run {selected!r}, which is not one of its trials")
        elif adapter is None or adapter != self.runs[selected][0][1]:
            raise bad(f"the selected run {selected!r}'s adapter hash is not the one its run entry recorded")
        # 5.
        eps_u, by_class = self.totals(run_ids)
        stated = entry["eps_by_class"]
        names = [item["data_class"] for item in stated]
        if names != sorted(set(names)):
            raise bad("eps_by_class must list each class once, sorted by name")
        if entry["eps_u"] != max((item["eps_u"] for item in stated), default=0):
            raise bad(f"eps_u {entry['eps_u']} is not the largest of its eps_by_class")
        if entry["eps_u"] != eps_u or stated != by_class:
            raise bad(f"states ε {entry['eps_u']} ({_show(stated)}) but its trials' spend entries imply "
                      f"{eps_u} ({_show(by_class)})")

    def add(self, seq: int, entry: dict) -> None:
        self.tunes[entry["tune_id"]] = seq
        for trial in entry["trials"]:
            self.tuned[trial["run_id"]] = entry["tune_id"]


def _show(by_class: list[dict]) -> str:
    return ", ".join(f"{item['data_class']} {item['eps_u']}" for item in by_class) or "none"
