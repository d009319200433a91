"""What the ledger says, for people: sizes, epochs, checkpoints, classes, one contribution's history."""

from __future__ import annotations

from govtrain.errors import Code, RejectedError
from govtrain.ledger.entries import decode_entry
from govtrain.ledger.ledger import Ledger


def ledger_status(ledger: Ledger) -> dict:
    store = ledger.store
    latest = store.latest_checkpoint()
    withdrawn = store.withdrawals()
    classes: dict[str, dict[str, int]] = {name: {"admitted": 0, "withdrawn": 0} for name in ledger.policy.classes}
    for row in store.admissions():
        counts = classes.setdefault(row.data_class, {"admitted": 0, "withdrawn": 0})
        counts["admitted"] += 1
        counts["withdrawn"] += row.contribution_id in withdrawn
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
        "classes": classes,
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
