"""Crash safety and concurrent writers: the ledger always verifies and never holds a partial write."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from govtrain.gate.admission import admit_many
from govtrain.ledger.ledger import Ledger
from govtrain.verify.verifier import verify_ledger
from tests.conftest import REPO, Corpus

WRITER = """
import os
import sys
import time
from govtrain.ledger.entries import run_entry
from govtrain.ledger.ledger import Ledger
ledger = Ledger.open(sys.argv[1])
print("ready", flush=True)
n = 0
while True:
    with ledger.append() as appender:
        for _ in range(int(sys.argv[2])):
            n += 1
            t = int(time.time())
            appender.add("run", t, lambda seq, n=n, t=t: run_entry(seq, t, run_id=f"r{os.getpid()}-{n}",
                         run_nonce=bytes(16), mechanism="dpsgd", device="cpu", precision="fp32",
                         config_sha256=bytes(32), base_model_sha256=bytes(32), adapter_sha256=None))
    if n % 60 == 0:
        ledger.close_epoch()
"""


def test_sigkill_at_random_moments_never_leaves_a_partial_entry(corpus: Corpus):
    rng = random.Random(20261122)
    sizes = []
    for attempt in range(20):
        process = subprocess.Popen([sys.executable, "-c", WRITER, corpus.url, str(rng.choice([1, 7, 50]))],
                                   cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert process.stdout.readline().strip() == "ready", process.stderr.read()
        time.sleep(rng.uniform(0.02, 0.6))
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        report = verify_ledger(corpus.url)  # every time: the whole ledger verifies
        with Ledger.open(corpus.url) as ledger:
            latest = ledger.store.latest_checkpoint()
            assert latest.size == ledger.size() == report.entries  # no entry without its checkpoint
        sizes.append(report.entries)
    assert sizes == sorted(sizes) and sizes[-1] > sizes[0]  # it kept growing across the kills


def _admit_worker(url: str, items: list[tuple[str, bytes, Path]]) -> None:
    with Ledger.open(url) as ledger:
        outcomes = admit_many(ledger, items, batch_size=10)
    assert all(o.receipt for o in outcomes), [o.error for o in outcomes if o.error][:3]


def _concurrent_admissions(corpus: Corpus, url: str, workers: int = 4, each: int = 500) -> None:
    import multiprocessing

    data_dir = corpus.dir / "many"
    data_dir.mkdir(exist_ok=True)
    batches = []
    for w in range(workers):
        items = []
        for i in range(each):
            name = f"w{w}-{i:03d}"
            data = corpus.data(f"many/{name}.jsonl")
            items.append((name, corpus.attestation(data, contribution_id=name), data))
        batches.append(items)
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=_admit_worker, args=(url, batch)) for batch in batches]
    for p in processes:
        p.start()
    for p in processes:
        p.join(timeout=600)
        assert p.exitcode == 0
    report = verify_ledger(url)
    assert report.entries == 1 + workers * each and report.admissions == workers * each
    with Ledger.open(url) as ledger:
        assert [e.seq for e in ledger.store.entries()] == list(range(1 + workers * each))
        assert ledger.store.latest_checkpoint().size == 1 + workers * each


def test_four_writers_append_500_each_on_sqlite(corpus: Corpus):
    _concurrent_admissions(corpus, corpus.url)
