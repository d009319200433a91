"""The update's hyperparameters at each governed step, and the check that nothing else set them (issue 34, item 8).

A learning rate, momentum, betas, weight decay or eps set from private data is a use of it that no spend entry
charges: a Trainer callback that set `lr = 5·eval_loss` from an evaluation of admitted rows (or from the training
loss, which is not noised: an ordinary reduce-on-plateau) changed the released adapter while the spend and both
ledgers stayed as they were. So every hyperparameter the update reads is a function of the governed step alone:

- what RUN.toml configured: each of the run's optimizer's groups as `make_optimizer` built it (every key but
  `params`), and PRISM's (`lr`, `betas`, `floor`, `max_condition`, `eps`) and DP-Muon's (`lr`, `momentum`,
  `kappa`, `steps`, `iteration`) as `Update.build` built them (`Hyperparameters.of`, before anything is loaded);
- the learning rates scaled by the run's `Schedule`, a function of the governed step (empty draws count) and of
  public settings only: constant (the default), or a Trainer's `lr_scheduler_type` among `SCHEDULES`, fixed
  before the run's first governed update in the process (`GovernedRun.set_schedule`); each group also holds its
  configured rate as `initial_lr`, where torch's schedulers keep their base.

Before every governed update (and every draw, governed forward, checkpoint and save: `Weights.changed`) each group
must hold exactly those keys, every value of the exact type and value configured, the rates finite and equal to
the schedule's up to rounding (1e-12, relative: a scheduler of one's own that multiplies the same factor may
round otherwise); anything else is refused (`ungoverned_update`) before the update acts. The update then meets
the schedule's own values, written as plain floats (`apply`), so nothing but the step reaches it.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np

SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine")  # Hugging Face's, as functions of the step
RATE_KEYS = ("lr", "initial_lr")  # what a learning-rate schedule writes into an optimizer's groups
RATES = (float, int, np.float64, np.float32, np.float16)  # a learning rate's exact types (numpy's: C arithmetic)
_PLAIN = (bool, int, float, str, type(None))
_ROUNDING = 1e-12  # relative: what two computations of one factor times one rate may differ by
_PARTS = {"prism": ("lr", "betas", "floor", "max_condition", "eps"),
          "muon": ("lr", "momentum", "kappa", "steps", "iteration")}


class Tuned(Protocol):
    """What `Hyperparameters.apply` and `changed` reach of an update (`mechanisms.update.Update` is one): its
    optimizer (None where the mechanism keeps none), and the parts its schedule names (`prism`, `muon`) as
    attributes. A protocol, so that the update imports this module and not the other way round."""

    optimizer: Any


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """The learning rates' factor at each governed step of a run of `total` steps: `kind` of `SCHEDULES`, with
    `warmup` steps rising linearly from 0 (Hugging Face's formulas, `transformers.optimization`, at the run's step
    rather than the Trainer's, which skips empty draws)."""

    kind: str = "constant"
    warmup: int = 0
    total: int = 1

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"the schedule is one of {', '.join(SCHEDULES)}, not {self.kind!r}")
        if type(self.warmup) is not int or self.warmup < 0 or (self.kind == "constant" and self.warmup):
            raise ValueError("warm-up steps are a non-negative int (none for a constant schedule), not "
                             f"{self.warmup!r}")
        if type(self.total) is not int or self.total < 1:
            raise ValueError(f"a run has at least one step, not {self.total!r}")

    def factor(self, step: int) -> float:
        if self.kind == "constant":
            return 1.0
        if step < self.warmup:
            return float(step) / float(max(1, self.warmup))
        if self.kind == "constant_with_warmup":
            return 1.0
        if self.kind == "linear":
            return max(0.0, float(self.total - step) / float(max(1, self.total - self.warmup)))
        progress = float(step - self.warmup) / float(max(1, self.total - self.warmup))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))

    def __str__(self) -> str:
        return self.kind + (f" with {self.warmup} warm-up step(s)" if self.warmup else "")

    def record(self) -> dict[str, Any]:
        """What a run state keeps of it: the public choice its steps were taken under (`total` is the run's)."""
        return {"kind": self.kind, "warmup": self.warmup}

    @classmethod
    def of_record(cls, record: Any, *, total: int) -> "Schedule":
        """The schedule a run state recorded (`record`), for a run of `total` steps; ValueError if it is none."""
        if not isinstance(record, dict) or set(record) != {"kind", "warmup"}:
            raise ValueError(f"a schedule record is {{kind, warmup}}, not {record!r}")
        return cls(kind=record["kind"], warmup=record["warmup"], total=total)


class Hyperparameters:
    """What RUN.toml configured for an update (`of`), and the run's schedule over it: `expected(step)`, `apply`
    and `changed` (module docstring)."""

    def __init__(self, groups: list[dict[str, Any]], parts: dict[str, dict[str, Any]]) -> None:
        # frozen copies: the reference `changed` compares with and `apply` writes is no object the loop can edit
        # (review: `groups[i]["lr"]` rewritten moved the rates past every check); `groups` and `parts` hand out
        # copies, and `Weights` refuses a schedule set other than by `set_schedule` (`reference()`)
        self._groups = tuple(MappingProxyType(copy.deepcopy(dict(group))) for group in groups)
        self._parts = MappingProxyType({name: MappingProxyType(copy.deepcopy(dict(values)))
                                        for name, values in parts.items()})
        self.schedule = Schedule()

    @property
    def groups(self) -> list[dict[str, Any]]:
        """A copy of each group's configured hyperparameters (writing it changes nothing)."""
        return [copy.deepcopy(dict(group)) for group in self._groups]

    @property
    def parts(self) -> dict[str, dict[str, Any]]:
        """A copy of PRISM's and DP-Muon's configured hyperparameters (writing it changes nothing)."""
        return {name: copy.deepcopy(dict(values)) for name, values in self._parts.items()}

    def reference(self) -> tuple:
        """What the checks compare with, by identity, and the schedule: `Weights` keeps it as the run set it and
        refuses any other (a schedule assigned past `set_schedule`, the frozen copies swapped)."""
        return self._groups, self._parts, self.schedule

    @classmethod
    def of(cls, optimizer: Any, prism: Any, muon: Any) -> "Hyperparameters":
        """An update's hyperparameters as it was built, from the run's configuration (before a run state is loaded)."""
        groups = [] if optimizer is None else [copy.deepcopy({k: v for k, v in g.items() if k not in ("params",
                                                                                                      "initial_lr")})
                                               for g in optimizer.param_groups]
        parts = {name: {key: copy.deepcopy(getattr(part, key)) for key in _PARTS[name]}
                 for name, part in (("prism", prism), ("muon", muon)) if part is not None}
        return cls(groups, parts)

    def expected(self, step: int) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
        """Every group's hyperparameters and PRISM's and DP-Muon's at governed step `step`."""
        factor = self.schedule.factor(step)
        groups = [{**copy.deepcopy(dict(group)), "lr": float(group["lr"]) * factor, "initial_lr": float(group["lr"])}
                  for group in self._groups]
        parts = {name: {**copy.deepcopy(dict(values)), "lr": float(values["lr"]) * factor}
                 for name, values in self._parts.items()}
        return groups, parts

    def apply(self, update: Tuned, step: int) -> None:
        """Write step `step`'s values into the update: each group then holds exactly the configured keys."""
        groups, parts = self.expected(step)
        optimizer = update.optimizer
        for group, values in zip(optimizer.param_groups if optimizer is not None else (), groups):
            for key in [k for k in group if k != "params" and k not in values]:
                del group[key]
            group.update(values)
        for name, values in parts.items():
            for key, value in values.items():
                setattr(getattr(update, name), key, value)

    def changed(self, update: Tuned, step: int) -> str | None:
        """The first hyperparameter of `update` that is not step `step`'s, in words; None when all are."""
        groups, parts = self.expected(step)
        optimizer = update.optimizer
        held = optimizer.param_groups if optimizer is not None else []
        if len(held) != len(groups):
            return f"the optimizer has {len(held)} parameter group(s), not the {len(groups)} RUN.toml configured"
        for i, (group, values) in enumerate(zip(held, groups)):
            keys = set(group) - {"params"}
            if keys != set(values):
                added, removed = sorted(map(str, keys - set(values))), sorted(map(str, set(values) - keys))
                what = [f"key(s) {', '.join(keys_)} {how}" for keys_, how in ((added, "added"), (removed, "removed"))
                        if keys_]
                return f"param_groups[{i}] has {' and '.join(what)}"
            for key in sorted(values):
                wrong = _differs(key, group[key], values[key])
                if wrong:
                    return f"param_groups[{i}][{key!r}] is {wrong}"
        for name, values in parts.items():
            part = getattr(update, name)
            for key in sorted(values):
                wrong = _differs(key, getattr(part, key, None), values[key])
                if wrong:
                    return f"{name}.{key} is {wrong}"
        return None


def _differs(key: str, value: Any, expected: Any) -> str | None:
    """How `value` differs from `expected` (a rate up to rounding, anything else exactly, by exact type), or None."""
    if key in RATE_KEYS:
        if type(value) not in RATES or not math.isfinite(value):
            return (f"{value!r}, a {type(value).__name__}, not a finite float (the update would run its arithmetic)")
        if abs(float(value) - expected) > _ROUNDING * abs(expected):
            return f"{float(value)!r}, where the schedule gives {expected!r}"
        return None
    if _same(value, expected):
        return None
    if type(value) is not type(expected):  # an object of the loop's, equal or not: its code would run in the update
        return f"a {type(value).__name__} ({value!r}), where RUN.toml gives a {type(expected).__name__} ({expected!r})"
    return f"{value!r}, where RUN.toml gives {expected!r}"


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if type(a) in (tuple, list):
        return len(a) == len(b) and all(map(_same, a, b))
    return type(a) in _PLAIN and (a == b or (a != a and b != b))


__all__ = ["SCHEDULES", "Schedule", "Hyperparameters", "RATE_KEYS", "RATES"]
