"""What the step benchmark (bench/step.py) and the utility benchmark (bench/utility.py) share: the three kinds
of training step (non-private, governed through the routing layer, Opacus), the policy class and run file
they are built from, the device's clock and memory readings, and a line naming the machine.

Benchmarks only: every seed here is fixed (`insecure_seed`) so that variants are comparable; nothing here is
a private run.
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
import warnings
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F

from govtrain.errors import Code, ConfigError
from govtrain.mechanisms.update import Update
from govtrain.policy.model import DataClass, DepthProfile
from govtrain.resolver.model import describe
from govtrain.resolver.profile import resolve
from govtrain.routing.router import Router
from govtrain.train.config import RunFile

TARGETS = ["query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense"]
Autocast = Callable[[], ContextManager]


def data_class(name: str, **profile) -> DataClass:
    """A policy class of one depth profile (band=…, fraction_u=…, layers=… or adapter=…; head=…). Its clip
    norm, noise floor and budgets are placeholders: a benchmark passes C and σ to the step itself."""
    kind = next(k for k in ("band", "fraction_u", "layers", "adapter") if k in profile)
    return DataClass(name=name, clip_norm_u=1_000_000, min_noise_multiplier_u=1_000_000, eps_budget_u=1_000_000,
                     max_eps_budget_u=1_000_000, profile=DepthProfile(kind=kind.removesuffix("_u"), **profile))


def run_file(mechanism: str, *, lr: float = 1e-4, head_lr: float | None = None, mechanism_lr: float | None = None,
             targets=TARGETS, max_length: int = 128, pooling: str = "model") -> RunFile:
    """A RUN.toml for `mechanism`: AdamW at `lr` (for prism and dp-muon, on what their own update does not
    move) and `head_lr` for the head, and `mechanism_lr` for [prism] or [muon] (their defaults when None)."""
    own = {} if mechanism_lr is None else {"lr": mechanism_lr}
    sections = {"prism": {"prism": own}, "dp-muon": {"muon": own}}.get(mechanism, {})
    optimizer = {"name": "adamw", "lr": lr, **({} if head_lr is None else {"head_lr": head_lr})}
    return RunFile.model_validate({
        "model": {"base": "minilm", "max_length": max_length, "pooling": pooling},
        "lora": {"r": 8, "alpha": 16, "target_modules": list(targets)},
        "optimizer": optimizer,
        "training": {"mechanism": mechanism, "steps": 1, "data": "d", "output": "o"}, **sections})


def adamw(model, lr: float, head_lr: float | None) -> torch.optim.Optimizer:
    """AdamW over `model`'s trainable parameters as `govtrain train` builds it (`make_optimizer`): the head,
    outside the layer stack, at `head_lr` when given, the rest at `lr`."""
    from govtrain.mechanisms.update import make_optimizer
    from govtrain.train.config import OptimizerSection

    return make_optimizer(OptimizerSection(name="adamw", lr=lr, head_lr=head_lr),
                          {n: p for n, p in model.named_parameters() if p.requires_grad})


def autocast(device: str, precision: str) -> ContextManager:
    """The forward pass's precision, as `govtrain train` sets it: bf16 autocast, or nothing (fp32)."""
    if precision == "bf16":
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def sync(device: str) -> None:
    """Wait for the device, so that a host clock read next times the work queued before it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def classification_losses(output, labels):
    """Each example's cross-entropy against its label: the per-example loss of a sequence classifier."""
    return F.cross_entropy(output.logits.float(), labels, reduction="none")


def causal_lm_losses(output, targets):
    """Each example's mean next-token cross-entropy over its target tokens (`targets`: [B, T], -100 elsewhere),
    as `task = "causal-lm"` computes it."""
    from govtrain.tasks import Batch, CausalLM

    return CausalLM().per_example_loss(output, Batch({}, targets))


Losses = Callable[..., torch.Tensor]


class NonPrivate:
    """Mean loss, `backward()`, AdamW: the reference every private step is compared with."""

    name = "non-private"

    def __init__(self, model, *, lr: float = 1e-4, head_lr: float | None = None,
                 autocast: Autocast = contextlib.nullcontext, losses: Losses = classification_losses) -> None:
        self.model, self.autocast, self.losses = model, autocast, losses
        self.optimizer = adamw(model, lr, head_lr)

    def step(self, inputs, labels) -> None:
        with self.autocast():
            output = self.model(**inputs)
        self.losses(output, labels).mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class Governed:
    """A step as `govtrain train` takes it, without a ledger: per-example losses (`losses`; classification's by
    default) privatized by the routing layer (the samples' classes cycled over `classes`, each clipped to `clip`,
    noise σ·C per group, divided by `expected_batch`, or by the batch's own size when None), then the mechanism's
    `Update`. An empty batch releases noise alone. `compiled`: the router's clipping stage as a graph
    (`routing.compiled`). `privatizer`: the router's noise (`govtrain.privatizers`; None: the i.i.d. Gaussian)."""

    def __init__(self, model, classes: dict[str, DataClass], run: RunFile, *, noise_multiplier: float = 1.0,
                 clip: float = 1.0, expected_batch: float | None = None, name: str | None = None,
                 autocast: Autocast = contextlib.nullcontext, seed: int = 0,
                 losses: Losses = classification_losses, compiled: bool = False, privatizer=None) -> None:
        self.model, self.autocast, self.losses = model, autocast, losses
        self.name = name or run.training.mechanism
        if run.noise.microbatches != 1:  # `step` privatizes each batch whole, with one noise per group
            raise ConfigError(Code.PRIVATIZER_UNSUPPORTED, f"the bench harness takes one noise per step, not "
                                                           f"[noise] microbatches = {run.noise.microbatches}: use "
                                                           "govtrain train or GovernedRun for per-microbatch noise")
        resolution = resolve(classes, describe(model))
        self.router = Router(model, resolution, mechanism=run.training.mechanism, insecure_seed=seed,
                             compiled=compiled, privatizer=privatizer)
        self.classes, self.clip, self.expected_batch = list(classes), clip, expected_batch
        self.std = {g.classes: noise_multiplier * clip for g in resolution.groups if g.classes}
        self.update = Update.build(model, run)

    def step(self, inputs, labels, units: list[int] | None = None) -> None:
        """`units`: the contribution of each example (privacy_unit = "contribution", numbered from 0 in order),
        whose examples are averaged and clipped together; None: each example on its own."""
        size = labels.shape[0]
        expected = float(self.expected_batch or size)
        if size == 0:
            self.router.noise_only(self.std, expected)
        else:
            clipped = size if units is None else max(units) + 1
            classes = [self.classes[i % len(self.classes)] for i in range(clipped)]
            with self.router.capture(classes, units), self.autocast():  # each example through its class's adapters
                output = self.model(**inputs)
            losses = self.losses(output, labels)
            self.router.privatize(losses, classes, [self.clip] * clipped, self.std, expected, units=units)
        self.update.step(self.router.noise_std)
        self.update.zero_grad()


class OpacusStep:
    """Opacus's DP-SGD on the model's trainable parameters: `GradSampleModule` (hooks) for per-sample
    gradients, `DPOptimizer` for flat clipping to `clip`, Gaussian noise σ·C and division by the expected batch
    size, then AdamW. σ is given: Opacus's accountant is not used. Raises ImportError without opacus."""

    name = "opacus"

    def __init__(self, model, *, expected_batch: int, lr: float = 1e-4, head_lr: float | None = None,
                 noise_multiplier: float = 1.0,
                 clip: float = 1.0, autocast: Autocast = contextlib.nullcontext,
                 generator: torch.Generator | None = None) -> None:
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer

        self.params = [p for p in model.parameters() if p.requires_grad]
        inner = adamw(model, lr, head_lr)  # before wrapping: the parameter names are the model's own
        # Opacus records activations in training mode only (`step` sets it), so dropout must be off in the model
        self.model, self.autocast = GradSampleModule(model, batch_first=True, loss_reduction="mean"), autocast
        self.optimizer = DPOptimizer(inner, noise_multiplier=noise_multiplier,
                                     max_grad_norm=clip, expected_batch_size=expected_batch, loss_reduction="mean",
                                     generator=generator)

    def step(self, inputs, labels) -> None:
        self.model.train()  # an evaluation in between (model.eval()) would stop the recording
        if labels.shape[0] == 0:  # an empty Poisson batch: no per-sample gradient, noise alone
            for p in self.params:
                p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
        else:
            with self.autocast():
                logits = self.model(**inputs).logits
            with warnings.catch_warnings():  # Opacus's hooks fire on module outputs when the inputs are frozen
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                F.cross_entropy(logits.float(), labels).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def rss_mb() -> float:
    """Peak resident memory of this process so far (VmHWM), in MB."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def report_rss_growth(steps: Callable[[], None]) -> None:
    """Run `steps` and print how much they grew the process's peak RSS, for `rss_growth_in_child`."""
    before = rss_mb()
    steps()
    print(f"MEMORY {rss_mb() - before:.1f}")


def rss_growth_in_child(argv: list[str]) -> float:
    """Peak RSS growth in MB that `python argv…` reports through `report_rss_growth`: each variant measured in a
    process of its own, since a process's peak never comes down."""
    out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, check=True).stdout
    return float(next(line.split()[1] for line in out.splitlines() if line.startswith("MEMORY")))


def machine(device: str) -> str:
    """The machine a figure was measured on: the GPU's name, or the CPU's model and cores; torch's version."""
    if torch.device(device).type == "cuda":
        index = torch.device(device).index or 0
        properties = torch.cuda.get_device_properties(index)
        where = f"{properties.name} ({properties.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}"
    else:
        model = platform.processor() or platform.machine()
        with contextlib.suppress(OSError), open("/proc/cpuinfo") as handle:
            model = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), model)
        where = f"{model}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    return f"{where}; torch {torch.__version__}, Python {platform.python_version()}"
