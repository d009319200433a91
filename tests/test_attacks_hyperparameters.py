"""Attacks that set a hyperparameter from private data outside the charge (issue 34, item 8).

The adversary is code that runs between governed steps: a Trainer callback (`on_evaluate` with an evaluation of
admitted rows, `on_log` with the training loss, which is not noised, `on_step_end`) or the documented loop around
`GovernedRun`. It writes the optimizer's `param_groups` (the learning rate, betas, momentum, weight decay, eps, a key
of its own) or PRISM's and DP-Muon's rate through the Trainer's view, and the next governed update would use it:
the spend stays the same and both ledgers verify, yet the released adapter depends on the data it read. The issue's
proof set `lr = 5·eval_loss` on an evaluation of a contribution's admitted rows.

Every hyperparameter the update reads must be RUN.toml's, its rates scaled by the run's schedule (a function of the
governed step alone); anything else is refused (`ungoverned_update`) before the update acts, and nothing changes:
the weights, the optimizer's moments and step counts, the ledger (what the epoch wrote ahead aside), the run's step.
A configured schedule (through the loop or a Trainer's `lr_scheduler_type`) and a standard Trainer run still train.
An early stop chosen from the training loss releases nothing: the run pauses, its steps fixed by training.steps.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import govtrain  # noqa: E402
from govtrain.errors import Code, ConfigError  # noqa: E402
from govtrain.integrations.hf import GovernedOptimizer, GovernedTrainer  # noqa: E402
from govtrain.verify.verifier import verify_ledger  # noqa: E402
from tests.conftest import rates_met, snapshot  # noqa: E402
from tests.test_api import QUIET, _corpus, _same, _trainable  # noqa: E402
from tests.test_attacks_selection import _admitted, _evaluating, _held_out  # noqa: E402
from tests.test_attacks_user_code import _loop, _step_once  # noqa: E402
from tests.test_hf_trainer import MECHANISMS, _arguments  # noqa: E402
from tests.test_train import _config, tiny_model  # noqa: E402,F401


def _moments(run) -> list:
    """The update's state as plain copies: every optimizer moment and step count, PRISM's and DP-Muon's state (read
    with `get`: the optimizer's state is a defaultdict, and indexing it would add entries)."""
    update = run._run.update

    def copied(value):
        if isinstance(value, torch.Tensor):
            return value.detach().clone()
        if isinstance(value, dict):
            return {k: copied(v) for k, v in value.items()}
        return value

    optimizer = update.optimizer
    state = [copied(optimizer.state.get(p)) for g in optimizer.param_groups for p in g["params"]] if optimizer else []
    return [state, copied(update.prism.state if update.prism else {}), copied(update.muon.state if update.muon else {})]


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


class _Then:
    """What the run held when a callback acted: the weights, the update's state, the ledger and the step."""

    def __init__(self, run, url: str) -> None:
        self.run, self.url = run, url
        self.weights, self.state = _trainable(run), _moments(run)
        self.ledger, self.steps = snapshot(url), run.steps

    def unchanged(self) -> bool:
        run = self.run
        return (_same(self.weights, run) and _equal(_moments(run), self.state) and snapshot(self.url) == self.ledger
                and run.steps == self.steps)


class _SetRate(transformers.TrainerCallback):
    """A callback that sets every group's learning rate from what it is handed: an evaluation's loss (the issue's
    proof: 5·eval_loss), the training loss as logged (a reduce-on-plateau), or the step's end."""

    def __init__(self, run, url: str, event: str) -> None:
        self.run, self.url, self.event = run, url, event
        self.then: _Then | None = None
        self.best = math.inf

    def _set(self, trainer_optimizer, rate: float) -> None:
        if self.then is None:
            for group in trainer_optimizer.param_groups:
                group["lr"] = rate
            self.then = _Then(self.run, self.url)

    def on_evaluate(self, args, state, control, metrics=None, optimizer=None, **kwargs):
        if self.event == "on_evaluate":
            self._set(optimizer, 5 * metrics["eval_loss"])

    def on_log(self, args, state, control, logs=None, optimizer=None, **kwargs):
        if self.event == "on_log" and "loss" in (logs or {}):
            if state.global_step >= 2:  # a plateau (no better than the best so far) halves the rate
                self._set(optimizer, optimizer.param_groups[0]["lr"] * (0.5 if logs["loss"] >= self.best else 0.9))
            self.best = min(self.best, logs["loss"])

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if self.event == "on_step_end" and state.global_step == 2:
            self._set(optimizer, 10 * self.run.result.losses[-1])


@pytest.mark.parametrize("event", ["on_evaluate", "on_log", "on_step_end"])
def test_a_callback_setting_the_learning_rate_from_what_it_saw_is_refused_before_the_update(
        tmp_path: Path, tiny_model: Path, event: str):
    """The issue's proof (eval_dataset: a contribution's admitted rows, no selection setting on, `on_evaluate`
    sets lr = 5·eval_loss), and the same from `on_log`'s training loss and from `on_step_end`."""
    corpus = _corpus(tmp_path, "trainer")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 6), corpus.url, insecure_seed=1, **QUIET) as run:
        callback = _SetRate(run, corpus.url, event)
        trainer = GovernedTrainer(run, args=_evaluating(tmp_path, logging_steps=1),
                                  eval_dataset=_admitted(run), processing_class=run.tokenizer, callbacks=[callback])
        with pytest.raises(ConfigError) as refused:
            trainer.train()
        assert refused.value.code is Code.UNGOVERNED_UPDATE, refused.value
        assert "param_groups[0]['lr']" in refused.value.detail and "\n" not in refused.value.detail
        assert callback.then is not None and callback.then.steps >= 2 and callback.then.unchanged()
        assert run.result.adapter_sha256 is None
    assert snapshot(corpus.url) == callback.then.ledger  # no run entry: nothing was released
    assert "run" not in verify_ledger(corpus.url).by_kind


def _sgd(config: Path) -> Path:
    config.write_text(config.read_text().replace('name = "adamw"', 'name = "sgd"\nmomentum = 0.9'))
    return config


WRITES = {  # what the loop writes, on which optimizer -> (the change, what the refusal names)
    "lr": ("adamw", lambda g: g.__setitem__("lr", 0.05), "['lr']"),
    "initial_lr": ("adamw", lambda g: g.__setitem__("initial_lr", 0.05), "['initial_lr']"),
    "betas": ("adamw", lambda g: g.__setitem__("betas", (0.5, 0.999)), "['betas']"),
    "weight_decay": ("adamw", lambda g: g.__setitem__("weight_decay", 0.5), "['weight_decay']"),
    "eps": ("adamw", lambda g: g.__setitem__("eps", 1e-3), "['eps']"),
    "amsgrad": ("adamw", lambda g: g.__setitem__("amsgrad", True), "['amsgrad']"),
    "momentum": ("sgd", lambda g: g.__setitem__("momentum", 0.5), "['momentum']"),
    "nesterov": ("sgd", lambda g: g.__setitem__("nesterov", True), "['nesterov']"),
    "a key added": ("adamw", lambda g: g.__setitem__("lr_scale", 2.0), "lr_scale added"),
    "a key removed": ("adamw", lambda g: g.pop("initial_lr"), "initial_lr removed"),
}


@pytest.mark.parametrize("what", sorted(WRITES))
def test_a_loop_writing_the_optimizers_groups_is_refused_before_the_update(tmp_path: Path, tiny_model: Path,
                                                                            what: str):
    optimizer, write, says = WRITES[what]
    corpus = _corpus(tmp_path, "loop")
    config = _config(corpus, tiny_model, 3)
    if optimizer == "sgd":
        _sgd(config)
    with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=1, **QUIET) as run:
        _step_once(run, corpus)
        then = _Then(run, corpus.url)
        group = run._run.update.optimizer.param_groups[0]  # what GovernedOptimizer(run).param_groups[0] is
        kept = dict(group)
        write(group)
        with pytest.raises(ConfigError) as refused:
            _loop(run)
        assert refused.value.code is Code.UNGOVERNED_UPDATE and says in refused.value.detail, refused.value
        assert then.unchanged()
        group.clear()
        group.update(kept)  # put back: the run goes on
        _loop(run)
        assert run.save().steps == 3
    assert verify_ledger(corpus.url).by_kind["run"] == 1


def test_a_rate_written_during_a_step_is_refused_at_its_update(tmp_path: Path, tiny_model: Path):
    """Written between a step's forward and its `run.step` (after the draw and the forward's check): the update's
    own check refuses it before anything moves; the step is then broken, as any raise inside one is."""
    corpus = _corpus(tmp_path, "during")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 3), corpus.url, insecure_seed=1, **QUIET) as run:
        _step_once(run, corpus)
        then = _Then(run, corpus.url)
        batches = run.batches()
        batch = next(batches)
        losses = run.per_example_loss(run.model(**batch.inputs), batch)
        run._run.update.optimizer.param_groups[0]["lr"] = 3 * float(losses.detach().mean())
        with pytest.raises(ConfigError) as refused:
            while run.step(losses) is None:
                batch = next(batches)
                losses = run.per_example_loss(run.model(**batch.inputs), batch)
        assert refused.value.code is Code.UNGOVERNED_UPDATE and "['lr']" in refused.value.detail, refused.value
        assert _same(then.weights, run) and _equal(_moments(run), then.state) and run.steps == 1
    assert "run" not in verify_ledger(corpus.url).by_kind


@pytest.mark.parametrize("mechanism", ["prism", "dp-muon"])
def test_prisms_and_muons_own_rate_written_through_the_trainers_view_is_refused(tmp_path: Path, tiny_model: Path,
                                                                                  mechanism: str):
    corpus = _corpus(tmp_path, mechanism)
    config = _config(corpus, tiny_model, 3, mechanism, MECHANISMS[mechanism])
    with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=1, **QUIET) as run:
        _step_once(run, corpus)
        then = _Then(run, corpus.url)
        GovernedOptimizer(run).param_groups[-1]["lr"] = 0.5  # the mechanism's own rate, as a callback reaches it
        with pytest.raises(ConfigError) as refused:
            _loop(run)
        name = "prism" if mechanism == "prism" else "muon"
        assert refused.value.code is Code.UNGOVERNED_UPDATE and f"{name}.lr" in refused.value.detail, refused.value
        assert then.unchanged()


def test_a_configured_schedule_trains_and_is_the_only_one(tmp_path: Path, tiny_model: Path, monkeypatch):
    """`set_schedule` before the first step: the update meets RUN.toml's rate times the schedule's factor at each
    governed step; set again after a step, it is refused."""
    corpus = _corpus(tmp_path, "schedule")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 5), corpus.url, insecure_seed=1, **QUIET) as run:
        run.set_schedule("cosine", warmup_steps=2)
        used = rates_met(monkeypatch, run._run.update.optimizer)
        _step_once(run, corpus)
        with pytest.raises(ConfigError) as refused:
            run.set_schedule("constant")
        assert refused.value.code is Code.UNGOVERNED_UPDATE
        _loop(run)
        assert run.save().steps == 5
    factors = [0.0, 0.5] + [0.5 * (1 + math.cos(math.pi * (k - 2) / 3)) for k in range(2, 5)]
    assert used == pytest.approx([0.01 * f for f in factors])
    assert verify_ledger(corpus.url).by_kind["run"] == 1


def test_the_trainers_warm_up_and_cosine_schedule_is_the_runs(tmp_path: Path, tiny_model: Path, monkeypatch):
    """A standard Trainer run: `lr_scheduler_type` and warm-up name the run's schedule, which the Trainer's
    scheduler follows, with a callback that only reads (logs, evaluation on admitted rows, selecting nothing)."""
    corpus = _corpus(tmp_path, "cosine")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 6), corpus.url, insecure_seed=1, **QUIET) as run:
        trainer = GovernedTrainer(run, args=_evaluating(tmp_path, lr_scheduler_type="cosine", warmup_steps=2,
                                                        logging_steps=1),
                                  eval_dataset=_admitted(run), processing_class=run.tokenizer)
        assert (run.schedule.kind, run.schedule.warmup, run.schedule.total) == ("cosine", 2, 6)
        used = rates_met(monkeypatch, run._run.update.optimizer)
        trainer.train()
        assert run.result.adapter_sha256 is not None
    factors = [0.0, 0.5] + [0.5 * (1 + math.cos(math.pi * (k - 2) / 4)) for k in range(2, 6)]
    assert used == pytest.approx([0.01 * f for f in factors])
    assert verify_ledger(corpus.url).by_kind["run"] == 1


@pytest.mark.parametrize("kind, code", [("reduce_lr_on_plateau", Code.UNGOVERNED_UPDATE),
                                        ("polynomial", Code.RUN_CONFIG_INVALID)])
def test_a_trainer_schedule_that_is_not_the_steps_alone_is_refused_when_built(tmp_path: Path, tiny_model: Path,
                                                                             kind: str, code: Code):
    """reduce_lr_on_plateau sets the rate from evaluations (on held-out rows too: the run cannot tell what a
    callback's rate read); a schedule the run does not compute is refused too. Nothing is written."""
    corpus = _corpus(tmp_path, "plateau")
    before = snapshot(corpus.url)
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 4), corpus.url, insecure_seed=1, **QUIET) as run:
        with pytest.raises(ConfigError) as refused:
            GovernedTrainer(run, args=_evaluating(tmp_path, lr_scheduler_type=kind), eval_dataset=_held_out(run),
                            processing_class=run.tokenizer)
        assert refused.value.code is code and kind in refused.value.detail
        assert run.steps == 0
    assert snapshot(corpus.url) == before


@pytest.mark.slow
def test_a_follower_rank_setting_its_rate_from_the_loss_is_refused_and_nothing_is_recorded(tmp_path: Path,
                                                                                           tiny_model: Path):
    """Under two processes each rank checks its own update: a follower whose loop sets lr = 5·loss after step 1 is
    refused (`ungoverned_update`) before its next update, every rank stops, and no run is recorded."""
    from tests.test_attacks_distributed_review import finish, records, start
    from tests.test_distributed import make_world

    corpus, config = make_world(tmp_path / "world", tiny_model, steps=3)
    base = {"config": str(config), "ledger": corpus.url}
    results = finish(start([base, {**base, "behaviour": "rate", "after": 1}], tmp_path / "out"))
    assert results[1][0] != 0 and "ungoverned_update" in results[1][1] and "param_groups[0]['lr']" in results[1][1]
    assert results[0][0] != 0  # the lead stops too
    assert [r["steps"] for r in records(tmp_path / "out", 2)] == [None, None]
    assert "run" not in verify_ledger(corpus.url).by_kind


class _StopOnLoss(transformers.TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in (logs or {}) and state.global_step >= 2:
            control.should_training_stop = True  # an early stop chosen from the training loss


def test_an_early_stop_from_the_training_loss_releases_nothing(tmp_path: Path, tiny_model: Path):
    """What holds (passes on main too): the number of steps is training.steps; a Trainer stopped early by a
    callback reading the training loss (not noised) saves and records nothing: the run pauses, and opened again
    it takes the remaining steps."""
    corpus = _corpus(tmp_path, "stop")
    config = _config(corpus, tiny_model, 4)
    with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=1, **QUIET) as run:
        GovernedTrainer(run, args=_arguments(tmp_path, logging_steps=1), callbacks=[_StopOnLoss()]).train()
        assert run.steps < 4 and run.result.adapter_sha256 is None
    assert "run" not in verify_ledger(corpus.url).by_kind
    assert not (corpus.dir / "adapter" / "adapter_config.json").exists()


def test_a_paused_run_keeps_its_schedule_when_resumed(tmp_path: Path, tiny_model: Path, monkeypatch):
    """A schedule chosen again when a paused run is opened anew, after seeing how its steps went (the training loss
    is not noised), would be a rate set from the data: the run state records the schedule its steps were taken
    under, a resumed run keeps it, and `set_schedule` with another one is refused (`ungoverned_update`) with
    nothing changed; the same schedule set again is accepted."""
    corpus = _corpus(tmp_path, "paused")
    config = _config(corpus, tiny_model, 5)
    used: list[float] = []
    with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=1, **QUIET) as run:
        run.set_schedule("cosine", warmup_steps=2)
        met = rates_met(monkeypatch, run._run.update.optimizer)
        _step_once(run, corpus)
        _step_once(run, corpus)
        used += met
    with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=1, **QUIET) as run:
        assert run.steps == 2 and (run.schedule.kind, run.schedule.warmup) == ("cosine", 2)
        then = _Then(run, corpus.url)
        with pytest.raises(ConfigError) as refused:
            run.set_schedule("linear", warmup_steps=0)
        assert refused.value.code is Code.UNGOVERNED_UPDATE and "cosine" in refused.value.detail, refused.value
        assert then.unchanged() and run.schedule.kind == "cosine"
        run.set_schedule("cosine", warmup_steps=2)  # the same one: nothing to refuse
        met = rates_met(monkeypatch, run._run.update.optimizer)
        _loop(run)
        used += met
        assert run.save().steps == 5
    factors = [0.0, 0.5] + [0.5 * (1 + math.cos(math.pi * (k - 2) / 3)) for k in range(2, 5)]
    assert used == pytest.approx([0.01 * f for f in factors])
    assert verify_ledger(corpus.url).by_kind["run"] == 1


def test_the_release_records_the_schedule_and_a_folder_without_it_still_reads(tmp_path: Path, tiny_model: Path):
    """The schedule is chosen in user code, outside RUN.toml's hash: govtrain.json (hashed into the adapter the run
    entry records) and the card say which; a govtrain.json written before they did still reads (schedule None)."""
    import json

    from govtrain.release.artifact import RECORD, ScheduleRecord, read_record
    from govtrain.release.verify import verify_adapter

    corpus = _corpus(tmp_path, "recorded")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 3), corpus.url, insecure_seed=1, **QUIET) as run:
        run.set_schedule("cosine", warmup_steps=1)
        _loop(run)
        run.save()
    folder = corpus.dir / "adapter"
    assert read_record(folder).run.schedule == ScheduleRecord(kind="cosine", warmup=1)
    assert "`cosine` schedule after 1 warm-up step(s)" in (folder / "README.md").read_text()
    verify_adapter(folder, corpus.url)
    written = json.loads((folder / RECORD).read_text())
    del written["run"]["schedule"]
    (folder / RECORD).write_text(json.dumps(written))
    assert read_record(folder).run.schedule is None
