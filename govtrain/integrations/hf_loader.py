"""The Trainer's training data from a `GovernedRun` (`integrations/hf.py`): one `LogicalStep` per Trainer step, the
chunks of one logical Poisson step of the run, drawn one at a time as the training step asks, and the loader that
yields them (`GovernedLoader`), so the Trainer never samples, collates or accumulates a batch of its own.
"""

from __future__ import annotations

from typing import Iterator

from govtrain.train.governed import GovernedBatch, GovernedRun


class LogicalStep:
    """One Trainer step's input: the chunks of one logical Poisson step, drawn one at a time as the training
    step asks (the run hands out a chunk only once the one before is stepped). Under several processes, a step
    this rank already took with an empty share of the draw (`first` None: `idle`) has no chunks."""

    def __init__(self, first: GovernedBatch | None, batches: Iterator[GovernedBatch | None]) -> None:
        self.first, self._batches = first, batches

    @property
    def idle(self) -> bool:
        return self.first is None

    def __iter__(self) -> Iterator[GovernedBatch]:
        batch = self.first
        if batch is None:
            return
        yield batch
        while not batch.last:
            batch = next(self._batches)
            assert batch is not None  # None comes only between logical steps
            yield batch

    def __contains__(self, key: object) -> bool:  # the Trainer looks for "labels" or "input_ids" in a batch
        return False


class GovernedLoader:
    """The training loader: one `LogicalStep` per remaining logical step of the run, in order, but for the
    empty draws, which the run steps between two of them. Under several processes every rank yields one for
    each draw that any rank had examples of, so each rank's Trainer takes as many steps, at the same draws, and
    the Trainer's own collectives (the logged loss gathered across ranks) meet between the run's."""

    def __init__(self, run: GovernedRun) -> None:
        self.run = run

    def __len__(self) -> int:
        return max(self.run.total_steps - self.run.steps, 0)

    def __iter__(self) -> Iterator[LogicalStep]:
        batches = self.run._batches(idle=True)
        for first in batches:
            yield LogicalStep(first, batches)
