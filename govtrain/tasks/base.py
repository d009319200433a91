"""The interface every task implements (`govtrain.tasks`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

# Public text for probes that run before any spend (`govtrain.routing.independence`): no contribution's data.
PROBE_WORDS = ("the cat sat on the mat and the dog ran to the red door while a bird sang in the old green tree by "
               "the river on a good day in the capital of france").split()


def probe_texts() -> list[str]:
    """Three public texts of 2, 7 and 30 words, shortest first: lengths that still differ once tokenized and
    truncated to any max_length of 8 tokens or more."""
    return [" ".join(PROBE_WORDS[:n]) for n in (2, 7, 30)]


@dataclass
class Batch:
    """Model inputs (keyword arguments of the forward) and what the loss needs, on one device."""

    inputs: dict[str, Any]
    targets: Any
    extra: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.targets)


class Task(Protocol):
    name: str
    # True where the loss at a position reads only the tokens before it (next-token prediction): a row's opening
    # then fixes that part of its loss, so a selection refuses rows that share one with an admitted row
    # (`govtrain.data.rows.PrefixIndex`); False where the whole row is read at once (a classifier's pooled output).
    causal: bool

    def example(self, row: Mapping[str, Any], where: str) -> Any:
        """One example from one data row, or ConfigError(BAD_DATA) naming `where` (file:row)."""

    def check(self, examples: Sequence[Any], tokenizer: Any, max_length: int) -> None:
        """ConfigError(BAD_DATA) naming the first example `encode` could not use (e.g. one truncation would
        leave without a target); called before a run writes any spend."""

    def encode(self, examples: Sequence[Any], tokenizer: Any, max_length: int, device: Any) -> Batch:
        """The batch of `examples`, tokenized, padded and truncated to `max_length`, on `device`."""

    def per_example_loss(self, output: Any, batch: Batch) -> Any:
        """[len(batch)] float32 losses, each depending on its own example only."""

    def probe_examples(self) -> Sequence[Any]:
        """Public examples of different lengths (`probe_texts`), shortest first, that `encode` accepts: the
        batch-independence probe runs them alone and in batches before a run writes any spend."""

    def tally(self, output: Any, batch: Batch) -> dict[str, float]:
        """Counts an evaluation sums over batches (examples, correct answers, target tokens, summed loss)."""

    def report(self, totals: Mapping[str, float]) -> dict[str, Any]:
        """The evaluation's figures from the summed counts of every batch (`govtrain eval`)."""
