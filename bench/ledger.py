"""Ledger throughput: batched appends, verification of a million entries, proofs at a million.

    .venv/bin/python bench/ledger.py [--entries 1000000] [--batch 10000] [--pg URL]
    .venv/bin/python bench/ledger.py --load [--seconds 300] [--writers 8] [--url URL | --restart-pg]

Prints, from one run on this machine:
  1. batched append rate into SQLite (entries per second; each batch is one transaction that also
     signs a checkpoint of the new tree)                                 [target >= 40,000/s]
     and into PostgreSQL when --pg (or $GOVTRAIN_TEST_PG_URL) names a server;
  2. verification of the whole ledger, integrity only (sequence, leaf hashes, each body's kind against
     its row, every checkpoint's root and signature: no entry decoded, no attestation re-verified)
                                                                          [target <= 4 s]
     next to the hashing-only lower bound (leaf and interior hashes of the same bodies, in memory);
  3. inclusion proof generation and verification at the full size       [target <= 5 ms each].
Entries are spend-shaped (the bulk of a real ledger: one per contribution per epoch).

`--load`: the ledger under load instead (bench/ledger_load.py): writer processes admitting, withdrawing and
writing spend while a verifier process audits, for `--seconds`, against `--url` (a SQLite file by default, or an
empty PostgreSQL database) or, with `--restart-pg`, a PostgreSQL cluster this bench creates (initdb in a temporary
folder, a free port), stops and starts again halfway. Exit 1 if any end check fails.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from govtrain.ledger.entries import spend_entry  # noqa: E402
from govtrain.ledger.ledger import Ledger  # noqa: E402
from govtrain.ledger.merkle import leaf_hash, verify_inclusion  # noqa: E402
from govtrain.ledger.checkpoint import verify_checkpoint  # noqa: E402
from govtrain.ledger.ledger import note_keys  # noqa: E402
from govtrain.policy.config import load_policy  # noqa: E402
from govtrain.verify.verifier import inspect_ledger  # noqa: E402
from tests.conftest import TEST_POLICY, copy_demo_keys  # noqa: E402


GROUPS = [{"classes": ["public"], "s_pu": 10**12}]  # one epoch schedule: sigma 1 x C 1


def build(url: str, keys: Path, entries: int, batch: int) -> tuple[float, list[bytes]]:
    """Create a ledger and append `entries` spend entries in batches; return the append rate and bodies."""
    (keys / "policy.toml").write_text(TEST_POLICY)
    policy, digest = load_policy(keys / "policy.toml")
    ledger = Ledger.init(url, policy, digest, key_path=keys / "ledger.key", now=1)
    leaf = hashlib.sha256(b"admit").digest()
    elapsed = 0.0
    appended = 0
    while appended < entries - 1:
        count = min(batch, entries - 1 - appended)
        start = time.perf_counter()
        with ledger.append(now=2) as appender:
            for i in range(appended, appended + count):
                appender.add("spend", 2, lambda seq, i=i: spend_entry(
                    seq, 2, contribution_id=f"c{i % 100_000:06d}", admit_leaf=leaf, run_id="bench",
                    run_nonce=bytes(16), epoch=i // 100_000, epoch_steps=50, steps=50,
                    sampling_rate_u=10_000, noise_multiplier_u=1_000_000, accountant="prv", delta_p=10_000_000,
                    privacy_unit="example", eps_u=1_000 * (i // 100_000 + 1), noise_groups=GROUPS))
        elapsed += time.perf_counter() - start
        appended += count
    bodies = [row[2] for rows in ledger.store.leaf_rows() for row in rows]
    ledger.close()
    return appended / elapsed, bodies


def hashing_lower_bound(bodies: list[bytes]) -> float:
    start = time.perf_counter()
    sha256 = hashlib.sha256
    level = [sha256(b"\x00" + body).digest() for body in bodies]
    while len(level) > 1:
        paired = [sha256(b"\x01" + level[i] + level[i + 1]).digest() for i in range(0, len(level) - 1, 2)]
        level = paired + ([level[-1]] if len(level) % 2 else [])
    return time.perf_counter() - start


def load(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(REPO / "bench"))
    from ledger_load import passed, report_lines, run_load
    from tests.pg_cluster import Cluster

    root = Path(tempfile.mkdtemp(prefix="govtrain-ledger-load-"))
    cluster = None
    try:
        if args.restart_pg:
            cluster = Cluster().start()
            url, label, restart = cluster.url, "PostgreSQL (own cluster)", cluster.restart
        else:
            url = args.url or f"sqlite:///{root / 'ledger.db'}"
            label, restart = ("PostgreSQL" if url.startswith("postgresql") else "SQLite"), None
        result = run_load(url, root, seconds=args.seconds, writers=args.writers, restart=restart)
        print("\n".join(report_lines(result, label)))
    finally:
        if cluster is not None:
            cluster.remove()
        shutil.rmtree(root, ignore_errors=True)
    if not passed(result):
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--load", action="store_true", help="the ledger under load (bench/ledger_load.py)")
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--url", help="--load: the ledger URL (default: a SQLite file in a temporary folder)")
    parser.add_argument("--restart-pg", action="store_true",
                        help="--load: on a PostgreSQL cluster of its own, stopped and started halfway")
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pg", default=os.environ.get("GOVTRAIN_TEST_PG_URL"))
    parser.add_argument("--pg-entries", type=int, default=100_000)
    args = parser.parse_args()
    if args.load:
        return load(args)
    root = Path(tempfile.mkdtemp(prefix="govtrain-ledger-bench-"))
    try:
        keys = copy_demo_keys(root / "keys")
        from govtrain.attest.keys import generate_key_pair

        generate_key_pair(keys, "limited")
        url = f"sqlite:///{root / 'ledger.db'}"
        print(f"govtrain ledger bench: {args.entries:,} entries, batches of {args.batch:,}, {os.cpu_count()} cores")
        rate, bodies = build(url, keys, args.entries, args.batch)
        print(f"append, SQLite, batched:             {rate:10,.0f} entries/s  (target >= 40,000)")

        verify_times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            report = inspect_ledger(url, integrity_only=True)
            verify_times.append(time.perf_counter() - start)
            assert report.ok, report.as_json()
        lower = statistics.median(hashing_lower_bound(bodies) for _ in range(args.repeats))
        print(f"verify {report.entries:,} entries, integrity only ({report.checkpoints} checkpoints): "
              f"{statistics.median(verify_times):6.2f} s  (target <= 4 s); hashing-only lower bound {lower:.2f} s")

        ledger = Ledger.open(url)
        size = ledger.size()
        checkpoint_note = ledger.store.latest_checkpoint().note
        keys_ = note_keys(ledger.policy)
        make, check = [], []
        for index in (1, size // 3, size // 2 + 7, size - 2):
            contribution_leaf = leaf_hash(bodies[index])
            start = time.perf_counter()
            proof = ledger.tree(size).inclusion_proof(index, size)
            make.append(time.perf_counter() - start)
            start = time.perf_counter()
            checkpoint = verify_checkpoint(checkpoint_note, origin=ledger.policy.origin, keys=keys_)
            verify_inclusion(index, checkpoint.size, contribution_leaf, proof, checkpoint.root)
            check.append(time.perf_counter() - start)
        ledger.close()
        print(f"inclusion proof at {size:,}: generate {statistics.median(make) * 1e3:.2f} ms, verify (with the "
              f"checkpoint signature) {statistics.median(check) * 1e3:.2f} ms  (target <= 5 ms each)")

        if args.pg:
            import uuid

            from sqlalchemy import create_engine
            from sqlalchemy.engine import make_url

            name = f"govtrain_bench_{uuid.uuid4().hex[:8]}"
            admin = create_engine(args.pg, isolation_level="AUTOCOMMIT")
            with admin.connect() as connection:
                connection.exec_driver_sql(f"CREATE DATABASE {name}")
            try:
                pg_url = make_url(args.pg).set(database=name).render_as_string(hide_password=False)
                pg_rate, _ = build(pg_url, keys, args.pg_entries, args.batch)
                print(f"append, PostgreSQL, batched:         {pg_rate:10,.0f} entries/s  ({args.pg_entries:,} entries)")
            finally:
                with admin.connect() as connection:
                    connection.exec_driver_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
                admin.dispose()
        else:
            print("append, PostgreSQL: not measured (no --pg URL and no $GOVTRAIN_TEST_PG_URL)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
