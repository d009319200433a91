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
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from govtrain.distributed import fsdp
from govtrain.distributed.world import World
from govtrain.errors import Code, ConfigError
from govtrain.mechanisms import MECHANISMS
from govtrain.privatizers import entropy
from govtrain.privatizers.base import Privatizer
from govtrain.privatizers.gaussian import IIDGaussian
from govtrain.resolver.reach import check_reach, lora_pairs
from govtrain.resolver.profile import Resolution
from govtrain.routing import compiled as compiled_routing
from govtrain.routing import coverage, layout, materialized, moe, persample, slots
from govtrain.routing.adapters import AdapterRoutes
from govtrain.routing.tangent import TangentStacks


class _Tap:
    """What one tapped module's calls left in a chunk. The forward hook keeps each call's input and the
    shapes; the output itself is not kept (it would hold activations autograd has freed). In the backward
    pass a hook on the output receives its gradient and either forms the call's per-sample gradients at
    once, where they are smaller than the input and output gradient they come from (a LoRA factor's, a
    LayerNorm's), dropping both, or keeps the pair for the book-keeping sum (`persample.Calls`)."""

    def __init__(self, name: str, module: nn.Module, leaves: dict[str, str]) -> None:
        self.name, self.module = name, module
        # an MoE router or experts module sees its block's tokens flattened: the block whose [B, T] it needs
        self.block = name.replace(".base_layer", "").rpartition(".")[0] if moe.is_moe(module) else None
        self.leaves = leaves  # leaf ("weight") -> full parameter name
        # peft's LoRA on this experts module's fused parameters: leaf ("lora_A:default:gate_up_proj") -> (its
        # ParamWrapper, adapter, fused parameter, "A" or "B"); formed from that parameter's per-sample gradient
        self.lora: dict[str, tuple[nn.Module, str, str, str]] = {}
        self.inputs: list[Tensor | None] = []
        self.shapes: list[tuple[torch.Size, torch.Size]] = []  # (input, output) of each call
        self.grads: list[Tensor | None] = []  # output gradient of each call kept for book-keeping
        self.edges: list[Any] = []  # the gradient edge of each call's output: what `_clipped_sum` differentiates
        self.formed: dict[str, Tensor] = {}  # leaf -> per-sample gradient, summed over the calls that formed it
        self.received = False  # an output gradient came in: this chunk's forward was already differentiated

    @property
    def outputs(self) -> list[torch.Size]:
        return [out for _, out in self.shapes]

    def clear(self) -> None:
        self.inputs.clear()
        self.shapes.clear()
        self.grads.clear()
        self.edges.clear()
        self.formed.clear()
        self.received = False


@dataclass(frozen=True)
class StepReport:
    batch_size: int
    clipped: int  # samples whose gradient norm exceeded their C_i
    max_norm: float  # largest finite per-sample norm before clipping (not released: for diagnostics in tests)
    nonfinite: int = 0  # units whose per-sample norm was not finite (inf or nan): each contributed exactly zero


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
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches must be a positive integer: got {microbatches!r}")
        if microbatches > 1 and privatizer is not None and privatizer.correlated:
            raise ConfigError(Code.PRIVATIZER_UNSUPPORTED,
                              f"the {privatizer.name} privatizer's noise is correlated across steps and its state "
                              "advances once per step: per-microbatch noise (microbatches > 1) takes the i.i.d. "
                              "gaussian or a noise family; set microbatches = 1")
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
        # a trainable parameter -> every (module path, module, leaf) that holds it: one, or several for tied weights
        holders: dict[int, list[tuple[str, nn.Module, str]]] = {}
        for module_name, module in model.named_modules():
            for leaf, param in module.named_parameters(recurse=False):
                if param.requires_grad:
                    holders.setdefault(id(param), []).append((module_name, module, leaf))
        trainable = [n for n, p in params.items() if p.requires_grad]
        self.taps: dict[str, _Tap] = {}
        self.shared: set[str] = set()  # parameters several modules hold: formed whole per sample (`persample.Shared`)
        checked: set[str] = set()
        owners = [(name, holder) for name in trainable for holder in holders[id(params[name])]]
        for name in trainable:
            if len(holders[id(params[name])]) > 1:
                coverage.check_shareable(name, holders[id(params[name])])
                self.shared.add(name)
        for name, (module_name, module, leaf) in owners:
            fused = coverage.fused_lora(model, module_name)
            if fused is not None:  # a LoRA factor peft multiplies into an experts module's fused parameter
                wrapper, path, adapter, factor = fused
                if mechanism == "prism":
                    raise ConfigError(Code.ROUTING_UNCOVERED,
                                      f"trainable parameter {name}: LoRA on fused expert parameters holds one pair per "
                                      "expert side by side, not one rank-r pair: use dpsgd or dp-muon")
                module_name, module = path, moe.innermost(wrapper)
                coverage.check_covered(model, module_name, module, name, checked)
                tap = self.taps.setdefault(module_name, _Tap(module_name, module, {}))
                leaf = f"lora_{factor}:{adapter}:{wrapper.parameter_name}"
                tap.lora[leaf] = (wrapper, adapter, wrapper.parameter_name, factor)
                tap.leaves[leaf] = name
                continue
            coverage.check_covered(model, module_name, module, name, checked)
            tap = self.taps.setdefault(module_name, _Tap(module_name, module, {}))
            tap.leaves[leaf] = name
        layout_names = {p.name for p in resolution.layout.trainable()}
        if set(trainable) != layout_names:
            raise ConfigError(Code.ROUTING_UNCOVERED, "the resolution was made for other trainable parameters "
                                                      f"({len(layout_names)} there, {len(trainable)} here): resolve again")
        self.params = {n: params[n] for n in trainable}
        # class -> parameter -> None (all of it) or (dim, index)
        self.masks: dict[str, dict[str, tuple[int, Tensor] | None]] = {}
        for data_class, parts in resolution.reach.items():
            self.masks[data_class] = {
                part.name: None if part.dim is None else
                (part.dim, torch.tensor(part.index, dtype=torch.long, device=self.params[part.name].device))
                for part in parts}
        # prism: lora_B name -> lora_A name of each LoRA pair, reached whole or not at all by every class
        check_reach(mechanism, resolution.reach, self.params)
        self.pairs = lora_pairs(self.params) if mechanism == "prism" else {}
        self._paired = set(self.pairs) | set(self.pairs.values())  # measured, summed and noised as stacks
        # dp-muon: each parameter a class reaches is clipped on its own to C_i / sqrt(units)
        self.units = {data_class: len(masks) for data_class, masks in self.masks.items()}
        self.noise_std: dict[str, float] = {}  # per reached parameter: the last step's noise std / batch size
        # its whole state from the OS (`routing.entropy`: manual_seed keeps 32 bits on the CPU); tests seed it
        self.generator = entropy.generator(next(iter(self.params.values())).device if self.params else "cpu",
                                           insecure_seed)
        self.privatizer = IIDGaussian() if privatizer is None else privatizer
        slots.check_privatizer(mechanism, self.privatizer)
        if self.privatizer.generator is None:
            self.privatizer.generator = self.generator
        self._recording = False
        # Only modules holding a parameter some class reaches are recorded: autograd then stops where the
        # deepest reached parameter is, instead of differentiating layers no one may train.
        reached = {part.name for parts in resolution.reach.values() for part in parts}
        self._reached = reached
        self.tangent = TangentStacks(self.params, self.pairs, {c: set(masks) for c, masks in self.masks.items()}
                                     ) if self.pairs else None
        # what the privatizer noises, in the order the noise is drawn; its state (secret: `Run` saves it 0600)
        self.noise_slots = slots.NoiseSlots(self.params, resolution, self._paired, self.tangent)
        self.noise_state = self.privatizer.init(self.noise_slots.slots)
        self.materialized: materialized.Path | None = None  # the noise families' per-sample path (`materialize`)
        if materialized.needs_materialized(self.privatizer):  # L1 clipping or quantisation: per-sample gradients
            self.materialize(self.privatizer)
        self._dtype = torch.float32
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
        self._handles = [tap.module.register_forward_hook(self._hook(tap)) for tap in self.taps.values()
                         if reached.intersection(tap.leaves.values())]
        self._grids: dict[str, tuple[int, ...]] = {}  # MoE block -> the [B, T] of its last input
        for block in {tap.block for tap in self.taps.values() if tap.block is not None}:
            self._handles.append(model.get_submodule(block).register_forward_pre_hook(
                lambda _, args, block=block: self._grids.__setitem__(block, tuple(args[0].shape[:-1]) if args else ())))

    def inject_audit_canaries(self, canaries) -> None:  # type: ignore[no-untyped-def]
        """AUDIT ONLY. White-box canary gradients (`govtrain.audit.canaries.DiracCanaries`, which nothing but
        `govtrain.audit` builds; no config, policy or option reaches this) added to the per-sample clipping: each
        canary's Dirac joins its unit's squared norm before the coefficients are formed, and its clipped value
        the sum before the noise. Its parameters must be reached, whole, by the canaries' class alone, so a real
        example's gradient, norm and coefficient are exactly what they are without it (docs/auditing.md)."""
        from govtrain.audit.canaries import DiracCanaries

        if type(canaries) is not DiracCanaries:
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
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.routes.close()
        self._canaries = None  # an audit's canaries end with its router's life

    def _hook(self, tap: _Tap):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
            if self._recording:
                index = len(tap.inputs)
                if tap.block is not None:  # tokens flattened by the block: recorded against its [B, T]
                    saved, shapes, output = moe.record(module, args, output, self._grids.get(tap.block, ()))
                else:
                    saved, shapes = args[0].detach(), (args[0].shape, output.shape)
                tap.inputs.append(saved)
                tap.shapes.append(shapes)
                tap.grads.append(None)
                if output.requires_grad:
                    output.register_hook(lambda g: self._received(tap, index, g))
                    tap.edges.append(torch.autograd.graph.get_gradient_edge(output))

        return hook

    def _received(self, tap: _Tap, index: int, g: Tensor) -> None:
        """Backward hook on a tapped call's output: form its per-sample gradients now where they are smaller
        than what they are formed from (then keep neither), else keep the output gradient for later."""
        tap.received = True
        a = tap.inputs[index]
        if a is None:  # formed already: a second backward through the forward (`_clipped_sum` refuses the first)
            return
        dtype = self._dtype
        module = tap.module
        if isinstance(module, nn.Embedding):
            tap.grads[index] = g.to(dtype)
            return
        if tap.block is not None:
            formed = moe.grads(module, a, g, tap.shapes[index], dtype, every=bool(tap.lora))
            for leaf, (wrapper, adapter, fused, factor) in tap.lora.items():  # the chain rule through W + s·B·A
                formed[leaf] = moe.lora_grads(wrapper, adapter, formed[fused])[factor]
            formed = {leaf: value for leaf, value in formed.items() if leaf in tap.leaves}
            for leaf, value in formed.items():
                tap.formed[leaf] = tap.formed[leaf] + value if leaf in tap.formed else value
            tap.inputs[index] = None
            return
        a, g = a.to(dtype), g.to(dtype)
        if isinstance(module, persample.LINEAR) and not persample.form_early(a, g, self.per_sample):
            tap.inputs[index], tap.grads[index] = a, g
            return
        formed = persample.grads_of(module, a, g)
        for leaf, value in formed.items():
            tap.formed[leaf] = tap.formed[leaf] + value if leaf in tap.formed else value
        tap.inputs[index] = None

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
            self._recording = True
            try:
                yield
            finally:
                self._recording = False

    def probe(self, batches: Iterable[Mapping[str, Any]]) -> None:
        """Run the model forward on each of `batches` (keyword inputs, e.g. a tokenizer's output) under
        capture, and refuse every tapped call whose input or output does not have that batch's size first.

        One step's shapes cannot tell a sequence-first [T, B, D] call from a batch-first one when T = B, nor a
        call on a fixed-size tensor [n, ...] from one at batch size n. So the probe batches must come in at
        least two different sizes, each larger than one and different from every other dimension of its
        inputs: then a leading dimension that follows the batch size through all of them is the batch."""
        batches = list(batches)
        sizes = [layout.probe_size(batch) for batch in batches]
        if len(set(sizes)) < 2:
            raise ValueError(f"a layout probe needs batches of at least two different sizes: got {sizes}")
        device = next(iter(self.params.values())).device if self.params else torch.device("cpu")
        try:
            for batch, size in zip(batches, sizes):
                inputs = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}
                with self.capture(), torch.no_grad():
                    self.model(**inputs)
                self._check_layout(size)
        finally:
            for tap in self.taps.values():
                tap.clear()

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
        if self.materialized is not None and self.materialized.privatizer is not self.privatizer \
                and any(std > 0 for std in group_std.values()):  # its sums are another privatizer's to release
            raise RuntimeError(f"the materialized path clips or quantises for {self.materialized.privatizer.name!r}, "
                               f"but {self.privatizer.name!r} releases: build the router with that privatizer")
        totals = self._totals if self._totals is not None else self._zeros()
        self._totals = None
        if self.microbatches == 1:
            self._finish(totals, group_std, expected_batch_size)
            return
        parts, self._parts = self._parts, {}
        self._finish_microbatches([totals] + [parts.get(m) or self._zeros() for m in range(1, self.microbatches)],
                                  group_std, expected_batch_size)

    def _zeros(self) -> dict[str, Tensor]:
        """The sum of no clipped gradient: full-size, also for a sharded parameter, in the dtype a sum takes (float64
        on the quantising path), so ranks with and without examples sum tensors of one layout."""
        quantized = self.materialized is not None and self.materialized.privatizer.quantized
        return {name: torch.zeros(p.shape, dtype=torch.float64 if quantized else _accumulator(p.dtype), device=p.device)
                for name, p in self.params.items()}

    def _finish_microbatches(self, parts: list[dict[str, Tensor]], group_std: Mapping[frozenset, float],
                             expected_batch_size: float) -> None:
        """Per-microbatch noise: each microbatch's clipped sum gets the group noise on its own, in microbatch
        order, and the step releases their sum over the expected batch size (k times the variance of one)."""
        self.world.sum_([total for part in parts for total in part.values()])
        for part in parts:
            self._noise_once(part, group_std, expected_batch_size)
        totals = parts[0]
        for part in parts[1:]:
            for name, total in part.items():
                totals[name] += total
        self.noise_std = {name: std * math.sqrt(len(parts)) for name, std in self.noise_std.items()}
        self.world.share_(list(totals.values()))
        _check_release(totals)
        self._write(totals, expected_batch_size)

    def _clipped_sum(self, losses: Tensor, classes: Sequence[str], clip_norms,
                     units: Tensor | Sequence[int] | None) -> tuple[dict[str, Tensor], StepReport]:
        batch = len(classes)  # clipping units: examples, or contributions
        examples = batch if units is None else len(units)
        if losses.dim() != 1 or losses.shape[0] != examples:  # before anything is formed, summed or drawn
            raise ValueError(f"need one loss per example, shape ({examples},): got {tuple(losses.shape)}. Take the "
                             "loss with reduction='none' and reduce each example's tokens alone (a mean over the "
                             "batch couples examples, so their gradients cannot be clipped one by one)")
        if units is not None:
            units = torch.as_tensor(units, dtype=torch.long, device=losses.device)
            counts = torch.bincount(units, minlength=batch) if examples else torch.zeros(batch, dtype=torch.long)
            if units.dim() != 1 or (examples and (int(units.min()) < 0 or int(units.max()) >= batch)) \
                    or counts.shape[0] != batch or not bool((counts > 0).all()):
                raise ValueError(f"need one unit in [0, {batch}) per example, and at least one example per unit")
            losses = losses / counts[units].to(losses.dtype)  # a unit's gradient is its examples' mean
        unknown = sorted(set(classes) - self.masks.keys())
        if unknown:
            raise ValueError(f"class {unknown[0]!r} has no resolved profile")
        routed, self._routed = self._routed, None
        if self.routes.adapters and routed != tuple(self.routes.examples(classes, units)):
            raise ValueError("the captured forward was routed through the adapters of other classes than these "
                             "examples are clipped as (or of none): capture(classes, units) with the classes and "
                             "units given here")
        dtype = _accumulator(losses.dtype)  # norms, clipping and sums never below fp32, whatever autocast ran in
        clip = torch.as_tensor(clip_norms, dtype=dtype, device=losses.device)
        if clip.shape != (batch,) or not bool((clip > 0).all()):
            raise ValueError("need one positive clipping norm per clipping unit (example or contribution)")
        if self._canaries is not None:  # audit only: each unit's canary named, and clipped as the canaries' class
            self._canaries.check(classes)
        # Rounding favours privacy: clip to a hair under C_i, so that a norm computed in floating point (fp32
        # rounds at ~1e-7) never lets a released per-sample gradient exceed the C_i the accountant charges; and
        # `_clip` widens each unit's norm by its rounding allowance (`persample.Calls.bounded`), for the rounding
        # that grows with the size of a unit's terms rather than with its norm (terms that cancel).
        clip = clip * (1 - 8 * torch.finfo(dtype).eps)
        self._check_layout(examples)  # before autograd: nothing per-sample is formed from a call that is refused
        coverage.check_batch_norms(self._batch_norms)  # a model switched to train mode after the router was built
        taps = [t for t in self.taps.values() if t.shapes]
        if any(t.received for t in taps):  # its per-sample gradients would be formed from another loss's gradient
            raise ConfigError(Code.UNGOVERNED_BATCH, "a backward through the governed forward ran before run.step(): "
                                                     "the step differentiates the per-example losses itself; do not "
                                                     "call backward() or autograd.grad on the model's output")
        # Gradients flow to the recorded outputs (autograd stops at the deepest, and never forms a weight's
        # gradient: the router forms its own); their hooks see every output gradient (`_received`). Outputs, not
        # parameters: under FSDP the parameters are shards the forward never used (`distributed/fsdp.py`). What
        # autograd returns is dropped.
        requested = [edge for t in taps for edge in t.edges]
        self._dtype = dtype
        if requested:
            torch.autograd.grad(losses.sum(), requested, allow_unused=True)
            if losses.requires_grad and not any(t.received for t in taps):
                raise RuntimeError("no output gradient reached a tapped module: nothing would be clipped")
        if units is not None:  # from here on a "sample" is a unit: its examples' gradients summed
            for tap in taps:
                _group_calls(tap, units, batch)
        rows = {c: torch.tensor([i for i, k in enumerate(classes) if k == c], dtype=torch.long, device=losses.device)
                for c in sorted(set(classes))}

        # parameter -> (the calls of its module in this chunk, its leaf name): norms and sums are asked of
        # them; no per-sample gradient is kept beyond this chunk (persample.Calls)
        calls: dict[str, tuple[persample.Calls | persample.Shared, str]] = {}
        sources: dict[str, list[tuple[persample.Calls, str]]] = {}  # a shared parameter's holders that were called
        for tap in taps:
            kept = [(a, g) for a, g in zip(tap.inputs, tap.grads) if a is not None and g is not None]
            if not kept and not tap.formed:
                continue
            module_calls = persample.Calls(tap.module, [a for a, _ in kept], [g for _, g in kept],
                                           strategy=self.per_sample, formed=dict(tap.formed))
            tap.clear()
            for leaf, name in tap.leaves.items():
                if name in self.shared:
                    sources.setdefault(name, []).append((module_calls, leaf))
                else:
                    calls[name] = (module_calls, leaf)
        for name, held in sources.items():
            calls[name] = (persample.Shared(held), "")
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
        finite = torch.isfinite(norms)
        bad = int((~finite).sum())
        self.nonfinite += bad
        largest = float(norms[finite].max()) if bad < batch else 0.0
        return StepReport(batch, clipped, largest, bad)

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
        self._noise_once(totals, group_std, expected_batch_size)
        self.world.share_(list(totals.values()))  # the lead's release, bitwise, on every rank
        _check_release(totals)
        self._write(totals, expected_batch_size)

    def _noise_once(self, totals: dict[str, Tensor], group_std: Mapping[frozenset, float],
                    expected_batch_size: float) -> None:
        """The noise, drawn once for all the ranks: by the lead, whose release `share_` then copies to the others;
        a follower only sets `noise_std`, which the update reads (its `totals` are overwritten by the lead's)."""
        if self.world.lead:
            self._noise(totals, group_std, expected_batch_size)
        else:
            self.noise_std = self._stds(group_std, expected_batch_size)

    def _noise(self, totals: dict[str, Tensor], group_std: Mapping[frozenset, float], expected_batch_size: float
               ) -> None:
        """Add each group's noise to `totals` in place (prism: the pairs' sums lifted, with their tangent noise);
        `noise_std` then holds each reached parameter's noise std over the expected batch size."""
        groups = self._groups(group_std)
        self.noise_std = self._stds(group_std, expected_batch_size)
        pair_std: dict[str, float] = {}
        if self.tangent is not None:  # prism: the pairs' clipped sums lifted, each with its group's tangent noise
            for group, std in groups:
                for part in group.parts:
                    if part.name in self._paired:
                        if part.dim is not None:
                            raise RuntimeError(f"{part.name} is reached in part: check_reach should have refused it")
                        pair_std[part.name] = std
        # every draw is the privatizer's, in slot order: the tangent Gaussians first, then each group's parts
        sums, std, keep = self.noise_slots.step(totals, groups, pair_std)
        noisy, self.noise_state = self.privatizer.update(sums, self.noise_state, std=std, keep=keep)
        self.noise_slots.released(totals, noisy)
        if self.tangent is not None:
            self.tangent.release(totals, pair_std, self.noise_slots.omega(noisy))

    def _groups(self, group_std: Mapping[frozenset, float]) -> list:
        return [(group, float(group_std.get(group.classes, 0.0))) for group in self.resolution.groups if group.classes]

    def _stds(self, group_std: Mapping[frozenset, float], expected_batch_size: float) -> dict[str, float]:
        """Each reached parameter's noise std over the expected batch size."""
        if not expected_batch_size > 0:
            raise ValueError("the expected batch size must be positive")
        return {part.name: std / expected_batch_size for group, std in self._groups(group_std) for part in group.parts}

    def _write(self, totals: dict[str, Tensor], expected_batch_size: float) -> None:
        for name, param in self.params.items():
            param.grad = fsdp.local((totals[name] / expected_batch_size).to(param.dtype), param) \
                if name in self.noise_std else None  # a sharded parameter gets its own shard

    def _module_of(self, name: str) -> nn.Module:
        return next(t.module for t in self.taps.values() if name in t.leaves.values())


def _group_calls(tap: _Tap, units: Tensor, count: int) -> None:
    """Rewrite what one tapped module recorded so that row u holds unit u's examples: each call's input and
    output gradient [B, T, ...] become [U, M·T, ...] (a unit's examples side by side along the token axis,
    zero-padded to the largest unit's M examples; zero rows add nothing to a norm or a sum), and gradients
    already formed per example are summed per unit. Every per-sample rule then sees units as samples: the
    gradient of a Linear, LayerNorm or Embedding is a sum over tokens, and a unit's is the sum over its
    examples' tokens."""
    sizes = torch.bincount(units, minlength=count)
    order = torch.argsort(units, stable=True)
    slot = torch.empty_like(units)  # position of each example inside its unit
    slot[order] = torch.arange(units.shape[0], device=units.device) - (torch.cumsum(sizes, 0) - sizes)[units[order]]
    width = int(sizes.max()) if count else 0

    def regroup(x: Tensor, *, ids: bool = False) -> Tensor:
        out = x.new_zeros((count, width, *x.shape[1:]))
        out[units, slot] = x
        if ids:  # an embedding's token ids [B, T]: one row of M·T ids per unit
            return out.reshape(count, -1)
        return out if x.dim() == 2 else out.reshape(count, width * x.shape[1], *x.shape[2:])

    embedding = isinstance(tap.module, nn.Embedding)
    for index, (a, g) in enumerate(zip(tap.inputs, tap.grads)):
        if a is not None and g is not None:
            tap.inputs[index], tap.grads[index] = regroup(a, ids=embedding), regroup(g)
    for leaf, per in tap.formed.items():
        tap.formed[leaf] = per.new_zeros((count, *per.shape[1:])).index_add_(0, units, per)


def _check_release(totals: Mapping[str, Tensor]) -> None:
    """Refuse a noised sum with a non-finite coordinate before it reaches `.grad`: a unit with a non-finite norm
    contributes zero (`_clip`), so this cannot happen; if it does, a release that a neighbouring batch could not
    produce would leave under a finite charge, so nothing is written and nothing moves."""
    if not totals or bool(torch.stack([torch.isfinite(total).all() for total in totals.values()]).all()):
        return  # one read of the device per step; the names only when it fails
    bad = [name for name, total in totals.items() if not bool(torch.isfinite(total).all())]
    if bad:
        raise ConfigError(Code.NONFINITE_RELEASE,
                          f"the step's noised gradient of {', '.join(bad[:3])}{' and more' if len(bad) > 3 else ''} "
                          "is not finite: nothing was released or updated; this is a defect in govtrain, report it")


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    """The dtype per-sample norms, clipping, sums and noise are computed in: float32, or wider if given."""
    return torch.promote_types(dtype, torch.float32)


def _coefficient(norms: Tensor, clip: Tensor, finite: Tensor) -> Tensor:
    """min(1, C / ‖g‖) per sample, without dividing by a zero norm; 0 for a unit whose joint norm is not finite
    (`finite`: the unit's, not this parameter's, so a unit is taken out of every parameter at once). nan > C is
    false: without `finite` a nan norm would keep its coefficient 1 and its nan gradient would be released."""
    coefficient = torch.where(norms > clip, clip / norms.clamp(min=torch.finfo(norms.dtype).tiny),
                              torch.ones_like(norms))
    return torch.where(finite, coefficient, torch.zeros_like(norms))

