"""The rehearsal: one logical step of synthetic rows through the user's own loop before the run spends anything.

A loop's bugs used to cost a ledger epoch: a script that crashed at its first step (a mean loss, a second
forward, an exception of its own) had already written that epoch's spend ahead (issue 21). Now the first
logical step `run.batches()` hands out is a rehearsal (`batch.rehearsal is True`), and the first epoch's spend
is written only once its last chunk was stepped. Its rows are synthetic: random tokens of the tokenizer's
vocabulary at several lengths (so padding and truncation run), random labels, never a contributed row (a row
equal to an admitted example is drawn again), spread over the classes of the run's contributions with each
class's public clipping norm, so every class's profile is routed (a row runs through the default adapter and
the adapter of the class it is given, as a real row of that class would: `routing/adapters.py`). One of its
chunks is full: as many rows as the largest chunk a real step is likely to hand out (`full_chunk_rows`), each at
`max_length` tokens, so a failure that depends on a chunk's size (out of memory on the device) is met before any
spend.

It runs every check a real step runs, on the same code: the guard at its forward, the loss's shape and type,
the router's per-sample gradients, layout and coverage, and clipping (`Router.accumulate`). Then its sums are
dropped (`Router.begin`): no noise is drawn, no update runs, so no parameter and no optimizer state moves, and
nothing is written to the ledger or the output folder. Its last chunk holds one of the first chunk's rows alone,
unpadded: the loop's loss for that row must be the same in both (`check_alone`), or an example's loss depends on
the other examples of its batch (a loss normalised over the batch, left padding; `batch_coupled`). Its forwards
run in eval mode at full fp32 matmul precision, so that dropout or TF32 rounding is not taken for coupling.
Torch's global random state is put back as it was, so a seeded run trains as it would have without it.

The rehearsal proves the loop runs; it guards nothing. Every real step runs the checks of a step again (the
guard, the loss's shape and type, the router's per-sample gradients, layout, coverage and clipping), and code
that tells the rehearsal apart (`batch.rehearsal`) gains nothing by it: what the rehearsal computes never leaves
it. The one exception is the batch-coupling comparison (`check_alone`): it needs a row's loss alone and in a
batch, so it runs on the rehearsal only. A loop that couples its losses on real batches alone (telling them
apart by `batch.rehearsal` or by their rows) is not refused by it; its per-example gradients are then not each
one example's, and the clipping bound the accountant relies on does not hold. That is code written against
the run, like patching the library: out of reach of a check.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from govtrain import units
from govtrain.errors import Code, ConfigError
from govtrain.tasks.base import PROBE_WORDS

# Honest differences between a row's loss alone and padded in a batch, measured on CPU over 5 rehearsals each: the
# tiny test BERT 0 (fp32 and bf16); the demo's MiniLM with mean pooling at most 3.0e-7 in fp32 and 1.2e-3 under
# bf16 autocast (the padded and unpadded matmuls round differently). A loss normalised over the rehearsal's batch
# (its sum, its mean, its size) differs by 0.5 and more.
TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}


@dataclass
class Rehearsal:
    """The rehearsal's rows (the task's examples), its chunks (`run.Chunk`, indices into `examples`), where one
    row sits padded in a batch and alone (chunk, position) twice, and the loop's losses as each chunk was stepped."""

    examples: list[Any]
    chunks: list[Any]
    batched: tuple[int, int]
    alone: tuple[int, int]
    losses: dict[int, list[float]] = field(default_factory=dict)

    def check_alone(self, precision: str) -> None:
        """Refuse (`batch_coupled`) a loop whose loss for the row alone differs from its loss in the batch."""
        (i, p), (j, k) = self.batched, self.alone
        if i == j or i not in self.losses or j not in self.losses:
            return
        inside, alone = self.losses[i][p], self.losses[j][k]
        scale = max(abs(inside), abs(alone), 1e-12)
        difference = abs(inside - alone) / scale if inside == inside and alone == alone else float("nan")
        if difference != difference:
            raise ValueError(f"your loop's loss for the rehearsal's row {self.chunks[i].indices[p] + 1} is {inside:g} "
                             f"in a batch and {alone:g} alone: check the loss your loop computes (nothing was spent)")
        if not difference <= TOLERANCE[precision]:
            raise ConfigError(Code.BATCH_COUPLED, f"the rehearsal's row {self.chunks[i].indices[p] + 1} has loss "
                                                  f"{inside:.6g} in a padded batch of {len(self.chunks[i].indices)} "
                                                  f"and {alone:.6g} alone ({difference:.3g} relative, at most "
                                                  f"{TOLERANCE[precision]:g} passes): your loop's per-example loss "
                                                  "depends on the other examples of its batch (a loss normalised "
                                                  "over the batch, its mean or token count, left padding, a model "
                                                  "that ignores attention_mask); give each example a loss of its "
                                                  "own. Nothing was spent")


def full_chunk_rows(*, physical_batch: int | None, expected_batch: float, per_contribution: int | None,
                    examples: int) -> int:
    """How many rows the rehearsal's full chunk holds: the largest chunk a real step is likely to hand out.
    `physical_batch` rows, or with it unset the whole logical batch at its likely largest: the expected batch plus
    four standard deviations of the Poisson draw (sqrt of the mean; exceeded about once in 30,000 steps for a
    batch of 16, more rarely for larger ones), in sampling units (examples, or contributions of at most
    `per_contribution` examples each). Never more than that likely largest draw, nor than the run's `examples`."""
    likely = math.ceil(expected_batch + 4 * math.sqrt(expected_batch)) * (per_contribution or 1)
    rows = likely if physical_batch is None else min(physical_batch, likely)
    return max(1, min(rows, examples))


def synthetic_examples(task: Any, tokenizer: Any, max_length: int, count: int, *, seed: bytes,
                       admitted: Sequence[Any] = (), lengths: Sequence[int] | None = None) -> list[Any]:
    """`count` examples of the task's own kind (its public probe examples, their text replaced) made of random
    tokens of the tokenizer's vocabulary, at cycling `lengths` (default 2 tokens, about a third of `max_length`
    and past it, cut there); a label, where the example has one, at random. None equals an example of
    `admitted`."""
    import numpy as np

    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(seed).digest()[:8], "big"))
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    vocabulary = np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)
    shapes = list(task.probe_examples())
    labels = getattr(task, "num_labels", None)
    lengths = tuple(lengths) if lengths else (2, max(3, max_length // 3), max_length + 4)
    seen = {_key(e) for e in admitted}
    examples: list[Any] = []
    for k in range(count):
        shape = shapes[k % len(shapes)]
        for _ in range(100):
            ids = rng.choice(vocabulary, size=lengths[k % len(lengths)]).tolist() if len(vocabulary) else []
            text = tokenizer.decode(ids, skip_special_tokens=True).strip() if ids else ""
            if not text:
                text = " ".join(rng.choice(PROBE_WORDS, size=lengths[k % len(lengths)]).tolist())
            changes: dict[str, Any] = {"text": text}
            if labels is not None and hasattr(shape, "label"):
                changes["label"] = int(rng.integers(labels))
            example = dataclasses.replace(shape, **changes)
            if _key(example) in seen:
                continue
            try:  # e.g. a causal row whose tokens merged into one: no target left
                task.check([example], tokenizer, max_length)
            except ConfigError:
                continue
            break
        else:  # pragma: no cover - 100 draws of random tokens, each an admitted row or unusable
            raise RuntimeError("could not draw a usable rehearsal row that is not an admitted example")
        examples.append(example)
    return examples


def plan_rehearsal(examples: list[Any], classes: Mapping[str, float], *, chunk: int | None,
                   per_contribution: int | None, Chunk: type, full: int = 0) -> Rehearsal:
    """The rehearsal's chunks: every row but the last `full` in order (longest first, then the shortest, so that
    it is padded), in chunks of at most `chunk` rows, each row its own clipping unit with a class of `classes`
    (name -> public clipping norm) in turn; then the last `full` rows as one chunk (the full chunk: a real
    chunk's size at `max_length`); then the shortest row alone."""
    small = len(examples) - full
    order = sorted(range(small), key=lambda i: -len(getattr(examples[i], "text", "")))
    order = [order[0], order[-1], *order[1:-1]] if len(order) > 2 else order
    names = sorted(classes)
    size = chunk or len(order)
    chunks = []
    for start in range(0, len(order), size):
        part = order[start:start + size]
        chosen = [names[(start + i) % len(names)] for i in range(len(part))]
        chunks.append(Chunk(part, None if per_contribution is None else list(range(len(part))),
                            ["rehearsal"] * len(part), chosen, [classes[n] for n in chosen]))
    shortest = order[1] if len(order) > 1 else order[0]
    batched = next((c, p) for c, part in enumerate(chunks) for p, i in enumerate(part.indices) if i == shortest)
    name = chunks[batched[0]].classes[batched[1]]
    if full:
        part = list(range(small, len(examples)))
        chosen = [names[i % len(names)] for i in range(full)]
        chunks.append(Chunk(part, None if per_contribution is None else list(range(full)), ["rehearsal"] * full,
                            chosen, [classes[n] for n in chosen]))
    chunks.append(Chunk([shortest], None if per_contribution is None else [0], ["rehearsal"], [name], [classes[name]]))
    if len(chunks[batched[0]].indices) == 1:  # a physical batch of one: no batch to compare with
        batched = (len(chunks) - 1, 0)
    return Rehearsal(examples, chunks, batched, (len(chunks) - 1, 0))


def class_clips(policy: Any, classes: Sequence[str]) -> dict[str, float]:
    """Each of `classes` with its policy's public clipping norm."""
    return {name: policy.classes[name].clip_norm_u / units.MICRO for name in sorted(set(classes))}


def rehearsal_seed(insecure_seed: int | None) -> bytes:
    return os.urandom(16) if insecure_seed is None else b"govtrain rehearsal %d" % insecure_seed


def _key(example: Any) -> Any:
    try:
        hash(example)
    except TypeError:
        return repr(example)
    return example
