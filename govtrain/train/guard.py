"""The run owns sampling: hooks on `run.model` that refuse (`ungoverned_batch`) whatever would train on rows
the Poisson sampler did not draw. The accountant's q holds only for batches govtrain drew.

- **The draw is the run's.** `batches()` keeps its own copy of each logical step's draw (`Drawn`: every
  chunk's examples, contributions, classes and signed clipping norms, and which chunk is next), and
  `run.step()` clips with, routes by and closes the step from that copy alone. A `GovernedBatch` holds the
  tensors and, read-only, its place in its step, none of it authoritative: clipping norms rewritten in the
  batch turned clipping off, and a last chunk made to look like one with more to come dropped its step, so
  the loop could draw again until it liked the draw (review 2, P8 and P9). A drawn step is completed as
  drawn: a loop that leaves `batches()` before the step's last chunk is stepped gets the same draw's
  remaining chunks when it iterates again, the one handed out and not stepped first.
- **The batch as drawn.** Each batch is handed out with its tensors (inputs and targets) recorded: the objects,
  their version counters and their values. A tensor written in place after the draw (which bumps its counter;
  a write through `.data` or `.numpy()` does not, so the values are compared too), or replaced in the batch, is
  refused at the governed forward and again at `run.step()`: otherwise overwriting the drawn rows with any
  others trains on them while the ledger charges the draw (issue 20, item 6a).
- **Exactly the batch's inputs, each under its own keyword.** The governed forward of `run.model` receives every
  input tensor of the waiting batch as the keyword it was drawn under (`**batch.inputs`), and no other tensor;
  a tensor passed positionally is refused (P6: the batch's `input_ids` and `attention_mask` passed under each
  other's keyword moved a GPT-2 classifier's clipped sum by 1.61 C). Plain options (`return_dict`,
  `output_hidden_states`: bool, int, float, str, None) pass, and any other object, which could carry tensors,
  is refused.
- **The model as opened.** Every module's path, identity and type, its instance-level methods (a replaced
  `forward`) and hooks, and torch's global module hooks are recorded when the run opens (`structure`, after the
  run's own hooks, the forwards that install transformers' own, and transformers' output-capturing hooks, which
  transformers 5 would otherwise install on the first forward asking for `output_hidden_states` or
  `output_attentions`, so that such a forward was refused), and so is what transformers picks each layer's
  attention by (`dispatch`): the config each module holds, the attention and MoE-experts implementation it and its
  sub-configs name, and each function the attention, attention-mask and experts registries (`AttentionInterface`
  and its kind: the class's mapping and each instance's own) map a name to. A governed forward that finds any of
  it changed is refused: a hook or method added later runs after the checks above and could swap the rows they
  checked (P1); an attention registered and selected after the run opened (`AttentionInterface.register`,
  `set_attn_implementation`) is one the batch-independence probe never saw: one mixing the examples of a batch
  moved the clipped sum by 1.34 C for one example, one replacing the drawn examples' values with a never-admitted
  row's by 5.85 C, and both runs were recorded (review 3, F3 and F4). The check runs as Python under
  `torch.compile`. In that forward the model's input embedding must receive the drawn `input_ids`, by value.
- **Inner modules.** Every module that directly holds a trainable parameter gets a forward pre-hook: while the
  run is iterating `batches()`, calling it with gradients enabled outside the governed forward of `run.model`
  is refused, so the model's inner modules (`run.model.base_model.model`, a LoRA factor) are no way around the
  top-level checks (item 6b). Under `torch.no_grad()` anything may run (evaluation).

The `state_dict` and `load_state_dict` hooks are part of the model as opened too: `save()` checks it before it
writes the adapter (review 8). The hooks change neither the model's type nor its `state_dict` keys, and
`remove()` takes every one away (transformers' output-capturing hooks too: transformers installs them again
when next asked).
Code that patches a library's classes (torch, transformers, peft, govtrain) changes what every instance does,
and no check inside the process can tell it from the library: that is outside what the guard can stop.

The records of a draw the guard checks against are `drawn.py`'s, shared with `governed.py`, which hands the
batches out; what it compares the model by is `model_structure.py`'s.
"""

from __future__ import annotations

import contextlib
import operator
import sys
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch import Tensor, nn

from govtrain.distributed.fsdp import is_sharded
from govtrain.errors import Code, ConfigError
from govtrain.train.drawn import NOT_YOURS, Drawn, GovernedBatch, Waiting, leaves
from govtrain.train.model_structure import dispatch, fingerprint, structure

PLAIN = (bool, int, float, str, type(None))


class Guard:
    """The hooks on `model`: the top-level checks of the governed forward (run under `forward()`, the router's
    capture and the run's precision), the input embedding's check and the pre-hooks on every module holding a
    trainable parameter; then the model's structure as opened."""

    def __init__(self, model: nn.Module, forward: Callable[[], ContextManager[None]]) -> None:
        self.model, self._context = model, forward
        self.drawn: Drawn | None = None  # the logical step being handed out
        self.waiting: Waiting | None = None
        self.iterating = False
        self._forward: contextlib.ExitStack | None = None
        holders = [(name, module) for name, module in model.named_modules() if module is not model
                   and any(p.requires_grad for p in module.parameters(recurse=False))]
        # A sharded model's (`distributed.fsdp`): before FSDP's own pre-forward, which puts the gathered parameters
        # in place of the shards the checks compare
        first = any(is_sharded(p) for p in model.parameters())
        self._hooks = [model.register_forward_pre_hook(self._before_forward, with_kwargs=True, prepend=first),
                       model.register_forward_hook(self._after_forward, always_call=True),
                       *(module.register_forward_pre_hook(self._inner(name)) for name, module in holders)]
        embedding = _input_embedding(model)
        if embedding is not None:
            self._hooks.append(embedding.register_forward_pre_hook(self._embedding, with_kwargs=True))
        self._uninstall = _install_output_capture(model)
        # last: the run's own hooks and transformers' are part of the model as opened
        self._structure, self._fingerprint = structure(model), fingerprint(model)
        self._dispatch = dispatch(model).keys()

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._uninstall()

    def wait(self, batch: GovernedBatch) -> None:
        """`batch`, the next chunk of the step being handed out, is handed out: record its tensors as drawn."""
        assert self.drawn is not None
        self.waiting = Waiting.of(batch, self.drawn)

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

    def check_structure(self) -> None:
        self.adopt(lambda where, value: False)

    # never traced: under torch.compile(run.model), dynamo traced this into the graph with the model's configs and
    # hooks as it first saw them, and a hook added later passed (the check is Python's, so it runs as Python)
    @torch.compiler.disable
    def adopt(self, expected: Callable[[str, Any], bool]) -> None:
        """Take the model as it is now for the model as opened where every difference is one `expected(where,
        value now)` accepts (a library's own change: TRL's fused LM head, `integrations/hf.py`); refuse any
        other difference, as a governed forward refuses it."""
        fast = fingerprint(self.model)
        if len(fast) == len(self._fingerprint) and all(map(operator.is_, fast, self._fingerprint)):
            return
        now, opened = structure(self.model), self._structure
        for where in [*opened, *(k for k in now if k not in opened)]:
            if now.get(where) is not opened.get(where) and not expected(where, now.get(where)):
                what = "added" if where not in opened else "removed" if where not in now else "replaced"
                if where in self._dispatch or where in dispatch(self.model):
                    raise ConfigError(Code.UNGOVERNED_BATCH, f"run.model's attention changed after the run opened "
                                                             f"({where} {what}): the attention implementation and the "
                                                             "functions transformers' registries map it to decide how "
                                                             "the examples of a batch meet, and the batch-independence "
                                                             "probe checked the ones the run opened with; set the "
                                                             "attention implementation before opening the run (in the "
                                                             "model's config), not in the loop")
                raise ConfigError(Code.UNGOVERNED_BATCH, f"run.model changed after the run opened ({where} {what}): a "
                                                         "hook, method or module added later runs after the guard's "
                                                         "checks and can swap the rows the sampler drew; remove it "
                                                         "before the next governed forward (read activations with "
                                                         "output_hidden_states=True), or add it after run.save()")
        self._structure, self._fingerprint, self._dispatch = now, fast, dispatch(self.model).keys()

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
        drawn = waiting.inputs
        given = {id(t) for _, t in _arguments(args, kwargs) if isinstance(t, Tensor)}
        if not grad:
            if all(id(tensor) in given for tensor in drawn.values()):
                raise ConfigError(Code.UNGOVERNED_BATCH, "the forward of a governed batch ran under torch.no_grad(): "
                                                         "its per-sample gradients cannot be formed")
            return  # another forward without gradients (evaluation) trains nothing
        self.check_structure()
        _check_arguments(args, kwargs, drawn)
        self.check_unchanged(waiting)
        waiting.forwarded = True
        self._forward = contextlib.ExitStack()
        self._forward.enter_context(self._context())

    def _after_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._forward is not None:
            self._forward, forward = None, self._forward
            forward.close()
            waiting = self.waiting  # output None: the forward raised, and that error is the one to see
            if output is not None and waiting is not None and waiting.ids is not None and not waiting.embedded:
                raise ConfigError(Code.UNGOVERNED_BATCH, "the governed forward of run.model never passed the waiting "
                                                         "batch's input_ids to the model's input embedding: its "
                                                         f"tokens came from elsewhere; {NOT_YOURS}")

    def _embedding(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        waiting = self.waiting
        if self._forward is None or waiting is None or waiting.ids is None:
            return
        ids = args[0] if args else kwargs.get("input")
        drawn = waiting.ids
        if not (isinstance(ids, Tensor) and ids.dtype == drawn.dtype and ids.shape == drawn.shape
                and torch.equal(ids, drawn)):
            raise ConfigError(Code.UNGOVERNED_BATCH, "the model's input embedding got other token ids than the "
                                                     "waiting batch's input_ids in its governed forward: something "
                                                     "between run.model and the embedding (a hook, a replaced forward "
                                                     f"or class) swapped the rows the sampler drew; {NOT_YOURS}")
        waiting.embedded = True

    def _inner(self, name: str) -> Callable[[nn.Module, tuple], None]:
        def before(module: nn.Module, args: tuple) -> None:
            if self.iterating and self._forward is None and torch.is_grad_enabled():
                raise ConfigError(Code.UNGOVERNED_BATCH, f"a forward of {name} (it holds trainable parameters) with "
                                                         "gradients enabled outside the governed forward of "
                                                         f"run.model on the waiting batch: {NOT_YOURS} (call run.model "
                                                         "on **batch.inputs; run other forwards under torch.no_grad())")

        return before


def _check_arguments(args: tuple, kwargs: dict, drawn: dict[str, Tensor]) -> None:
    """A governed forward's arguments: each drawn tensor under its own keyword, no other tensor, plain options."""
    ours = {id(t): key for key, t in drawn.items()}
    for where, value in _arguments(args, kwargs):
        if isinstance(value, Tensor) and id(value) in ours and where != f"keyword {ours[id(value)]}":
            raise ConfigError(Code.UNGOVERNED_BATCH, f"a forward of run.model with gradients enabled got the waiting "
                                                     f"batch's {ours[id(value)]} as {where}: each of its tensors goes "
                                                     "under the keyword it was drawn under, or the model reads one "
                                                     f"as another; {NOT_YOURS} (pass exactly **batch.inputs)")
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
    missing = [key for key, tensor in drawn.items() if kwargs.get(key) is not tensor]
    if missing:
        raise ConfigError(Code.UNGOVERNED_BATCH, f"a forward of run.model with gradients enabled without the "
                                                 f"waiting batch's {', '.join(missing)}: {NOT_YOURS} (pass "
                                                 "exactly **batch.inputs; run other forwards under "
                                                 "torch.no_grad())")



def _install_output_capture(model: nn.Module) -> Callable[[], None]:
    """Install the forward hooks that transformers (5 and later) installs on a model's layers the first time a
    forward asks for `output_hidden_states` or `output_attentions` (`capture_outputs`): installed in the loop, they
    changed the model as opened and the next governed forward was refused. Each records only in a forward that
    asks for it. Returns what takes them away again, leaving transformers to install them when next asked."""
    if "transformers" not in sys.modules:
        return lambda: None
    try:
        from transformers.utils.output_capturing import capture_outputs, maybe_install_capturing_hooks
    except ImportError:  # a transformers before 5 installs no such hooks
        return lambda: None
    wrapper = capture_outputs(lambda self: None).__code__
    modules = list(model.modules())
    before = [(set(module._forward_hooks), "_output_capturing_hooks_installed" in vars(module)) for module in modules]
    for module in modules:
        forward = getattr(type(module), "forward", None)
        while forward is not None and getattr(forward, "__code__", None) is not wrapper:
            forward = getattr(forward, "__wrapped__", None)  # under its other decorators
        if forward is not None:
            maybe_install_capturing_hooks(module)
    added = [(module, [key for key in module._forward_hooks if key not in hooks], flagged)
             for module, (hooks, flagged) in zip(modules, before)]

    def uninstall() -> None:
        for module, keys, flagged in added:
            for key in keys:
                module._forward_hooks.pop(key, None)
            if not flagged:
                vars(module).pop("_output_capturing_hooks_installed", None)
        added.clear()

    return uninstall


def _input_embedding(model: nn.Module) -> nn.Module | None:
    try:
        embedding = model.get_input_embeddings()  # type: ignore[operator]
    except (AttributeError, NotImplementedError):
        return None
    return embedding if isinstance(embedding, nn.Module) else None


def _arguments(args: tuple, kwargs: dict) -> Iterator[tuple[str, Any]]:
    """(where, value) of every leaf of a forward's arguments, lists, tuples and dicts opened."""
    for i, value in enumerate(args):
        yield from leaves(value, f"positional argument {i}")
    for key, value in kwargs.items():
        yield from leaves(value, f"keyword {key}")

