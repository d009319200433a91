"""A throwaway PostgreSQL cluster: initdb in a folder of our own, on a free loopback port, run as the `postgres`
user where we are root. The load bench and its test stop and restart it mid-load; the server that CI (or the
user) started for GOVTRAIN_TEST_PG_URL is never touched."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PASSWORD = "govtrain-load"


def binaries() -> Path | None:
    """The newest installed PostgreSQL's bin folder (Debian's layout, else pg_ctl on PATH), or None."""
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parts[-3]))
    if versions:
        return versions[-1].parent
    found = shutil.which("pg_ctl")
    return Path(found).parent if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """`Cluster(folder).start()`: a cluster in `folder`; `url` its postgres database; `restart()`; `stop()`."""

    def __init__(self, folder: Path | None = None) -> None:
        self.bin = binaries()
        if self.bin is None:
            raise FileNotFoundError("no PostgreSQL binaries (initdb, pg_ctl) installed")
        # A folder of its own under /tmp by default: the postgres user cannot enter pytest's tmp_path (0700).
        self.folder = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="govtrain-pg-"))
        self.data = self.folder / "data"
        self.port = _free_port()
        self.user = "postgres" if os.geteuid() == 0 else None

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres:{PASSWORD}@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str, timeout: float = 60) -> None:
        command = [str(self.bin / args[0]), *args[1:]]
        if self.user is not None:
            command = ["runuser", "-u", self.user, "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{args[0]} failed: {(done.stderr or done.stdout).strip()[-400:]}")

    def start(self) -> "Cluster":
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.user is not None:
            shutil.chown(self.folder, self.user, self.user)
        secret = self.folder / "password"
        secret.write_text(PASSWORD + "\n")
        if self.user is not None:
            shutil.chown(secret, self.user, self.user)
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=scram-sha-256", f"--pwfile={secret}",
                  "-E", "UTF8", "--no-sync")
        self._start()
        return self

    def _start(self) -> None:
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories='{self.folder}' " \
                  "-c max_connections=100 -c fsync=on"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.folder / "server.log"), "-o", options, "-w",
                  "-t", "60", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def restart(self, pause_s: float = 1.0) -> float:
        """Stop the server (fast: open transactions are cut off), wait `pause_s`, start it; the seconds it was down."""
        start = time.perf_counter()
        self.stop()
        time.sleep(pause_s)
        self._start()
        return time.perf_counter() - start

    def remove(self) -> None:
        try:
            self.stop("immediate")
        except (RuntimeError, subprocess.TimeoutExpired):
            pass
        shutil.rmtree(self.folder, ignore_errors=True)
