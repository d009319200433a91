"""A hook for tests/test_attacks_distributed_kills.py: loaded by a `sitecustomize.py` the test writes into a folder on
PYTHONPATH, so that every process `govtrain train --nproc N` starts (the launcher's ranks are `python -m govtrain`, no
test module of ours) runs it before govtrain's code. Production code has no switch for this.

Environment: KILLS_DIR (a folder), KILLS_RANK (the rank that dies), KILLS_AT (where), KILLS_NTH (the n-th time there).
Each rank writes its pid to KILLS_DIR/pid-<rank> and, through tests/crash_child.py's wrappers, a journal of what it did
(KILLS_DIR/journal-<rank>.jsonl: every step with its ledger epoch and drawn contributions). KILLS_AT:

- crash_child's points (`spend-rows`, `spend-unseen`, `extras-pending`, `entry-recorded`, ...);
- `epoch-closed`: the n-th `Ledger.close_epoch` returned, the run state not yet saved;
- `before-record-run`: the adapter saved (peft's files and govtrain's), the run entry not yet recorded;
- `prepare`: inside `Run._load` (before the lead's claim on the run);
- `rehearsal-sleep`: the rank sleeps 4 s at the n-th rehearsal chunk's step, then is SIGKILLed (a follower slower
  than the lead, then killed before its rehearsal passed).
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def install() -> None:
    folder = os.environ.get("KILLS_DIR")
    rank = os.environ.get("RANK")
    if not folder or rank is None:  # the launcher itself, or a process of another test
        return
    Path(folder, f"pid-{rank}").write_text(str(os.getpid()))
    from tests import crash_child

    journal = crash_child.Journal(str(Path(folder, f"journal-{rank}.jsonl")))
    at = os.environ.get("KILLS_AT") if os.environ.get("KILLS_RANK") == rank else None
    nth = int(os.environ.get("KILLS_NTH", "1"))
    crash_child.install(journal, at if at in crash_child.WHERE else None, nth, 0.5)
    if at is None or at in crash_child.WHERE:
        return
    import govtrain.train.governed as governed
    import govtrain.train.run as run_module
    from govtrain.ledger.ledger import Ledger

    counts: dict[str, int] = {}

    def hit(what: str) -> bool:
        counts[what] = counts.get(what, 0) + 1
        return what == at and counts[what] == nth

    def wrap(owner, name, around):  # type: ignore[no-untyped-def]
        original = getattr(owner, name)
        setattr(owner, name, lambda *a, **k: around(original, *a, **k))

    def close_epoch(original, *a, **k):  # type: ignore[no-untyped-def]
        out = original(*a, **k)
        if hit("epoch-closed"):
            crash_child.die(journal, at)
        return out

    def record_run(original, *a, **k):  # type: ignore[no-untyped-def]
        if hit("before-record-run"):
            crash_child.die(journal, at)
        return original(*a, **k)

    def load(original, *a, **k):  # type: ignore[no-untyped-def]
        if hit("prepare"):
            crash_child.die(journal, at)
        return original(*a, **k)

    def rehearsal_step(original, *a, **k):  # type: ignore[no-untyped-def]
        if hit("rehearsal-sleep"):
            time.sleep(float(os.environ.get("KILLS_SLEEP", "4")))
            crash_child.die(journal, at)
        return original(*a, **k)

    wrap(Ledger, "close_epoch", close_epoch)
    wrap(Ledger, "record_run", record_run)
    wrap(run_module.Run, "_load", load)
    wrap(governed.GovernedRun, "_rehearsal_step", rehearsal_step)
