"""Crash campaigns (issue 23, item 2): `govtrain train` killed 20 times with SIGKILL, `govtrain tune` and the
documented `GovernedRun` loop 10 times each, inside the write-ahead spend, the run-state checkpoint, the adapter save
(and a tune's trial config) and at uniformly random times; each resumed by running the same command again until it
completes; then checked. Prints one row per kill: where it landed, and whether the run resumed, the ledger verified,
spend was never under-counted and the adapter hashes to its run entry (tests/crash_setup.py, tests/crash_checks.py).

    .venv/bin/python bench/crash.py                       # seed 2323; each run forked from one that imported torch
    .venv/bin/python bench/crash.py --fresh --seed 7      # each run a fresh `python -m tests.crash_child` process

Exits 1 if any check failed. Tiny BERT, SQLite ledgers in a temporary folder (kept with --keep).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.crash_setup import ForkServer, Processes, campaign, table  # noqa: E402
from tests.test_train import save_tiny_bert  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=2323, help="the kill plan's seed (printed)")
    parser.add_argument("--train", type=int, default=20, help="kills of govtrain train")
    parser.add_argument("--tune", type=int, default=10, help="kills of govtrain tune")
    parser.add_argument("--loop", type=int, default=10, help="kills of the GovernedRun loop")
    parser.add_argument("--fresh", action="store_true", help="each run a fresh process (slower: torch imported each time)")
    parser.add_argument("--keep", action="store_true", help="keep the workspaces")
    args = parser.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="govtrain-crash-"))
    (root / "model").mkdir()
    model = save_tiny_bert(root / "model")
    runner = Processes() if args.fresh else ForkServer()
    started = time.monotonic()
    outcomes = []
    try:
        for tool, kills in (("train", args.train), ("tune", args.tune), ("GovernedRun", args.loop)):
            if kills:
                outcomes += campaign(tool, kills, args.seed, root / tool, model, runner,
                                     log=lambda line: print(line, file=sys.stderr))
    finally:
        runner.close()
    print(f"seed {args.seed}; {'fresh processes' if args.fresh else 'forked from one process'}; "
          f"{time.monotonic() - started:.0f} s; workspaces {root if args.keep else '(removed)'}\n")
    print(table(outcomes))
    for out in outcomes:
        for problem in out.problems:
            print(f"{out.tool}: {problem}")
    missed = sum(len(o.missed) for o in outcomes)
    print(f"\n{sum(len(o.kills) for o in outcomes)} kills in {sum(o.invocations for o in outcomes)} runs "
          f"({len(outcomes)} from a fresh workspace); {missed} planned kill(s) came after the run ended and were "
          "planned again")
    if not args.keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
