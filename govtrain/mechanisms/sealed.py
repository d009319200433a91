"""The update's own objects as the run built them: no code of the loop's may sit inside a governed update.

The run's optimizer, PRISM, DP-Muon and the `Update` that steps them run inside every governed update, after the
check of its hyperparameters and before the weights are kept: code placed on them runs there with the weights,
the rates and the moments in hand. An outside review placed it four ways, each unrefused: a step pre-hook on the
run's own optimizer that set every rate from the non-noised training loss, a post-hook that moved every weight, a
`state_dict` post-hook that hid moments written from the loss, and an instance attribute shadowing a method
(`optimizer.step`, PRISM's `step`, DP-Muon's `orthogonalize`) wrapped around the real one. torch's global
optimizer hooks are refused for the same reason (`governed.check_optimizer_hooks`).

So `Sealed.of(update)` records, when the run opens, each object's class, the names of its instance attributes, and
each hook dict it holds (torch's `_optimizer_*_hooks`: its type and entries); `changed()` names the first that
differs: a class swapped, an instance attribute that shadows an attribute of its class (a method replaced on the
instance), a hook registered, a hook dict replaced. Checked wherever `Weights.changed` runs (before each draw,
governed forward, update, checkpoint and save). Patching the classes themselves (torch's, govtrain's) changes
what every instance does, and no check inside the process can tell it from the library: that is out of reach.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _is_hooks(name: str, value: Any) -> bool:
    return name.endswith("hooks") and isinstance(value, dict)


@dataclass(frozen=True)
class _Object:
    where: str
    obj: Any
    kind: type
    names: frozenset[str]
    hooks: tuple[tuple[str, type, tuple], ...]  # (attribute, its exact type, its entries)


@dataclass(frozen=True)
class Sealed:
    """The update's objects (`Update`, its optimizer, PRISM, DP-Muon) as the run opened them."""

    objects: tuple[_Object, ...]

    @classmethod
    def of(cls, update: Any) -> "Sealed":
        found = [("the update", update)]
        found += [(f"the update's {name}", getattr(update, name)) for name in ("optimizer", "prism", "muon")
                  if getattr(update, name, None) is not None]
        return cls(tuple(_Object(where, obj, type(obj), frozenset(vars(obj)), _hooks(obj)) for where, obj in found))

    def changed(self) -> str | None:
        """The first of the update's objects that is not as the run opened it, in words; None when all are."""
        for kept in self.objects:
            obj = kept.obj
            if type(obj) is not kept.kind:
                return f"{kept.where} changed class to {type(obj).__name__} (its code would run inside the update)"
            attributes = vars(obj)
            shadowing = sorted(name for name in attributes if name not in kept.names and hasattr(kept.kind, name))
            if shadowing:
                return (f"{kept.where} has {', '.join(shadowing)} set on the instance, in place of its class's (code "
                        "of the loop's would run inside the update)")
            hooks = _hooks(obj)
            if hooks != kept.hooks:
                added = [f"{name} ({len(entries)})" for name, kind, entries in hooks if entries
                         and (name, kind, entries) not in kept.hooks]
                return (f"{kept.where} has hooks registered ({', '.join(added) or 'a hook dict replaced'}): they run "
                        "inside the update with the weights and the rates in hand")
        return None


def _hooks(obj: Any) -> tuple[tuple[str, type, tuple], ...]:
    """Each hook dict `obj` holds: its name, exact type, and entries (key, hook) by identity."""
    return tuple((name, type(value), tuple((key, id(hook)) for key, hook in dict.items(value)))
                 for name, value in sorted(vars(obj).items()) if _is_hooks(name, value))


__all__ = ["Sealed"]
