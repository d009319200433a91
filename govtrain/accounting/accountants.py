"""Accountants behind one interface: `prv` (prv-accountant), `pld` and `rdp` (dp-accounting).

A history is a sequence of buckets (sampling rate q, noise multiplier sigma, steps) composed
heterogeneously; the ledger records one bucket per contribution per ledger epoch. Buckets with
q = 0 or no steps cost nothing and are left out (prv-accountant raises on q = 0 mechanisms).
Every result is an upper bound on epsilon at the given delta, rounded up to micro-units; `prv`
also reports its estimate and lower bound. Where prv-accountant raises, or its bounds do not
bracket its estimate, the PLD accountant answers instead and the result says so (`fallback`).

Each accountant defines the canonical `key` of a history, and its answer is a pure function of
that key, so the verifier, recomputing from the ledger, gets bit-for-bit what the writer got:

- `pld` is dp-accounting's PLD accountant at its default discretization (1e-4). It composes the
  buckets **in the order given** (epoch order), exactly as dp-accounting's `PLDAccountant` composes a
  `ComposedDpEvent`: identity, then each bucket's self-composition.
  Floating-point convolution is commutative only up to rounding, so the order is part of the key.
  That makes histories prefixes of one another, and each composed prefix is cached: extending a
  contribution's history by one epoch costs one convolution, not a recomputation.
- `rdp` sums each bucket's RDP curve (cached per (q, sigma)) over dp-accounting's default orders
  and converts once; `prv` hands the buckets to prv-accountant. Both are order-free: their key
  merges equal (q, sigma) buckets and sorts them.
"""

from __future__ import annotations

import functools
import logging
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol, Sequence

from govtrain import units

# dp-accounting's RDP orders that fail to converge log a warning each; they are simply excluded.
logging.getLogger("absl").setLevel(logging.ERROR)

Key = tuple[tuple[float, float, int], ...]


@dataclass(frozen=True, slots=True)
class Bucket:
    sampling_rate: float
    noise_multiplier: float
    steps: int

    @classmethod
    def from_micro(cls, sampling_rate_u: int, noise_multiplier_u: int, steps: int) -> "Bucket":
        return cls(sampling_rate_u / units.MICRO, noise_multiplier_u / units.MICRO, steps)

    @property
    def free(self) -> bool:
        return self.sampling_rate == 0 or self.steps == 0


@dataclass(frozen=True, slots=True)
class EpsilonResult:
    epsilon_u: int  # the upper bound, micro-units, rounded up
    accountant: str
    estimate: float | None = None
    lower: float | None = None
    fallback: str | None = None

    @property
    def epsilon(self) -> float:
        return self.epsilon_u / units.MICRO


class Accountant(Protocol):
    name: str
    ordered: bool  # whether the order of buckets is part of the key

    def epsilon(self, buckets: Sequence[Bucket], delta: float) -> EpsilonResult: ...


def _checked(buckets: Sequence[Bucket]) -> list[Bucket]:
    for b in buckets:
        if not (0 <= b.sampling_rate <= 1 and b.noise_multiplier > 0 and b.steps >= 0):
            raise ValueError(f"invalid bucket {b}")
    return [b for b in buckets if not b.free]


def ordered_key(buckets: Sequence[Bucket]) -> Key:
    """The paying buckets in the order given."""
    return tuple((b.sampling_rate, b.noise_multiplier, b.steps) for b in _checked(buckets))


def merged_key(buckets: Sequence[Bucket]) -> Key:
    """The paying buckets with equal (q, sigma) merged, sorted: for accountants where order is immaterial."""
    steps: dict[tuple[float, float], int] = {}
    for b in _checked(buckets):
        steps[(b.sampling_rate, b.noise_multiplier)] = steps.get((b.sampling_rate, b.noise_multiplier), 0) + b.steps
    return tuple((q, s, t) for (q, s), t in sorted(steps.items()))


class _LRU(OrderedDict):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def lookup(self, key):
        value = self.get(key)
        if value is not None:
            self.move_to_end(key)
        return value

    def store(self, key, value) -> None:
        self[key] = value
        if len(self) > self.size:
            self.popitem(last=False)


@functools.lru_cache(maxsize=64)
def _one_step_pld(sampling_rate: float, noise_multiplier: float, interval: float):
    from dp_accounting.pld import privacy_loss_distribution as pld

    return pld.from_gaussian_mechanism(standard_deviation=noise_multiplier, sampling_prob=sampling_rate,
                                       value_discretization_interval=interval)


PLD_INTERVAL = 1e-4


class PLDAccountant:
    name = "pld"
    ordered = True
    key = staticmethod(ordered_key)

    def __init__(self, value_discretization_interval: float = PLD_INTERVAL, cached_prefixes: int = 48) -> None:
        self.interval = value_discretization_interval
        self._buckets = _LRU(256)  # (q, sigma, steps) -> that bucket's self-composed PLD
        self._prefixes = _LRU(cached_prefixes)  # key -> composed PLD (a few MB each)

    def _bucket(self, bucket: tuple[float, float, int]):
        found = self._buckets.lookup(bucket)
        if found is None:
            q, sigma, steps = bucket
            found = _one_step_pld(q, sigma, self.interval).self_compose(steps)
            self._buckets.store(bucket, found)
        return found

    def composed(self, key: Key):
        from dp_accounting.pld import privacy_loss_distribution as pld

        start = len(key)
        while start and self._prefixes.lookup(key[:start]) is None:
            start -= 1
        composed = self._prefixes.lookup(key[:start]) if start else pld.identity(value_discretization_interval=self.interval)
        for i in range(start, len(key)):
            composed = composed.compose(self._bucket(key[i]))
        if len(key) > start:
            self._prefixes.store(key, composed)
        return composed

    def epsilon(self, buckets: Sequence[Bucket], delta: float) -> EpsilonResult:
        key = self.key(buckets)
        if not key:
            return EpsilonResult(0, self.name)
        return EpsilonResult(units.spent_eps_u(float(self.composed(key).get_epsilon_for_delta(delta))), self.name)


@functools.lru_cache(maxsize=1024)
def _rdp_curve(sampling_rate: float, noise_multiplier: float):
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    curve = rdp._compute_rdp_poisson_subsampled_gaussian(sampling_rate, noise_multiplier, _rdp_orders())
    curve.setflags(write=False)
    return curve


@functools.lru_cache(maxsize=1)
def _rdp_orders():
    import numpy as np
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    return np.array(rdp.RdpAccountant()._orders, dtype=np.float64)


class RDPAccountant:
    """dp-accounting's RDP accountant for Poisson-subsampled Gaussians at its default orders: the same
    curve it composes (count x the per-step RDP, summed in key order), converted by its own
    `compute_epsilon`, with the per-step curve cached per (q, sigma)."""

    name = "rdp"
    ordered = False
    key = staticmethod(merged_key)

    def epsilon(self, buckets: Sequence[Bucket], delta: float) -> EpsilonResult:
        import numpy as np
        from dp_accounting.rdp import rdp_privacy_accountant as rdp

        key = self.key(buckets)
        if not key:
            return EpsilonResult(0, self.name)
        total = np.zeros_like(_rdp_orders())
        for q, sigma, steps in key:
            total += steps * _rdp_curve(q, sigma)
        epsilon, _ = rdp.compute_epsilon(_rdp_orders(), total, delta)
        return EpsilonResult(units.spent_eps_u(float(epsilon)), self.name)


class PRVAccountant:
    name = "prv"
    ordered = False
    key = staticmethod(merged_key)

    def __init__(self, eps_error: float = 0.01, delta_error: float = 1e-10) -> None:
        self.eps_error, self.delta_error = eps_error, delta_error

    def epsilon(self, buckets: Sequence[Bucket], delta: float) -> EpsilonResult:
        key = self.key(buckets)
        if not key:
            return EpsilonResult(0, self.name)
        try:
            from prv_accountant import PRVAccountant as _PRV

            accountant = _PRV(
                prvs=[_mechanism(q, sigma) for q, sigma, _ in key],
                max_self_compositions=[steps for _, _, steps in key],
                eps_error=self.eps_error, delta_error=self.delta_error,
            )
            lower, estimate, upper = accountant.compute_epsilon(delta=delta,
                                                                num_self_compositions=[t for _, _, t in key])
        except Exception as e:  # prv-accountant's known failure modes (large epsilon, numerical range)
            return self._fallback(key, delta, f"prv-accountant raised {type(e).__name__}: {e}")
        if not all(math.isfinite(x) for x in (lower, estimate, upper)) or not lower <= estimate <= upper or upper < 0:
            return self._fallback(key, delta, f"prv-accountant bounds are unreliable ({lower}, {estimate}, {upper})")
        return EpsilonResult(units.spent_eps_u(float(upper)), self.name, estimate=estimate, lower=lower)

    def _fallback(self, key: Key, delta: float, reason: str) -> EpsilonResult:
        result = _fallback_pld().epsilon([Bucket(*b) for b in key], delta)
        return EpsilonResult(result.epsilon_u, self.name, fallback=f"pld ({reason})")


def _mechanism(sampling_rate: float, noise_multiplier: float):
    """prv-accountant's Poisson-subsampled Gaussian, with its RDP at each order remembered (`_rdp_of`).

    prv-accountant sizes each accountant's domain from an RDP bound: it evaluates the mechanism's RDP at 150 orders,
    twice per mechanism, in Python (`_compute_log_a_frac`), on every call. That is ~90% of a call's time, and it is
    the same numbers every time for one (q, sigma): a run's planner searches the steps k at a fixed (q, sigma), and the
    verifier recomputes many histories that share their (q, sigma). The remembered value is the object the
    library's own method returned, so every result is bitwise the library's."""
    mechanism = _remembering()(noise_multiplier=noise_multiplier, sampling_probability=sampling_rate)
    mechanism.key = (sampling_rate, noise_multiplier)
    return mechanism


@functools.lru_cache(maxsize=1)
def _remembering() -> type:
    """The mechanism class whose `rdp` is `_rdp_of` (made once: prv-accountant is imported only when asked for)."""
    from prv_accountant import PoissonSubsampledGaussianMechanism

    class RememberingRDP(PoissonSubsampledGaussianMechanism):
        def rdp(self, alpha: float) -> float:
            return _rdp_of(*self.key, alpha)

    return RememberingRDP


@functools.lru_cache(maxsize=1 << 16)  # 150 orders each: ~430 (q, sigma) pairs
def _rdp_of(sampling_rate: float, noise_multiplier: float, alpha: float) -> float:
    from prv_accountant import PoissonSubsampledGaussianMechanism

    return PoissonSubsampledGaussianMechanism(noise_multiplier=noise_multiplier,
                                              sampling_probability=sampling_rate).rdp(alpha)


@functools.lru_cache(maxsize=1)
def _fallback_pld() -> PLDAccountant:
    return PLDAccountant()


ACCOUNTANTS = {"prv": PRVAccountant, "pld": PLDAccountant, "rdp": RDPAccountant}


def get_accountant(name: str) -> Accountant:
    try:
        return ACCOUNTANTS[name]()
    except KeyError:
        raise ValueError(f"unknown accountant {name!r}; choose one of {', '.join(ACCOUNTANTS)}") from None
