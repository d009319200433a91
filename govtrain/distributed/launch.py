"""`govtrain train --nproc N`: N ranks of one run on this machine (docs/distributed.md, launching).

Each rank is `python -m govtrain train ...` (the same arguments, without --nproc) with the environment `torchrun`
gives its workers: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR (127.0.0.1), MASTER_PORT (a free
one). The launcher waits for them all. When one stops with an error or is killed, the others are stopped (SIGTERM,
then SIGKILL after a grace period), so no rank waits for ever on a peer that is gone, and the launcher exits with
the lead's code (else the first failing rank's). The run's state is the lead's last checkpoint: running the same
command again resumes it, as it would a single process. Followers' stdout is dropped (the lead prints the result);
their stderr is kept, so an error on any rank is seen. SIGINT and SIGTERM to the launcher are passed to every rank.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Sequence

__all__ = ["launch", "free_port"]

GRACE_S = 10.0  # how long a rank told to stop has before it is killed


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(arguments: Sequence[str], nproc: int, *, poll_s: float = 0.1) -> int:
    """Run `python -m govtrain *arguments` as `nproc` ranks; the exit code the run ends with."""
    port = free_port()
    ranks: list[subprocess.Popen] = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        ranks.append(subprocess.Popen([sys.executable, "-m", "govtrain", *arguments], env=env,
                                      stdout=None if rank == 0 else subprocess.DEVNULL,
                                      preexec_fn=_with_launcher(os.getpid())))
    stopping = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for process in ranks:
            if process.poll() is None:
                process.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    first: int | None = None  # the first rank seen to fail
    try:
        while True:
            codes = [process.poll() for process in ranks]
            failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed or all(code is not None for code in codes):
                break
            time.sleep(poll_s)
        if failed:
            first = 0 if 0 in failed else failed[0]
            _stop(ranks)
        codes = [process.wait() for process in ranks]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if first is None:
        return 130 if stopping else 0
    code = codes[first]
    if code < 0:  # killed: it said nothing, so the launcher says it
        print(f"error[rank_lost]: rank {first} of {nproc} was killed (signal {-code}); every rank was stopped: the "
              "run's state is its last checkpoint's, and running the same command again resumes it", file=sys.stderr)
        return 2
    return code


def _with_launcher(launcher: int):  # type: ignore[no-untyped-def]
    """A rank's pre-exec: SIGKILL when its launcher dies (Linux's prctl PR_SET_PDEATHSIG), so that no rank trains on
    (charging spend, holding the run's lock) after its launcher was killed; elsewhere None (no pre-exec)."""
    if not sys.platform.startswith("linux"):
        return None

    def arm() -> None:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != launcher:  # it died before the line above
            os._exit(1)

    return arm


def _stop(ranks: list[subprocess.Popen]) -> None:
    """Stop every rank still running: SIGTERM, then SIGKILL after `GRACE_S`."""
    for process in ranks:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + GRACE_S
    for process in ranks:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
