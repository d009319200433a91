"""Seed 002's signal-to-noise claim, computed and measured (the inference bench reports it; no torch here).

Seed 002 argued that post-transformer states (norm ~165-190) survive noise of norm sigma sqrt(d) ~ 190, "SNR ~1,
zero quality degradation". But its own mechanism clips the state to Delta_f = 1 before adding the noise, so the
signal that reaches the server has norm 1, not 177: the ratio is 1 / (sigma sqrt(d)). `seed_002_claim` gives those
numbers for a hidden size d (MiniLM: 384) at the seed's epsilon 1, delta 1e-5: the seed's classical sigma, the
analytic sigma at the seed's Delta = C, and govtrain's, at Delta = 2C (any two queries are neighbours).
`measure_norms` takes the same figures from pooled states the encoder actually computes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from govtrain.accounting import gaussian
from govtrain.inference.mechanism import add_noise, clip, noise_rng, release_for


def expected_noise_norm(sigma: float, dimension: int) -> float:
    """E||N(0, sigma^2 I_d)|| = sigma sqrt(2) Gamma((d+1)/2) / Gamma(d/2) (a chi distribution's mean)."""
    return sigma * math.sqrt(2) * math.exp(math.lgamma((dimension + 1) / 2) - math.lgamma(dimension / 2))


@dataclass(frozen=True, kw_only=True, slots=True)
class SeedClaim:
    """The signal (the clipped state: norm at most C) against the noise (norm ~ sigma sqrt(d)), per calibration."""

    dimension: int
    epsilon: float
    delta: float
    clip_norm: float
    sigma_classical: float  # seed 002: Delta sqrt(2 ln(1.25/delta)) / epsilon at Delta = C
    sigma_analytic_seed: float  # the analytic Gaussian at the seed's Delta = C
    sigma_govtrain: float  # the analytic Gaussian at Delta = 2C, what govtrain draws
    seed_true_epsilon: float  # what the seed's sigma gives against any two queries (Delta = 2C), at delta

    def noise_norm(self, sigma: float) -> float:
        """sigma sqrt(d), the seed's own figure (`expected_noise_norm` is the exact mean)."""
        return sigma * math.sqrt(self.dimension)

    def snr(self, sigma: float) -> float:
        """||signal|| / ||noise|| after clipping: C / (sigma sqrt(d))."""
        return self.clip_norm / self.noise_norm(sigma)

    def rows(self) -> list[tuple[str, float, float, float]]:
        """(calibration, sigma, noise norm, signal-to-noise ratio) for each of the three sigmas."""
        return [(name, sigma, self.noise_norm(sigma), self.snr(sigma)) for name, sigma in (
            ("classical, Δ = C (seed 002)", self.sigma_classical),
            ("analytic, Δ = C", self.sigma_analytic_seed),
            ("analytic, Δ = 2C (govtrain)", self.sigma_govtrain))]


def seed_002_claim(dimension: int = 384, epsilon: float = 1.0, delta: float = 1e-5,
                   clip_norm: float = 1.0) -> SeedClaim:
    """The numbers of seed 002's argument for a model of hidden size `dimension` (MiniLM: 384; the seed's: 1536)."""
    classical = gaussian.classical_sigma(epsilon, delta, clip_norm)
    return SeedClaim(dimension=dimension, epsilon=epsilon, delta=delta, clip_norm=clip_norm,
                     sigma_classical=classical,
                     sigma_analytic_seed=gaussian.calibrate_sigma(epsilon, delta, clip_norm),
                     sigma_govtrain=release_for(epsilon, delta, clip_norm).sigma,
                     seed_true_epsilon=gaussian.gdp_epsilon(2 * clip_norm / classical, delta))


@dataclass(frozen=True, kw_only=True, slots=True)
class NormReport:
    """Norms of real pooled states, before and after clipping, and of the noised vectors a client would send."""

    texts: int
    dimension: int
    sigma: float
    clip_norm: float
    raw_norm_mean: float  # the state before clipping: what seed 002 compared the noise with
    raw_norm_min: float
    raw_norm_max: float
    clipped_norm_mean: float  # the signal that reaches the server
    clipped_norm_max: float  # <= clip_norm
    noise_norm_mean: float  # measured: ||noised - clipped||
    cosine_mean: float  # cos(clipped, noised): how much of the direction survives

    @property
    def snr(self) -> float:
        """The signal that reaches the server against the noise it carries (clipped norm mean / noise norm mean)."""
        return self.clipped_norm_mean / self.noise_norm_mean


def measure_norms(encoder: Any, texts: Sequence[str], *, epsilon: float = 1.0, delta: float = 1e-5,
                  clip_norm: float = 1.0, rng: np.random.Generator | None = None) -> NormReport:
    """Pool `texts` with `encoder` (a `PooledEncoder`, or anything with `pooled(texts)`), clip and noise them as the
    client would at (epsilon, delta, C), and report the norms. Nothing is charged or sent."""
    release = release_for(epsilon, delta, clip_norm)
    rng = rng if rng is not None else noise_rng()
    raw = np.asarray(encoder.pooled(list(texts)), dtype=np.float64)
    clipped = np.stack([clip(row, release.clip_norm) for row in raw])
    noised = np.stack([add_noise(row, release, rng) for row in clipped])
    cosines = (clipped * noised).sum(1) / (np.linalg.norm(clipped, axis=1) * np.linalg.norm(noised, axis=1))
    raw_norms, clipped_norms = np.linalg.norm(raw, axis=1), np.linalg.norm(clipped, axis=1)
    return NormReport(texts=len(raw), dimension=raw.shape[1], sigma=release.sigma, clip_norm=release.clip_norm,
                      raw_norm_mean=float(raw_norms.mean()), raw_norm_min=float(raw_norms.min()),
                      raw_norm_max=float(raw_norms.max()),
                      clipped_norm_mean=float(clipped_norms.mean()), clipped_norm_max=float(clipped_norms.max()),
                      noise_norm_mean=float(np.linalg.norm(noised - clipped, axis=1).mean()),
                      cosine_mean=float(cosines.mean()))
