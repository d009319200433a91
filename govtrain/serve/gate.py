"""The gate's two decisions, from the release's predicate and the ledger (docs/serving.md, "The gate"):

* `decide`: what a verified rights envelope may draw on. A class the release's training drew on and the envelope
  excludes is dropped by disabling its own adapter where it reached that adapter and nothing else (the
  predicate's `classes[].adapter`); where it reached shared parameters (layers of the default adapter, the
  classifier head), the request is refused with `class_not_permitted`, naming those parameters and classes.
* `TaintWatch`: whether the release may be served at all. Contributions its run trained on that were withdrawn,
  since the release was signed or before it (seed 004: withdrawals are authoritative for inference gates, and
  signing the same adapter again is no retraining), make it tainted; a tainted release is refused with
  `release_tainted` until a release of a run trained without them is served, unless the policy grants a grace
  period, counted from the ledger time of the first such withdrawal (never later than when the gate first saw
  it: `memory.py`). A ledger that cannot be read refuses with `taint_unknown`: the gate
  never serves on a taint reading it does not have. Its callers are told only that (the ledger's location, and
  what failed there, are the operator's business: they go to the server's log).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from govtrain.errors import Code, GovtrainError, ServeError

DEFAULT_ADAPTER = "default"
TAINT_UNREADABLE = ("cannot read the ledger to check whether this release is tainted; refusing until it can (the "
                    "gate's log has the cause)")
log = logging.getLogger("govtrain.serve")


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """What one request is served with: the adapters left active, those disabled, and the classes dropped (those
    the release drew on that the envelope excludes, each through its own adapter)."""

    active_adapters: tuple[str, ...]
    disabled_adapters: tuple[str, ...]
    excluded_classes: tuple[str, ...]


def drawn_classes(predicate: Any) -> list[Any]:
    """The predicate's classes whose training the release draws on: those that reached a trained group and had
    contributions charged, or an ε charged (a tune's trials), in its run."""
    return [c for c in predicate.classes if c.groups and (c.contributions > 0 or c.eps_u > 0)]


def decide(predicate: Any, permitted: Iterable[str]) -> Decision:
    """The adapters to serve a caller permitted `permitted` with, or `class_not_permitted`."""
    allowed = frozenset(permitted)
    excluded = [c for c in drawn_classes(predicate) if c.data_class not in allowed]
    shared = [c for c in excluded if c.adapter is None]
    if shared:
        where = sorted({i for c in shared for i in c.groups})
        names = ", ".join(c.data_class for c in shared)
        raise ServeError(Code.CLASS_NOT_PERMITTED, (
            f"this release's training drew on class(es) {names} in shared parameters "
            f"({'; '.join(describe_group(predicate.groups[i]) for i in where)}), and your rights envelope does not "
            f"permit them (it permits: {', '.join(sorted(allowed)) or 'no class'}); no adapter can be disabled to "
            "serve without them: ask the issuer for rights to them, or serve a release trained without them"))
    disabled = tuple(sorted({c.adapter for c in excluded}))
    return Decision(active_adapters=tuple(a for a in predicate.adapter.adapters if a not in disabled),
                    disabled_adapters=disabled, excluded_classes=tuple(sorted(c.data_class for c in excluded)))


def describe_group(group: Any) -> str:
    """A trained group in the policy's terms: "layers 4-5 of adapter default", "classifier (head)"."""
    parts = []
    if group.layers:
        parts.append(f"layer{'s' if len(group.layers) > 1 else ''} {_ranges(group.layers)}")
    for kind, items in (("heads", group.heads), ("experts", group.experts)):
        for item in items:
            parts.append(f"{kind} {_ranges(item.indices)} of layer {item.layer}")
    parts.extend(f"{name} (outside the layers)" for name in group.outside)
    return f"{', '.join(parts) or 'no parameter'} of adapter{'s' if len(group.adapters) > 1 else ''} " \
           f"{', '.join(group.adapters)}"


def _ranges(values: Sequence[int]) -> str:
    out: list[str] = []
    for value in sorted(values):
        if out and out[-1][1] == value - 1:
            out[-1] = (out[-1][0], value)
        else:
            out.append((value, value))  # type: ignore[arg-type]
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)  # type: ignore[misc]


# -- taint ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class TaintReading:
    """The ledger's answer: the contributions the release trained on that were withdrawn since it was signed
    (`withdrawn`) and before it (`at_release`), and the ledger time of the first of those withdrawals (None when
    there is none)."""

    withdrawn: tuple[str, ...]
    since: int | None
    checked_at: int
    at_release: tuple[str, ...] = ()

    @property
    def tainted(self) -> bool:
        return bool(self.withdrawn or self.at_release)


class TaintWatch:
    """Reads the taint of the served release through `read` (the ledger), at most once per `ttl_s` seconds of
    `clock`, and refuses to serve a tainted release past `grace_s` seconds after its first withdrawal."""

    def __init__(self, read: Callable[[int], TaintReading], *, ttl_s: int, grace_s: int,
                 clock: Callable[[], float]) -> None:
        self._read = read
        self.ttl_s, self.grace_s = ttl_s, grace_s
        self._clock = clock
        self._lock = threading.Lock()
        self._reading: TaintReading | None = None
        self._failed_at: int | None = None
        self.failure: str | None = None  # why the last read failed (for the operator; never sent to a caller)

    def reading(self, *, max_age_s: int | None = None) -> TaintReading:
        """The current reading, read again once it is `ttl_s` old, or `taint_unknown`. With `max_age_s` (a caller
        who need not be authenticated), a reading or a failed read younger than that is reused, so such requests
        never read the ledger more often than once per `max_age_s`."""
        now = int(self._clock())
        age = self.ttl_s if max_age_s is None else max_age_s
        with self._lock:  # one reader at a time; the others wait for its answer
            held = self._reading
            if max_age_s is not None and held is None and self._failed_at is not None \
                    and 0 <= now - self._failed_at < age:
                raise ServeError(Code.TAINT_UNKNOWN, TAINT_UNREADABLE)
            if held is None or now - held.checked_at >= age or now < held.checked_at:
                try:
                    held = self._read(now)
                except Exception as e:  # whatever the reason (the database, a rollback, a fork), no reading: refuse
                    self._reading, self._failed_at, self.failure = None, now, describe_failure(e)
                    log.warning("the release's taint could not be read: %s", self.failure)
                    raise ServeError(Code.TAINT_UNKNOWN, TAINT_UNREADABLE) from e
                self._reading, self._failed_at, self.failure = held, None, None
            return held

    def check(self) -> TaintReading:
        """The reading, or `release_tainted` when the release is tainted beyond its grace period."""
        reading = self.reading()
        if not reading.tainted:
            return reading
        assert reading.since is not None
        now = int(self._clock())
        if self.grace_s and now < reading.since + self.grace_s:
            return reading
        grace = f"its grace period of {self.grace_s} s ended at {reading.since + self.grace_s}" if self.grace_s \
            else "the inference policy grants no grace period"
        parts = [f"{len(names)} contribution(s) it trained on were withdrawn {when} ({_names(names)})"
                 for names, when in ((reading.withdrawn, "since it was signed"),
                                     (reading.at_release, "before it was signed, which a new signature does not "
                                                          "undo")) if names]
        raise ServeError(Code.RELEASE_TAINTED, (
            f"this release is tainted: {'; '.join(parts)}, and {grace}; it is refused until a release of a run "
            "trained without them is served"))

    def grace_until(self, reading: TaintReading) -> int | None:
        """Until when a tainted release is served (None when it is not tainted)."""
        return reading.since + self.grace_s if reading.tainted and reading.since is not None else None


def _names(names: Sequence[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def describe_failure(error: BaseException) -> str:
    """One line saying why a taint read failed, for the server's log and the operator's start-up error."""
    if isinstance(error, GovtrainError):
        return error.line()
    first = str(error).splitlines()[0][:300] if str(error) else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__
