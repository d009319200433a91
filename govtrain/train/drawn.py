"""A draw as the run and its guard both hold it: the run's own record of a logical step's draw (`Drawn`), each
chunk of it handed out as a batch (`GovernedBatch`), and the batch handed out and not yet stepped (`Waiting`, its
tensors as drawn).

`governed.py` hands the batches out (`govtrain.GovernedBatch` is documented there) and `guard.py` checks them;
both read these records, so they live below both (neither imports the other's module for them). A chunk is read
through `DrawnChunk`, the fields of `run.Chunk` a draw's record is read by, so that this module needs no `Run`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol, Sequence

import torch
from torch import Tensor

from govtrain.tasks.base import Batch

NOT_YOURS = ("the accountant's q holds only for batches govtrain's Poisson sampler drew: iterate run.batches() "
             "and put your data in training.data")


@dataclass
class GovernedBatch(Batch):
    """One physical chunk of a logical Poisson step: the model's keyword `inputs` and the task's `targets`
    on the run's device. `step` counts logical steps over the whole run; `chunk` of `chunks` places this one
    in its step (the optimizer moves after the last). The place is read-only and only says what the run's own
    record of the draw says: nothing written into a batch changes how it is clipped or when its step ends."""

    _place: tuple[int, int, int] = field(default=(0, 0, 1), repr=False, compare=False)
    _rehearsal: bool = field(default=False, repr=False, compare=False)

    @property
    def rehearsal(self) -> bool:
        """Whether this chunk is of the rehearsal (`rehearsal.py`): synthetic rows, never a contribution's, handed
        out before the run writes any spend; stepping it moves nothing. Read-only, as the place is: the run's own
        record of the draw says which chunks are the rehearsal's."""
        return self._rehearsal

    @property
    def step(self) -> int:
        return self._place[0]

    @property
    def chunk(self) -> int:
        return self._place[1]

    @property
    def chunks(self) -> int:
        return self._place[2]

    @property
    def last(self) -> bool:
        return self.chunk == self.chunks - 1


class DrawnChunk(Protocol):
    """One physical chunk of a drawn step as its record is read (`run.Chunk`): its examples, their units,
    contributions, classes, signed clipping norms and microbatch."""

    indices: list[int]
    units: list[int] | None
    owners: list[str]
    classes: list[str]
    clips: list[float]
    microbatch: int


@dataclass
class Drawn:
    """One logical step as the sampler drew it: the run's own copies of its chunks, and the next to hand out; or
    the rehearsal (`rehearsal.py`), whose chunks index its synthetic rows and whose sums are dropped."""

    step: int
    chunks: Sequence[DrawnChunk]
    next: int = 0
    rehearsal: bool = False


@dataclass
class Waiting:
    """The batch handed out and not yet stepped: its chunk (the run's copy) and place, and its tensors as drawn
    (where in the batch, the tensor, its version counter, a copy of its values)."""

    batch: GovernedBatch
    chunk: DrawnChunk
    last: bool
    inputs: dict[str, Tensor]
    drawn: list[tuple[str, Any, int, Tensor]] = field(default_factory=list)
    ids: Tensor | None = None  # the drawn input_ids' values, which the input embedding must receive
    forwarded: bool = False
    embedded: bool = False

    @classmethod
    def of(cls, batch: GovernedBatch, draw: Drawn) -> "Waiting":
        inputs = {k: v for k, v in batch.inputs.items() if isinstance(v, Tensor)}
        tensors = {f"batch.inputs[{k!r}]": v for k, v in inputs.items()}
        tensors.update(tensors_in(batch.targets, "batch.targets"))
        tensors.update(tensors_in(batch.extra, "batch.extra"))
        drawn = [(where, v, v._version, v.detach().clone()) for where, v in tensors.items()]
        ids = next((values for where, _, _, values in drawn if where == "batch.inputs['input_ids']"), None)
        return cls(batch, draw.chunks[draw.next], draw.next == len(draw.chunks) - 1, inputs, drawn, ids)

    def changed(self) -> str | None:
        """Which tensor of the batch is not as drawn, or None."""
        batch = self.batch
        now = {f"batch.inputs[{k!r}]": v for k, v in batch.inputs.items() if isinstance(v, Tensor)}
        now.update(tensors_in(batch.targets, "batch.targets"))
        now.update(tensors_in(batch.extra, "batch.extra"))
        drawn = {where for where, *_ in self.drawn}
        for where in sorted(set(now) - drawn):
            return f"{where} was added after the batch was drawn"
        for where, tensor, version, values in self.drawn:
            if now.get(where) is not tensor:
                return f"{where} was replaced after the batch was drawn"
            if tensor._version != version or tensor.shape != values.shape or not torch.equal(tensor, values):
                return f"{where} was written after the batch was drawn"
        return None


def leaves(value: Any, where: str) -> Iterator[tuple[str, Any]]:
    """(where, value) of every leaf of `value`, lists, tuples and dicts opened."""
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from leaves(item, f"{where}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, f"{where}[{key!r}]")
    else:
        yield where, value


def tensors_in(value: Any, where: str) -> dict[str, Tensor]:
    return {w: v for w, v in leaves(value, where) if isinstance(v, Tensor)}
