"""The state of `run.model` that its forward reads besides its parameters, modules, methods and hooks.

An outside review of issue 34's item 8 set, between governed steps and from the non-noised training loss, state
that every example's forward reads and that neither `Weights` (parameters, the update) nor the guard's "model as
opened" (modules, methods, hooks, configs, by identity) compared: a registered buffer (BERT's `position_ids`,
written in place or replaced), peft's per-adapter LoRA `scaling` (lora_alpha / r), an attention module's float
`scaling`, the modules' `training` flag (dropout on or off). Each made every example's clipped gradient at the
next step a function of all the data, so neighbouring data sets' clipped sums differed in every term, with the
spend unchanged and the run recorded.

`ModelState` keeps, as the last governed forward or step left them:
- every buffer, by name: the tensor's identity and a copy of its values (compared by value: a write through
  `.data` bumps no version counter, and one written back as it was changes nothing the forward reads);
- every module's plain attributes (bool, int, float, str, None, and tuples, lists and dicts of them: peft's
  `scaling`, `r`, `lora_alpha`, its active adapter, an attention's `scaling`), the `training` flag aside; one
  added later (accelerate's `_is_accelerate_prepared`, set by a Trainer) is recorded from the next record on,
  unless it is a number or flag that hides an attribute of its class of the same name (a class-level `scaling`
  the forward read).
`changed()` names the first that differs; the run refuses it (`ungoverned_update`) at every check `Weights` runs
at (before each draw, governed forward, update, checkpoint and save). A governed forward may write buffers itself
(BatchNorm's running statistics): the record is taken again after each one.

The modes (`training`) are the loop's choice, and a Trainer switches them around its evaluations; so they are
compared only at each governed forward, against the first governed forward's in this process (`check_modes`): a
mode chosen from the data at a later step is refused (`ungoverned_batch`).

What stays out of reach: state the forward reads that is not a buffer, a module's plain attribute or its mode (a
tensor held as a plain attribute, a module-level global, a library patched), and the loss the loop computes from
the output (`docs/python-api.md`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from govtrain.distributed.fsdp import is_sharded

if TYPE_CHECKING:
    from torch import nn

_PLAIN = (bool, int, float, str, type(None))
_CONTAINERS = (tuple, list, dict)  # exactly these types (an OrderedDict of hooks is none)
_NUMBERS = (bool, int, float)
_STR = frozenset({str})  # a name's type exactly (a str subclass may compare or hash as another name)


class ModelState:
    def __init__(self, model: "nn.Module") -> None:
        self.model = model
        self.modes: list[bool] | None = None  # each module's `training` at this process's first governed forward
        self.take()

    def take(self) -> None:
        """Record the model's buffers and plain attributes as they are now (after a governed forward or step)."""
        self.buffers = [(name, b, _local(b).detach().clone())
                        for name, b in self.model.named_buffers(remove_duplicate=False)]
        modules = list(self.model.named_modules(remove_duplicate=False))
        self.regular = _regular(modules)
        self.attributes = _by_module(modules) if self.regular else _attributes(modules)
        self.names = {id(module): (module, frozenset(vars(module))) for _, module in modules}

    def changed(self) -> str | None:
        """The first buffer or plain attribute of the model that is not as last recorded, in words; None when all
        are."""
        now = list(self.model.named_buffers(remove_duplicate=False))
        names = [name for name, *_ in self.buffers]
        if [name for name, _ in now] != names:
            added = sorted({name for name, _ in now} - set(names))
            removed = sorted(set(names) - {name for name, _ in now})
            return f"run.model's buffers changed ({', '.join([*added, *removed][:3]) or 'their order'})"
        # by value, not by identity: the Trainer's distributed wrapping and `.to()` replace a buffer by an equal one,
        # which the forward reads the same; one replaced by other values is refused as one written in place
        for (name, b), (_, _kept, values) in zip(now, self.buffers):
            held = _local(b).detach()
            if held.shape != values.shape or held.dtype != values.dtype or \
                    not torch.equal(held.to(values.device), values):
                return f"run.model's buffer {name} was written or replaced"
        modules = list(self.model.named_modules(remove_duplicate=False))
        if self.regular and _regular(modules):
            found = _changed_by_module(self.attributes, dict(modules))
        else:
            kept = _flat(self.attributes) if self.regular else self.attributes
            attributes = _attributes(modules)
            found = next((f"run.model's {where} was set (to {attributes.get(where, _MISSING)!r}, from {then!r})"
                          for where, then in kept.items() if not _same(attributes.get(where, _MISSING), then)), None)
        return found or self._shadowing(modules)

    def _shadowing(self, modules: list[tuple[str, "nn.Module"]]) -> str | None:
        """A number or flag set on a module since the record (one added since is otherwise no setting the forward
        read then) where its class has an attribute of that name: the instance's now hides the class's, which the
        forward read (a class-level `scaling`, say), so the forward reads another value. Text and lists stay out:
        TRL's SFTTrainer tags the model (`model_tags`, None on the class), which no forward reads."""
        for path, module in modules:
            kept = self.names.get(id(module))
            if kept is None or kept[0] is not module:
                continue  # a module added since: `model_structure` refuses what the forward would run of it
            for name in vars(module).keys() - kept[1]:
                value = vars(module)[name]
                if type(value) in _NUMBERS and name != "training" and \
                        any(name in vars(klass) for klass in type(module).__mro__):
                    held = next(vars(klass)[name] for klass in type(module).__mro__ if name in vars(klass))
                    return f"run.model's {path or 'run.model'}.{name} was set (to {value!r}, over its class's {held!r})"
        return None

    def check_modes(self) -> str | None:
        """At a governed forward: each module's mode against this process's first governed forward's."""
        modes = [module.training for module in self.model.modules()]
        if self.modes is None:
            self.modes = modes
            return None
        if modes != self.modes:
            switched = [(name or "run.model", now) for (name, _), now, then in
                        zip(self.model.named_modules(), modes, self.modes) if now != then]
            (name, now), more = switched[0], len(switched) - 1
            return (f"{name}{f' and {more} more module(s)' if more else ''} switched to "
                    f"{'training' if now else 'evaluation'} mode")
        return None


class _Missing:
    def __repr__(self) -> str:
        return "nothing"


_MISSING = _Missing()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_sharded(t) else t


def _plain(value: Any, depth: int = 0) -> bool:
    if type(value) in _PLAIN:
        return True
    if depth < 2 and type(value) in (tuple, list):
        return all(_plain(v, depth + 1) for v in value)
    if depth < 2 and type(value) is dict:
        return all(type(k) in _PLAIN and _plain(v, depth + 1) for k, v in value.items())
    return False


def _copy(value: Any) -> Any:
    if type(value) in (tuple, list):
        return type(value)(_copy(v) for v in value)
    if type(value) is dict:
        return {k: _copy(v) for k, v in value.items()}
    return value


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if type(a) in (tuple, list):
        return len(a) == len(b) and all(map(_same, a, b))
    if type(a) is dict:
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b or (a != a and b != b)


def _attributes(modules: list[tuple[str, "nn.Module"]]) -> dict[str, Any]:
    """Every module's plain instance attributes (copies), by where they are ("path.name", the root's
    "run.model.name"), the `training` flag aside: the record of a model that is not `_regular`."""
    found: dict[str, Any] = {}
    for path, module in modules:
        where = path or "run.model"
        for name, value in vars(module).items():
            if name != "training" and _plain(value):
                found[f"{where}.{name}"] = _copy(value)
    return found


def _regular(modules: list[tuple[str, "nn.Module"]]) -> bool:
    """Whether each (module path, attribute name) pair has a "where" of its own in `_attributes`: every module's
    `__dict__` a dict, its children's and attributes' names strings without a dot (the child's not empty), and no
    path under "run.model" (the root's). `nn.Module.__setattr__` takes any name, so a model can break this; such a
    model is recorded and compared as `_attributes` has it, one value per "where"."""
    for path, module in modules:
        attributes = vars(module)
        if type(attributes) is not dict or path == "run.model" or path.startswith("run.model."):
            return False
        for names in (attributes, module._modules):  # in C: the names' types as a set, and their characters joined
            if not _STR.issuperset(map(type, names)) or "." in "".join(names):
                return False
        if "" in module._modules:
            return False
    return True


def _by_module(modules: list[tuple[str, "nn.Module"]]) -> dict[str, dict[str, Any]]:
    """`_attributes` of a `_regular` model, by module path and then attribute name (a module without any left
    out): the same record, without building each "where"."""
    found: dict[str, dict[str, Any]] = {}
    for path, module in modules:
        plain = {name: value if type(value) in _PLAIN else _copy(value) for name, value in vars(module).items()
                 if (type(value) in _PLAIN or type(value) in _CONTAINERS and _plain(value)) and name != "training"}
        if plain:
            found[path] = plain
    return found


def _flat(by_module: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A `_by_module` record as `_attributes` has it (the same order)."""
    return {f"{path or 'run.model'}.{name}": value for path, plain in by_module.items() for name, value in plain.items()}


def _changed_by_module(kept: dict[str, dict[str, Any]], modules: dict[str, "nn.Module"]) -> str | None:
    """`changed`'s comparison of the plain attributes when the model was and is `_regular`: the same report."""
    for path, plain in kept.items():
        module = modules.get(path)
        now = vars(module) if module is not None else {}
        for name, then in plain.items():
            value = now.get(name, _MISSING)
            if type(value) is type(then) and type(then) in _PLAIN and (value == then or (value != value and then != then)):
                continue  # the common case without a call: the same plain value (a NaN still a NaN)
            if value is not _MISSING and not _plain(value):
                value = _MISSING
            if not _same(value, then):
                return f"run.model's {path or 'run.model'}.{name} was set (to {value!r}, from {then!r})"
    return None


__all__ = ["ModelState"]
