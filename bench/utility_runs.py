"""The utility bench's runs (`bench/utility.py`): a fresh LoRA MiniLM per run, each method's step on it (`start`),
the Poisson draws every private row shares (`draws`), training and scoring one run (`trial`), the best of a
learning-rate grid (`tune`), banded-mf's bands (`choose_bands`) and every method at every ε (`run_rows`).
"""

from __future__ import annotations

import gc
import importlib.util
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
from harness import Governed, NonPrivate, OpacusStep, autocast, data_class, run_file, sync  # noqa: E402
from utility_task import (BANDS, CLIP, DELTA, HEAD_LR, METHODS, POOLING, Performance, Row, Setup,  # noqa: E402
                          Trial)


def accuracy(model, tokenizer, texts: list[str], labels: list[int], max_length: int) -> float:
    """Accuracy on (texts, labels), scored by `govtrain eval`'s own function: every row and the demo alike."""
    examples = [Labelled(text, label) for text, label in zip(texts, labels)]
    return evaluate(model, tokenizer, Classification(num_labels=2), examples, max_length, batch_size=64)["accuracy"]


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
