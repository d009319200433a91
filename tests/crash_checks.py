"""What tests/test_crash.py checks once a killed tool has been run again to completion (`crash_setup.py`): that the
work is complete, that spend was not under-counted (`spend_problems`), and that each adapter is the one its run entry
records (`hash_problems`). Each returns the problems it finds, so that a campaign can report every one."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

from govtrain.ledger.entries import decode_stored
from govtrain.ledger.ledger import Ledger

if TYPE_CHECKING:
    from tests.crash_setup import Scene


def entries(url: str, kind: str) -> list[dict]:
    with Ledger.open(url) as ledger:
        return [decode_stored(e) for e in ledger.store.entries(kinds=(kind,)) if e.body is not None]


def complete(s: "Scene") -> bool:
    """The work is recorded and nothing is left to resume: the tune entry (tune), or every run entry with its
    run state removed."""
    if s.tool == "tune":
        return any(t["tune_id"] == s.tune_id for t in entries(s.url, "tune"))
    recorded = {r["run_id"] for r in entries(s.url, "run")}
    return all(r in recorded and not (out / "run-state.safetensors").exists() for r, out in s.runs.items())


def spend_problems(s: "Scene", events: list[dict], reference: dict[str, int] | None) -> list[str]:
    """Spend is under-counted when a step that moved a model was not charged as it ran. The steps that ran come
    from the journal the child wrote before each update (`crash_child.py`, not the code under test); what was
    charged comes from the ledger's spend entries (written ahead, verified). For every run, every step journalled
    in ledger epoch e (in any process, also one killed later) must find e's spend under the run's lease: at the
    sampling rate the step drew at, with each noise group's std no smaller than the std charged, for each
    contribution eligible at the step (each drawn one among them) with at least k+1 steps charged in e, k the
    step's place in e (its index less the first index journalled in e). The steps journalled must cover the run's
    steps (0 to training.steps - 1, as the config its run entry hashes says). Each contribution's charged epsilon
    (its last cumulative eps_u) is then at least the accountant's epsilon of the steps that ran at the charged
    parameters, and at least what an uninterrupted run of the same config charges (`reference`): a crash may
    over-count (a step lost and redone under a later epoch's spend), never under-count."""
    from govtrain.accounting.spend import spend_epsilon_u
    from govtrain.train.config import load_run_config

    problems: list[str] = []
    runs = {r["run_id"]: r for r in entries(s.url, "run")}
    spends = entries(s.url, "spend")
    ran: dict[str, dict[int, int]] = {}  # contribution -> epoch -> steps that ran in it
    for run_id, output in s.runs.items():
        mine = [e for e in spends if e["run_id"] == run_id]
        if run_id not in runs:
            return [f"{run_id}: no run entry"]
        if any(e["run_nonce"] != runs[run_id]["run_nonce"] for e in mine):
            problems.append(f"{run_id}: spend under another lease than its run entry's")
        if s.tool == "tune":  # the trial's derived config, as its hash is taken, beside its folder
            document = (output.parent / f"{output.name}.json").read_bytes()
            sha256, total = hashlib.sha256(document).digest(), json.loads(document)["training"]["steps"]
        else:
            config = load_run_config(s.config)
            sha256, total = config.sha256, config.file.training.steps
        if sha256 != runs[run_id]["config_sha256"]:
            problems.append(f"{run_id}: the config is not the one its run entry hashes")
        charged = {(e["contribution_id"], e["epoch"]): e for e in mine}
        steps = [e for e in events if e["event"] == "step" and e["run_id"] == run_id]
        first = {}
        for e in steps:
            first[e["epoch"]] = min(first.get(e["epoch"], e["step"]), e["step"])
        covered = {e["step"] for e in steps}
        if covered != set(range(total)):
            problems.append(f"{run_id}: the steps journalled are {sorted(covered)}, not 0..{total - 1}")
        for e in steps:
            place = e["step"] - first[e["epoch"]]
            for cid in e["eligible"]:
                spend = charged.get((cid, e["epoch"]))
                if spend is None or spend["steps"] <= place:
                    problems.append(f"{run_id}: step {e['step']} ran in epoch {e['epoch']} with {cid} eligible, "
                                    f"charged {spend['steps'] if spend else 0} steps there")
                    continue
                if round(e["q"] * 1e6) != spend["sampling_rate_u"]:
                    problems.append(f"{run_id}: step {e['step']} drew at q {e['q']}, charged at "
                                    f"{spend['sampling_rate_u']}")
                for group in spend["noise_groups"]:
                    used = e["noise"].get(",".join(sorted(group["classes"])))
                    if used is None or used < group["s_pu"] / 1e12 * (1 - 1e-12):
                        problems.append(f"{run_id}: step {e['step']} used noise std {used} for {group['classes']}, "
                                        f"charged {group['s_pu'] / 1e12}")
                ran.setdefault(cid, {})[e["epoch"]] = max(ran.get(cid, {}).get(e["epoch"], 0), place + 1)
            if set(e["drawn"]) - set(e["eligible"]):
                problems.append(f"{run_id}: step {e['step']} drew {sorted(set(e['drawn']) - set(e['eligible']))}, "
                                "not eligible")
    last: dict[str, dict] = {}
    for e in spends:
        last[e["contribution_id"]] = e
    for cid, epochs in ran.items():
        spend = last[cid]
        history = [(x["sampling_rate_u"], x["noise_multiplier_u"], epochs[x["epoch"]])
                   for x in spends if x["contribution_id"] == cid and x["epoch"] in epochs]
        floor = spend_epsilon_u(spend["accountant"], spend["delta_p"], history)
        if spend["eps_u"] < floor:
            problems.append(f"{cid}: charged ε {spend['eps_u']} < {floor}, the ε of the steps that ran")
    for cid, eps_u in (reference or {}).items():
        if last.get(cid, {}).get("eps_u", 0) < eps_u:
            problems.append(f"{cid}: charged ε {last.get(cid, {}).get('eps_u', 0)} < {eps_u}, an uninterrupted "
                            "run's")
    return problems


def hash_problems(s: "Scene") -> list[str]:
    from govtrain.errors import GovtrainError
    from govtrain.release.artifact import adapter_sha256
    from govtrain.release.verify import verify_adapter

    runs = {r["run_id"]: r for r in entries(s.url, "run")}
    problems = []
    for run_id, output in s.runs.items():
        if run_id not in runs:
            problems.append(f"{run_id}: no run entry")
        elif adapter_sha256(output) != runs[run_id]["adapter_sha256"]:
            problems.append(f"{run_id}: {output} hashes to {adapter_sha256(output).hex()[:16]}, the run entry records "
                            f"{runs[run_id]['adapter_sha256'].hex()[:16]}")
        else:
            try:
                card = verify_adapter(output, s.url).card
                if card != "matches":
                    problems.append(f"{run_id}: the model card {card}")
            except GovtrainError as e:
                problems.append(f"{run_id}: {e.line()}")
        if (output / "run-state.safetensors").exists():
            problems.append(f"{run_id}: its run state (which holds its sampling key) is left in {output}")
    return problems


def charged_eps(url: str) -> dict[str, int]:
    return {e["contribution_id"]: e["eps_u"] for e in entries(url, "spend")}
