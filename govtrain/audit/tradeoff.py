"""Trade-off curves for the f-DP one-run test (`bounds.fdp_rejects`): what a claim says about how well any test
can tell whether one canary was in (Dong, Roth & Su, "Gaussian differential privacy", 2022).

A trade-off curve f maps a test's type I error α to the least type II error any test can have; a mechanism is
f-DP when no test does better. A claim's curve is built from its privacy profile δ(ε), by their Proposition 2.12:

    f(α) = sup over ε >= 0 of max(0, 1 - δ(ε) - e^ε α, e^-ε (1 - δ(ε) - α))

which is exact when δ is the mechanism's own profile and the sup runs over every ε. Here the sup runs over a finite
grid of ε and δ is an upper bound (dp_accounting's pessimistic PLD), so each line is at or below the true curve's
supporting line and the curve is never *above* the true one: the claim is made no stronger than it is, and a test
against it rejects an honest mechanism no more often than its confidence allows.

`SubsampledGaussian` is the claim an audited run makes: each canary's contribution passes `steps` times through
the Poisson-subsampled (rate q) Gaussian mechanism with noise multiplier σ. Its curve comes from dp_accounting's
privacy loss distribution (add-or-remove adjacency, both directions), and `epsilon` states a member of the family
as ε at δ from the *optimistic* PLD, rounded down: a lower bound that errs only towards saying less.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

_GRID = 600  # ε grid points of a curve: more lines, a curve closer to the true one from below
_TAIL = 1e-12  # the grid reaches the ε where δ(ε) falls below this; lines beyond move f by at most this near α = 0
_DISCRETISATION = 1e-3  # the PLD's privacy-loss bin width at noise multiplier >= 1 (finer costs time, not validity)


@dataclass(frozen=True)
class TradeOff:
    """A convex, decreasing trade-off curve: the upper envelope of the lines intercept - slope·α and of 0."""

    intercepts: np.ndarray
    slopes: np.ndarray

    def __call__(self, alpha: float) -> float:
        return max(0.0, float(np.max(self.intercepts - self.slopes * alpha)))

    @classmethod
    def from_profile(cls, epsilons: np.ndarray, deltas: np.ndarray) -> "TradeOff":
        """The curve of the profile (ε_j, δ_j): two lines per point (Proposition 2.12 above). Each δ_j must be an
        upper bound on the mechanism's δ at ε_j for the curve to be a valid claim."""
        epsilons, deltas = np.asarray(epsilons, dtype=float), np.clip(np.asarray(deltas, dtype=float), 0.0, 1.0)
        if epsilons.shape != deltas.shape or epsilons.size == 0 or not np.all(epsilons >= 0):
            raise ValueError("need as many epsilons (each >= 0) as deltas, and at least one")
        kept = 1 - deltas
        return cls(intercepts=np.concatenate([kept, np.exp(-epsilons) * kept]),
                   slopes=np.concatenate([np.exp(epsilons), np.exp(-epsilons)]))


def perfect_privacy() -> TradeOff:
    """f(α) = 1 - α: nothing tells the two worlds apart."""
    return TradeOff(intercepts=np.array([1.0]), slopes=np.array([1.0]))


def epsilon_delta_curve(epsilon: float, delta: float) -> TradeOff:
    """f_{ε,δ}, the curve of every (ε, δ)-DP mechanism."""
    if not (epsilon >= 0 and math.isfinite(epsilon)) or not 0 <= delta < 1:
        raise ValueError(f"need a finite epsilon >= 0 and 0 <= delta < 1, not {epsilon}, {delta}")
    return TradeOff.from_profile(np.array([epsilon]), np.array([delta]))


@dataclass(frozen=True, kw_only=True)
class SubsampledGaussian:
    """`steps` compositions of the Gaussian mechanism with noise multiplier `noise_multiplier` on a Poisson
    sample at rate `sampling_rate`: an audited canary's mechanism, as the run claims it."""

    noise_multiplier: float
    sampling_rate: float
    steps: int

    def __post_init__(self) -> None:
        if not (self.noise_multiplier > 0 and math.isfinite(self.noise_multiplier)):
            raise ValueError(f"the noise multiplier must be finite and > 0, not {self.noise_multiplier}")
        if not 0 < self.sampling_rate <= 1:
            raise ValueError(f"the sampling rate must be in (0, 1], not {self.sampling_rate}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps must be an int >= 1, not {self.steps!r}")

    def with_noise(self, noise_multiplier: float) -> "SubsampledGaussian":
        """The same q and steps at another noise multiplier: the family the run's claim belongs to."""
        return replace(self, noise_multiplier=noise_multiplier)

    def _pld(self, *, pessimistic: bool):  # type: ignore[no-untyped-def]
        from dp_accounting.pld import privacy_loss_distribution as pld

        # coarser bins for a small noise multiplier, whose privacy losses spread over ~1/σ²: valid, only looser
        interval = _DISCRETISATION * max(1.0, 0.25 / self.noise_multiplier ** 2)
        single = pld.from_gaussian_mechanism(standard_deviation=self.noise_multiplier, sensitivity=1.0,
                                             sampling_prob=self.sampling_rate, pessimistic_estimate=pessimistic,
                                             value_discretization_interval=interval,
                                             use_connect_dots=pessimistic)  # the optimistic side has no dots
        return single.self_compose(self.steps) if self.steps > 1 else single

    def curve(self) -> TradeOff:
        """The claimed trade-off curve, never above the true one (module docstring)."""
        import warnings

        loss = self._pld(pessimistic=True)
        top = float(loss.get_epsilon_for_delta(_TAIL))
        epsilons = np.linspace(0.0, max(top, 1e-3), _GRID)
        with warnings.catch_warnings():  # δ at an ε beyond every finite loss: e^ε overflows to 0·inf, dropped below
            warnings.simplefilter("ignore", RuntimeWarning)
            deltas = np.asarray(loss.get_delta_for_epsilon(epsilons), dtype=float)
        # a δ the PLD could not state is taken as 1 (its lines then say nothing): never stronger than the truth
        deltas = np.where(np.isfinite(deltas), deltas, 1.0)
        return TradeOff.from_profile(epsilons, deltas)

    def epsilon(self, delta: float) -> float:
        """ε at `delta` of this mechanism, from the optimistic PLD: at most the true ε (a lower bound's side)."""
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), not {delta}")
        return max(0.0, float(self._pld(pessimistic=False).get_epsilon_for_delta(delta)))
