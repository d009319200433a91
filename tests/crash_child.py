"""The process tests/test_crash.py kills: `govtrain train`, `govtrain tune` or the documented `GovernedRun` loop
(examples/custom_loop.py), run for real, with production functions wrapped *in this process only* so that one of
them SIGKILLs the process midway through its n-th call. Production code has no switch for this.

    python -m tests.crash_child --journal J.jsonl [--kill WHERE --nth N --fraction F] -- train --config ... --ledger ...
    python -m tests.crash_child --journal J.jsonl ... -- loop --config ... --ledger ...

Where (`--kill`), each the n-th call in this process of what it names:

- mid-spend, the write-ahead (`Ledger.record_spend`):
  `spend-rows`: the spend rows and their checkpoint are inserted, the transaction is not committed;
  `spend-head`: committed, the signer's record of its head (`SignedHead.save`) not yet written;
  `spend-unseen`: `record_spend` returned, the run has not yet seen it (nor saved its state).
- mid-checkpoint, the run state (`run._save_state`): `state-partial`: `--fraction` of `run-state.safetensors.tmp`'s
  bytes are written (1.0: all of them, not yet renamed over `run-state.safetensors`).
- mid-adapter-save (`Run.finish`): `weights-partial`: `--fraction` of the n-th adapter weights file `finish` saves
  is written (peft's `save_file`); `extras-pending`: peft's files are written, govtrain's (`Release.write`) not yet;
  `entry-recorded`: the run entry is in the ledger, the run state not yet removed.
- tune only: `trial-config-partial`: `--fraction` of the n-th `trial-<k>.json` is written.

The journal (JSON lines, appended with unbuffered writes, so a kill loses none) records what this process did, for
the test to check against the ledger: `start`; `call` for each wrapped call (`what`, its count); `step` before each
update moves the model (`Run.move`: the ledger epoch it trains in, the step's index, the contributions whose
gradients it sums and those it could have drawn, the sampling rate and each noise group's std the step uses); `kill` just before the SIGKILL.
It is written by this test module around the production calls, so the code under test cannot forge it."""

from __future__ import annotations

import argparse
import io
import json
import os
import runpy
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEND = ("spend-rows", "spend-head", "spend-unseen")
STATE = ("state-partial",)
ADAPTER = ("weights-partial", "extras-pending", "entry-recorded")
TUNE = ("trial-config-partial",)
WHERE = {**dict.fromkeys(SPEND, "mid-spend"), **dict.fromkeys(STATE, "mid-checkpoint"),
         **dict.fromkeys(ADAPTER, "mid-adapter-save"), **dict.fromkeys(TUNE, "mid-trial-config")}


class Journal:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.counts: dict[str, int] = {}

    def write(self, event: str, **fields: object) -> None:
        os.write(self.fd, (json.dumps({"pid": os.getpid(), "event": event, **fields}) + "\n").encode())

    def call(self, what: str) -> int:
        self.counts[what] = count = self.counts.get(what, 0) + 1
        self.write("call", what=what, n=count)
        return count


def die(journal: Journal, where: str, **detail: object) -> None:
    journal.write("kill", where=where, **detail)
    os.kill(os.getpid(), signal.SIGKILL)


def write_part(handle, data: bytes, fraction: float) -> int:  # type: ignore[no-untyped-def]
    """Write the first `fraction` of `data` to `handle` and flush it to the kernel (a kill then loses none of it)."""
    part = data[:int(len(data) * fraction)]
    handle.write(part)
    handle.flush()
    return len(part)


def install(journal: Journal, kill: str | None, nth: int, fraction: float) -> None:
    """Wrap the production functions this process calls, recording each call, killing at the n-th of `kill`."""
    import ledger_store.store as store
    import peft.peft_model

    import govtrain.train.run as run_module
    import govtrain.train.state_file as state_module
    import govtrain.train.tune as tune_module
    from govtrain.ledger.ledger import Ledger
    from govtrain.ledger.signer import SignedHead
    from govtrain.release.export import Release

    inside = {"spend": 0, "state": 0, "finish": 0}  # the record_spend / _save_state call in progress (0: none); in finish

    def wrap(owner, name, around):  # type: ignore[no-untyped-def]
        original = getattr(owner, name)
        setattr(owner, name, lambda *a, **k: around(original, *a, **k))

    def record_spend(original, *args, **kwargs):  # type: ignore[no-untyped-def]
        inside["spend"] = journal.call("record_spend")
        try:
            stored = original(*args, **kwargs)
        finally:
            number, inside["spend"] = inside["spend"], 0
        if kill == "spend-unseen" and number == nth:
            die(journal, kill, n=nth, entries=len(stored))
        return stored

    def add_checkpoint(original, appender, *args, **kwargs):  # type: ignore[no-untyped-def]
        original(appender, *args, **kwargs)
        if kill == "spend-rows" and inside["spend"] == nth and any(e.kind == "spend" for e in appender.added):
            die(journal, kill, n=nth, rows=len(appender.added))

    def head_save(original, *args, **kwargs):  # type: ignore[no-untyped-def]
        if kill == "spend-head" and inside["spend"] == nth:
            die(journal, kill, n=nth)
        return original(*args, **kwargs)

    def save_state(original, path, state, key):  # type: ignore[no-untyped-def]
        inside["state"] = journal.call("save_state")
        try:
            return original(path, state, key)
        finally:
            inside["state"] = 0

    def write_state(original, path: Path, write):  # type: ignore[no-untyped-def]
        if kill in STATE and inside["state"] == nth:
            buffer = io.BytesIO()
            write(buffer)
            data = buffer.getvalue()

            def partial(handle):  # type: ignore[no-untyped-def]
                die(journal, kill, n=nth, written=write_part(handle, data, fraction), of=len(data))

            return original(path, partial)
        return original(path, write)

    def finish(original, *args, **kwargs):  # type: ignore[no-untyped-def]
        inside["finish"] = 1
        try:
            return original(*args, **kwargs)
        finally:
            inside["finish"] = 0

    def save_file(original, tensors, filename, metadata=None):  # type: ignore[no-untyped-def]
        from safetensors.torch import save

        if not inside["finish"]:  # the run also saves its adapter's files once when it opens (`Release`)
            return original(tensors, filename, metadata=metadata)
        number = journal.call("save_file")
        if kill == "weights-partial" and number == nth:
            data = save(tensors, metadata=metadata)
            with open(filename, "wb") as handle:
                written = write_part(handle, data, fraction)
            die(journal, kill, n=nth, file=Path(filename).name, written=written, of=len(data))
        return original(tensors, filename, metadata=metadata)

    def release_write(original, *args, **kwargs):  # type: ignore[no-untyped-def]
        if journal.call("release_write") == nth and kill == "extras-pending":
            die(journal, kill, n=nth)
        return original(*args, **kwargs)

    def record_run(original, *args, **kwargs):  # type: ignore[no-untyped-def]
        number = journal.call("record_run")
        stored = original(*args, **kwargs)
        if kill == "entry-recorded" and number == nth:
            die(journal, kill, n=nth, seq=stored.seq)
        return stored

    def write_trial_config(original, path: Path, write):  # type: ignore[no-untyped-def]
        if journal.call("trial_config") == nth and kill == "trial-config-partial":
            buffer = io.BytesIO()
            write(buffer)
            data = buffer.getvalue()

            def partial(handle):  # type: ignore[no-untyped-def]
                die(journal, kill, n=nth, file=path.name + ".tmp", written=write_part(handle, data, fraction),
                    of=len(data))

            return original(path, partial)
        return original(path, write)

    drawn: list[str] = []

    def draw(original, run):  # type: ignore[no-untyped-def]
        drawn.clear()
        return original(run)

    def accumulate(original, run, chunk, *args, **kwargs):  # type: ignore[no-untyped-def]
        drawn.extend(chunk.owners)
        return original(run, chunk, *args, **kwargs)

    def move(original, run):  # type: ignore[no-untyped-def]
        place = run.result.steps - run.pending["first_step"]
        eligible = [cid for cid, allowed in zip(run.ids, run._allowed) if allowed > place]
        journal.write("step", run_id=run.run_id, epoch=run.pending["epoch"], step=run.result.steps,
                      drawn=sorted(set(drawn)), eligible=eligible, q=run.sampler.sampling_rate,
                      noise={",".join(sorted(g)): std for g, std in run._group_std.items()})
        return original(run)

    wrap(Ledger, "record_spend", record_spend)
    wrap(Ledger, "record_run", record_run)
    wrap(store.Appender, "add_checkpoint", add_checkpoint)
    wrap(SignedHead, "save", head_save)
    wrap(run_module, "_save_state", save_state)
    wrap(state_module, "write_whole", write_state)  # the run state, written whole (`state_file.write`)
    wrap(peft.peft_model, "safe_save_file", save_file)
    wrap(Release, "write", release_write)
    wrap(tune_module, "write_whole", write_trial_config)  # a trial's config, written whole (`resume.write_whole`)
    wrap(run_module.Run, "draw", draw)
    wrap(run_module.Run, "accumulate", accumulate)
    wrap(run_module.Run, "move", move)
    wrap(run_module.Run, "finish", finish)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--journal", required=True)
    parser.add_argument("--kill", choices=sorted(WHERE), default=None)
    parser.add_argument("--nth", type=int, default=1)
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    journal = Journal(args.journal)
    install(journal, args.kill, args.nth, args.fraction)
    journal.write("start", command=command[:1], kill=args.kill, nth=args.nth)
    if command[:1] == ["loop"]:  # the documented GovernedRun loop, as its example script runs it
        sys.argv = [str(ROOT / "examples" / "custom_loop.py"), *command[1:]]
        return runpy.run_path(sys.argv[0])["main"](command[1:])
    from govtrain.cli.main import cli

    cli.main(args=command, prog_name="govtrain")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
