"""Test processes forked from one interpreter that imported torch, transformers, peft and govtrain's training stack
once: a rank or a command starts in a fraction of a second instead of the 5 to 10 s a fresh interpreter spends on
those imports (more when the machine is loaded).

`start(argv, env=..., cwd=...)` is `subprocess.Popen([sys.executable, *argv], ...)` with stdout and stderr captured:
each child runs `python -m MODULE ARGS` (or `python SCRIPT ARGS`) as a fresh process would, from the server's state
after its imports and nothing else (the server itself never runs a test's code), with its own environment, working
directory, stdin on /dev/null and exit code (a refusal's documented one, 1 for an uncaught exception, -N when killed
by signal N). Several children run at once: the ranks of one process group. A child reads its environment after
the fork, so what a library reads only when it is imported (torch's OMP_NUM_THREADS, huggingface_hub's
HF_HUB_OFFLINE) is the server's: `SERVER_ENV`, which every test environment here sets the same way.

The server is `python -m tests.forkserver`, one per pytest worker, started at the first `start` and ended with the
worker. The crash campaigns (tests/crash_setup.py's `ForkServer`) fork their runs from it too.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVER_ENV = {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
              "TOKENIZERS_PARALLELISM": "false", "PYTHONFAULTHANDLER": "1"}
PRELOAD = ("torch", "transformers", "peft", "govtrain.cli.main", "govtrain.train.governed", "govtrain.train.loop",
           "govtrain.train.tune", "govtrain.verify.verifier")


class Child:
    """A forked process, as much of `subprocess.Popen` as the tests use: `pid`, `poll`, `wait`, `communicate`,
    `returncode`, `send_signal`, `kill`."""

    def __init__(self, server: "Server", pid: int, folder: Path, text: bool, stderr: Path | None = None) -> None:
        self._server, self.pid, self._folder, self._text = server, pid, folder, text
        self._stderr = stderr or folder / "stderr"
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"forked {self.pid}", timeout or 0)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str | bytes, str | bytes]:
        self.wait(timeout)
        out, err = (self._folder / "stdout").read_bytes(), self._stderr.read_bytes()
        return (out.decode(), err.decode()) if self._text else (out, err)

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Server:
    """The client's side of `python -m tests.forkserver`: requests on its stdin, replies on its stdout."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                                   "MASTER_PORT")}
        self.process = subprocess.Popen([sys.executable, "-m", "tests.forkserver"], cwd=ROOT, env={**env, **SERVER_ENV},
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self._buffer = b""
        self._codes: dict[int, int] = {}
        line = self._line(600)
        if line != "ready":
            raise RuntimeError(f"the fork server did not start: {line!r}")

    def _line(self, timeout: float | None) -> str | None:
        while b"\n" not in self._buffer:
            if not select.select([self.process.stdout], [], [], timeout)[0]:
                return None
            chunk = os.read(self.process.stdout.fileno(), 65536)
            if not chunk:
                raise RuntimeError("the fork server ended")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def _exited(self, line: str) -> None:
        _, pid, code = line.split()
        self._codes[int(pid)] = int(code)

    def start(self, argv: list[str], env: dict[str, str], cwd: Path, folder: Path, stderr: Path | None) -> int:
        request = {"argv": argv, "env": env, "cwd": str(cwd), "stdout": str(folder / "stdout"),
                   "stderr": str(stderr or folder / "stderr")}
        self.process.stdin.write((json.dumps(request) + "\n").encode())
        while True:
            line = self._line(600)
            if line is None:
                raise RuntimeError("the fork server did not answer")
            if line.startswith("exit "):
                self._exited(line)
            else:
                return int(line)

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while pid not in self._codes:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            line = self._line(left)
            if line is None:
                return None
            self._exited(line)
        return self._codes[pid]


_server: Server | None = None
_folders: Path | None = None  # each child's captured output, in a folder of this process's, removed at its exit


def _folder() -> Path:
    global _folders
    if _folders is None:
        import atexit
        import shutil

        _folders = Path(tempfile.mkdtemp(prefix="govtrain-forked-"))
        atexit.register(shutil.rmtree, _folders, True)
    return Path(tempfile.mkdtemp(prefix="forked-", dir=_folders))


def start(argv: list[str], *, env: dict[str, str] | None = None, cwd: Path | str = ROOT, text: bool = True,
          stderr: Path | None = None) -> Child:
    """`python *argv` (`-m MODULE ...`, `-c CODE ...` or `SCRIPT ...`) forked from the server (started at the first
    call), with `env` (by default this process's) and `cwd`; its stdout and stderr are captured to files that
    `communicate` reads once it ends (stderr to `stderr` when given)."""
    global _server
    if _server is None or _server.process.poll() is not None:
        _server = Server()
    folder = _folder()
    pid = _server.start(list(argv), dict(os.environ if env is None else env), Path(cwd), folder, stderr)
    return Child(_server, pid, folder, text, stderr)


def _run(request: dict) -> int:
    """(In the forked child.) The request's command, as `python *argv` runs it; its exit code."""
    import runpy

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(null, 0), os.dup2(out, 1), os.dup2(err, 2)
    for fd in (null, out, err):
        os.close(fd)
    argv = request["argv"]
    sys.path[0] = {"-m": str(Path(request["cwd"]).resolve()), "-c": ""}.get(argv[0]) or \
        str(Path(argv[0]).resolve().parent)
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        import traceback

        traceback.print_exc()
        return 1


def serve() -> None:
    """Import `PRELOAD`, then for each request line ({"argv", "env", "cwd", "stdout", "stderr"}) fork a child that
    runs it (`_run`) and reply with its pid; reply `exit PID CODE` as each child ends (-N: killed by signal N).
    Nothing but imports has run here before a fork: no thread pool exists yet to be lost across it."""
    import atexit
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the children's output goes to their own files, never the replies
    replies.write("ready\n")
    requests = sys.stdin.buffer
    pending = b""
    running: set[int] = set()
    open_ = True
    while open_ or running:
        if open_ and select.select([requests], [], [], 0.02)[0]:
            chunk = os.read(requests.fileno(), 65536)
            open_ = bool(chunk)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush(), sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    replies.close()
                    code = _run(request)
                    try:
                        atexit._run_exitfuncs()
                    finally:
                        sys.stdout.flush(), sys.stderr.flush()
                        os._exit(code & 0xFF)
                running.add(pid)
                replies.write(f"{pid}\n")
        elif not open_:
            select.select([], [], [], 0.02)
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            running.discard(pid)
            replies.write(f"exit {pid} {os.waitstatus_to_exitcode(status)}\n")


if __name__ == "__main__":
    serve()
