"""`govtrain.integrations.hf`: the Hugging Face Trainer and TRL's SFTTrainer train a `GovernedRun`. The
Trainer path gives the privatized gradients, adapter and ledger spend of `govtrain train` on the same seed;
the user keeps TrainingArguments, logging, evaluation and callbacks; the model is not wrapped; and whatever
would break the run's sampling or its accounting is refused before anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import govtrain  # noqa: E402
from govtrain.errors import Code, ConfigError  # noqa: E402
from govtrain.integrations.hf import GovernedOptimizer, GovernedTrainer  # noqa: E402
from govtrain.release.artifact import adapter_sha256  # noqa: E402
from govtrain.train.config import load_run_config  # noqa: E402
from govtrain.verify.verifier import verify_ledger  # noqa: E402
from tests.conftest import rates_met, snapshot  # noqa: E402
from tests.test_api import QUIET, _corpus, _spend  # noqa: E402
from tests.test_train import _config, tiny_model  # noqa: E402,F401

EXTRA = "physical_batch = 7\nexpected_batch_size = 16"


def _arguments(tmp_path: Path, **overrides) -> transformers.TrainingArguments:
    settings = dict(output_dir=str(tmp_path / "trainer"), use_cpu=True, logging_steps=2, save_strategy="no",
                    lr_scheduler_type="constant", report_to=[], disable_tqdm=True)
    return transformers.TrainingArguments(**{**settings, **overrides})


def _recording_updates(monkeypatch) -> list[dict[str, torch.Tensor]]:
    """Every privatized gradient the update steps on, as it is handed to the optimizer."""
    from govtrain.mechanisms.update import Update

    seen: list[dict[str, torch.Tensor]] = []
    original = Update.step

    def step(self, noise_std):
        seen.append({n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None})
        return original(self, noise_std)

    monkeypatch.setattr(Update, "step", step)
    return seen


class _Log(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.logs: list[dict] = []
        self.steps: list[int] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


MECHANISMS = {"dpsgd": "", "prism": "[prism]\nlr = 0.01", "dp-muon": "[muon]\nlr = 0.02"}


@pytest.mark.parametrize("mechanism", sorted(MECHANISMS))
def test_the_trainer_path_gives_the_cli_paths_gradients_adapter_and_spend(tmp_path: Path, tiny_model: Path,
                                                                         monkeypatch, mechanism: str):
    from govtrain.train.loop import train

    cli, hf = _corpus(tmp_path, "cli"), _corpus(tmp_path, "hf")
    updates = _recording_updates(monkeypatch)
    extra = f"{EXTRA}\n{MECHANISMS[mechanism]}"
    train(load_run_config(_config(cli, tiny_model, 12, mechanism, extra)), cli.url, insecure_seed=5, **QUIET)
    cli_updates = list(updates)
    updates.clear()

    log = _Log()
    with govtrain.GovernedRun.open(_config(hf, tiny_model, 12, mechanism, extra), hf.url, insecure_seed=5,
                                   **QUIET) as run:
        model, keys = run.model, list(run.model.state_dict())
        trainer = GovernedTrainer(run, args=_arguments(tmp_path), callbacks=[log])
        assert trainer.model is model and type(trainer.model).__name__ == "PeftModel"
        assert isinstance(trainer.optimizer, GovernedOptimizer)
        trainer.train()
        assert run.steps == 12 and run.result.adapter_sha256 is not None  # train() saved and recorded the run
    assert list(model.state_dict()) == keys
    assert len(updates) == len(cli_updates) == 12
    for ours, theirs in zip(updates, cli_updates):
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert adapter_sha256(hf.dir / "adapter") == adapter_sha256(cli.dir / "adapter")
    assert _spend(hf.url) == _spend(cli.url)
    assert verify_ledger(hf.url).by_kind["run"] == 1
    assert log.steps == list(range(1, len(log.steps) + 1)) and log.steps[-1] <= 12  # an empty draw is no Trainer step
    assert any("loss" in entry for entry in log.logs)  # the Trainer's own logging of the governed loss


def test_the_users_trainer_settings_evaluation_and_schedule_apply(tmp_path: Path, tiny_model: Path,
                                                                  monkeypatch):
    """Evaluation runs (under no_grad, between governed steps), compute_metrics and callbacks see it, and the
    Trainer's schedule scales the run's optimizer's learning rate (here linearly to zero)."""
    import numpy as np

    corpus = _corpus(tmp_path, "eval")
    log = _Log()
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 6), corpus.url, insecure_seed=1, **QUIET) as run:
        tokenizer = run.tokenizer
        rows = [tokenizer(text) | {"labels": label} for text, label in (("good movie", 1), ("awful film", 0))] * 4
        metrics = lambda prediction: {"accuracy": float(np.mean(prediction.predictions.argmax(-1)  # noqa: E731
                                                                == prediction.label_ids))}
        trainer = GovernedTrainer(run, args=_arguments(tmp_path, lr_scheduler_type="linear", eval_strategy="steps",
                                                       eval_steps=3, per_device_eval_batch_size=4),
                                  eval_dataset=rows, compute_metrics=metrics, callbacks=[log],
                                  data_collator=None, processing_class=tokenizer)
        lr = trainer.optimizer.param_groups[0]["lr"]
        # the rate in the run's own optimizer at each governed update (review 4: a stale copy was scaled)
        used = rates_met(monkeypatch, run._run.update.optimizer)
        trainer.train()
        assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.0)  # the linear schedule ran to zero
        assert used == pytest.approx([0.01 * (6 - k) / 6 for k in range(6)])  # and the update used each rate
        assert lr == pytest.approx(0.01)  # RUN.toml's lr, which the schedule scales
        assert "eval_accuracy" in trainer.evaluate()
    assert any("eval_accuracy" in entry for entry in log.logs)
    assert verify_ledger(corpus.url).by_kind["run"] == 1


@pytest.mark.parametrize("given, code, says", [
    ({"train_dataset": [{"input_ids": [1, 2]}]}, Code.UNGOVERNED_BATCH, "train_dataset"),
    ({"data_collator": lambda rows: rows}, Code.UNGOVERNED_BATCH, "data_collator"),
    ({"compute_loss_func": lambda *a, **k: 0}, Code.RUN_CONFIG_INVALID, "per_example_loss"),
    ({"args": {"gradient_accumulation_steps": 4}}, Code.RUN_CONFIG_INVALID, "gradient_accumulation_steps"),
    ({"args": {"max_steps": 50}}, Code.RUN_CONFIG_INVALID, "training.steps"),
    ({"args": {"bf16": True}}, Code.RUN_CONFIG_INVALID, "bf16"),
    ({"args": {"gradient_checkpointing": True}}, Code.RUN_CONFIG_INVALID, "gradient_checkpointing"),
])
def test_what_would_break_the_runs_sampling_or_accounting_is_refused(tmp_path: Path, tiny_model: Path, given, code,
                                                                     says):
    corpus = _corpus(tmp_path, "refused")
    before = snapshot(corpus.url)
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 4), corpus.url, insecure_seed=1, **QUIET) as run:
        weights = {n: p.detach().clone() for n, p in run.model.named_parameters() if p.requires_grad}
        arguments = given.pop("args", {})
        with pytest.raises(ConfigError) as refused:
            GovernedTrainer(run, args=_arguments(tmp_path, **arguments), **given)
        assert refused.value.code is code and says in refused.value.detail
        assert all(torch.equal(weights[n], p) for n, p in run.model.named_parameters() if p.requires_grad)
    assert snapshot(corpus.url) == before


def test_a_trainer_resuming_its_own_checkpoint_or_searching_is_refused(tmp_path: Path, tiny_model: Path):
    corpus = _corpus(tmp_path, "resume")
    before = snapshot(corpus.url)
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 4), corpus.url, insecure_seed=1, **QUIET) as run:
        trainer = GovernedTrainer(run, args=_arguments(tmp_path))
        with pytest.raises(ConfigError, match="resumes from its own state"):
            trainer.train(resume_from_checkpoint=True)
        with pytest.raises(ConfigError, match="govtrain tune"):
            trainer.train(trial={"learning_rate": 1e-3})
        with pytest.raises(ConfigError) as refused:  # a training step on a batch the run did not draw
            trainer.training_step(run.model, run.tokenizer(["good movie"], return_tensors="pt"))
        assert refused.value.code is Code.UNGOVERNED_BATCH
        with pytest.raises(RuntimeError, match="without a governed step"):
            trainer.optimizer.step()
    assert snapshot(corpus.url) == before


def test_the_sft_trainer_trains_a_causal_lm_run_like_the_cli_and_refuses_packing(tmp_path: Path, monkeypatch):
    trl = pytest.importorskip("trl")
    from govtrain.integrations.hf import GovernedSFTTrainer
    from govtrain.train.loop import train
    from tests import causal_models
    from tests.test_causal_lm import _contribution, _rows, _run_toml

    model = causal_models.save(tmp_path / "tiny-llama", "llama", layers=6)
    corpora = []
    for name in ("cli", "sft"):
        corpus = _corpus_lm(tmp_path, name)
        _contribution(corpus, "pairs", _rows("pair", 40))
        _contribution(corpus, "chats", _rows("chat", 40))
        config = _run_toml(corpus, model, 4)
        config.write_text(config.read_text() + "expected_batch_size = 8\nphysical_batch = 5\n")
        corpora.append((corpus, config))
    (cli, cli_config), (corpus, config) = corpora
    updates = _recording_updates(monkeypatch)
    train(load_run_config(cli_config), cli.url, insecure_seed=3, **QUIET)
    cli_updates = list(updates)
    updates.clear()

    settings = dict(output_dir=str(tmp_path / "sft"), use_cpu=True, save_strategy="no", report_to=[],
                    lr_scheduler_type="constant", disable_tqdm=True, logging_steps=1, bf16=False,
                    gradient_checkpointing=False)  # TRL's defaults are True: the run's precision governs
    before = snapshot(corpus.url)
    with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=3, **QUIET) as run:
        with pytest.raises(ConfigError, match="packing"):
            GovernedSFTTrainer(run, args=trl.SFTConfig(**settings, packing=True))
        assert snapshot(corpus.url) == before
        trainer = GovernedSFTTrainer(run, args=trl.SFTConfig(**settings))
        assert trainer.model is run.model
        trainer.train()
        assert run.steps == 4
    assert len(updates) == len(cli_updates) == 4
    for ours, theirs in zip(updates, cli_updates):
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    for name in ("adapter_model.safetensors", "adapter_config.json"):  # TRL tags the model card ("sft", "trl")
        assert (corpus.dir / "adapter" / name).read_bytes() == (cli.dir / "adapter" / name).read_bytes()
    assert _spend(corpus.url) == _spend(cli.url)
    assert verify_ledger(corpus.url).by_kind["run"] == 1


def _corpus_lm(tmp_path: Path, name: str):
    from tests.conftest import make_corpus
    from tests.test_api import BATCH_POLICY

    folder = tmp_path / name
    folder.mkdir()
    return make_corpus(folder, f"sqlite:///{folder / 'ledger.db'}", BATCH_POLICY)


def test_the_sft_trainer_refuses_a_classification_run(tmp_path: Path, tiny_model: Path):
    trl = pytest.importorskip("trl")
    from govtrain.integrations.hf import GovernedSFTTrainer

    corpus = _corpus(tmp_path, "cls")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 2), corpus.url, insecure_seed=1, **QUIET) as run:
        with pytest.raises(ConfigError, match="causal-lm"):
            GovernedSFTTrainer(run, args=trl.SFTConfig(output_dir=str(tmp_path / "sft"), use_cpu=True, report_to=[],
                                                       bf16=False, gradient_checkpointing=False))


@pytest.mark.parametrize("mechanism", ["prism", "dp-muon"])
def test_the_trainers_schedule_scales_prisms_and_muons_own_learning_rate(tmp_path: Path, tiny_model: Path,
                                                                          mechanism: str):
    corpus = _corpus(tmp_path, mechanism)
    config = _config(corpus, tiny_model, 4, mechanism, MECHANISMS[mechanism])
    with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=1, **QUIET) as run:
        update = run._run.update
        own = update.prism if update.prism is not None else update.muon
        trainer = GovernedTrainer(run, args=_arguments(tmp_path, lr_scheduler_type="linear"))
        group = trainer.optimizer.param_groups[-1]  # after the run optimizer's groups (the head's)
        moved = [p for pair in own.pairs.values() for p in pair] if mechanism == "prism" else list(own.params.values())
        assert [id(p) for p in group["params"]] == [id(p) for p in moved]
        assert group["lr"] == own.lr == pytest.approx(0.01 if mechanism == "prism" else 0.02)
        trainer.train()
        assert own.lr == pytest.approx(0.0) and group["lr"] == own.lr  # the linear schedule ran it to zero
    assert verify_ledger(corpus.url).by_kind["run"] == 1


def test_a_run_paused_in_a_users_loop_is_finished_by_the_trainer(tmp_path: Path, tiny_model: Path):
    """The Trainer takes a resumed run's remaining steps (max_steps = what is left) and the ledger history goes
    on: the spend is that of a run never paused."""
    whole, parts = _corpus(tmp_path, "whole"), _corpus(tmp_path, "parts")
    with govtrain.GovernedRun.open(_config(whole, tiny_model, 12), whole.url, insecure_seed=2, **QUIET) as run:
        GovernedTrainer(run, args=_arguments(tmp_path / "a")).train()
    config = _config(parts, tiny_model, 12)
    with govtrain.GovernedRun.open(config, parts.url, insecure_seed=2, **QUIET) as run:
        for batch in run.batches():
            if run.step(run.per_example_loss(run.model(**batch.inputs), batch)) is not None and run.steps == 5:
                break
    with govtrain.GovernedRun.open(config, parts.url, insecure_seed=2, **QUIET) as run:
        assert run.steps == 5
        trainer = GovernedTrainer(run, args=_arguments(tmp_path / "b"))
        assert trainer.args.max_steps == 7
        trainer.train()
        assert run.steps == 12 and run.result.adapter_sha256 is not None
    assert _spend(parts.url) == _spend(whole.url)
    assert verify_ledger(parts.url).by_kind["run"] == 1
