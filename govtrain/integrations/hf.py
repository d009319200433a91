"""Hugging Face `Trainer` (and TRL `SFTTrainer`) whose training step and data are a `GovernedRun`'s.

    with govtrain.GovernedRun.open("run.toml", ledger_url, key=key) as run:
        trainer = GovernedTrainer(run, args=TrainingArguments("out", logging_steps=10, eval_strategy="steps",
                                                              eval_steps=50, lr_scheduler_type="constant"),
                                  eval_dataset=heldout, compute_metrics=accuracy, callbacks=[...])
        trainer.train()        # governed steps; at the end the adapter is saved and the run entry written

What stays the Trainer's: `TrainingArguments` (logging, evaluation, checkpoints of the Trainer's own state, the
learning-rate schedule's kind and warm-up), callbacks, `evaluate()` and `predict()`. What is the run's, and refused
if given:
- the data: the training loader yields one logical Poisson step of `run.batches()` per Trainer step (its
  physical chunks are run inside the step); `train_dataset`, `data_collator` and a custom sampler are refused
  (`ungoverned_batch`), as is gradient accumulation (a logical step is the Poisson batch);
- the loss: one value per example (`per_example_loss`, by default the run's task loss; override it in a
  subclass), never the Trainer's mean (`compute_loss_func` is refused);
- the update: RUN.toml's `[optimizer]` (and PRISM's or DP-Muon's). The Trainer's optimizer is a view of it
  (`GovernedOptimizer`): `TrainingArguments.lr_scheduler_type` and warm-up name the run's schedule
  (`GovernedRun.set_schedule`, a function of the governed step alone), which the Trainer's scheduler follows, and
  its `step()` checks that the governed step happened. A callback that writes the optimizer's groups (a rate from
  an evaluation or the training loss) is refused before the next update acts (`ungoverned_update`,
  `mechanisms/hyperparameters.py`), and so are the schedules that step on a metric. `max_grad_norm` clips
  nothing: each example's gradient was clipped to its contribution's bound and the gradients are consumed by the
  governed step;
- the logs: the `grad_norm` the Trainer logs is the L2 norm of the privatized gradient the update applied (the
  clipped sum plus its noise, over the expected batch size: post-processing, safe to show), never a statistic
  of the un-noised gradients; and each training log carries every class's ε as charged so far (`eps/<class>`,
  the epoch written ahead included), so TensorBoard and W&B plot it beside the loss;
- the device and precision: RUN.toml's `training.device` and `training.precision`; a Trainer that would put
  the model elsewhere, use fp16/bf16 autocast, several devices in one process, another number of processes than
  the run's, or resume from its own checkpoint is refused (a governed run resumes when the same config is opened
  again);
- the processes: under torchrun each rank opens the run and builds its Trainer. The model is never wrapped in
  DDP (the ranks' clipped sums meet inside the governed step, noised once by the lead), every rank's Trainer
  takes a step for each draw that any rank had examples of (with no chunks where its own share is empty), and
  the Trainer's checkpoints are rank 0's (docs/hf-trainer.md, "Under torchrun");
- selection: evaluation may choose what is saved or when training stops (`load_best_model_at_end`,
  `EarlyStoppingCallback`, ...) only on held-out rows; evaluation data with admitted rows is refused while such
  a setting is on, and so is recording a run that an unchecked evaluation may have chosen (`selection_admitted`,
  `govtrain/integrations/selection.py`). Evaluation runs on a list of the rows as read and checked.

Before its first step, `train()` runs the training step (your `training_step` or `per_example_loss`) once on
the run's rehearsal (`batch.rehearsal is True`: synthetic rows, nothing spent, nothing moves), so a bug in it
costs nothing; a run opened with `check=True` stops there, its plan logged, and the Trainer trains nothing (with
no `args`, its default output folder is a temporary one, removed when the check ends: a check writes no folder).

The model is `run.model` itself: not wrapped, same type, same `state_dict` keys. An empty Poisson draw is a
governed step too (noise only), taken between two Trainer steps, so `state.global_step` can trail
`run.steps` by the number of empty draws; the run ends at `training.steps`.

Here: the Trainer subclasses. Beside it: `hf_optimizer.py` (the Trainer's view of the update and its schedule),
`hf_loader.py` (one logical Poisson step per Trainer step) and `hf_arguments.py` (the arguments refused).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainingArguments

from govtrain.errors import Code, ConfigError
from govtrain.integrations.hf_arguments import REFUSED, check_arguments
from govtrain.integrations.hf_loader import GovernedLoader, LogicalStep
from govtrain.integrations.hf_optimizer import GovernedOptimizer, RunSchedule, run_schedule
from govtrain.integrations.selection import (Evaluations, SelectionCheck, changed_by_evaluation, evaluation_flags,
                                             materialised, named, selection_settings)
from govtrain.train.governed import GovernedBatch, GovernedRun

__all__ = ["GovernedTrainer", "GovernedSFTTrainer", "GovernedOptimizer"]


class _Governed:
    """What a Trainer subclass needs to train through a `GovernedRun`: the mixin of `GovernedTrainer` and
    `GovernedSFTTrainer`."""

    run: GovernedRun

    def __init__(self, run: GovernedRun, args: TrainingArguments | None = None, **kwargs: Any) -> None:
        if not isinstance(run, GovernedRun):
            raise TypeError(f"the first argument is the GovernedRun to train, not {type(run).__name__}")
        for name, why in REFUSED.items():
            if kwargs.get(name) not in (None, (None, None)):
                code = Code.UNGOVERNED_BATCH if name in ("train_dataset", "data_collator") else Code.RUN_CONFIG_INVALID
                raise ConfigError(code, f"{type(self).__name__}({name}=...) is refused: {why}")
        if kwargs.get("model") is run.model:
            del kwargs["model"]
        if "model" in kwargs:
            raise ConfigError(Code.RUN_CONFIG_INVALID, "the model is run.model: do not pass another one")
        self._check_folder = None  # a check's TrainingArguments folder: temporary, removed when the check ends
        if args is None and run.checking:  # a check writes no folder: the Trainer creates its output_dir
            import tempfile

            self._check_folder = tempfile.TemporaryDirectory(prefix="govtrain-check-")
            args = TrainingArguments(output_dir=self._check_folder.name)
        elif args is None:  # beside the adapter's folder, which holds only what save() writes
            output = run.config.output_dir
            args = TrainingArguments(output_dir=str(output.with_name(f"{output.name}-trainer")))
        check_arguments(args, run)
        left = run.total_steps - run.steps  # a resumed run has taken some already
        if args.max_steps <= 0:
            args.max_steps = left  # the Trainer's steps: the run's (an empty draw is one too)
        elif args.max_steps != left:
            raise ConfigError(Code.RUN_CONFIG_INVALID, f"TrainingArguments.max_steps = {args.max_steps}, but the run "
                                                       f"has {left} of training.steps = {run.total_steps} left: leave "
                                                       "max_steps unset, or set training.steps in RUN.toml")
        self.run = run
        self._selection = SelectionCheck(run)
        self._selection.check(named(kwargs.get("eval_dataset"), "eval_dataset"),
                              selection_settings(args, kwargs.get("callbacks") or ()))
        schedule = run_schedule(args, run)  # after the selection check: a metric's schedule on admitted rows is that
        if schedule != run.schedule:
            run.set_schedule(schedule.kind, schedule.warmup)
        super().__init__(model=run.model, args=args, optimizers=(GovernedOptimizer(run), None),
                         **self._sft_arguments(kwargs))
        self._evaluations = Evaluations(run, self.data_collator)
        if run._run.world.many:
            # Under several processes accelerate's prepare would wrap run.model in DistributedDataParallel: its
            # all-reduce of .grad is a sum of un-noised gradients, and its first broadcast writes the weights
            # outside a governed step. It leaves a model it has marked prepared as it is; the run already put the
            # model on its device, and the ranks' clipped sums meet inside the governed step (govtrain.distributed).
            run.model._is_accelerate_prepared = True

    def _sft_arguments(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return kwargs

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """The Trainer's scheduler follows the run's (`RunSchedule`): the run writes each step's rates."""
        if self.lr_scheduler is None:
            self.lr_scheduler = RunSchedule(self.optimizer if optimizer is None else optimizer)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    # -- the data and the step are the run's -----------------------------------------------------------

    def get_train_dataloader(self) -> Any:
        return GovernedLoader(self.run)

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        raise ConfigError(Code.UNGOVERNED_BATCH, "a governed Trainer has no sampler of its own: the run draws its "
                                                 "Poisson batches")

    def per_example_loss(self, outputs: Any, batch: GovernedBatch) -> torch.Tensor:
        """One loss per example of `batch` (shape [len(batch)], each from its own example only): the run's task
        loss. Override for another loss."""
        return self.run.per_example_loss(outputs, batch)

    def training_step(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """One logical Poisson step: each physical chunk forward and clipped, then the noise once and the update
        (`GovernedRun.step`). Returns the step's mean loss per example for the Trainer's logs."""
        if not isinstance(inputs, LogicalStep):
            raise ConfigError(Code.UNGOVERNED_BATCH, "the training step got a batch the run did not draw: the "
                                                     "accountant's q holds only for run.batches()")
        loss = None
        for batch in inputs:
            outputs = model(**batch.inputs)
            loss = self.run.step(self.per_example_loss(outputs, batch))
        if inputs.idle:  # taken as drawn, with the other ranks' examples in its loss
            loss = self.run.result.losses[-1]
        return torch.tensor(loss if loss is not None else math.nan, device=self.args.device)

    # -- what the Trainer logs: the privatized gradient's norm and ε per class ----------------------------------

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        """What the Trainer logs as `grad_norm`: the norm of the privatized gradient the governed update applied
        (`Update.grad_norm`). Nothing is clipped: that gradient was consumed by the update inside the step, and
        the Trainer's own clip of `.grad` would read nothing (it logged 0.0)."""
        norm = self.run._run.update.grad_norm
        return norm if norm is not None else torch.zeros(())

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        return self._clip_grad_norm(model) if grad_norm is None else grad_norm

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's `log`; a training log (its loss) also carries each class's ε as charged so far. The count of
        units with a non-finite gradient is not logged here: it is an un-noised statistic of the per-sample
        gradients, and these logs reach `report_to` and `trainer_state.json`; it stays in the run's own step log."""
        if "loss" in logs or "train_loss" in logs:
            logs.update({f"eps/{name}": eps for name, eps in sorted(self.run.epsilons().items())})
        super().log(logs, *args, **kwargs)

    def _rehearse(self) -> None:
        """The training step on the run's rehearsal, before the Trainer's loop and any spend (module docstring)."""
        run = self.run
        if run.rehearsed or run.steps >= run.total_steps:
            return
        batches = run.batches()
        try:
            first = next(batches, None)
            if first is not None:
                self.training_step(self.model, LogicalStep(first, batches))
            if run.checking:
                next(batches, None)  # the plan, logged as the check ends
        finally:
            batches.close()

    def floating_point_ops(self, inputs: Any) -> int:
        return 0  # the Trainer's estimate reads a dict batch; a logical step's chunks are not one

    def train(self, resume_from_checkpoint: Any = None, trial: Any = None, **kwargs: Any) -> Any:
        """The Trainer's loop over the run's remaining steps; when the run has taken all of them (or no
        contribution is eligible any more), `run.save()`: the adapter and the run entry."""
        if resume_from_checkpoint:
            raise ConfigError(Code.RUN_CONFIG_INVALID, "a governed run resumes from its own state: open the same "
                                                       "config again and call train() without resume_from_checkpoint")
        if trial is not None:
            raise ConfigError(Code.RUN_CONFIG_INVALID, "hyperparameter search through the Trainer is not charged: "
                                                       "use govtrain tune")
        self._check_selection(named(self.eval_dataset, "eval_dataset"), self._selection_settings())
        try:
            self._rehearse()
        finally:
            if self.run.checking and self._check_folder is not None:
                self._check_folder.cleanup()
        if self.run.checking:
            return None
        output = super().train(**kwargs)
        run = self.run
        if run.steps >= run.total_steps or run.result.exhausted:
            def check() -> None:
                self._check_selection(named(self.eval_dataset, "eval_dataset"), self._selection_settings())
                self._evaluations.before_release(self.state, self.args)  # whatever the settings said when read

            run._run.world.together(check)  # a refusal on one rank is every rank's: none waits in save()
            run.save()
        return output

    # -- evaluation may choose what is released only on held-out rows (integrations/selection.py) ----------

    def _selection_settings(self, callbacks: tuple = ()) -> list[str]:
        return selection_settings(self.args, [*self.callback_handler.callbacks, *callbacks])

    def _check_selection(self, datasets: dict[str, Any], settings: list[str]) -> None:
        self._evaluations.check_collator(self.data_collator, settings)
        self._selection.check(datasets, settings)

    def add_callback(self, callback: Any) -> None:
        """The Trainer's `add_callback`; one that lets evaluation choose when training stops (an
        `EarlyStoppingCallback`) is refused, and not added, while `eval_dataset` holds admitted rows."""
        if hasattr(self, "callback_handler"):
            self._selection.check(named(getattr(self, "eval_dataset", None), "eval_dataset"),
                                  self._selection_settings((callback,)))
        super().add_callback(callback)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """The Trainer's `evaluate`, on a list of the rows as read (what is checked is what is scored). While a
        selection setting is on, data with admitted rows is refused before it is evaluated; a callback that stops
        training, changes what is saved or turns a selection setting on in response to an evaluation of admitted
        rows is refused at that evaluation, its change undone (nothing is saved or recorded)."""
        given = eval_dataset is not None
        data = eval_dataset if given else self.eval_dataset
        label = "evaluate(eval_dataset)" if given else "eval_dataset"
        if isinstance(data, str):  # an entry of a dict eval_dataset, by name
            label, data = f"eval_dataset[{data!r}]", self.eval_dataset[data]
        self._check_selection(named(data, label), self._selection_settings())
        if not isinstance(data, dict):
            return self._evaluate_once(label, data, eval_dataset, ignore_keys, metric_key_prefix)
        metrics: dict[str, float] = {}
        for key, item in data.items():  # one at a time, as the Trainer does: a callback's response is per data set
            metrics.update(self._evaluate_once(f"{label}[{key!r}]", item, item if given else key, ignore_keys,
                                               f"{metric_key_prefix}_{key}"))
        return metrics

    def predict(self, test_dataset: Any, ignore_keys: list[str] | None = None,
                metric_key_prefix: str = "test") -> Any:
        """The Trainer's `predict`, on a list of the rows as read, checked and recorded as `evaluate` checks
        and records them: a callback can choose what is released from predictions as well as from metrics."""
        label = "predict(test_dataset)"
        rows = materialised(test_dataset)
        settings = self._selection_settings()
        self._check_selection({label: rows if rows is not None else test_dataset}, settings)
        if not settings:
            self._evaluations.unchecked.append(label)
        return super().predict(rows if rows is not None else test_dataset, ignore_keys, metric_key_prefix)

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        self.run._check_governed("at a Trainer checkpoint")  # what it saves is a governed step's, or nothing
        super()._save_checkpoint(model, trial)
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        self._evaluations.saved(f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")

    def _save_rng_state(self, output_dir: str) -> None:
        if self.args.should_save:  # the lead's alone: a governed run never resumes from a Trainer checkpoint
            super()._save_rng_state(output_dir)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The Trainer's save (each checkpoint, `save_model`), completed as the run's release is (`Release.write`):
        portable adapter configs that plain peft refuses where it would predict wrong, the record and the run's
        tokenizer, so `govtrain.load` reads it. What it saves is not recorded: the run's adapter is `run.save()`'s."""
        super()._save(output_dir, state_dict)
        if self.args.should_save:
            self.run._release.write(Path(output_dir if output_dir is not None else self.args.output_dir))

    def _evaluate_once(self, label: str, data: Any, argument: Any, ignore_keys: list[str] | None,
                       prefix: str) -> dict[str, float]:
        rows = materialised(data)
        checked = {label: rows if rows is not None else data}
        settings = self._selection_settings()
        self._check_selection(checked, settings)
        before = evaluation_flags(self.control)
        metrics = super().evaluate(rows if rows is not None else argument, ignore_keys, prefix)
        acting = changed_by_evaluation(before, self.control) + self._selection_settings()  # read again after it
        try:
            self._check_selection(checked, acting)
        except ConfigError:
            for flag, value in before.items():
                setattr(self.control, flag, value)
            raise
        if not (settings or acting):
            self._evaluations.unchecked.append(label)
        return metrics


class GovernedTrainer(_Governed, Trainer):
    """A `transformers.Trainer` that trains a `GovernedRun`: `GovernedTrainer(run, args=..., eval_dataset=...,
    compute_metrics=..., callbacks=...)`."""


def __getattr__(name: str) -> Any:
    if name == "GovernedSFTTrainer":
        return _sft_trainer()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _sft_trainer() -> type:
    """`GovernedSFTTrainer`: TRL's `SFTTrainer` (its SFTConfig, evaluation metrics and chat handling for
    evaluation data) training a causal-LM `GovernedRun`. Needs `pip install govtrain[hf]`."""
    global _SFT
    if _SFT is None:
        try:
            from trl import SFTTrainer
        except ImportError as e:
            raise ConfigError(Code.RUN_CONFIG_INVALID,
                              "GovernedSFTTrainer needs TRL: pip install 'govtrain[hf]'") from e

        class GovernedSFTTrainer(_Governed, SFTTrainer):
            """TRL's `SFTTrainer` training a causal-LM `GovernedRun`: `GovernedSFTTrainer(run, args=SFTConfig(...),
            eval_dataset=..., callbacks=...)`. Packing and padding-free batches are refused."""

            def __init__(self, run: GovernedRun, args: Any = None, **kwargs: Any) -> None:
                if run.config.file.model.task != "causal-lm":
                    raise ConfigError(Code.RUN_CONFIG_INVALID, "GovernedSFTTrainer trains a task = \"causal-lm\" run; "
                                                               "use GovernedTrainer for this one")
                kwargs.setdefault("processing_class", run.tokenizer)
                super().__init__(run, args, **kwargs)
                base = run.model.get_base_model()
                path = next(name for name, module in run.model.named_modules() if module is base)
                run._guard.adopt(lambda where, value: where == f"{path}.forward" and _trl_fused_lm_head(base, value))

            def _sft_arguments(self, kwargs: dict[str, Any]) -> dict[str, Any]:
                # SFTTrainer insists on a non-empty train_dataset, which it inspects and tokenizes up front; the
                # run draws every training batch, so it gets one public line that is never trained on (a user's
                # train_dataset was refused in _Governed.__init__ before this is added).
                import datasets

                return {**kwargs, "train_dataset": datasets.Dataset.from_dict({"text": ["govtrain draws the batches"]})}

        _SFT = GovernedSFTTrainer
    return _SFT


_SFT: type | None = None


def _trl_fused_lm_head(base: torch.nn.Module, value: Any) -> bool:
    """Whether `value` is TRL's fused LM head (`trl.trainer.utils.add_fused_lm_head`) on `base` around its class's
    own forward: the `forward` SFTTrainer gives every model it trains. Unless a forward passes
    `fused_lm_head=True` (the governed one passes `**batch.inputs`), it calls that forward unchanged."""
    from trl.trainer import utils

    code = next((c for c in utils.add_fused_lm_head.__code__.co_consts if getattr(c, "co_name", "") ==
                 "_fused_forward"), None)
    function = getattr(value, "__func__", None)
    if code is None or getattr(value, "__self__", None) is not base or getattr(function, "__code__", None) is not code:
        return False
    original = dict(zip(code.co_freevars, function.__closure__ or ())).get("original_forward")
    inner = getattr(original, "cell_contents", None)
    return getattr(inner, "__self__", None) is base and getattr(inner, "__func__", None) is type(base).forward
