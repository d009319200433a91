"""What a long command shows while it works: a progress bar on a terminal (`progress_text`), and where the
output is a log file or a pipe, where a bar would be one growing line of control codes, a plain line every
`EVERY` seconds (`ProgressLines`).

The clock is injected (`clock=`), so tests drive the lines without waiting.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Mapping

EVERY = 30.0  # seconds between two progress lines in a log

CLOCK: Callable[[], float] = time.monotonic  # the default clock; tests of the command line replace it


def progress_text(step: int, total: int, seconds_per_step: float | None, eps_by_class: Mapping[str, float],
                  loss: float | None = None, nonfinite: int = 0) -> str:
    """What the progress bar shows after `step` of `total` steps: the step, the pace (`seconds_per_step`,
    None before the first step), the time left at that pace, the last loss (nan, an empty batch: not shown)
    and each class's ε as charged so far, which includes the epoch written ahead."""
    parts = [f"step {step}/{total}"]
    if seconds_per_step is not None:
        parts += [f"{seconds_per_step:.2f} s/step", f"ETA {clock_text(seconds_per_step * max(total - step, 0))}"]
    parts += step_details(eps_by_class, loss, nonfinite)
    return " | ".join(parts)


def step_details(eps_by_class: Mapping[str, float], loss: float | None = None, nonfinite: int = 0) -> list[str]:
    """A training step's loss (not an empty batch's nan), the run's units with a non-finite gradient so far (each
    contributed zero; shown once there is one) and each class's ε so far."""
    parts = []
    if loss is not None and loss == loss:
        parts.append(f"loss {loss:.3f}")
    if nonfinite:
        parts.append(f"non-finite units {nonfinite}")
    if eps_by_class:
        parts.append(", ".join(f"{name} ε {eps:.3f}" for name, eps in sorted(eps_by_class.items())))
    return parts


def clock_text(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


class ProgressLines:
    """Progress for a log that is not a terminal: a line through `log` after the first unit of work, then after
    every unit that ends `every` seconds or more after the last line, and (`finish`) one at the end. Each line
    says how far (`what` done/total), the time elapsed, the rate, the time left at that rate and any details
    the caller adds (a loss, ε so far). A unit longer than `every` delays the next line until it ends."""

    def __init__(self, log: Callable[[str], None], total: int, *, what: str = "step", done: int = 0,
                 every: float = EVERY, clock: Callable[[], float] | None = None) -> None:
        self.log, self.total, self.what, self.every = log, total, what, every
        self.clock = clock or CLOCK
        self.started = self.clock()
        self.first = done  # a resumed run's earlier steps are not this process's pace
        self.last: float | None = None  # when the last line was written
        self.done = self.shown = done

    def update(self, done: int, details: Iterable[str] | Callable[[], Iterable[str]] = ()) -> None:
        """`done` units of `total` are done; write a line if one is due. `details` may be a function, called
        only when a line is written."""
        self.done = done
        now = self.clock()
        if self.last is not None and now - self.last < self.every:
            return
        self._write(now, details)

    def finish(self, details: Iterable[str] | Callable[[], Iterable[str]] = ()) -> None:
        """The last line, unless a line already showed this much done."""
        if self.last is None or self.done != self.shown:
            self._write(self.clock(), details)

    def _write(self, now: float, details: Iterable[str] | Callable[[], Iterable[str]]) -> None:
        self.last, self.shown = now, self.done
        self.log(self.line(now, details() if callable(details) else details))

    def line(self, now: float, details: Iterable[str] = ()) -> str:
        elapsed = now - self.started
        parts = [f"{self.what} {self.done}/{self.total}", f"{clock_text(elapsed)} elapsed"]
        units = self.done - self.first
        if units > 0 and elapsed > 0:
            rate = units / elapsed
            parts.append(f"{rate:.2f} {self.what}/s" if rate >= 1 else f"{1 / rate:.2f} s/{self.what}")
            parts.append(f"ETA {clock_text(max(self.total - self.done, 0) / rate)}")
        return " | ".join([*parts, *details])


__all__ = ["EVERY", "ProgressLines", "progress_text", "step_details", "clock_text"]
