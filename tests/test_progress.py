"""Progress where the output is no terminal (a log file, a pipe, CI): `train`, `eval`, `tune` and the demo's
non-private reference write a plain line at least every 30 s of work, driven here by an injected clock; and no
command writes an ANSI control code there."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from govtrain.train.progress import ProgressLines

LINE = re.compile(r"^step (\d+)/(\d+) \| (\d+:\d\d) elapsed")


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def test_lines_come_after_the_first_step_then_every_30_seconds_of_steps():
    clock, lines = FakeClock(), []
    progress = ProgressLines(lines.append, 10, clock=clock)
    for step in range(1, 11):
        clock.now += 12  # each step takes 12 s
        progress.update(step, lambda: ["loss 0.500", "public ε 0.250"])
    progress.finish()
    assert [int(LINE.match(line).group(1)) for line in lines] == [1, 4, 7, 10]  # 12 s, then at 36 s, 36 s, 36 s
    assert lines[0] == "step 1/10 | 0:12 elapsed | 12.00 s/step | ETA 1:48 | loss 0.500 | public ε 0.250"
    assert lines[-1].startswith("step 10/10 | 2:00 elapsed | 12.00 s/step | ETA 0:00")


def test_details_are_computed_only_for_a_line_and_finish_adds_the_last_step():
    clock, lines, asked = FakeClock(), [], []
    progress = ProgressLines(lines.append, 5, what="example", done=0, every=30, clock=clock)

    def details():
        asked.append(1)
        return []

    for done in range(1, 6):
        clock.now += 0.5
        progress.update(done, details)
    assert len(asked) == 1 and lines == ["example 1/5 | 0:00 elapsed | 2.00 example/s | ETA 0:02"]
    progress.finish()
    assert lines[-1] == "example 5/5 | 0:02 elapsed | 2.00 example/s | ETA 0:00"
    progress.finish()  # nothing new to say
    assert len(lines) == 2


def test_a_resumed_run_counts_its_pace_from_where_it_resumed():
    clock, lines = FakeClock(), []
    progress = ProgressLines(lines.append, 100, done=40, clock=clock)
    clock.now += 10
    progress.update(41)
    assert lines == ["step 41/100 | 0:10 elapsed | 10.00 s/step | ETA 9:50"]


# -- the commands -------------------------------------------------------------------------


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402

from govtrain.cli.main import cli  # noqa: E402
from tests.conftest import REPO, Corpus  # noqa: E402
from tests.test_train import _admit, _config, _data, save_tiny_bert  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


def test_train_logs_a_line_every_30_seconds_of_steps_with_epsilon(corpus: Corpus, tiny_model: Path):
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import train

    _admit(corpus, "pub")
    _admit(corpus, "sens", data_class="sensitive", clip_norm_u=500_000, eps_budget_u=3_000_000)
    clock, lines = FakeClock(), []

    def observe(step: int, ids: list[str]) -> None:
        clock.now += 12  # the step being drawn takes 12 s

    result = train(load_run_config(_config(corpus, tiny_model, 12)), corpus.url, insecure_seed=1, log=lines.append,
                   progress=True, observe=observe, clock=clock)
    progress = [line for line in lines if LINE.match(line)]
    assert [int(LINE.match(line).group(1)) for line in progress] == [1, 4, 7, 10, 12]
    assert all(int(LINE.match(line).group(2)) == 12 for line in progress)
    assert "12.00 s/step" in progress[1] and "public ε " in progress[1] and "sensitive ε " in progress[1]
    assert f"public ε {result.eps_by_class['public'][-1]:.3f}" in progress[-1]


def test_train_eval_and_tune_on_the_command_line_off_a_terminal(corpus: Corpus, tiny_model: Path, monkeypatch):
    """CliRunner's streams are no terminal: progress comes as lines (every step here, the clock moving 31 s between
    reads), through the run's log on stdout for train and tune and on stderr for eval and --json; no ANSI codes."""
    from govtrain.train import progress

    ticks = FakeClock()

    def clock() -> float:
        ticks.now += 31
        return ticks.now

    monkeypatch.setattr(progress, "CLOCK", clock)
    _admit(corpus, "pub")
    config = _config(corpus, tiny_model, 5)
    runner = CliRunner()
    trained = runner.invoke(cli, ["train", "--config", str(config), "--ledger", corpus.url, "--insecure-seed", "1"])
    assert trained.exit_code == 0, trained.output
    steps = [int(m.group(1)) for m in map(LINE.match, trained.stdout.splitlines()) if m]
    assert steps == [1, 2, 3, 4, 5] and "public ε" in trained.stdout

    heldout = corpus.dir / "heldout.jsonl"  # outside the training data folder: rows no contribution admitted
    heldout.write_text(_data(corpus, "heldout", records=70).read_text())
    (corpus.dir / "data" / "heldout.jsonl").unlink()
    evaluated = runner.invoke(cli, ["eval", "--config", str(config), "--data", str(heldout), "--json"])
    assert evaluated.exit_code == 0, evaluated.output
    assert json.loads(evaluated.stdout)["examples"] == 70  # stdout is the JSON only
    assert [line.split(" | ")[0] for line in evaluated.stderr.splitlines()] == [
        "example 32/70", "example 64/70", "example 70/70"]

    grid = corpus.dir / "grid.toml"
    grid.write_text(f'[grid]\n"optimizer.lr" = [0.01]\n[select]\ndata = "{heldout}"\n')
    tune_config = corpus.dir / "tune.toml"
    tune_config.write_text(config.read_text().replace('output = "adapter"', 'output = "tuned"'))
    tuned = runner.invoke(cli, ["tune", "--config", str(tune_config), "--grid", str(grid), "--ledger", corpus.url,
                                "--insecure-seed", "3", "--id", "t"])
    assert tuned.exit_code == 0, tuned.output
    assert "step 5/5 |" in tuned.stdout and "example 70/70 |" in tuned.stdout
    for result in (trained, evaluated, tuned):
        assert "\x1b" not in result.stdout + result.stderr


def test_train_through_a_pipe_has_progress_lines_and_no_control_codes(corpus: Corpus, tiny_model: Path):
    """A real process whose stdout and stderr are pipes, as under nohup, CI or `| tee`."""
    _admit(corpus, "pub")
    config = _config(corpus, tiny_model, 3)
    result = subprocess.run([sys.executable, "-m", "govtrain.cli.main", "train", "--config", str(config), "--ledger",
                             corpus.url, "--insecure-seed", "1"], capture_output=True, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO), "TERM": "xterm-256color"}, timeout=300)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^step 1/3 \| \d+:\d\d elapsed \| .* \| public ε \d\.\d{3}", result.stdout, re.M), result.stdout
    assert "\x1b" not in result.stdout + result.stderr and "\r" not in result.stdout + result.stderr


def test_the_non_private_reference_reports_progress(tmp_path: Path, tiny_model: Path):
    import importlib.util

    from govtrain.train.config import load_run_config
    from tests.test_eval import _config as eval_config, _write
    from tests.test_train import WORDS

    spec = importlib.util.spec_from_file_location("nonprivate", REPO / "examples" / "nonprivate.py")
    nonprivate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nonprivate)
    rows = [{"text": f"{WORDS[i % 2]} movie", "label": i % 2} for i in range(8)]
    train = _write(tmp_path / "contrib-00.jsonl", rows)
    config = load_run_config(eval_config(tmp_path, tiny_model, "sequence-classification", ""))
    clock, lines = FakeClock(), []

    def tick(line: str) -> None:
        lines.append(line)

    class Ticking(ProgressLines):
        def update(self, done, details=()):  # each step takes 20 s
            clock.now += 20
            super().update(done, details)

    nonprivate.train_nonprivate(config, [train], steps=5, batch=4, progress=Ticking(tick, 5, clock=clock))
    assert [line.split(" | ")[0] for line in lines] == ["step 1/5", "step 3/5", "step 5/5"]
    assert all(re.search(r"\| loss \d+\.\d{3}$", line) for line in lines)
