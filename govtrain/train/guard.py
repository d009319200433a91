"""The run owns sampling: hooks on `run.model` that refuse (`ungoverned_batch`) whatever would train on rows
the Poisson sampler did not draw. The accountant's q holds only for batches govtrain drew.

- **The batch as drawn.** Each batch is handed out with its tensors (inputs and targets) recorded: the objects,
  their version counters and their values. A tensor written in place after the draw (which bumps its counter;
  a write through `.data` or `.numpy()` does not, so the values are compared too), or replaced in the batch, is
  refused at the governed forward and again at `run.step()`: otherwise overwriting the drawn rows with any
  others trains on them while the ledger charges the draw (issue 20, item 6a).
- **Exactly the batch's inputs.** The governed forward of `run.model` receives every input tensor of the
  waiting batch and no other tensor (positional or keyword, inside lists, tuples or dicts too); plain options
  (`return_dict`, `output_hidden_states`: bool, int, float, str, None) pass, and any other object, which could
  carry tensors, is refused.
- **Inner modules.** Every module that directly holds a trainable parameter gets a forward pre-hook: while the
  run is iterating `batches()`, calling it with gradients enabled outside the governed forward of `run.model`
  is refused, so the model's inner modules (`run.model.base_model.model`, a LoRA factor) are no way around the
  top-level checks (item 6b). Under `torch.no_grad()` anything may run (evaluation).

The hooks change neither the model's type nor its `state_dict` keys, and `remove()` takes every one away.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator

import torch
from torch import Tensor, nn

from govtrain.errors import Code, ConfigError

if TYPE_CHECKING:
    from govtrain.train.governed import GovernedBatch

NOT_YOURS = ("the accountant's q holds only for batches govtrain's Poisson sampler drew: iterate run.batches() "
             "and put your data in training.data")
PLAIN = (bool, int, float, str, type(None))


@dataclass
class Waiting:
    """The batch handed out and not yet stepped: its tensors as drawn (where in the batch, the tensor, its
    version counter, a copy of its values)."""

    batch: "GovernedBatch"
    inputs: dict[str, Tensor]
    drawn: list[tuple[str, Any, int, Tensor]] = field(default_factory=list)
    forwarded: bool = False

    @classmethod
    def of(cls, batch: "GovernedBatch") -> "Waiting":
        inputs = {k: v for k, v in batch.inputs.items() if isinstance(v, Tensor)}
        tensors = {f"batch.inputs[{k!r}]": v for k, v in inputs.items()}
        tensors.update(_tensors_in(batch.targets, "batch.targets"))
        tensors.update(_tensors_in(batch.extra, "batch.extra"))
        return cls(batch, inputs, [(where, v, v._version, v.detach().clone()) for where, v in tensors.items()])

    def changed(self) -> str | None:
        """Which tensor of the batch is not as drawn, or None."""
        batch = self.batch
        now = {f"batch.inputs[{k!r}]": v for k, v in batch.inputs.items() if isinstance(v, Tensor)}
        now.update(_tensors_in(batch.targets, "batch.targets"))
        now.update(_tensors_in(batch.extra, "batch.extra"))
        drawn = {where for where, *_ in self.drawn}
        for where in sorted(set(now) - drawn):
            return f"{where} was added after the batch was drawn"
        for where, tensor, version, values in self.drawn:
            if now.get(where) is not tensor:
                return f"{where} was replaced after the batch was drawn"
            if tensor._version != version or tensor.shape != values.shape or not torch.equal(tensor, values):
                return f"{where} was written after the batch was drawn"
        return None


class Guard:
    """The hooks on `model`: the top-level checks of the governed forward (run under `forward()`, the router's
    capture and the run's precision) and the pre-hooks on every module holding a trainable parameter."""

    def __init__(self, model: nn.Module, forward: Callable[[], ContextManager[None]]) -> None:
        self.model, self._context = model, forward
        self.waiting: Waiting | None = None
        self.iterating = False
        self._forward: contextlib.ExitStack | None = None
        holders = [(name, module) for name, module in model.named_modules() if module is not model
                   and any(p.requires_grad for p in module.parameters(recurse=False))]
        self._hooks = [model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
                       model.register_forward_hook(self._after_forward, always_call=True),
                       *(module.register_forward_pre_hook(self._inner(name)) for name, module in holders)]

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def wait(self, batch: "GovernedBatch") -> None:
        """`batch` is handed out: record its tensors as drawn."""
        self.waiting = Waiting.of(batch)

    def check_waiting(self, batch: object) -> Waiting:
        if self.waiting is None or batch is not self.waiting.batch:
            raise ConfigError(Code.UNGOVERNED_BATCH, "this batch is not the one run.batches() is waiting on: "
                                                     f"{NOT_YOURS}")
        return self.waiting

    def check_unchanged(self, waiting: Waiting) -> None:
        changed = waiting.changed()
        if changed is not None:
            raise ConfigError(Code.UNGOVERNED_BATCH, f"{changed}: a step on it would train on rows the sampler did "
                                                     f"not draw while the ledger charges the draw; {NOT_YOURS} "
                                                     "(leave the batch's tensors as handed out)")

    # -- hooks -----------------------------------------------------------------------------------------

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        waiting, grad = self.waiting, torch.is_grad_enabled()
        if waiting is None or waiting.forwarded:
            if grad and self.iterating:
                raise ConfigError(Code.UNGOVERNED_BATCH, ("a second forward of run.model on one batch" if waiting
                                                          else "a forward of run.model with gradients enabled outside "
                                                          "a batch of run.batches()") +
                                  f": {NOT_YOURS} (run other forwards under torch.no_grad())")
            return
        passed = list(_arguments(args, kwargs))
        drawn = waiting.inputs
        given = {id(t) for _, t in passed if isinstance(t, Tensor)}
        missing = [key for key, tensor in drawn.items() if id(tensor) not in given]
        if not grad:
            if not missing:
                raise ConfigError(Code.UNGOVERNED_BATCH, "the forward of a governed batch ran under torch.no_grad(): "
                                                         "its per-sample gradients cannot be formed")
            return  # another forward without gradients (evaluation) trains nothing
        ours = {id(t) for t in drawn.values()}
        for where, value in passed:
            if isinstance(value, Tensor) and id(value) not in ours:
                raise ConfigError(Code.UNGOVERNED_BATCH, "a forward of run.model with gradients enabled got the "
                                                         f"tensor {where}, which is not one of the waiting batch's "
                                                         f"inputs: {NOT_YOURS} (pass exactly **batch.inputs; run "
                                                         "other forwards under torch.no_grad())")
            if not isinstance(value, (Tensor, *PLAIN)):
                raise ConfigError(Code.UNGOVERNED_BATCH, f"a forward of run.model with gradients enabled got {where} "
                                                         f"of type {type(value).__name__}, which may carry tensors the "
                                                         f"sampler did not draw: {NOT_YOURS} (pass **batch.inputs and "
                                                         "plain options only)")
        if missing:
            raise ConfigError(Code.UNGOVERNED_BATCH, f"a forward of run.model with gradients enabled without the "
                                                     f"waiting batch's {', '.join(missing)}: {NOT_YOURS} (pass "
                                                     "exactly **batch.inputs; run other forwards under "
                                                     "torch.no_grad())")
        self.check_unchanged(waiting)
        waiting.forwarded = True
        self._forward = contextlib.ExitStack()
        self._forward.enter_context(self._context())

    def _after_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._forward is not None:
            self._forward, forward = None, self._forward
            forward.close()

    def _inner(self, name: str) -> Callable[[nn.Module, tuple], None]:
        def before(module: nn.Module, args: tuple) -> None:
            if self.iterating and self._forward is None and torch.is_grad_enabled():
                raise ConfigError(Code.UNGOVERNED_BATCH, f"a forward of {name} (it holds trainable parameters) with "
                                                         "gradients enabled outside the governed forward of "
                                                         f"run.model on the waiting batch: {NOT_YOURS} (call run.model "
                                                         "on **batch.inputs; run other forwards under torch.no_grad())")

        return before


def _arguments(args: tuple, kwargs: dict) -> Iterator[tuple[str, Any]]:
    """(where, value) of every leaf of a forward's arguments, lists, tuples and dicts opened."""
    for i, value in enumerate(args):
        yield from _leaves(value, f"positional argument {i}")
    for key, value in kwargs.items():
        yield from _leaves(value, f"keyword {key}")


def _leaves(value: Any, where: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{where}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, f"{where}[{key!r}]")
    else:
        yield where, value


def _tensors_in(value: Any, where: str) -> dict[str, Tensor]:
    return {w: v for w, v in _leaves(value, where) if isinstance(v, Tensor)}
