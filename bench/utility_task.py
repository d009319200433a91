"""The utility bench's task and records (`bench/utility.py`): the constants every row shares, the movie-split task
(`movie_task`), what every row trains (`Setup`) and where (`Performance`), and each run's `Trial` and each
method's `Row`.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import numpy as np  # noqa: E402

METHODS = ("non-private", "dpsgd", "prism", "dp-muon", "opacus", "banded-mf")
BANDS = (2, 3, 4, 6, 8, 16)  # the bands banded-mf may take; `choose_bands` picks one per ε from public numbers
CLIP = 0.5
DELTA = 1e-5
HEAD_LR = 0.02  # the classifier head's AdamW learning rate in every row (`optimizer.head_lr`, as the demo)
POOLING = "mean"  # MiniLM is a sentence-transformers model: the masked mean of its tokens (`model.pooling`)
TUNING = "tuned on a validation split of training movies; tuning itself is not charged"

Texts = tuple[list[str], list[int]]


@dataclass(frozen=True, kw_only=True)
class Task:
    train: Texts
    validation: Texts
    heldout: Texts
    movies: tuple[int, ...] = ()  # the movie (a contribution, under --unit contribution) of each training snippet

    def contributions(self) -> list[np.ndarray]:
        """Each training movie's snippet indices: one contribution per movie."""
        movies = np.asarray(self.movies)
        return [np.flatnonzero(movies == m) for m in range(int(movies.max()) + 1)] if len(movies) else []

    @property
    def majority(self) -> float:
        """The held-out accuracy of always answering the held-out set's most frequent label."""
        labels = self.heldout[1]
        return max(labels.count(label) for label in set(labels)) / len(labels)


@dataclass(frozen=True, kw_only=True)
class Setup:
    """What every row trains: the task, the model (`load(seed)`: a fresh LoRA model with dropout off, and its
    tokenizer), the band of layers the class reaches (plus the head), and for how long. Steps and batch set
    q and T, so they belong to the privacy side; `Performance` never changes what is released."""

    task: Task
    load: Callable[[int], tuple]
    band: tuple[int, int]
    max_length: int
    steps: int
    batch: int  # expected units per step: examples, or contributions under unit = "contribution"
    seed: int = 0
    unit: str = "example"  # the privacy unit: "example", or "contribution" (one movie's snippets)
    per_contribution: int = 8  # examples_per_contribution: the most snippets a drawn movie uses per step

    @property
    def sampling_rate(self) -> float:
        units = len(self.task.contributions()) if self.unit == "contribution" else len(self.task.train[0])
        return self.batch / units


@dataclass(frozen=True, kw_only=True)
class Performance:
    """Where and at what precision the steps are computed: never what they release."""

    device: str = "cpu"
    precision: str = "fp32"


@dataclass(frozen=True, kw_only=True)
class Trial:
    lr: float
    validation: float
    seconds_per_step: float
    memory_mb: float | None  # CUDA: peak allocated during the run, its weights included; None on the CPU


@dataclass(frozen=True, kw_only=True)
class Row:
    method: str
    epsilon: float | None  # None: non-private
    sigma: float | None
    trials: tuple[Trial, ...]
    chosen: Trial
    heldout: float
    memory_mb: float | None  # on the CPU, the method's peak RSS growth measured in a process of its own
    bands: int | None = None  # banded-mf: the strategy's bands


def movie_task(validation_max: int | None = None, seed: int = 0) -> Task:
    """Every labelled snippet, split by movie: bucket 9 of 10 held out, bucket 8 validation, the rest training;
    the validation set cut to `validation_max` snippets (a fixed draw) when given."""
    from prepare_data import LABELS, bucket, load_rows

    parts: dict[str, Texts] = {"train": ([], []), "validation": ([], []), "heldout": ([], [])}
    movies: dict[str, int] = {}
    owner: list[int] = []
    for row in load_rows():
        which = bucket(row["movie_name"], 10)
        side = parts["heldout" if which == 9 else "validation" if which == 8 else "train"]
        side[0].append(row["text"])
        side[1].append(LABELS[row["category"]])
        if side is parts["train"]:
            owner.append(movies.setdefault(row["movie_name"], len(movies)))
    texts, labels = parts["validation"]
    if validation_max is not None and len(texts) > validation_max:
        keep = sorted(random.Random(seed).sample(range(len(texts)), validation_max))
        parts["validation"] = ([texts[i] for i in keep], [labels[i] for i in keep])
    return Task(**parts, movies=tuple(owner))
