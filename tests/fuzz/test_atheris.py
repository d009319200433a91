"""Each atheris harness runs, coverage-guided, for a few thousand inputs in a subprocess and exits 0: the CI share
of `make fuzz` (which runs each target for FUZZ_SECONDS). atheris is in the dev extra (Linux wheels only)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fuzz.run import MODULES

RUNS = int(os.environ.get("FUZZ_SMOKE_RUNS", "2000"))
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", MODULES)
def test_atheris_harness_runs(module: str, tmp_path: Path) -> None:
    pytest.importorskip("atheris", reason="atheris has wheels for Linux only (pip install atheris): the coverage-guided "
                                          "runs are skipped here; the hypothesis tests of tests/fuzz still run")
    corpus = tmp_path / "corpus"
    # libFuzzer's memory limit (2 GB by default) reads the peak RSS, which the child starts with from this process
    # (a long-lived test worker can hold more than 2 GB): the harness gets its 2 GB on top of what it inherits
    inherited_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    # -timeout=600: the per-input timer is a SIGALRM every timeout/2 + 1 s that stays armed after "Done", and one that
    # came while the process exited killed it (-14) on a loaded machine; every 301 s it never comes within the run's
    # 300 s (a hung input fails on that limit; `make fuzz` keeps its 20 s per input). -timeout=0 is no way out: a
    # 1-second run under it was killed the same way
    done = subprocess.run(
        [sys.executable, "-m", f"tests.fuzz.{module}", f"-atheris_runs={RUNS}", "-timeout=600", "-seed=1",
         f"-rss_limit_mb={inherited_mb + 2048}", f"-artifact_prefix={tmp_path}/", str(corpus)],
        cwd=REPO, capture_output=True, text=True, errors="replace", timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert f"Done {RUNS} " in done.stderr + done.stdout
    assert any(corpus.iterdir())  # seeded, and grown by what the run found
