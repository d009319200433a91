"""Deliberately broken mechanisms, for showing that the audit can fail (docs/auditing.md). TESTS ONLY.

Each is a context manager that patches the running process's govtrain and restores it on exit; nothing in
`govtrain/` imports this module or has a switch, flag, variable or parameter that does what these do
(tests/test_attacks_audit.py checks that no govtrain module imports from tests).

- `noise_off`: every group's noise std is 0.
- `noise_scaled(factor)`: every group's noise std is `factor` times what the ledger charges for (0.5: half the
  noise, the noise multiplier the ledger claims is twice the one applied).
- `clip_scaled(factor)`: every clipping unit is clipped to `factor`·C while the ledger charges for C and the noise
  stays σ·C (2: the sensitivity doubled, for a canary the same as half the noise).
- `noise_over_realised_batch`: the bug of noising the mean at the sum's scale. The router must add N(0, s_g²) to
  the *sum* of clipped gradients and divide that by the expected batch size B (fixed, public). The broken
  router divides the noise's std by the *realised* batch size b (how many clipping units the Poisson draw
  gave), as if it were noising a mean, and then divides the sum by B as before: the noise is b times too small
  (b ≈ qN, hundreds here), and b itself depends on who was drawn.
- `clipping_skipped_for_layer(layer)`: the clipping coefficient of every parameter of one transformer layer
  (`.layer.<n>.` in its name: the real class's adapter factors there and the audit class's alike) is 1 for every
  sample (that layer is left out of clipping); every other parameter is clipped as before.
  `clipping_skipped_for(suffix)` does the same for one parameter named by its suffix.
- `sampled_at(factor)`: the sampler draws at `factor`·q while the ledger's spend (and the run's own rate check,
  which reads the sampler's rate attribute) says q: a contribution charged at the wrong q.
"""

from __future__ import annotations

import contextlib
import inspect
import textwrap
from typing import Callable, Iterator

from govtrain.routing import router as router_module
from govtrain.routing.router import Router
from govtrain.routing.sampler import PoissonSampler


@contextlib.contextmanager
def _patched(owner: object, name: str, value: object) -> Iterator[None]:
    original = owner.__dict__[name]
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def noise_off() -> Iterator[None]:
    finish = Router.finish

    def broken(self, group_std, expected_batch_size):  # type: ignore[no-untyped-def]
        return finish(self, {group: 0.0 for group in group_std}, expected_batch_size)

    with _patched(Router, "finish", broken):
        yield


@contextlib.contextmanager
def noise_scaled(factor: float) -> Iterator[None]:
    finish = Router.finish

    def broken(self, group_std, expected_batch_size):  # type: ignore[no-untyped-def]
        return finish(self, {group: std * factor for group, std in group_std.items()}, expected_batch_size)

    with _patched(Router, "finish", broken):
        yield


@contextlib.contextmanager
def clip_scaled(factor: float) -> Iterator[None]:
    accumulate = Router.accumulate

    def broken(self, losses, classes, clip_norms, units=None, **options):  # type: ignore[no-untyped-def]
        scaled = [float(c) * factor for c in clip_norms]
        return accumulate(self, losses, classes, scaled, units, **options)

    with _patched(Router, "accumulate", broken):
        yield


@contextlib.contextmanager
def noise_over_realised_batch() -> Iterator[None]:
    accumulate, finish, begin = Router.accumulate, Router.finish, Router.begin

    def counting_begin(self, group_std=None):  # type: ignore[no-untyped-def]
        self._realised = 0
        return begin(self, group_std)

    def counting(self, losses, classes, clip_norms, units=None, **options):  # type: ignore[no-untyped-def]
        self._realised = getattr(self, "_realised", 0) + len(classes)
        return accumulate(self, losses, classes, clip_norms, units, **options)

    def broken(self, group_std, expected_batch_size):  # type: ignore[no-untyped-def]
        realised = max(getattr(self, "_realised", 0), 1)
        return finish(self, {group: std / realised for group, std in group_std.items()}, expected_batch_size)

    with _patched(Router, "begin", counting_begin), _patched(Router, "accumulate", counting), \
            _patched(Router, "finish", broken):
        yield


_SHARED_LINE = "coefficients = {name: shared for name in squares}"


@contextlib.contextmanager
def _clipping_skipped(skipped: Callable[[str], bool]) -> Iterator[None]:
    """`Router._clip` (the clipping stage) recompiled from its own source with one line changed (a mutant): the
    dpsgd/prism branch's shared coefficient is replaced by ones for each parameter `skipped` names. Fails loudly
    if that line is gone."""
    source = textwrap.dedent(inspect.getsource(Router._clip))
    if source.count(_SHARED_LINE) != 1:
        raise RuntimeError("Router._clip changed: update _clipping_skipped in tests/audit_faults.py")
    source = source.replace(_SHARED_LINE, "coefficients = {name: torch.ones_like(shared) if SKIPPED(name) else "
                                          "shared for name in squares}")
    scope = dict(vars(router_module), SKIPPED=skipped)
    exec(compile(source, inspect.getsourcefile(Router), "exec"), scope)  # noqa: S102 (a test's mutant)
    with _patched(Router, "_clip", scope["_clip"]):
        yield


def clipping_skipped_for(suffix: str):  # type: ignore[no-untyped-def]
    """Clipping skipped for the one parameter whose name ends with `suffix`."""
    return _clipping_skipped(lambda name: name.endswith(suffix))


def clipping_skipped_for_layer(layer: int):  # type: ignore[no-untyped-def]
    """Clipping skipped for every parameter of transformer layer `layer`, whichever class reaches it."""
    return _clipping_skipped(lambda name: f".layer.{layer}." in name)


@contextlib.contextmanager
def sampled_at(factor: float) -> Iterator[None]:
    sample = PoissonSampler.sample

    def broken(self, eligible, *, identities=None):  # type: ignore[no-untyped-def]
        charged = self.sampling_rate
        self.sampling_rate = min(1.0, charged * factor)
        try:
            return sample(self, eligible, identities=identities)
        finally:
            self.sampling_rate = charged

    with _patched(PoissonSampler, "sample", broken):
        yield
