"""Review item 1: a second run in the same ledger epoch trained without writing its spend.

The adversary is a second or restarted run on the same ledger: an operator who moves a killed run's
state file away and starts afresh, or two runs at once. Neither may train on another run's
write-ahead spend: every contribution a run draws is charged by that run's own spend entry."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")

from govtrain.errors import ConfigError  # noqa: E402
from govtrain.ledger.entries import decode_entry  # noqa: E402
from govtrain.train.config import load_run_config  # noqa: E402
from govtrain.train.loop import STATE_FILE, train  # noqa: E402
from govtrain.verify.verifier import verify_ledger  # noqa: E402
from tests.conftest import Corpus, snapshot  # noqa: E402
from tests.test_train import _admit, _config, tiny_model  # noqa: E402,F401


def _spends(corpus: Corpus) -> list[dict]:
    with corpus.open() as ledger:
        return [decode_entry(e.body, seq=e.seq, kind="spend") for e in ledger.store.entries(kinds=("spend",))]


def _second_config(corpus: Corpus, model: Path, steps: int, run_id: str, output: str):
    path = _config(corpus, model, steps)
    text = path.read_text().replace('run_id = "test-run"', f'run_id = "{run_id}"').replace(
        'output = "adapter"', f'output = "{output}"')
    second = corpus.dir / f"{run_id}.toml"
    second.write_text(text)
    return load_run_config(second)


def _assert_every_draw_charged_by_its_run(corpus: Corpus, draws: dict[str, set[str]]) -> None:
    charged: dict[str, set[str]] = {}
    holders: dict[int, set[str]] = {}
    for spend in _spends(corpus):
        charged.setdefault(spend["run_id"], set()).add(spend["contribution_id"])
        holders.setdefault(spend["epoch"], set()).add(spend["run_id"])
    assert all(len(runs) == 1 for runs in holders.values()), holders  # one run per ledger epoch
    for run_id, drawn in draws.items():
        assert drawn and drawn <= charged.get(run_id, set()), (run_id, drawn, charged)
    report = verify_ledger(corpus.url)  # and every spend recomputes
    assert report.ok and report.spend_recomputed


def test_a_restarted_run_never_trains_on_the_killed_runs_write_ahead(corpus: Corpus, tiny_model: Path):
    _admit(corpus, "pub")
    config = load_run_config(_config(corpus, tiny_model, 25))
    with pytest.raises(KeyboardInterrupt):
        train(config, corpus.url, insecure_seed=3, log=lambda line: None, checkpoint_every=4,
              interrupt_after_steps=14)  # killed in ledger epoch 1, after its spend was written
    _admit(corpus, "late")  # admitted after run A's write-ahead for epoch 1
    moved = corpus.dir / "moved-away.pt"
    shutil.move(corpus.dir / "adapter" / STATE_FILE, moved)  # "move the file away to start afresh"

    before = snapshot(corpus.url)
    with pytest.raises(ConfigError) as info:  # the same run id, without its state: refused, nothing written
        train(config, corpus.url, insecure_seed=4, log=lambda line: None)
    assert info.value.code.value == "run_config_invalid" and "already wrote spend" in info.value.detail
    assert snapshot(corpus.url) == before

    draws: dict[str, set[str]] = {"run-b": set()}
    lines: list[str] = []
    second = _second_config(corpus, tiny_model, 20, "run-b", "adapter-b")
    train(second, corpus.url, insecure_seed=4, log=lines.append,
          observe=lambda step, ids: draws["run-b"].update(ids))
    assert any("ledger epoch 1 is held by test-run" in line for line in lines), lines
    assert "late" in draws["run-b"]
    epochs_b = {s["epoch"] for s in _spends(corpus) if s["run_id"] == "run-b"}
    assert epochs_b == {2, 3}  # run A's epoch 1 was closed, never reused
    _assert_every_draw_charged_by_its_run(corpus, draws)


def test_two_concurrent_runs_each_charge_their_own_epochs(corpus: Corpus, tiny_model: Path):
    _admit(corpus, "pub")
    _admit(corpus, "sens", data_class="sensitive", clip_norm_u=500_000, eps_budget_u=3_000_000)
    first = _second_config(corpus, tiny_model, 20, "run-a", "adapter-a")
    second = _second_config(corpus, tiny_model, 10, "run-b", "adapter-b")
    draws: dict[str, set[str]] = {"run-a": set(), "run-b": set()}
    started = []

    def observe_a(step: int, ids: list[str]) -> None:
        draws["run-a"].update(ids)
        if step == 3 and not started:  # run B starts while run A is inside its first ledger epoch
            started.append(True)
            train(second, corpus.url, insecure_seed=6, log=lambda line: None,
                  observe=lambda s, i: draws["run-b"].update(i))

    result = train(first, corpus.url, insecure_seed=5, log=lambda line: None, observe=observe_a)
    assert started and result.steps == 20
    holders = {s["epoch"]: s["run_id"] for s in _spends(corpus)}
    assert holders == {0: "run-a", 1: "run-b", 2: "run-a"}
    _assert_every_draw_charged_by_its_run(corpus, draws)
    assert verify_ledger(corpus.url).by_kind["run"] == 2
