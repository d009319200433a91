"""The routing layer (docs/design.md §5): per-sample gradients restricted to each sample's depth profile,
clipped jointly to its own C_i, summed, noised per parameter group, divided by the expected batch size.

    router = Router(model, resolution)               # refuses a trainable parameter no hook covers
    with router.capture(classes):                    # each example through its own class's adapters only
        logits = model(**batch).logits
    losses = F.cross_entropy(logits, labels, reduction="none")   # one loss per example
    router.privatize(losses, classes, clip_norms, group_std, expected_batch_size)
    optimizer.step()

Every tapped call must have the batch first (`routing/layout.py`: a call on a tensor the batch shares,
such as DeBERTa's relative embeddings, or a sequence-first one cannot be split per sample). `probe` refuses
any other call before a run spends anything, and every `privatize` checks again (`routing_uncovered`):

    router.probe(layout.probe_batches(tokenizer, max_length))   # two batch sizes, neither the sequence length

A module called more than once in a forward (a reused LayerNorm, a projection shared across layers)
contributes each call to its samples' gradients. A trainable parameter several modules hold (tied
embeddings) gets the sum of every holder's per-sample gradient before the norm (`persample.Shared`, formed
whole per chunk). BatchNorm that mixes the examples of a batch is refused. What the router covers, and
what it refuses, is `coverage.py`. In a captured forward each example runs through the default adapter and its
own class's adapters only, never another class's (`adapters.py`): `capture` takes the examples' classes.

`privatize` never calls `loss.backward()`: it asks autograd for the gradients of the tapped modules'
*outputs* (`torch.autograd.grad`), so no parameter's `.grad` is written by anyone else. When it
returns, each reachable parameter's `.grad` holds the privatized gradient and nothing per-sample is
kept. A parameter that no class reaches gets `.grad = None`, so SGD, Adam and AdamW leave it and its
optimizer state untouched. Noise is drawn from a generator seeded from the operating system's
entropy; a fixed seed exists only as `insecure_seed`.

The mechanism (RUN.toml `training.mechanism`) changes what a sample's gradient is measured and noised in,
never who reaches what or how much noise a group gets (so the accounting is DP-SGD's for all three):

- `dpsgd`: the joint Euclidean norm over the sample's profile, clipped to C_i; N(0, s_g²) per coordinate.
- `prism`: each LoRA pair's per-sample gradient G_i is measured by its intrinsic norm ‖P_{A,B}(G_i)‖_F,
  the norm of its part in the tangent space of the rank-r manifold (`mechanisms.prism.projected_sq_norm`),
  jointly with the Euclidean norm of the profile's other parameters. The clipped sum is lifted to the
  tangent space once (the lift is linear, so this is the sum of the per-sample lifts) and gets the
  isotropic tangent Gaussian with the group's s_g: a Gaussian mechanism on the tangent space with
  sensitivity C_i. `.grad` holds the canonical lift (lora_B.grad = dA, lora_A.grad = dBᵀ). The pairs
  are measured, summed, lifted and noised as stacks of one shape (`routing.tangent`).
  Every class must reach a LoRA pair whole or not at all (a heads profile splits one: refused).
- `dp-muon`: every parameter the sample's profile reaches is clipped on its own to C_i/√L_i (L_i of
  them), so the joint norm stays at most C_i and the group noise s_g ≥ σ_i·C_i covers it as one mechanism
  (`mechanisms.muon`).

Here: the `Router` itself, its clipping stage (`_clip`) and its audit-only extension point. What its hooks record
is `taps.py`; a chunk's argument checks and backward `chunk.py`; the noise and the write of `.grad` `release.py`.
"""

from __future__ import annotations

import sys

from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from govtrain.distributed.world import World
from govtrain.errors import Code, ConfigError
from govtrain.mechanisms import MECHANISMS
from govtrain.privatizers import entropy
from govtrain.privatizers.base import Privatizer
from govtrain.privatizers.gaussian import IIDGaussian
from govtrain.resolver.reach import check_reach, lora_pairs
from govtrain.resolver.profile import Resolution
from govtrain.routing import compiled as compiled_routing
from govtrain.routing import chunk, coverage, layout, materialized, microbatch, persample, release, slots, taps
from govtrain.routing.chunk import StepReport
from govtrain.routing.adapters import AdapterRoutes
from govtrain.routing.tangent import TangentStacks


# The one type `Router.inject_audit_canaries` takes: `DiracCanaries` of `govtrain.audit.canaries`, the class itself.
# The audit sits above routing, so the router reads the class from the loaded module rather than importing it (an
# import would point back up); no registration call exists that code of a user's loop could make first.
_AUDIT_MODULE, _AUDIT_CLASS = "govtrain.audit.canaries", "DiracCanaries"


def _audit_canaries_type() -> type | None:
    module = sys.modules.get(_AUDIT_MODULE)
    return getattr(module, _AUDIT_CLASS, None) if module is not None else None


class Router:
    def __init__(self, model: nn.Module, resolution: Resolution, *, mechanism: str = "dpsgd",
                 insecure_seed: int | None = None, per_sample: str = "auto", privatizer: Privatizer | None = None,
                 compiled: bool = False, microbatches: int = 1) -> None:
        """`per_sample` is a performance flag that never changes what is released: how a Linear weight's
        per-sample norms are computed (`persample.use_ghost`: auto picks per layer; ghost; materialize).
        `compiled` is another: the clipping stage (`_clip`) runs as a compiled graph (`routing.compiled`), whose
        output is bitwise the hooks' eager one.
        `privatizer` adds the noise (`govtrain.privatizers`; None: the i.i.d. Gaussian); one without a generator
        of its own draws from the router's (OS entropy, or `insecure_seed`). `microbatches` is a privacy
        parameter (docs/privatizers.md, per-microbatch noise): k > 1 keeps a clipped sum per microbatch
        (`accumulate(..., microbatch=m)`) and has the privatizer noise each on its own; 1 is the step with one
        noise per group. A correlated privatizer's state advances once per step, so it takes k = 1 only."""
        microbatch.check_count(microbatches, privatizer)
        self.microbatches = microbatches
        if mechanism not in MECHANISMS:
            raise ValueError(f"unknown mechanism {mechanism!r}: one of {', '.join(MECHANISMS)}")
        if per_sample not in persample.STRATEGIES:
            raise ValueError(f"unknown per-sample strategy {per_sample!r}: one of {', '.join(persample.STRATEGIES)}")
        self.per_sample = per_sample
        self.model = model
        self.mechanism = mechanism
        self.resolution = resolution
        self._batch_norms = [(n, m) for n, m in model.named_modules() if isinstance(m, _BatchNorm)]
        coverage.check_batch_norms(self._batch_norms)  # before the generic refusal of an uncovered parameter
        params = dict(model.named_parameters())
        self.taps: dict[str, taps.Tap]
        self.shared: set[str]  # parameters several modules hold: formed whole per sample (`persample.Shared`)
        trainable, self.taps, self.shared = taps.tap_modules(model, params, mechanism)
        layout_names = {p.name for p in resolution.layout.trainable()}
        if set(trainable) != layout_names:
            raise ConfigError(Code.ROUTING_UNCOVERED, "the resolution was made for other trainable parameters "
                                                      f"({len(layout_names)} there, {len(trainable)} here): resolve again")
        self.params = {n: params[n] for n in trainable}
        self.masks = taps.reach_masks(resolution, self.params)  # class -> parameter -> None (all) or (dim, index)
        # prism: lora_B name -> lora_A name of each LoRA pair, reached whole or not at all by every class
        check_reach(mechanism, resolution.reach, self.params)
        self.pairs = lora_pairs(self.params) if mechanism == "prism" else {}
        self._paired = set(self.pairs) | set(self.pairs.values())  # measured, summed and noised as stacks
        # dp-muon: each parameter a class reaches is clipped on its own to C_i / sqrt(units)
        self.units = {data_class: len(masks) for data_class, masks in self.masks.items()}
        self.noise_std: dict[str, float] = {}  # per reached parameter: the last step's noise std / batch size
        # its whole state from the OS (`privatizers.entropy`: manual_seed keeps 32 bits on the CPU); tests seed it
        self.generator = entropy.generator(next(iter(self.params.values())).device if self.params else "cpu",
                                           insecure_seed)
        self.privatizer = IIDGaussian() if privatizer is None else privatizer
        slots.check_privatizer(mechanism, self.privatizer)
        if self.privatizer.generator is None:
            self.privatizer.generator = self.generator
        self.tangent = TangentStacks(self.params, self.pairs, {c: set(masks) for c, masks in self.masks.items()}
                                     ) if self.pairs else None
        # what the privatizer noises, in the order the noise is drawn; its state (secret: `Run` saves it 0600)
        self.noise_slots = slots.NoiseSlots(self.params, resolution, self._paired, self.tangent)
        self.noise_state = self.privatizer.init(self.noise_slots.slots)
        self.materialized: materialized.Path | None = None  # the noise families' per-sample path (`materialize`)
        if materialized.needs_materialized(self.privatizer):  # L1 clipping or quantisation: per-sample gradients
            self.materialize(self.privatizer)
        # each example of a captured forward runs through the default adapter and its own class's adapters only;
        # built before any hook of the router, so that a class adapter it refuses leaves the model without hooks
        self.routes = AdapterRoutes(model, resolution.reach)
        self._routed: tuple[str, ...] | None = None  # the captured forward's examples' classes
        self._canaries = None  # audit only: `inject_audit_canaries`; None in every run
        self.nonfinite = 0  # this rank's units of the step in progress whose norm was not finite (`begin` resets)
        # the run's processes (`govtrain.distributed`): each rank clips its share of the draw; `finish` sums the
        # ranks' clipped sums, the lead alone noises them, and every rank writes the lead's release
        self.world = World.single()
        self._compiled = compiled_routing.CompiledStage(self._clip) if compiled else None
        # only modules holding a parameter some class reaches are recorded (`taps.Recorder`)
        reached = {part.name for parts in resolution.reach.values() for part in parts}
        self._recorder = taps.Recorder(model, self.taps, reached, per_sample)

    def inject_audit_canaries(self, canaries) -> None:  # type: ignore[no-untyped-def]
        """AUDIT ONLY. White-box canary gradients (`govtrain.audit.canaries.DiracCanaries`, which nothing but
        `govtrain.audit` builds; no config, policy or option reaches this) added to the per-sample clipping: each
        canary's Dirac joins its unit's squared norm before the coefficients are formed, and its clipped value
        the sum before the noise. Its parameters must be reached, whole, by the canaries' class alone, so a real
        example's gradient, norm and coefficient are exactly what they are without it (docs/auditing.md).
        The exact type is the audit's own class, read from its loaded module: routing never imports the audit."""
        kind = _audit_canaries_type()
        if kind is None or type(canaries) is not kind:
            raise TypeError(f"inject_audit_canaries takes a govtrain.audit DiracCanaries, not {type(canaries).__name__}")
        for name in sorted(canaries.names):
            reached = {c for c, masks in self.masks.items() if name in masks}
            if reached != {canaries.data_class} or self.masks[canaries.data_class][name] is not None \
                    or name in self._paired:
                raise ValueError(f"{name}: a canary coordinate must be in a parameter the audit class "
                                 f"{canaries.data_class!r} alone reaches whole, outside any LoRA pair under prism")
        self._canaries = canaries

    def materialize(self, privatizer) -> None:  # type: ignore[no-untyped-def]
        """Form the clipped sum from materialized per-sample gradients (`routing/materialized.py`): for a
        privatizer that clips in L1 or quantises (the noise families). `begin(group_std)` then gives each step's
        group noise, from which a quantising privatizer's lattice follows."""
        self.materialized = materialized.Path(privatizer, self.resolution, self.params, self.mechanism)

    def close(self) -> None:
        self._recorder.close()
        self.routes.close()
        self._canaries = None  # an audit's canaries end with its router's life

    @contextmanager
    def capture(self, classes: Sequence[str] | None = None, units: Tensor | Sequence[int] | None = None
                ) -> Iterator[None]:
        """Record the tapped modules' inputs and outputs during a forward pass, each example routed through
        the default adapter and its own class's adapters only (`routing/adapters.py`). `classes` and `units`
        are what `accumulate` will be given for this forward (with `units`, `classes` are per unit). On a model
        with class adapters, a forward with gradients enabled needs them; without gradients (the layout probe)
        every adapter runs."""
        for tap in self.taps.values():
            tap.clear()
        routed = None if classes is None else self.routes.examples(classes, units)
        with self.routes.routed(routed):
            self._routed = None if routed is None else tuple(routed)
            self._recorder.recording = True
            try:
                yield
            finally:
                self._recorder.recording = False

    def probe(self, batches: Iterable[Mapping[str, Any]]) -> None:
        """Run the model forward on each of `batches` (keyword inputs, e.g. a tokenizer's output) under
        capture, and refuse every tapped call whose input or output does not have that batch's size first
        (`layout.probe`: at least two batch sizes, neither equal to another dimension of the inputs)."""
        layout.probe(self, batches)

    def _check_layout(self, batch: int) -> None:
        """Refuse (before any gradient is taken) a recorded call that does not have the batch first."""
        for tap in self.taps.values():
            layout.check_batch_first(tap.name, [a for a, _ in tap.shapes], tap.outputs, batch)

    # -- the step --------------------------------------------------------------------------------

    def privatize(self, losses: Tensor, classes: Sequence[str], clip_norms: Tensor | Sequence[float],
                  group_std: Mapping[frozenset, float], expected_batch_size: float,
                  units: Tensor | Sequence[int] | None = None) -> StepReport:
        """Replace every reachable parameter's `.grad` with the privatized gradient of sum(losses): one logical
        step on one physical batch (`begin`, `accumulate` (with `units`: per contribution), `finish`)."""
        self.begin(group_std)
        report = self.accumulate(losses, classes, clip_norms, units)
        self.finish(group_std, expected_batch_size)
        return report

    def noise_only(self, group_std: Mapping[frozenset, float], expected_batch_size: float) -> StepReport:
        """The step of an empty Poisson batch: noise alone, divided by the expected batch size."""
        self.begin()
        self.finish(group_std, expected_batch_size)
        return StepReport(0, 0, 0.0)

    # A logical step over several physical chunks of one Poisson batch: `begin`, then `accumulate` once per
    # chunk (each under its own `capture`), then `finish`. Each sample is clipped on its own whichever chunk
    # it is in, so the sum of the chunks' clipped sums is the batch's clipped sum; the noise is drawn once,
    # in `finish`. Nothing per-sample outlives the `accumulate` that made it.

    def begin(self, group_std: Mapping[frozenset, float] | None = None) -> None:
        """Start a logical step: no clipped gradient summed yet. `group_std`: the step's noise per group, which
        the materialized path needs before the sum (a quantising privatizer's lattice); others ignore it."""
        self._totals: dict[str, Tensor] | None = None
        self._parts: dict[int, dict[str, Tensor]] = {}  # microbatch m >= 1 -> its clipped sum (per-microbatch noise)
        self.nonfinite = 0  # this rank's units of the step whose norm was not finite: each contributed zero
        if self.materialized is not None:
            self.materialized.set_std(group_std)
        if self.tangent is not None:
            self.tangent.begin()
            self.tangent.geometry()  # on every rank: a sharded model's factors are all-gathered (a collective)

    def accumulate(self, losses: Tensor, classes: Sequence[str], clip_norms: Tensor | Sequence[float],
                   units: Tensor | Sequence[int] | None = None, *, microbatch: int = 0) -> StepReport:
        """Add the clipped gradients of one chunk (the captured forward that gave `losses`, one per example).

        Without `units` every example is clipped on its own, and `classes` and `clip_norms` are per example.
        With `units` (one index in [0, U) per example; docs/design.md §5, privacy_unit = "contribution") the examples
        of a unit are averaged first and the average is what is restricted to the unit's profile and clipped
        to its C_i: `classes` and `clip_norms` are then per unit. Every example of a unit must be in this chunk.

        `losses` must be one value per example, shape [examples]: a scalar (a batch mean), a [B, T] token loss
        or a loss of another length is a programmer's mistake, refused with a ValueError before any gradient
        is taken, so nothing is summed, no `.grad` written and no noise drawn.

        `microbatch`: which of the router's `microbatches` this chunk's units belong to (`routing.microbatch`
        assigns them); its clipped sum is kept apart from the other microbatches' until each is noised."""
        if isinstance(microbatch, bool) or not isinstance(microbatch, int) or not 0 <= microbatch < self.microbatches:
            raise ValueError(f"microbatch must be an integer in [0, {self.microbatches}): got {microbatch!r}")
        try:
            totals, report = self._clipped_sum(losses, classes, clip_norms, units)
        finally:
            for tap in self.taps.values():
                tap.clear()
        if microbatch:  # per-microbatch noise: a microbatch after the first keeps a sum of its own
            held = self._parts.setdefault(microbatch, totals)
            if held is not totals:
                for name, total in totals.items():
                    held[name] += total
        elif self._totals is None:
            self._totals = totals
        else:
            for name, total in totals.items():
                self._totals[name] += total
        return report

    def finish(self, group_std: Mapping[frozenset, float], expected_batch_size: float) -> None:
        """Noise the step's clipped sum once per group, divide by the expected batch size, write `.grad`."""
        release.check_releaser(self, group_std)
        totals = self._totals if self._totals is not None else self._zeros()
        self._totals = None
        if self.microbatches == 1:
            self._finish(totals, group_std, expected_batch_size)
            return
        parts, self._parts = self._parts, {}
        release.finish_microbatches(self, [totals] + [parts.get(m) or self._zeros() for m in range(1, self.microbatches)],
                                    group_std, expected_batch_size)

    def _zeros(self) -> dict[str, Tensor]:
        """The sum of no clipped gradient (`release.zeros`)."""
        return release.zeros(self)

    def _clipped_sum(self, losses: Tensor, classes: Sequence[str], clip_norms,
                     units: Tensor | Sequence[int] | None) -> tuple[dict[str, Tensor], StepReport]:
        batch = len(classes)  # clipping units: examples, or contributions
        losses, units, examples = chunk.unit_losses(losses, batch, units)
        routed, self._routed = self._routed, None
        chunk.check_classes(classes, units, self.masks, self.routes, routed)
        clip, dtype = chunk.clip_norms_of(clip_norms, losses, batch)
        if self._canaries is not None:  # audit only: each unit's canary named, and clipped as the canaries' class
            self._canaries.check(classes)
        clip = chunk.within(clip)  # a hair under C_i: rounding favours privacy
        self._check_layout(examples)  # before autograd: nothing per-sample is formed from a call that is refused
        coverage.check_batch_norms(self._batch_norms)  # a model switched to train mode after the router was built
        active = [t for t in self.taps.values() if t.shapes]
        chunk.check_undifferentiated(active)
        self._recorder.dtype = dtype
        chunk.differentiate(active, losses)  # the hooks see every output gradient (`taps.receive`)
        if units is not None:  # from here on a "sample" is a unit: its examples' gradients summed
            for tap in active:
                taps.group_calls(tap, units, batch)
        rows = {c: torch.tensor([i for i, k in enumerate(classes) if k == c], dtype=torch.long, device=losses.device)
                for c in sorted(set(classes))}

        calls = taps.chunk_calls(active, self.shared, self.per_sample)
        # -- the noise families: L1 clipping or quantisation, from materialized per-sample gradients ----------
        if self.materialized is not None:
            diracs = None if self._canaries is None else self._canaries.diracs(classes)  # audit only
            totals, norms, clipped = self.materialized.clipped_sum(calls, self.masks, rows, clip, batch,
                                                                   self.generator, dtype, diracs=diracs)
            return totals, self._report(batch, clipped, norms)
        # -- end of the noise families' hook ---------------------------------------------------------------

        if self.tangent is not None:  # the step's factor geometry (an eigh), formed once, outside any compiled graph
            self.tangent.geometry()
        stage = self._clip if self._compiled is None or self._canaries is not None else self._compiled
        totals, norms, clipped = stage(calls, rows, clip, classes)
        return totals, self._report(batch, int(clipped.sum()), norms)

    def _report(self, batch: int, clipped: int, norms: Tensor) -> StepReport:
        """One chunk's report; its non-finite units are also counted into the step's (`nonfinite`)."""
        report = chunk.report(batch, clipped, norms)
        self.nonfinite += report.nonfinite
        return report

    def _clip(self, calls: Mapping[str, tuple[Any, str]], rows: Mapping[str, Tensor], clip: Tensor,
              classes: Sequence[str]) -> tuple[dict[str, Tensor], Tensor, Tensor]:
        """The masking, per-sample norms, clipping coefficients and clipped weighted sums of one chunk, from its
        calls, each class's rows and each unit's clip norm: (clipped sums, norms, whether each unit was clipped).
        A tensor function of its arguments and the router's fixed structure, which is what `compiled=True`
        compiles (`routing.compiled`); `classes` is read by the audit's canaries alone (never compiled)."""
        batch, dtype, device = clip.shape[0], clip.dtype, clip.device
        squares: dict[str, Tensor] = {}  # clipping unit (a parameter) -> [B]
        # each parameter's rounding allowance per unit (`persample.Calls.bounded`): the unit's norm is widened by it,
        # so that what the sum releases of a unit, rounding included, is within its clip norm, also where its
        # examples' terms cancel (the measured norm is then a rounding residual, which the release does not repeat)
        allowances: dict[str, Tensor] = {}
        for data_class, index in rows.items():
            take = None if len(rows) == 1 else index  # one class: every sample, in order, without a copy
            for name, mask in self.masks[data_class].items():
                if name in self._paired or name not in calls:
                    continue  # LoRA pairs under prism are measured as stacks; a parameter with no gradient adds nothing
                square = squares.setdefault(name, torch.zeros(batch, dtype=dtype, device=device))
                allowance = allowances.setdefault(name, torch.zeros(batch, dtype=dtype, device=device))
                source, leaf = calls[name]
                measured, widened = source.bounded(leaf, take, mask)
                square.index_add_(0, index, measured.to(dtype))
                allowance.index_add_(0, index, widened.to(dtype))
        paired, measured = torch.zeros(batch, dtype=dtype, device=device), []
        if self.tangent is not None:  # prism: the squared norms of the pairs' tangent parts, a stack per shape
            paired, measured = self.tangent.measure(calls, rows, batch, dtype)
        if self._canaries is not None:  # audit only: each canary's Dirac joins its own squared norm
            self._canaries.inject(squares, classes, batch, dtype, device)
        # ‖(x_p + y_p)_p‖ ≤ ‖x‖ + Σ_p y_p: the joint norm, widened by the sum of the parameters' allowances
        norms = sum(squares.values(), paired).sqrt() + sum(allowances.values(), torch.zeros_like(paired))
        # A unit whose norm is not finite (a nan or inf loss, an overflow: in any of its parameters, which makes the
        # joint norm nan or inf) contributes exactly zero: its coefficient is 0 in every parameter, and a weighted
        # sum takes a row of weight 0 out before it scales (`persample.Calls.weighted_sum`), since 0 * nan is nan.
        # Whether a unit is taken out depends on that unit alone, so the release stays a function of each unit's
        # own clipped gradient; the count is the step log's (`StepReport.nonfinite`).
        finite = torch.isfinite(norms)
        if self.mechanism == "dp-muon":  # each unit on its own, to C_i / sqrt(L_i)
            units = torch.zeros(batch, dtype=dtype, device=device)  # L_i of each unit, from its class's rows
            for data_class, index in rows.items():
                units.index_fill_(0, index, self.units[data_class])
            budget = clip / units.sqrt()
            each = {name: square.sqrt() + allowances[name] if name in allowances else square.sqrt()  # widened, as above
                    for name, square in squares.items()}
            coefficients = {name: _coefficient(norm, budget, finite) for name, norm in each.items()}
            clipped = torch.stack([norm > budget for norm in each.values()]).any(0) if each else norms > clip
        else:
            shared = _coefficient(norms, clip, finite)
            coefficients = {name: shared for name in squares}
            clipped = norms > clip

        totals = {name: torch.zeros(p.shape, dtype=dtype, device=p.device) for name, p in self.params.items()
                  if name not in self._paired}  # full-size, also for a sharded parameter
        for data_class, index in rows.items():
            take = None if len(rows) == 1 else index  # one class: every sample, in order, without a copy
            for name, mask in self.masks[data_class].items():
                if name in calls and name not in self._paired:  # the pairs' sums come from their stacks
                    source, leaf = calls[name]
                    weights = coefficients[name] if take is None else coefficients[name].index_select(0, index)
                    totals[name] += source.weighted_sum(leaf, take, weights, mask)
        if self.tangent is not None:
            totals.update(self.tangent.clipped_sums(measured, shared))
        if self._canaries is not None:  # audit only: each Dirac clipped with its own unit's coefficient
            self._canaries.add_clipped(totals, coefficients)
        return totals, norms, clipped

    def _finish(self, totals: dict[str, Tensor], group_std: Mapping[frozenset, float], expected_batch_size: float) -> None:
        self.world.sum_(list(totals.values()))  # every rank's clipped sum, on every rank
        release.noise_once(self, totals, group_std, expected_batch_size)
        self.world.share_(list(totals.values()))  # the lead's release, bitwise, on every rank
        release.check_release(totals)
        self._write(totals, expected_batch_size)

    def _noise(self, totals: dict[str, Tensor], group_std: Mapping[frozenset, float], expected_batch_size: float
               ) -> None:
        """Add each group's noise to `totals` in place (`release.noise`)."""
        release.noise(self, totals, group_std, expected_batch_size)

    def _write(self, totals: dict[str, Tensor], expected_batch_size: float) -> None:
        """Each reached parameter's `.grad`: its noised sum over the expected batch size (`release.write`)."""
        release.write(self, totals, expected_batch_size)


def _coefficient(norms: Tensor, clip: Tensor, finite: Tensor) -> Tensor:
    """min(1, C / ‖g‖) per sample, without dividing by a zero norm; 0 for a unit whose joint norm is not finite
    (`finite`: the unit's, not this parameter's, so a unit is taken out of every parameter at once). nan > C is
    false: without `finite` a nan norm would keep its coefficient 1 and its nan gradient would be released."""
    coefficient = torch.where(norms > clip, clip / norms.clamp(min=torch.finfo(norms.dtype).tiny),
                              torch.ones_like(norms))
    return torch.where(finite, coefficient, torch.zeros_like(norms))

