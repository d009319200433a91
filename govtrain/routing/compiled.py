"""Compiled routing (docs/design.md §5, seed 004 alternative 4): the router's clipping stage as one graph.

`Router(..., compiled=True)` is a performance flag, like `per_sample`: it never changes what is released. The
hooks still record each tapped call's input and output gradient and form what `persample` forms early; what is
compiled is the stage after them (`Router._clip`): the masking of each class's reach, every unit's per-sample
squared norms, the clipping coefficients (joint for dpsgd and prism, per parameter for dp-muon, the tangent
norms of PRISM's stacks) and the clipped weighted sums. That stage is traced once, at the first step, into one
graph (`fullgraph=True`: a graph break is an error, not a silent split), and every later step runs the graph
instead of the router's loops over classes, parameters and calls.

**Why `aot_eager`.** The graph must release bitwise what the hooks release, in float64 on the CPU. Measured on
the per-sample norms and sums (torch 2.13, CPU): inductor fuses each `pow(2).sum()` into a loop of its own, which
adds in another order than ATen's reduction kernels, and the norms moved in their last bits (1.5e-11 on ~1e4 in
float64); `deterministic`, `simdlen = 1` and `split_reductions = False` did not restore ATen's
order. Inductor with `fallback_by_default` matches bitwise, but only because it then calls the same ATen kernels
and fuses nothing, after a C++ build of ~15 s per graph. `aot_eager` traces the stage through AOTAutograd to ATen
operations (functionalised: an in-place `index_add_` becomes its out-of-place twin, the same kernel) and runs
them with the kernels eager mode calls, in the same order, so the output is bitwise the hooks' by construction,
in every dtype; the tests check it against the hook path for dpsgd, prism and dp-muon. What compiling buys is
the structure resolved once: which classes reach which parameters through which calls, the ghost-or-materialize
choice per layer and the mask indices become one flat graph of ATen calls, with no Python dictionaries walked
per step (`bench/step.py --compiled` reports what that is worth).

**Shapes.** Poisson batches change size every step, and sequences their length: a cache per size would
compile every step. The stage is compiled with `dynamic=True`, the batch, token and per-class row counts
symbolic, and `backed_size_oblivious`, so that a size seen as 1 (a class with one sample in the chunk) is not
specialised either: a graph serves every size (a layer's ghost-or-materialize choice, 2T² < in·out, is a guard on
T, and a few other guards on the traced sizes may add a second; the tests see at most two per structure). The graph
replays ATen calls that take their shapes at run time, so the release at a size it was not traced at is still
the eager one (tested). `torch.unique` (an embedding's distinct (sample, token) rows) has a data-dependent size:
it is traced with `capture_dynamic_output_shape_ops`. These settings hold for this stage's calls only. Which
classes a chunk holds is part of the structure, so each subset of classes seen gets a graph of its own, in
dynamo's cache for the stage's code, up to `RECOMPILE_LIMIT`; past that a call runs the same stage eagerly,
which releases the same bits (`CompiledStage.eager` counts them, and the first one warns).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.fx.experimental._config as shape_config

BACKEND = "aot_eager"
RECOMPILE_LIMIT = 64  # graphs of one stage: class subsets x the 0/1 batch specialisations x layers' ghost guards


class CompiledStage:
    """`stage` (a function of tensors, dictionaries and tuples of them, and the router's fixed structure) traced
    into one graph per structure by `torch.compile`, run in place of the eager call."""

    def __init__(self, stage: Callable[..., Any], *, backend: str = BACKEND) -> None:
        self.stage = stage
        self.graph = torch.compile(stage, backend=backend, dynamic=True, fullgraph=True)
        self.compiled = 0  # calls that ran a compiled graph
        self.eager = 0  # calls past the recompile limit, run eagerly (the same function: the same bits)

    def __call__(self, *args: Any) -> Any:
        try:
            with _settings():
                out = self.graph(*args)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            if not self.eager:
                warnings.warn(f"compiled routing: more than {RECOMPILE_LIMIT} structures of the clipping stage; "
                              "the others run eagerly (the same release, without the graph's speed)", stacklevel=2)
            self.eager += 1
            return self.stage(*args)
        self.compiled += 1
        return out


# dynamo's and the shape environment's settings while this stage is looked up or traced, restored after: set and
# reset by hand, since their `patch` context costs ~2 ms a call (as much as the stage itself on a small model)
_SETTINGS = ((torch._dynamo.config, "capture_dynamic_output_shape_ops", True),
             (torch._dynamo.config, "recompile_limit", RECOMPILE_LIMIT),
             (shape_config, "backed_size_oblivious", True))


@contextmanager
def _settings() -> Iterator[None]:
    saved = [getattr(module, name) for module, name, _ in _SETTINGS]
    for module, name, value in _SETTINGS:
        setattr(module, name, value)
    try:
        yield
    finally:
        for (module, name, _), value in zip(_SETTINGS, saved):
            setattr(module, name, value)
