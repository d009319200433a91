"""The Trainer's view of a `GovernedRun`'s update (`integrations/hf.py`): `GovernedOptimizer`, whose groups are the
update's and whose `step()` only checks that a governed step happened, the learning-rate scheduler that follows the
run's own schedule, and the schedule that `TrainingArguments.lr_scheduler_type` names.

Apart from the Trainer subclass so that what the Trainer may read and write of the update reads in one place: its
learning rates (through the run's schedule) and nothing of the update's state.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainingArguments

from govtrain.errors import Code, ConfigError
from govtrain.mechanisms.hyperparameters import SCHEDULES, Schedule
from govtrain.train.governed import GovernedRun
from govtrain.train.weights import same_state

if TYPE_CHECKING:
    from govtrain.mechanisms.update import Update


class MechanismGroup(dict):
    """A param group standing for PRISM's or DP-Muon's parameters: its "lr" is the mechanism's own learning
    rate, read and written through, so a Trainer's schedule scales it as it scales the optimizer's groups."""

    def __init__(self, owner: Any, params: list[torch.Tensor]) -> None:
        super().__init__(params=params)
        self._owner = owner

    def __getitem__(self, key: str) -> Any:
        return self._owner.lr if key == "lr" else super().__getitem__(key)

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "lr":
            self._owner.lr = float(value)
        else:
            super().__setitem__(key, value)

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key == "lr" or key in self else default

    def __contains__(self, key: object) -> bool:
        return key == "lr" or super().__contains__(key)


class GovernedOptimizer(torch.optim.Optimizer):
    """The Trainer's view of the run's update: its learning rates (the run's optimizer's param groups, shared,
    and one group each for PRISM's and DP-Muon's own rate, so the Trainer's schedule scales them all) and its
    state for the Trainer's checkpoints. `step()` moves nothing: the governed step (noise, then the update)
    already ran at the logical step's last chunk; it checks that one did, so a Trainer that steps without a
    governed step fails loudly."""

    def __init__(self, run: GovernedRun) -> None:  # no super().__init__: the groups are the update's
        self._run = run
        self._update: Update = run._run.update
        update = self._update
        self._mechanism_groups: list[MechanismGroup] = []
        if update.prism is not None:
            self._mechanism_groups.append(MechanismGroup(update.prism, [p for pair in update.prism.pairs.values()
                                                                         for p in pair]))
        if update.muon is not None:
            self._mechanism_groups.append(MechanismGroup(update.muon, list(update.muon.params.values())))
        self._optimizer_step_pre_hooks: dict = OrderedDict()  # torch's handles hold weak references to these
        self._optimizer_step_post_hooks: dict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: dict = OrderedDict()
        self._optimizer_state_dict_post_hooks: dict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: dict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: dict = OrderedDict()
        self._stepped = run.steps

    @property
    def param_groups(self) -> list[Any]:  # type: ignore[override]
        """The run's optimizer's groups as they are now, then PRISM's and DP-Muon's: read live, so a schedule
        scales the rates the update uses (a copy taken once went stale when torch replaced the dicts)."""
        inner = self._update.optimizer
        return [*(inner.param_groups if inner is not None else ()), *self._mechanism_groups]

    @property
    def state(self) -> Any:  # type: ignore[override]
        inner = self._update.optimizer
        return inner.state if inner is not None else {}

    @property
    def defaults(self) -> dict:  # type: ignore[override]
        inner = self._update.optimizer
        return inner.defaults if inner is not None else {}

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("a governed step takes no closure")
        if self._run.steps == self._stepped:
            raise RuntimeError("the Trainer stepped its optimizer without a governed step: the training step must "
                               "run a logical step of run.batches() to its last chunk")
        for hook in list(self._optimizer_step_pre_hooks.values()):  # torch's step hooks, on the view: they run
            hook(self, (), {})                                     # after the governed update, never inside it
        self._stepped = self._run.steps
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._update.zero_grad()

    def state_dict(self) -> dict:
        return self._update.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Only the update's own state as it is (accelerate loads `state_dict()` back when the Trainer prepares
        the optimizer): nothing is loaded. Any other state would steer the next governed update, moments and step
        count being what it divides the noise by (review 4: forged Adam moments landed a weight on chosen values
        and the run was recorded); a governed run resumes from its own state."""
        if not same_state(state_dict, self._update.state_dict()):
            raise ConfigError(Code.UNGOVERNED_UPDATE, "the Trainer's optimizer was given a state other than the run "
                                                      "update's own: it would steer the next governed update; a "
                                                      "governed run resumes when the same config is opened again")

    def __repr__(self) -> str:
        return f"GovernedOptimizer({self._update.mechanism})"


class RunSchedule(torch.optim.lr_scheduler.LRScheduler):
    """The Trainer's learning-rate scheduler: the run's own schedule (`GovernedRun.set_schedule`, from
    `lr_scheduler_type` and warm-up when the Trainer is built), which the run applies at each governed step (empty
    draws count, which the Trainer's own count skips). Stepping it writes back the rates the run set, and the
    Trainer logs them."""

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]


def run_schedule(args: TrainingArguments, run: GovernedRun) -> Schedule:
    """The run's schedule that `args.lr_scheduler_type` and its warm-up name, over the run's `training.steps`."""
    kind = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    if kind in ("reduce_lr_on_plateau", "greedy"):
        raise ConfigError(Code.UNGOVERNED_UPDATE, f"TrainingArguments.lr_scheduler_type = {kind!r} sets the learning "
                                                  "rate from evaluations, which the run cannot tell from a use of the "
                                                  f"data no spend charges: use one of {', '.join(SCHEDULES)}")
    if kind not in SCHEDULES or args.lr_scheduler_kwargs:
        raise ConfigError(Code.RUN_CONFIG_INVALID, f"TrainingArguments.lr_scheduler_type = {kind!r}"
                                                   f"{' with lr_scheduler_kwargs' if args.lr_scheduler_kwargs else ''}"
                                                   ": a governed run's learning rates follow one of "
                                                   f"{', '.join(SCHEDULES)} (no lr_scheduler_kwargs) at its own step")
    total = max(run.total_steps, 1)
    return Schedule(kind=kind, warmup=0 if kind == "constant" else args.get_warmup_steps(total), total=total)
