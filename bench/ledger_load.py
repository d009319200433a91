"""The ledger under load (`bench/ledger.py --load`): writer processes admit, withdraw and write spend through
govtrain's own write paths (`admit`, `Ledger.withdraw`, the training loop's `write_ahead`), while a verifier
process audits the ledger, checks each new checkpoint's consistency with the one before and proves a random
admission against it. At the end: every entry contiguous, every checkpoint verifies, every index row there, and
every operation a writer saw succeed is in the ledger exactly once (one it saw fail is absent, or counted as
ambiguous where the failure was the database's).

`run_load(url, root, seconds=…, writers=…, restart=…)` returns the figures and the end checks as a dict.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import statistics
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Callable

GROUPS = [{"classes": ["public"], "s_pu": 10**12}]  # every contribution signs sigma 1 x C 1: s_g = 10^12 pico
UNAVAILABLE = ("ledger_unavailable", "write_unconfirmed")  # the database's failures: an entry may be ambiguous


def prepare(root: Path, url: str) -> Path:
    """Keys, the test policy and a fresh ledger at `url`; the folder of keys."""
    from govtrain.attest.keys import generate_key_pair
    from govtrain.ledger.ledger import Ledger
    from govtrain.policy.config import load_policy
    from tests.conftest import TEST_POLICY, copy_demo_keys

    keys = copy_demo_keys(root / "keys")
    generate_key_pair(keys, "limited")
    (keys / "policy.toml").write_text(TEST_POLICY)
    policy, digest = load_policy(keys / "policy.toml")
    Ledger.init(url, policy, digest, key_path=keys / "ledger.key").close()
    return keys


# -- a writer ------------------------------------------------------------------------------------------------


class _Writer:
    """One process's operations, each timed and its outcome kept as the writer saw it."""

    def __init__(self, index: int, url: str, keys: Path, folder: Path) -> None:
        from govtrain.accounting.spend import spend_epsilon_u
        from govtrain.attest.keys import load_private_key
        from govtrain.ledger.ledger import Ledger

        self.index, self.folder = index, folder
        self.ledger = Ledger.open(url, key=keys / "ledger.key")
        self.attester = load_private_key(keys / "attester.key")
        self.run = (f"load-w{index}", os.urandom(16))
        policy = self.ledger.policy
        self.steps = policy.steps_per_epoch
        self.q_u = policy.sampling_rate_u
        self.eps_u = spend_epsilon_u(policy.accountant, policy.delta_p, [(self.q_u, 1_000_000, self.steps)])
        self.admitted: list[str] = []  # admitted, not yet charged
        self.charged: list[str] = []  # charged once (each is charged at most once: its ε stays the one epoch's)
        self.count = 0
        self.log: list[dict] = []

    def admit(self) -> dict:
        import hashlib

        from govtrain.attest.cose import sign_attestation
        from govtrain.attest.descriptor import Descriptor
        from govtrain.gate.admission import admit

        self.count += 1
        cid = f"w{self.index}-{self.count:06d}"
        data = self.folder / f"{cid}.jsonl"
        data.write_text("".join(json.dumps({"text": f"{cid} example {i}", "label": i % 2}) + "\n" for i in range(3)))
        now = int(time.time())
        descriptor = Descriptor(v=1, contribution_id=cid, contributor="load@example.org", data_class="public",
                                data_sha256=hashlib.sha256(data.read_bytes()).digest(), records=3,
                                clip_norm_u=1_000_000, noise_multiplier_u=1_000_000, eps_budget_u=5_000_000,
                                not_before=now - 60, not_after=now + 86_400, issued_at=now - 60,
                                salt=hashlib.sha256(cid.encode()).digest()[:16])
        record = {"op": "admit", "cid": cid}
        receipt = admit(self.ledger, sign_attestation(descriptor, self.attester), data)
        self.admitted.append(cid)
        return {**record, "seq": receipt.seq}

    def withdraw(self) -> dict:
        pool = self.charged or self.admitted
        cid = pool.pop(0)
        record = {"op": "withdraw", "cid": cid}
        stored = self.ledger.withdraw(cid, "load test")
        return {**record, "seq": stored.seq}

    def spend(self) -> dict:
        """A run's write-ahead for its next epoch: close the epoch it holds (its steps done), then `write_ahead`
        the spend of up to two fresh contributions, planning the next epoch where another writer holds one."""
        from govtrain.train.lease import write_ahead

        charge, self.admitted = self.admitted[:2], self.admitted[2:]
        for _ in range(500):  # seven other runs race for each epoch, as runs sharing a ledger do
            epoch = self.ledger.epoch()
            if self.ledger.spend_book().holder(epoch) == self.run:
                self.ledger.close_epoch(epoch=epoch)
                continue
            pending = {"epoch": epoch, "q_u": self.q_u, "steps": self.steps, "noise_groups": GROUPS,
                       "spend": [(cid, self.steps, 1_000_000, self.eps_u) for cid in charge]}
            if write_ahead(self.ledger, pending, self.run, lambda: int(time.time()), lambda _: None):
                self.charged += charge
                return {"op": "spend", "cids": charge, "epoch": epoch, "run": self.run[0]}
        raise RuntimeError("no epoch free after 500 tries")


def _writer_main(index: int, url: str, keys: str, folder: str, seconds: float, ready, out: str) -> None:
    from govtrain.errors import GovtrainError

    Path(folder).mkdir(parents=True, exist_ok=True)
    writer = _Writer(index, url, Path(keys), Path(folder))
    ready.wait()  # every process imported and opened: the clock starts together
    until = time.time() + seconds
    plan = ("admit", "admit", "admit", "spend", "withdraw")
    turn = 0
    while time.time() < until:
        op = plan[turn % len(plan)]
        turn += 1
        if op == "spend" and not writer.admitted or op == "withdraw" and not (writer.charged or writer.admitted):
            continue
        intended = {"admit": f"w{index}-{writer.count + 1:06d}", "withdraw": (writer.charged or writer.admitted)[:1],
                    "spend": writer.admitted[:2]}[op]
        start = time.perf_counter()
        try:
            record = getattr(writer, op)()
            record.update(ok=True)
        except GovtrainError as e:
            record = {"op": op, "ok": False, "code": e.code.value, "line": e.line(), "target": intended}
        except Exception as e:  # a driver traceback where a coded error belongs: the bench fails on it
            record = {"op": op, "ok": False, "code": None, "line": f"{type(e).__name__}: {e}",
                      "trace": traceback.format_exc()[-2000:], "target": intended}
        record["latency_s"] = time.perf_counter() - start
        writer.log.append(record)
    writer.ledger.close()
    Path(out).write_text(json.dumps(writer.log))


# -- the verifier ----------------------------------------------------------------------------------------------


def _verifier_main(url: str, seconds: float, ready, out: str) -> None:
    from govtrain.errors import GovtrainError
    from govtrain.ledger.checkpoint import verify_checkpoint
    from govtrain.ledger.ledger import Ledger, note_keys
    from govtrain.ledger.merkle import leaf_hash, verify_consistency, verify_inclusion
    from govtrain.verify.verifier import inspect_ledger

    rng = random.Random(0)
    log = {"audits": [], "consistency": 0, "inclusion": 0, "failures": [], "unavailable": 0}
    ledger = Ledger.open(url)
    keys = note_keys(ledger.policy)
    previous = None
    ready.wait()
    until = time.time() + seconds
    while time.time() < until:
        try:
            start = time.perf_counter()
            report = inspect_ledger(url)
            if report.error is not None:
                log["failures"].append(f"audit at {report.entries}: {report.error.line()}")
            log["audits"].append((time.perf_counter() - start, report.entries))
            latest = ledger.store.latest_checkpoint()
            checkpoint = verify_checkpoint(latest.note, origin=ledger.policy.origin, keys=keys)
            if previous is not None and previous.size < checkpoint.size:
                proof = ledger.tree(checkpoint.size).consistency_proof(previous.size, checkpoint.size)
                verify_consistency(previous.size, checkpoint.size, previous.root, checkpoint.root, proof)
                log["consistency"] += 1
            previous = checkpoint
            admissions = [row for row in ledger.store.admissions() if row.seq < checkpoint.size]
            if admissions:
                row = rng.choice(admissions)
                proof = ledger.prove(row.contribution_id, latest.note)
                verify_inclusion(proof.index, checkpoint.size, leaf_hash(proof.entry), proof.hashes, checkpoint.root)
                log["inclusion"] += 1
        except GovtrainError as e:
            if e.code.value in UNAVAILABLE:
                log["unavailable"] += 1
                time.sleep(0.2)
            else:
                log["failures"].append(e.line())
        except Exception as e:
            log["failures"].append(f"{type(e).__name__}: {e}")
    ledger.close()
    Path(out).write_text(json.dumps(log))


# -- the run and its end checks ----------------------------------------------------------------------------------


def run_load(url: str, root: Path, *, seconds: float = 300, writers: int = 8,
             restart: Callable[[], float] | None = None) -> dict:
    """Load the ledger at `url` (created here) for `seconds`; `restart` (stop and start the server, returning the
    seconds it was down) is called halfway. Returns the figures and the end checks."""
    keys = prepare(root, url)
    context = multiprocessing.get_context("spawn")
    ready = context.Barrier(writers + 2)
    processes = [context.Process(target=_writer_main, args=(i, url, str(keys), str(root / f"w{i}"), seconds, ready,
                                                            str(root / f"w{i}.json"))) for i in range(writers)]
    processes.append(context.Process(target=_verifier_main, args=(url, seconds, ready, str(root / "verifier.json"))))
    for process in processes:
        process.start()
    ready.wait(timeout=600)  # the processes take a while to import govtrain on a busy machine
    downtime = None
    if restart is not None:
        time.sleep(seconds / 2)
        downtime = restart()
    for process in processes:
        process.join(timeout=seconds + 600)
    crashed = [p.exitcode for p in processes if p.exitcode != 0]
    logs = [json.loads((root / f"w{i}.json").read_text()) for i in range(writers) if (root / f"w{i}.json").exists()]
    verifier = json.loads((root / "verifier.json").read_text()) if (root / "verifier.json").exists() else None
    result = {"seconds": seconds, "writers": writers, "restart_downtime_s": downtime, "crashed": crashed,
              "operations": _figures([r for log in logs for r in log], seconds), "verifier": verifier}
    result["end"] = end_checks(url, [r for log in logs for r in log])
    return result


def _figures(records: list[dict], seconds: float) -> dict:
    figures = {}
    for op in ("admit", "withdraw", "spend"):
        mine = [r for r in records if r["op"] == op]
        ok = sorted(r["latency_s"] for r in mine if r["ok"])
        figures[op] = {"ok": len(ok), "failed": dict(Counter(r["code"] or "uncoded" for r in mine if not r["ok"])),
                       "per_s": len(ok) / seconds,
                       "p50_ms": 1e3 * statistics.median(ok) if ok else None,
                       "p99_ms": 1e3 * ok[min(len(ok) - 1, int(0.99 * len(ok)))] if ok else None}
    figures["uncoded"] = [r["line"] for r in records if not r["ok"] and r["code"] is None][:5]
    return figures


def end_checks(url: str, records: list[dict]) -> dict:
    """What the ledger holds against what the writers saw. `problems` lists every violation; empty is a pass."""
    from govtrain.errors import GovtrainError
    from govtrain.ledger.entries import decode_stored
    from govtrain.ledger.ledger import Ledger
    from govtrain.verify.verifier import verify_ledger

    problems: list[str] = []
    try:
        report = verify_ledger(url)  # every entry, every checkpoint's root and signature, the index tables
    except GovtrainError as e:
        problems.append(f"the ledger does not verify: {e.line()}")
        report = None
    admits, withdraws, spends = Counter(), Counter(), Counter()
    with Ledger.open(url) as ledger:
        seqs, by_kind = [], Counter()
        for stored in ledger.store.entries():
            seqs.append(stored.seq)
            by_kind[stored.kind] += 1
            if stored.kind in ("admit", "withdraw", "spend"):
                entry = decode_stored(stored)
                if stored.kind == "admit":
                    admits[entry["contribution_id"]] += 1
                elif stored.kind == "withdraw":
                    withdraws[entry["contribution_id"]] += 1
                else:
                    spends[(entry["contribution_id"], entry["run_id"], entry["epoch"])] += 1
        if seqs != list(range(len(seqs))):
            problems.append("sequence numbers have a gap")
        latest = ledger.store.latest_checkpoint()
        if latest is None or latest.size != len(seqs):
            problems.append(f"the last checkpoint does not cover all {len(seqs)} entries")
        admission_rows = {row.contribution_id: row.seq for row in ledger.store.admissions()}
        withdrawal_rows = ledger.store.withdrawals()
        checkpoints = len(ledger.store.checkpoints())
    if set(admission_rows) != set(admits) or set(withdrawal_rows) != set(withdraws):
        problems.append("an entry without its index row, or an index row without its entry")
    problems += [f"{cid} admitted {n} times" for cid, n in admits.items() if n > 1]
    problems += [f"{cid} withdrawn {n} times" for cid, n in withdraws.items() if n > 1]
    charged = Counter(cid for cid, _, _ in spends.elements())
    problems += [f"{cid} charged {n} times" for cid, n in charged.items() if n > 1]
    ambiguous = unreported = 0
    for r in records:
        held = _held(r, admits, withdraws, spends)
        if r["ok"] and held != 1:
            problems.append(f"lost: {r['op']} {r.get('cid') or r.get('cids')} succeeded but the ledger holds it "
                            f"{held} times")
        elif not r["ok"] and held:
            if r["code"] in UNAVAILABLE:
                ambiguous += 1
            else:
                unreported += 1
                problems.append(f"{r['op']} {r['target']} failed ({r['line']}) yet is in the ledger")
        if not r["ok"] and r["code"] is None:
            problems.append(f"uncoded failure: {r['line']}")
    return {"entries": len(seqs), "checkpoints": checkpoints, "by_kind": dict(by_kind),
            "verified": report is not None, "ambiguous": ambiguous, "unreported": unreported, "problems": problems}


def _held(record: dict, admits: Counter, withdraws: Counter, spends: Counter) -> int:
    """How many times the ledger holds what `record` did (or, for a failure, tried to do)."""
    if record["ok"]:
        if record["op"] == "spend":
            counts = {spends[(cid, record["run"], record["epoch"])] for cid in record["cids"]}
            return counts.pop() if len(counts) == 1 else -1
        return (admits if record["op"] == "admit" else withdraws)[record["cid"]]
    target = record["target"]
    if record["op"] == "admit":
        return admits[target]
    if record["op"] == "withdraw":
        return withdraws[target[0]] if target else 0
    return sum(n for (cid, _, _), n in spends.items() if cid in target)


def report_lines(result: dict, label: str) -> list[str]:
    """The printed figures."""
    lines = [f"ledger under load, {label}: {result['writers']} writers for {result['seconds']:.0f} s "
             f"({os.cpu_count()} cores)" + (f", server restarted mid-load (down {result['restart_downtime_s']:.1f} s)"
                                             if result["restart_downtime_s"] is not None else "")]
    for op in ("admit", "withdraw", "spend"):
        f = result["operations"][op]
        failed = ", ".join(f"{code} {n}" for code, n in sorted(f["failed"].items())) or "none"
        lines.append(f"  {op:<9} {f['ok']:6d} ok  {f['per_s']:7.1f}/s  p50 {f['p50_ms'] or 0:8.1f} ms  "
                     f"p99 {f['p99_ms'] or 0:8.1f} ms  failed: {failed}")
    v = result["verifier"] or {}
    audits = v.get("audits", [])
    if audits:
        lines.append(f"  verifier  {len(audits)} full audits during load (last: {audits[-1][1]} entries in "
                     f"{audits[-1][0]:.2f} s), {v['consistency']} consistency and {v['inclusion']} inclusion proofs "
                     f"checked, {len(v['failures'])} failures, {v['unavailable']} passes cut off by the server")
    end = result["end"]
    lines.append(f"  end: {end['entries']} entries contiguous, {end['checkpoints']} checkpoints, ledger "
                 f"{'verifies' if end['verified'] else 'DOES NOT VERIFY'}; lost or duplicated: "
                 f"{sum(p.startswith(('lost', 'uncoded')) or 'times' in p for p in end['problems'])}; "
                 f"ambiguous (failed with the database, yet written): {end['ambiguous']}")
    for problem in (end["problems"] + [f"verifier: {f}" for f in v.get("failures", [])])[:10]:
        lines.append(f"  PROBLEM {problem}")
    if result["crashed"]:
        lines.append(f"  PROBLEM processes exited with {result['crashed']}")
    return lines


def passed(result: dict) -> bool:
    return not result["end"]["problems"] and not result["crashed"] and not (result["verifier"] or {}).get(
        "failures", True) and not result["operations"]["uncoded"]

