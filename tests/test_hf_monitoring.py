"""What a `GovernedTrainer` logs: `grad_norm` is the norm of the privatized gradient the update applied (never a
statistic of the un-noised one), and every training log carries each class's ε (`eps/<class>`), so the callbacks
that feed TensorBoard and W&B show both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402

import govtrain  # noqa: E402
from govtrain.cli.main import cli  # noqa: E402
from govtrain.integrations.hf import GovernedTrainer  # noqa: E402
from tests.test_api import QUIET, _corpus  # noqa: E402
from tests.test_hf_trainer import EXTRA, _arguments  # noqa: E402
from tests.test_train import _config, tiny_model  # noqa: E402,F401


class _Logged(transformers.TrainerCallback):
    """Each log the callbacks get, with how many governed updates had run by then."""

    def __init__(self, updates: list) -> None:
        self.updates, self.logs = updates, []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append((len(self.updates), dict(logs or {})))


def _norm(tensors) -> float:
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors])))


def test_grad_norm_is_the_privatized_gradients_and_eps_is_logged_per_class(tmp_path: Path, tiny_model: Path,
                                                                           monkeypatch):
    from govtrain.mechanisms.update import Update
    from govtrain.routing.router import Router

    applied, clean = [], []  # per governed update: what the optimizer got, and the clipped sum before its noise
    original_step, original_finish = Update.step, Router._finish

    def step(self, noise_std):
        applied.append([p.grad.clone() for p in self._moved() if p.grad is not None])
        return original_step(self, noise_std)

    def finish(self, totals, group_std, expected_batch_size):
        before = {name: total.clone() for name, total in totals.items()}
        original_finish(self, totals, group_std, expected_batch_size)
        clean.append([before[name] / expected_batch_size for name, p in self.params.items() if p.grad is not None])

    monkeypatch.setattr(Update, "step", step)
    monkeypatch.setattr(Router, "_finish", finish)
    corpus = _corpus(tmp_path, "logs")
    logged = _Logged(applied)
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 6, extra=EXTRA), corpus.url, insecure_seed=3,
                                   **QUIET) as run:
        trainer = GovernedTrainer(run, args=_arguments(tmp_path, logging_steps=1, max_grad_norm=1e-3),
                                  callbacks=[logged])
        trainer.train()
        final = run.epsilons()
    steps = [(count, logs) for count, logs in logged.logs if "loss" in logs]
    assert len(steps) >= 5 and len(applied) == len(clean) == 6
    for count, logs in steps:
        privatized, unnoised = _norm(applied[count - 1]), _norm(clean[count - 1])
        assert logs["grad_norm"] == pytest.approx(privatized, rel=1e-5)  # what the update applied
        assert abs(logs["grad_norm"] - unnoised) > 1e-3 * unnoised  # not the clean clipped sum
        assert logs["grad_norm"] > 1e-3  # max_grad_norm clipped nothing, and the norm is not 0
        assert {k for k in logs if k.startswith("eps/")} == {"eps/public", "eps/sensitive", "eps/restricted"}
    assert all("eps/public" not in logs for _, logs in logged.logs if any(k.startswith("eval_") for k in logs))
    # the last training log's ε is the run's, and what `ledger status` then shows per class
    last = steps[-1][1]
    assert {name: last[f"eps/{name}"] for name in final} == final
    status = json.loads(CliRunner().invoke(cli, ["ledger", "status", "--ledger", corpus.url, "--json"]).stdout)
    assert {name: row["eps_max"] for name, row in status["classes"].items()} == pytest.approx(final, abs=1e-6)
    assert status["runs"][0]["run_id"] == "test-run"
