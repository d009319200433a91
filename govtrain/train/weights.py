"""The weights move only in governed steps: `Weights` keeps the model's parameters and the update's state as the
last governed step left them, and names the first that differs (`changed`) before each draw, each governed
forward, each update, each Trainer checkpoint and at `save()`. Exact types are compared before values, so that no
object of the loop's (a tensor, dict, list or tuple subclass) runs its code inside the governed update
(`same_state`); a sharded parameter or moment is compared on this rank's shard (`same_shard`). Torch's global
optimizer hooks run inside every update and are refused (`check_optimizer_hooks`).

Split from `governed.py`, which calls these checks at each point of the loop: this module only compares.
"""

from __future__ import annotations

import collections
import copy
import operator
from typing import TYPE_CHECKING, Any, Callable

import torch

from govtrain.distributed.fsdp import is_sharded
from govtrain.errors import Code, ConfigError
from govtrain.mechanisms.hyperparameters import RATE_KEYS, Schedule
from govtrain.mechanisms.sealed import Sealed

if TYPE_CHECKING:
    from torch import nn

    from govtrain.mechanisms.update import Update


class Weights:
    """The model's parameters and the update's state as the last governed step left them: a copy of each
    trainable parameter's values, each parameter's identity and version counter (a frozen one is never written
    by a step: an in-place write bumps its counter), and a copy of the update's state (optimizer moments and
    step counts, PRISM's and DP-Muon's), and every hyperparameter the update reads, which must be RUN.toml's scaled
    by the run's schedule at the coming step (`mechanisms/hyperparameters.py`). `changed()` names the first that
    differs. Writes to a frozen parameter's storage that bypass its counter (`.data`, `.numpy()`)
    are not seen: that, like patching a library, is out of reach."""

    def __init__(self, model: "nn.Module", mechanism: "Update", steps: Callable[[], int]) -> None:
        self.model, self.mechanism, self.steps = model, mechanism, steps  # steps(): the coming update's step
        self.unscheduled = False  # what `changed()` last found is a hyperparameter the schedule did not set
        # the update's own objects (no hook, no method replaced on an instance) and the reference its hyperparameters
        # are compared with (the frozen copies of RUN.toml's and the schedule set_schedule fixed), as the run opened
        self.sealed = Sealed.of(mechanism)
        self.hyperparameters = mechanism.hyperparameters
        self.reference = mechanism.hyperparameters.reference()
        self.update()

    def adopt_schedule(self) -> None:
        """`set_schedule` fixed the update's schedule: it is the reference from now on."""
        self.reference = self.hyperparameters.reference()
        self.update()

    def update(self) -> None:
        self.trainable = trainable_weights(self.model)
        self.params = [(name, p, _version(p)) for name, p in self.model.named_parameters()]
        self.kinds = [type(p) for _, p, _ in self.params]  # compared before any op runs on a parameter
        self.state = _copied(self.mechanism.state_dict())
        optimizer = self.mechanism.optimizer
        self.groups = [list(group["params"]) for group in optimizer.param_groups] if optimizer is not None else []
        self.defaults = _copied(optimizer.defaults) if optimizer is not None else None

    def changed(self) -> str | None:
        self.unscheduled = False
        sealed = self.sealed.changed()  # first: the state checks below call the update's state_dict()
        if sealed is not None:
            return sealed
        hyperparameters = self.mechanism.hyperparameters
        kept = self.reference
        if hyperparameters is not self.hyperparameters or any(
                a is not b for a, b in zip(hyperparameters.reference()[:2], kept[:2])):
            return "the update's hyperparameters' reference (RUN.toml's values) was replaced"
        if type(hyperparameters.schedule) is not Schedule or hyperparameters.schedule != kept[2]:  # type first
            self.unscheduled = True
            return (f"the run's schedule is {hyperparameters.schedule}, where set_schedule fixed {kept[2]} (set "
                    "other than by set_schedule)")
        now = list(self.model.named_parameters())
        if len(now) != len(self.params) or any(p is not q for (_, p), (_, q, _) in zip(now, self.params)):
            return "a parameter of run.model was replaced or added"
        for (name, p), kind in zip(now, self.kinds):  # type() runs none of the parameter's code
            if type(p) is not kind:
                return f"{name} changed class to {type(p).__name__} (its code would run inside the update)"
        for name, p, version in self.params:
            if not p.requires_grad and _version(p) != version:
                return f"{name} (frozen) was written"
        for name, p in now:
            kept = self.trainable.get(name)
            if p.requires_grad != (kept is not None):
                return f"{name} had requires_grad switched"
            if kept is not None and not _equal(p.detach(), kept):
                return f"{name} was written"
        state = "the update's state (optimizer moments, step counts, parameter groups) was written"
        if not self._same_groups():  # types first
            return state
        step = self.steps()
        wrong = hyperparameters.changed(self.mechanism, step)
        self.unscheduled = wrong is not None  # a rate, momentum, betas, decay or eps set by other code (issue 34, 8)
        if wrong is not None:
            return f"the update's state ({wrong} at step {step}; the run's schedule: {hyperparameters.schedule})"
        if not same_state(self.mechanism.state_dict(), self.state):
            return state
        return None

    def _same_groups(self) -> bool:
        """The optimizer's groups hold, in exact lists of exact dicts, the parameters they held (`state_dict()`
        gives their indices only, so a list subclass iterated inside the update would pass it); its state is a
        defaultdict of dicts, and its defaults as they were (review 7: a state factory and a `defaults` value
        whose `__bool__` was the loop's ran inside the update and after it, before the weights were kept)."""
        optimizer = self.mechanism.optimizer
        if optimizer is None:
            return True
        state = optimizer.state  # torch calls its factory inside the update, and zero_grad reads `defaults`
        if type(state) is not collections.defaultdict or state.default_factory is not dict:
            return False
        if not same_state(optimizer.defaults, self.defaults):
            return False
        groups = optimizer.param_groups
        return (type(groups) is list and len(groups) == len(self.groups)
                and all(type(group) is dict and type(group["params"]) is list and len(group["params"]) == len(kept)
                        and all(map(operator.is_, group["params"], kept)) for group, kept in zip(groups, self.groups)))

    def same(self, weights: dict[str, "torch.Tensor"]) -> bool:
        return weights.keys() == self.trainable.keys() and all(_equal(v, self.trainable[n])
                                                               for n, v in weights.items())


_SCHEDULED = frozenset(RATE_KEYS)  # the rates: compared with the schedule's (`Hyperparameters`), not as state


_PLAIN = (int, float, bool, str, type(None))  # the values an update's state holds besides tensors and containers


def _copied(state: Any) -> Any:
    """A copy of an update's state, of the same exact types, the learning rates left out."""
    if type(state) is dict:
        return {key: _copied(value) for key, value in state.items() if key not in _SCHEDULED}
    if type(state) in (list, tuple):
        return type(state)(_copied(value) for value in state)
    return state.detach().clone() if isinstance(state, torch.Tensor) else copy.deepcopy(state)


def same_state(a: Any, b: Any) -> bool:
    """Whether two update states are equal, tensors by value, the learning rates aside. Only exact dicts, lists,
    tuples, plain tensors and plain values count as equal: a subclass of any of them (a tensor whose
    `__torch_function__`, a dict whose `__getitem__`, a tuple whose `__iter__` is code of the loop's) would run
    that code inside the governed update, which reads them (review 6)."""
    if type(a) is not type(b):
        return False
    if type(a) is dict:
        keys = {k for k in a if k not in _SCHEDULED}
        return (keys == {k for k in b if k not in _SCHEDULED} and all(type(k) in _PLAIN for k in keys)
                and all(same_state(a[k], b[k]) for k in keys))
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    if type(a) is torch.Tensor:  # accelerate moves the state to the device: compare on the CPU
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    if is_sharded(a):  # FSDP's moments (`distributed.fsdp`)
        return same_shard(a, b)
    return type(a) in _PLAIN and (a == b or (a != a and b != b))


def same_shard(a: "torch.Tensor", b: "torch.Tensor") -> bool:
    """Two DTensors (FSDP's sharded parameters or moments), exactly of torch's class, of one layout, equal on this
    rank's shard: each rank compares its own, with no collective (a rank that finds a difference stops the run)."""
    from torch.distributed.tensor import DTensor

    return (type(a) is DTensor and type(b) is DTensor and a.placements == b.placements and a.shape == b.shape
            and a.dtype == b.dtype and torch.equal(a.to_local().cpu(), b.to_local().cpu()))


def _version(p: "torch.Tensor") -> Any:
    """A parameter's version counter. A DTensor's wrapper has its own, and a write through `to_local()` bumps only its
    shard's (which FSDP's gathers never write): both are kept."""
    return (p._version, p.to_local()._version) if is_sharded(p) else p._version


def _equal(a: "torch.Tensor", b: "torch.Tensor") -> bool:
    return same_shard(a, b) if is_sharded(a) or is_sharded(b) else torch.equal(a, b)


def check_optimizer_hooks() -> None:
    """torch's global optimizer-step hooks run inside every governed update, with the weights and the step in
    hand: a pre-hook that raises could reject draws, a post-hook could move the weights again (review 3, F1)."""
    from torch.optim import optimizer

    hooks = [*optimizer._global_optimizer_pre_hooks.values(), *optimizer._global_optimizer_post_hooks.values()]
    if hooks:
        raise ConfigError(Code.UNGOVERNED_UPDATE, f"torch has {len(hooks)} global optimizer step hook(s) registered "
                                                  "(register_optimizer_step_pre_hook/post_hook): they would run inside "
                                                  "each governed update; remove them while the run is open")


def trainable_weights(model: "nn.Module") -> dict[str, "torch.Tensor"]:
    """A copy of every trainable parameter, by name."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
