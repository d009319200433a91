"""What the ledger says, for people: sizes, epochs, checkpoints, classes, ε spent, one contribution's history.

ε spent is what the ledger records: each contribution's cumulative ε is its latest spend entry's `eps_u` (the
verifier recomputes every one from the recorded parameters and fails a ledger where it is low; a spend that
retention redacted counts as its summary recorded it). Per class and per run it is shown as the largest and the
median over contributions, beside the budgets the contributions signed.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from govtrain import units
from govtrain.errors import Code, IntegrityError, RejectedError
from govtrain.ledger import retention
from govtrain.ledger.entries import decode_entry, decode_stored
from govtrain.ledger.ledger import Ledger


@dataclass
class Spending:
    """Per contribution, in micro-units: its class, its signed budget, its latest cumulative ε, and per run the
    cumulative ε that run's last spend of it recorded."""

    data_class: dict[str, str] = field(default_factory=dict)
    budget_u: dict[str, int] = field(default_factory=dict)
    eps_u: dict[str, int] = field(default_factory=dict)
    runs: dict[str, dict[str, int]] = field(default_factory=dict)  # run id -> contribution -> eps_u, ledger order
    epochs: dict[str, list[int]] = field(default_factory=dict)  # run id -> the ledger epochs it charged

    @classmethod
    def read(cls, ledger: Ledger) -> "Spending":
        spending, redacted = cls(), retention.Redacted.read(ledger.store)
        for stored in ledger.store.entries(start=1, kinds=("admit", "spend")):
            if stored.body is not None:
                entry = decode_stored(stored)
            elif stored.kind == "admit" and stored.seq in redacted.admits:
                entry = redacted.admits[stored.seq]
            elif stored.kind == "spend" and stored.seq in redacted.spends:
                r, spent = redacted.spends[stored.seq]
                entry = {**spent, "contribution_id": r["contribution_id"]}
            else:
                raise IntegrityError(Code.BAD_SUMMARY, f"entry {stored.seq} ({stored.kind}) has no body and no summary "
                                                       "records it: the ledger was altered; run govtrain-verify")
            cid = entry["contribution_id"]
            if stored.kind == "admit":
                spending.data_class[cid], spending.budget_u[cid] = entry["data_class"], entry["eps_budget_u"]
                spending.eps_u[cid] = 0
            else:
                spending.eps_u[cid] = entry["eps_u"]
                spending.runs.setdefault(entry["run_id"], {})[cid] = entry["eps_u"]
                epochs = spending.epochs.setdefault(entry["run_id"], [])
                if entry["epoch"] not in epochs:
                    epochs.append(entry["epoch"])
        return spending

    def figures(self, contributions: dict[str, int]) -> dict:
        """ε largest and median over `contributions` (id -> eps_u), with the smallest budget they signed."""
        values = list(contributions.values())
        return {
            "contributions": len(values),
            "eps_max": _eps(max(values, default=0)),
            "eps_median": _eps(statistics.median(values)) if values else 0.0,
            "eps_budget": _eps(min(self.budget_u[c] for c in contributions)) if values else None,
            "eps_left_min": _eps(min(self.budget_u[c] - e for c, e in contributions.items())) if values else None,
        }

    def by_class(self, contributions: dict[str, int]) -> dict[str, dict]:
        grouped: dict[str, dict[str, int]] = {}
        for cid, eps_u in contributions.items():
            grouped.setdefault(self.data_class[cid], {})[cid] = eps_u
        return {name: self.figures(members) for name, members in sorted(grouped.items())}


def _eps(micro: float) -> float:
    return round(micro / units.MICRO, 6)


def ledger_status(ledger: Ledger) -> dict:
    store = ledger.store
    latest = store.latest_checkpoint()
    withdrawn = store.withdrawals()
    spending = Spending.read(ledger)
    counts: dict[str, dict[str, int]] = {name: {"admitted": 0, "withdrawn": 0} for name in ledger.policy.classes}
    for row in store.admissions():
        count = counts.setdefault(row.data_class, {"admitted": 0, "withdrawn": 0})
        count["admitted"] += 1
        count["withdrawn"] += row.contribution_id in withdrawn
    spent = spending.by_class(spending.eps_u)
    classes = {name: {**count, **spent.get(name, spending.figures({}))} for name, count in counts.items()}
    for name, row in classes.items():
        del row["contributions"]  # the admitted count says it
        row["charged"] = sum(1 for c, e in spending.eps_u.items() if e and spending.data_class[c] == name)
    return {
        "ledger": store.url,
        "origin": ledger.policy.origin,
        "privacy_unit": ledger.policy.privacy_unit,
        "examples_per_contribution": ledger.policy.examples_per_contribution,
        "entries": store.size(),
        "epoch": ledger.epoch(),
        "checkpoints": len(store.checkpoints()),
        "last_checkpoint": None if latest is None else {"size": latest.size, "root": latest.root.hex(),
                                                        "time": latest.time},
        "summaries": len(store.summaries()),
        "classes": classes,  # admitted, withdrawn, charged, and ε over its admitted contributions
        "runs": [{"run_id": run_id, "epochs": spending.epochs[run_id], "classes": spending.by_class(charged)}
                 for run_id, charged in spending.runs.items()],  # ε as each run's last spend recorded it
        "tunes": tunes(ledger),
    }


def tunes(ledger: Ledger) -> list[dict]:
    """Every recorded hyperparameter search: its trials, the selected run and the total epsilon it charged."""
    found = []
    for stored in ledger.store.entries(start=1, kinds=("tune",)):
        entry = decode_entry(stored.body, seq=stored.seq, kind="tune")
        found.append({
            "seq": stored.seq, "tune_id": entry["tune_id"], "accounting": entry["accounting"],
            "metric": entry["metric"], "trials": [trial["run_id"] for trial in entry["trials"]],
            "selected_run_id": entry["selected_run_id"],
            "adapter_sha256": None if entry["adapter_sha256"] is None else entry["adapter_sha256"].hex(),
            "eps_u": entry["eps_u"], "eps_by_class": {item["data_class"]: item["eps_u"] for item in entry["eps_by_class"]},
        })
    return found


def contribution_status(ledger: Ledger, contribution_id: str) -> dict:
    store = ledger.store
    admission = store.admission(contribution_id)
    if admission is None:
        raise RejectedError(Code.UNKNOWN_CONTRIBUTION, f"no admitted contribution {contribution_id!r}")
    withdrawn_at = store.withdrawals().get(contribution_id)
    spend, runs, charged = [], [], set()  # charged: the runs whose write-ahead spend charged it
    for stored in store.entries(start=admission.seq + 1, kinds=("spend", "run")):
        if stored.body is None:
            continue
        entry = decode_entry(stored.body, seq=stored.seq, kind=stored.kind)
        if stored.kind == "spend" and entry["contribution_id"] == contribution_id:
            spend.append({"seq": stored.seq, "epoch": entry["epoch"], "steps": entry["steps"],
                          "run_id": entry["run_id"], "eps_u": entry["eps_u"]})
            charged.add(entry["run_id"])
        elif stored.kind == "run" and entry["run_id"] in charged:  # its gradients went into this adapter
            runs.append({"seq": stored.seq, "run_id": entry["run_id"],
                         "adapter_sha256": None if entry["adapter_sha256"] is None else entry["adapter_sha256"].hex()})
    tuned = [{"tune_id": t["tune_id"], "seq": t["seq"], "selected_run_id": t["selected_run_id"], "eps_u": t["eps_u"],
              "class_eps_u": t["eps_by_class"].get(admission.data_class, 0)}
             for t in tunes(ledger) if charged.intersection(t["trials"])]
    covering = [c for c in store.checkpoints() if c.size > admission.seq]
    return {
        "contribution_id": contribution_id,
        "data_class": admission.data_class,
        "admit_seq": admission.seq,
        "withdrawn_seq": withdrawn_at,
        "spend": spend,
        "eps_u": spend[-1]["eps_u"] if spend else 0,
        "runs": runs,
        "tunes": tuned,  # the searches whose trials charged it, with the total epsilon each charged
        "checkpoints": {"count": len(covering), "first": None if not covering else covering[0].size},
    }
