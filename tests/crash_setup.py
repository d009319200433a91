"""Crash campaigns for tests/test_crash.py and bench/crash.py: a tool (`govtrain train`, `govtrain tune`, the
documented `GovernedRun` loop) run in a child process (`tests/crash_child.py`) on a tiny BERT and a SQLite ledger,
SIGKILLed at chosen points or at uniformly random times, resumed by running the same command again until it
completes, and then checked:

- **resumed ok**: the same command, run again after each kill (and killed again, where the plan says so), ends
  with exit 0, leaving no run state behind; a kill that lands once the work is recorded (the tune entry, or the run
  entry with its state removed) leaves it complete;
- **ledger verified**: `verify_ledger` passes after every kill and at the end, the spend recomputed;
- **spend ok**: nothing is under-counted (see `spend_problems`);
- **hash ok**: each run's adapter folder hashes (`release.artifact.adapter_sha256`, the run entry's hash: every
  file but the model card and run state) to what its run entry records, `verify_adapter` accepts it with the model
  card the ledger's facts give, and no run state is left in it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests import forkserver
from tests.conftest import TEST_POLICY, make_corpus
from tests.crash_checks import charged_eps, complete, hash_problems, spend_problems
from tests.crash_child import ADAPTER, SPEND, STATE, TUNE, WHERE

TOOLS = ("train", "tune", "GovernedRun")
ROOT = Path(__file__).resolve().parents[1]
STEPS, EPOCH_STEPS = 12, 4  # three ledger epochs per run (two per tune trial, which takes TRIAL_STEPS)
TRIAL_STEPS = 8
# q = 0.05 draws a few examples a step; the RDP accountant keeps the seconds on the crash, not on accounting
POLICY = TEST_POLICY.replace("sampling_rate = 0.01", "sampling_rate = 0.05").replace('accountant = "prv"', 'accountant = "rdp"')


@dataclass
class Scene:
    """One workspace: a ledger with two contributions (public; restricted, with its own class adapter, so a run
    saves two weight files), a RUN.toml and, for tune, a grid; the command that runs the tool there."""

    tool: str
    dir: Path
    url: str
    config: Path
    runs: dict[str, Path]  # run id -> its adapter folder
    command: list[str]
    steps: int  # logical steps per run
    tune_id: str | None = None


def scene(root: Path, tool: str, model: Path) -> Scene:
    from tests.test_train import _admit, _config

    root.mkdir(parents=True)
    corpus = make_corpus(root, f"sqlite:///{root / 'ledger.db'}", POLICY)
    _admit(corpus, "pub")
    _admit(corpus, "restr", data_class="restricted", clip_norm_u=500_000, noise_multiplier_u=1_500_000,
           eps_budget_u=2_000_000)
    steps = TRIAL_STEPS if tool == "tune" else STEPS
    config = _config(corpus, model, steps, extra=f"epoch_steps = {EPOCH_STEPS}")
    output = corpus.dir / "adapter"
    key = ["--key", str(corpus.dir / "ledger.key")]
    if tool == "train":
        return Scene(tool, root, corpus.url, config, {"test-run": output},
                     ["train", "--config", str(config), "--ledger", corpus.url, *key], steps)
    if tool == "GovernedRun":
        return Scene(tool, root, corpus.url, config, {"test-run": output},
                     ["loop", "--config", str(config), "--ledger", corpus.url, *key], steps)
    from tests.test_tune import _grid, _valid

    _valid(corpus)
    grid = _grid(corpus, '"optimizer.lr" = [0.01, 0.05]')
    runs = {f"crash-trial-{k}": output / f"trial-{k}" for k in range(2)}
    return Scene(tool, root, corpus.url, config, runs, ["tune", "--config", str(config), "--grid", str(grid),
                                                        "--ledger", corpus.url, "--id", "crash", *key], steps, "crash")


# -- one invocation ---------------------------------------------------------------------------------------------

@dataclass
class Kill:
    where: str  # a kill point of tests/crash_child.py, or "random" (a timer in this process)
    nth: int = 1
    fraction: float = 0.5
    delay: float = 0.0  # random: seconds after the child's start event

    @property
    def category(self) -> str:
        return WHERE.get(self.where, "random")


def journal_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def child_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1"}
    for name in ("GOVTRAIN_LEDGER", "GOVTRAIN_LEDGER_KEY"):
        env.pop(name, None)
    return env


class Processes:
    """Each run a fresh `python -m tests.crash_child` process: what a user's command line starts."""

    def start(self, argv: list[str], cwd: Path, stderr: Path) -> int:
        with stderr.open("w") as errors:
            self.child = subprocess.Popen([sys.executable, "-m", "tests.crash_child", *argv], cwd=cwd, env=child_env(),
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errors)
        return self.child.pid

    def wait(self, timeout: float | None) -> int | None:
        try:
            return self.child.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        pass


class ForkServer:
    """Each run a process forked from tests/forkserver.py's server, which imported torch and govtrain once: the same
    code from the same state as a fresh process, without its seconds of imports."""

    def start(self, argv: list[str], cwd: Path, stderr: Path) -> int:
        self.child = forkserver.start(["-m", "tests.crash_child", *argv], env=child_env(), cwd=cwd, stderr=stderr)
        return self.child.pid

    def wait(self, timeout: float | None) -> int | None:
        try:
            return self.child.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        pass


def launch(s: Scene, journal: Path, kill: Kill | None, runner) -> tuple[int, str, float]:  # type: ignore[no-untyped-def]
    """Run the tool once; SIGKILL it `kill.delay` s after its start event if `kill` is random. (Return code,
    stderr, seconds from the start event to the exit.)"""
    argv = ["--journal", str(journal)]
    if kill is not None and kill.where != "random":
        argv += ["--kill", kill.where, "--nth", str(kill.nth), "--fraction", f"{kill.fraction:.6f}"]
    stderr = journal.with_suffix(".stderr")
    seen = len(journal_events(journal))
    pid = runner.start([*argv, "--", *s.command], s.dir, stderr)
    code = None
    while code is None and not any(e["event"] == "start" and e["pid"] == pid for e in journal_events(journal)[seen:]):
        code = runner.wait(0.02)
    started = time.monotonic()
    if code is None and kill is not None and kill.where == "random":
        code = runner.wait(kill.delay)
        if code is None:
            os.kill(pid, signal.SIGKILL)
    if code is None:
        code = runner.wait(None)
    return code, stderr.read_text(), time.monotonic() - started


def landed(pid_events: list[dict], kill: Kill) -> str:
    """Where a kill landed, from the killed process's journal: the point and its details, or, for a random kill,
    the last thing the process journalled before it."""
    if kill.where != "random":
        event = next(e for e in reversed(pid_events) if e["event"] == "kill")
        details = ", ".join(f"{k} {v}" for k, v in event.items() if k not in ("pid", "event", "where"))
        return f"{event['where']} ({details})"
    last = pid_events[-1] if pid_events else {"event": "start"}
    if last["event"] == "step":
        return f"after {kill.delay:.2f} s: at step {last['step']} (epoch {last['epoch']})"
    if last["event"] == "call":
        return f"after {kill.delay:.2f} s: after {last['what']} #{last['n']}"
    return f"after {kill.delay:.2f} s: after {last['event']}"


# -- a campaign -------------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    """One run of a tool from a fresh workspace to completion, with the kills that landed in it."""

    tool: str
    kills: list[tuple[str, str]] = field(default_factory=list)  # (category, where it landed)
    missed: list[Kill] = field(default_factory=list)  # planned kills the run completed before
    resumed_ok: bool = False
    verified: bool = False
    spend_ok: bool = False
    hash_ok: bool = False
    problems: list[str] = field(default_factory=list)
    invocations: int = 0

    @property
    def ok(self) -> bool:
        return self.resumed_ok and self.verified and self.spend_ok and self.hash_ok


@dataclass
class Reference:
    """An uninterrupted run of the tool: how long it runs, how often it calls each kill point, what it charges; its
    workspace and journal."""

    seconds: float
    counts: dict[str, int]
    eps: dict[str, int]
    scene: Scene
    journal: Path


def reference(root: Path, tool: str, model: Path, runner) -> Reference:  # type: ignore[no-untyped-def]
    s = scene(root, tool, model)
    journal = root / "journal.jsonl"
    code, stderr, seconds = launch(s, journal, None, runner)
    assert code == 0, stderr
    counts: dict[str, int] = {}
    for e in journal_events(journal):
        if e["event"] == "call":
            counts[e["what"]] = max(counts.get(e["what"], 0), e["n"])
    problems = spend_problems(s, journal_events(journal), None) + hash_problems(s)
    assert not problems, problems
    return Reference(seconds, counts, charged_eps(s.url), s, journal)


def episode(root: Path, tool: str, model: Path, kills: list[Kill], ref: Reference, runner, *,  # type: ignore[no-untyped-def]
            limit: int = 8) -> Outcome:
    """A fresh workspace; the tool run with `kills[0]`, then again (resuming) with `kills[1]`, ..., then without a
    kill until it completes (at most `limit` runs in all); the ledger verified after every kill; then the checks."""
    from govtrain.errors import GovtrainError
    from govtrain.verify.verifier import verify_ledger

    s = scene(root, tool, model)
    journal = root / "journal.jsonl"
    out = Outcome(tool)
    verified = True
    plan = list(kills)
    while out.invocations < limit:
        kill = plan.pop(0) if plan else None
        before = len(journal_events(journal))
        code, stderr, _ = launch(s, journal, kill, runner)
        out.invocations += 1
        pid_events = [e for e in journal_events(journal)[before:]]
        if code == -signal.SIGKILL:
            out.kills.append((kill.category if kill else "?", landed(pid_events, kill) if kill else "?"))
            try:
                verify_ledger(s.url)
            except GovtrainError as e:
                verified = False
                out.problems.append(f"after kill {len(out.kills)}: {e.line()}")
            if complete(s):  # the kill landed after the last thing the work records
                out.resumed_ok = True
                break
            continue
        if kill is not None:
            out.missed.append(kill)
        if code == 0 and complete(s):
            out.resumed_ok = True
        else:
            out.problems.append(f"run {out.invocations} exited {code}: {stderr.strip().splitlines()[-1:]}")
        break
    out.missed += plan
    if not out.resumed_ok:
        return out
    try:
        report = verify_ledger(s.url)
        out.verified = verified and report.spend_recomputed
    except GovtrainError as e:
        out.problems.append(f"at the end: {e.line()}")
    spend = spend_problems(s, journal_events(journal), ref.eps)
    hashes = hash_problems(s)
    out.spend_ok, out.hash_ok = not spend, not hashes
    out.problems += spend + hashes
    return out


POINTS = {"train": SPEND + STATE + ADAPTER, "GovernedRun": SPEND + STATE + ADAPTER, "tune": SPEND + STATE + ADAPTER + TUNE}
COUNTED = {"spend-rows": "record_spend", "spend-head": "record_spend", "spend-unseen": "record_spend",
           "state-partial": "save_state", "weights-partial": "save_file", "extras-pending": "release_write",
           "entry-recorded": "record_run", "trial-config-partial": "trial_config"}


CATEGORIES = ("mid-spend", "mid-checkpoint", "mid-adapter-save", "mid-trial-config")


def plan_kills(tool: str, total: int, rng: random.Random, ref: Reference) -> list[list[Kill]]:
    """`total` kills in episodes. Kill points first (each at a random one of its calls in an uninterrupted run, a
    random fraction of the file written): one of each category that applies to `tool`, then its other points, as
    many as leave one kill (where `total` > 1) to land at a uniformly random time in (0, the reference run's time);
    the rest land at such random times. A random kill follows a kill point in its episode (it lands in the resumed
    run) where there is one to follow, with even odds."""
    variants = {c: [w for w in POINTS[tool] if WHERE[w] == c] for c in CATEGORIES}
    firsts = [rng.choice(v) for v in variants.values() if v]
    others = [w for w in POINTS[tool] if w not in firsts]
    rng.shuffle(others)
    chosen = (firsts + others)[:max(total - 1, 1) if total > 1 else total]
    points = [Kill(where, nth=rng.randint(1, max(ref.counts.get(COUNTED[where], 1), 1)), fraction=rng.random())
              for where in chosen]
    randoms = [Kill("random", delay=rng.uniform(0, ref.seconds)) for _ in range(total - len(points))]
    episodes = []
    for point in points:
        episodes.append([point] + ([randoms.pop()] if randoms and rng.random() < 0.5 else []))
    episodes += [[k] for k in randoms]
    rng.shuffle(episodes)
    return episodes


def campaign(tool: str, total: int, seed: int, root: Path, model: Path, runner, *,  # type: ignore[no-untyped-def]
             log=print, ref: Reference | None = None) -> list[Outcome]:
    """Kill `tool` `total` times (seeded: `seed`), each missed kill planned again in an episode of its own."""
    rng = random.Random(seed)
    ref = ref or reference(root / "reference", tool, model, runner)
    log(f"{tool}: seed {seed}; uninterrupted run {ref.seconds:.1f} s, calls {ref.counts}")
    pending = plan_kills(tool, total, rng, ref)
    outcomes: list[Outcome] = []
    landed_kills = 0
    while pending and landed_kills < total and len(outcomes) < 3 * total:
        kills = pending.pop(0)
        out = episode(root / f"episode-{len(outcomes)}", tool, model, kills, ref, runner)
        outcomes.append(out)
        landed_kills += len(out.kills)
        for kill in out.missed:
            if kill.where == "random":
                kill = Kill("random", delay=rng.uniform(0, ref.seconds))
            pending.append([kill])
        log(f"{tool} episode {len(outcomes) - 1}: {[w for _, w in out.kills]} missed {len(out.missed)} "
            f"{'ok' if out.ok else out.problems}")
    return outcomes


def table(outcomes: list[Outcome]) -> str:
    """The outcome table: one row per kill."""
    rows = [("tool", "kill", "where it landed", "resumed ok", "ledger verified", "spend ok", "hash ok")]
    for tool in TOOLS:
        kills = 0
        for out in (o for o in outcomes if o.tool == tool):
            for category, where in out.kills:
                kills += 1
                rows.append((tool, str(kills), f"{category}: {where}", *("yes" if v else "NO" for v in
                             (out.resumed_ok, out.verified, out.spend_ok, out.hash_ok))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
