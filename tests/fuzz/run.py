"""`make fuzz`: every atheris harness for FUZZ_SECONDS (default 60) each, the line coverage its corpus reaches, then
the hypothesis tests at the "fuzz" profile; a table of executions, coverage and findings per target.

    python -m tests.fuzz.run [--seconds N] [--no-hypothesis] [TARGET ...]

Corpora are kept in fuzz-out/corpus/TARGET (a later run starts from them) and crashing inputs in fuzz-out/findings/;
the table is also written to fuzz-out/report.md and fuzz-out/report.json. Exit 1 if any target found something.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

MODULES = ("test_encoding", "test_ledger", "test_config", "test_data", "test_serve_release")
OUT = Path("fuzz-out")


def targets() -> list[tuple[str, object]]:
    """(module, target) for every target of every fuzz module."""
    found = []
    for module in MODULES:
        for target in importlib.import_module(f"tests.fuzz.{module}").TARGETS:
            found.append((module, target))
    return found


def fuzz(module: str, target, seconds: int) -> dict:  # type: ignore[no-untyped-def]
    corpus, findings = OUT / "corpus" / target.name, OUT / "findings"
    corpus.mkdir(parents=True, exist_ok=True)
    findings.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", f"tests.fuzz.{module}", f"--target={target.name}", f"-max_total_time={seconds}",
               "-timeout=20", "-rss_limit_mb=4096", "-print_final_stats=1",
               f"-artifact_prefix={findings}/{target.name}-", str(corpus)]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, errors="replace", env=_env())
    log = done.stdout + done.stderr
    (OUT / f"{target.name}.log").write_text(log)
    executions = re.findall(r"stat::number_of_executed_units: (\d+)", log) or re.findall(r"^#(\d+)", log, re.M)
    coverage = re.findall(r"cov: (\d+) ft: (\d+)", log)
    finding = None
    if done.returncode != 0:
        lines = [line for line in log.splitlines() if re.match(r"^\w*(Error|Exception|Violation)\b", line)]
        written = re.findall(r"Test unit written to (\S+)", log)
        finding = f"{lines[-1] if lines else 'exit ' + str(done.returncode)}" + (f" ({written[-1]})" if written else "")
    return {"target": target.name, "module": module, "seconds": round(time.monotonic() - started),
            "executions": int(executions[-1]) if executions else 0,
            "cov": int(coverage[-1][0]) if coverage else 0, "ft": int(coverage[-1][1]) if coverage else 0,
            "corpus": len(list(corpus.iterdir())), "finding": finding}


def line_coverage(module: str, target) -> float | None:  # type: ignore[no-untyped-def]
    """Percent of the target's source lines the corpus runs (coverage.py, one replay of every corpus input)."""
    data = OUT / f".coverage.{target.name}"
    include = ",".join(target.modules)
    replay = subprocess.run([sys.executable, "-m", "coverage", "run", f"--data-file={data}", f"--include={include}",
                             "-m", f"tests.fuzz.{module}", "--replay", f"--target={target.name}",
                             str(OUT / "corpus" / target.name)], capture_output=True, text=True, env=_env())
    if replay.returncode != 0:
        return None
    report = subprocess.run([sys.executable, "-m", "coverage", "report", f"--data-file={data}", "--format=total"],
                            capture_output=True, text=True, env=_env())
    try:
        return float(report.stdout.strip())
    except ValueError:
        return None


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}%"


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(Path.cwd()) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=int(os.environ.get("FUZZ_SECONDS", "60")))
    parser.add_argument("--no-hypothesis", action="store_true")
    parser.add_argument("only", nargs="*", help="target names (default: all)")
    args = parser.parse_args()
    OUT.mkdir(exist_ok=True)
    rows = []
    for module, target in targets():
        if args.only and target.name not in args.only:
            continue
        row = fuzz(module, target, args.seconds)
        row["lines_percent"] = line_coverage(module, target)
        rows.append(row)
        print(f"{row['target']:<20} {row['executions']:>9} execs  cov {row['cov']:>5} ft {row['ft']:>6}  lines "
              f"{_percent(row['lines_percent']):>5}  "
              f"{row['finding'] or 'no finding'}", flush=True)
    hypothesis = None
    if not args.no_hypothesis:
        started = time.monotonic()
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/fuzz",
                              "-k", "not atheris"], capture_output=True, text=True,
                             env={**_env(), "HYPOTHESIS_PROFILE": "fuzz"})
        summary = (run.stdout.strip().splitlines() or ["(no output)"])[-1]
        hypothesis = {"profile": "fuzz", "summary": summary, "seconds": round(time.monotonic() - started),
                      "ok": run.returncode == 0}
        (OUT / "hypothesis.log").write_text(run.stdout + run.stderr)
        print(f"hypothesis (profile fuzz): {summary}")
    table = ["| target | executions | cov | ft | lines of its modules | findings |", "|---|---:|---:|---:|---:|---|"]
    table += [f"| `{r['target']}` | {r['executions']:,} | {r['cov']} | {r['ft']} | "
              f"{_percent(r['lines_percent'])} | "
              f"{r['finding'] or 'none'} |" for r in rows]
    (OUT / "report.md").write_text("\n".join(table) + "\n")
    (OUT / "report.json").write_text(json.dumps({"seconds": args.seconds, "targets": rows,
                                                  "hypothesis": hypothesis}, indent=2) + "\n")
    print("\n".join(table))
    if any(r["finding"] for r in rows) or (hypothesis is not None and not hypothesis["ok"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
