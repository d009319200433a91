"""Accountants behind one interface: `prv` (prv-accountant), `pld` and `rdp` (dp-accounting).

A history is a list of buckets (sampling rate q, noise multiplier sigma, steps) composed
heterogeneously. Buckets with q = 0 or no steps cost nothing and are left out (prv-accountant
raises on q = 0 mechanisms). Every result is an upper bound on epsilon at the given delta,
rounded up to micro-units; `prv` also reports its estimate and lower bound. Where prv-accountant
raises, or its bounds do not bracket its estimate, the PLD accountant answers instead and the
result says so (`fallback`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Protocol, Sequence

from govtrain import units

# dp-accounting's RDP orders that fail to converge log a warning each; they are simply excluded.
logging.getLogger("absl").setLevel(logging.ERROR)


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

    def epsilon(self, buckets: Sequence[Bucket], delta: float) -> EpsilonResult: ...


def _merged(buckets: Sequence[Bucket]) -> list[Bucket]:
    """Paying buckets, with equal (q, sigma) merged: composition is commutative."""
    steps: dict[tuple[float, float], int] = {}
    for b in buckets:
        if b.sampling_rate < 0 or b.noise_multiplier <= 0 or b.steps < 0 or b.sampling_rate > 1:
            raise ValueError(f"invalid bucket {b}")
        if not b.free:
            steps[(b.sampling_rate, b.noise_multiplier)] = steps.get((b.sampling_rate, b.noise_multiplier), 0) + b.steps
    return [Bucket(q, s, t) for (q, s), t in sorted(steps.items())]


def _dp_event(buckets: Sequence[Bucket]):
    from dp_accounting import dp_event

    return dp_event.ComposedDpEvent([
        dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(b.sampling_rate,
                                                                    dp_event.GaussianDpEvent(b.noise_multiplier)),
                                     b.steps)
        for b in buckets
    ])


class PLDAccountant:
    name = "pld"

    def __init__(self, value_discretization_interval: float = 1e-4) -> None:
        self.interval = value_discretization_interval

    def epsilon(self, buckets: Sequence[Bucket], delta: float) -> EpsilonResult:
        from dp_accounting import pld

        paying = _merged(buckets)
        if not paying:
            return EpsilonResult(0, self.name)
        accountant = pld.PLDAccountant(value_discretization_interval=self.interval)
        accountant.compose(_dp_event(paying))
        return EpsilonResult(units.spent_eps_u(float(accountant.get_epsilon(delta))), self.name)


class RDPAccountant:
    name = "rdp"

    def epsilon(self, buckets: Sequence[Bucket], delta: float) -> EpsilonResult:
        from dp_accounting import rdp

        paying = _merged(buckets)
        if not paying:
            return EpsilonResult(0, self.name)
        accountant = rdp.RdpAccountant()
        accountant.compose(_dp_event(paying))
        return EpsilonResult(units.spent_eps_u(float(accountant.get_epsilon(delta))), self.name)


class PRVAccountant:
    name = "prv"

    def __init__(self, eps_error: float = 0.01, delta_error: float = 1e-10) -> None:
        self.eps_error, self.delta_error = eps_error, delta_error

    def epsilon(self, buckets: Sequence[Bucket], delta: float) -> EpsilonResult:
        paying = _merged(buckets)
        if not paying:
            return EpsilonResult(0, self.name)
        try:
            from prv_accountant import PoissonSubsampledGaussianMechanism
            from prv_accountant import PRVAccountant as _PRV

            accountant = _PRV(
                prvs=[PoissonSubsampledGaussianMechanism(noise_multiplier=b.noise_multiplier,
                                                         sampling_probability=b.sampling_rate) for b in paying],
                max_self_compositions=[b.steps for b in paying],
                eps_error=self.eps_error, delta_error=self.delta_error,
            )
            lower, estimate, upper = accountant.compute_epsilon(delta=delta,
                                                                num_self_compositions=[b.steps for b in paying])
        except Exception as e:  # prv-accountant's known failure modes (large epsilon, numerical range)
            return self._fallback(paying, delta, f"prv-accountant raised {type(e).__name__}: {e}")
        if not all(math.isfinite(x) for x in (lower, estimate, upper)) or not lower <= estimate <= upper:
            return self._fallback(paying, delta, f"prv-accountant bounds are unreliable ({lower}, {estimate}, {upper})")
        return EpsilonResult(units.spent_eps_u(float(upper)), self.name, estimate=estimate, lower=lower)

    def _fallback(self, paying: list[Bucket], delta: float, reason: str) -> EpsilonResult:
        result = PLDAccountant().epsilon(paying, delta)
        return EpsilonResult(result.epsilon_u, self.name, fallback=f"pld ({reason})")


ACCOUNTANTS = {"prv": PRVAccountant, "pld": PLDAccountant, "rdp": RDPAccountant}


def get_accountant(name: str) -> Accountant:
    try:
        return ACCOUNTANTS[name]()
    except KeyError:
        raise ValueError(f"unknown accountant {name!r}; choose one of {', '.join(ACCOUNTANTS)}") from None


def spend_epsilon_u(accountant: str, delta_p: int, history: Sequence[tuple[int, int, int]]) -> int:
    """The verifier's `SpendAccountant`: epsilon (micro-units, rounded up) of a recorded history of
    (sampling_rate_u, noise_multiplier_u, steps) under the named accountant at delta_p / 10^12."""
    buckets = [Bucket.from_micro(q, s, t) for q, s, t in history]
    return get_accountant(accountant).epsilon(buckets, delta_p / units.PICO).epsilon_u
