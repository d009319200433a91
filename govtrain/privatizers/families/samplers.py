"""Noise samplers of the noise families (docs/privatizers.md, "Noise families"), vectorised over numpy arrays.

- `discrete_gaussian(rng, n, sigma2)`: N_Z(0, σ²) by the exact sampler of Canonne, Kamath and Steinke (2020,
  Algorithms 1-3): rejection from a discrete Laplace, every Bernoulli exact, drawn as a uniform integer below a
  denominator (`Generator.integers`, exact). Each rejection loop runs on the whole pending array at once, so
  10⁶ draws take a few hundred milliseconds; an element whose integers would leave int64 (σ so large, or a tail
  so far out, that it never happens in practice) finishes the same algorithm in Python integers.
- `discrete_laplace(rng, n, t)`: P(x) ∝ exp(-|x|/t) on the integers, exact (CKS Algorithm 2).
- `skellam(rng, n, mu)`: Poisson(μ) − Poisson(μ) (variance 2μ), numpy's Poisson samplers, which compute their
  acceptance test in double: within a factor e^(±1e-9) of the exact pmf only for μ ≤ 2^15 (b ≤ 8,
  `accounting.families.SKELLAM_MAX_BITS`), refused above.
- `laplace(rng, n, b)`: the continuous Laplace(b), floating point. **Not used to release anything**: Mironov
  (2012) showed that a floating-point Laplace leaks the exact value through the low bits of the noisy output. The
  Laplace privatizer quantises each clipped gradient to an integer lattice instead and adds `discrete_laplace`
  there (`laplace.py`), so every output is an integer multiple of one public spacing and its low bits carry
  nothing. This one is kept for comparisons and tests.

The generator is numpy's PCG64 (`generator`), seeded with 256 bits from the operating system, or in tests from
an insecure seed; never from a torch generator (torch's CPU generator keeps 32 bits of its seed).
"""

from __future__ import annotations

import math
import os
from fractions import Fraction

import numpy as np

from govtrain.accounting.families import SKELLAM_MAX_BITS

__all__ = ["generator", "bernoulli_exp", "discrete_laplace", "discrete_gaussian", "skellam", "laplace"]

SKELLAM_MAX_MU = 1 << (2 * SKELLAM_MAX_BITS - 1)  # μ = 4^b / 2 at the largest b Skellam accepts
_SAFE = 1 << 55  # a denominator below this times a K below 2^7 stays below 2^62: int64 throughout
_K_LIMIT = 1 << 7


def generator(insecure_seed: int | tuple[int, ...] | None = None) -> np.random.Generator:
    """A PCG64 generator seeded with 256 bits from the operating system (`os.urandom`), or, for tests only, from
    `insecure_seed` (a non-negative integer or a sequence of them). Never from a torch generator: torch's CPU
    generator keeps 32 bits of its seed, and noise from one of 2^32 streams can be enumerated and subtracted."""
    if insecure_seed is None:
        seed = int.from_bytes(os.urandom(32), "big")
    elif isinstance(insecure_seed, (int, tuple, list)) and not isinstance(insecure_seed, bool):
        seed = insecure_seed
    else:
        raise TypeError(f"the noise generator is seeded from the OS, or from an integer insecure seed in tests: "
                        f"got {type(insecure_seed).__name__}")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed)))


# -- exact Bernoullis (CKS Algorithm 1) ------------------------------------------------------------------------

def _uniform_below(rng: np.random.Generator, bound: int) -> int:
    """A uniform integer in [0, bound) for a Python integer of any size: 62-bit words, rejection above."""
    bits = max(1, (bound - 1).bit_length())
    words = (bits + 61) // 62
    while True:
        value = 0
        for word in rng.integers(0, 1 << 62, size=words, dtype=np.int64).tolist():
            value = (value << 62) | int(word)
        value >>= words * 62 - bits
        if value < bound:
            return value


def _bernoulli_exp_scalar(rng: np.random.Generator, gamma: Fraction, k: int = 1) -> bool:
    """Bern(exp(-γ)) in Python integers (the slow path): `k` resumes the fractional loop at that K."""
    whole = gamma.numerator // gamma.denominator
    for _ in range(whole if k == 1 else 0):
        if not _bernoulli_exp_one_scalar(rng):
            return False
    frac = gamma - whole if k == 1 else gamma
    while _uniform_below(rng, frac.denominator * k) < frac.numerator:
        k += 1
    return k % 2 == 1


def _bernoulli_exp_one_scalar(rng: np.random.Generator) -> bool:
    """Bern(exp(-1)) in Python integers: the K loop at γ = 1 (Bern(1/K) is a uniform integer below K being 0),
    whose first Bern(1/1) always succeeds."""
    k = 2
    while _uniform_below(rng, k) == 0:
        k += 1
    return k % 2 == 1


def _bernoulli_exp_fraction(rng: np.random.Generator, num: np.ndarray, den: np.ndarray | int) -> np.ndarray:
    """Bern(exp(-num/den)) for 0 ≤ num ≤ den < 2^55 (int64 arrays, or one int den for all): K counts how long
    Bern(γ/K) keeps succeeding; exp(-γ) = P(K odd)."""
    count = num.shape[0]
    k = np.ones(count, dtype=np.int64)
    if np.ndim(den) == 0:  # one denominator: the first round (K = 1) draws below a scalar, much faster
        success = rng.integers(0, int(den), size=count, dtype=np.int64) < num
        den = np.full(count, int(den), dtype=np.int64)
    else:
        success = rng.integers(0, den) < num
    k[success] = 2
    active = np.flatnonzero(success)
    while active.size:
        success = rng.integers(0, den[active] * k[active]) < num[active]
        k[active[success]] += 1
        active = active[success]
        far = k[active] >= _K_LIMIT  # never in practice (1/127!): finish those in Python integers
        if far.any():
            for i in active[far].tolist():
                k[i] = 1 if _bernoulli_exp_scalar(rng, Fraction(int(num[i]), int(den[i])), int(k[i])) else 2
            active = active[~far]
    return k % 2 == 1


def _bernoulli_exp_one(rng: np.random.Generator, count: int) -> np.ndarray:
    """Bern(exp(-1)) `count` times: the K loop with γ = 1, whose first Bern(1/1) always succeeds (so it starts at
    K = 2), each Bern(1/K) a uniform integer below K being 0."""
    k = np.full(count, 2, dtype=np.int64)
    active = np.arange(count)
    while active.size:
        success = rng.integers(0, k[active]) == 0
        k[active[success]] += 1
        active = active[success]
    return k % 2 == 1


def bernoulli_exp(rng: np.random.Generator, num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """Exact Bern(exp(-num/den)) per element, for int64 arrays num ≥ 0, den ≥ 1 (den < 2^55): the whole part of
    γ as that many Bern(exp(-1)) in a row, then the fractional part (CKS Algorithm 1)."""
    num = np.asarray(num, dtype=np.int64)
    den = int(den) if np.ndim(den) == 0 else np.asarray(den, dtype=np.int64)
    if num.size and (int(num.min()) < 0 or int(np.min(den)) < 1 or int(np.max(den)) >= _SAFE):
        raise ValueError("bernoulli_exp needs num >= 0 and 1 <= den < 2^55")
    whole = num // den
    out = np.ones(num.shape[0], dtype=bool)
    pending = np.flatnonzero(whole > 0)
    left = whole.copy()
    while pending.size:
        ok = _bernoulli_exp_one(rng, pending.size)
        out[pending[~ok]] = False
        left[pending] -= 1
        pending = pending[ok & (left[pending] > 0)]
    alive = np.flatnonzero(out)
    den_alive = den if np.ndim(den) == 0 else den[alive]
    out[alive] = _bernoulli_exp_fraction(rng, num[alive] - whole[alive] * den_alive, den_alive)
    return out


# -- the integer distributions ---------------------------------------------------------------------------------

def discrete_laplace(rng: np.random.Generator, n: int, t: int) -> np.ndarray:
    """n draws of the discrete Laplace with scale t (an integer ≥ 1): P(x) ∝ exp(-|x|/t), exactly (CKS
    Algorithm 2: U uniform below t kept with probability exp(-U/t), plus t times a geometric count of
    Bern(exp(-1)) successes, a fair sign, and -0 rejected)."""
    if int(t) != t or t < 1 or t >= _SAFE:
        raise ValueError(f"the discrete Laplace scale must be an integer in [1, 2^55): got {t}")
    t = int(t)
    out = np.zeros(n, dtype=np.int64)
    pending = np.arange(n)
    while pending.size:
        u = rng.integers(0, t, size=pending.size, dtype=np.int64)
        kept = _bernoulli_exp_fraction(rng, u, t)  # U < t: γ = U/t < 1
        pending_u, slots = u[kept], pending[kept]
        v = np.zeros(slots.size, dtype=np.int64)
        going = np.arange(slots.size)
        while going.size:
            success = _bernoulli_exp_one(rng, going.size)
            v[going[success]] += 1
            going = going[success]
        x = pending_u + t * v
        negative = rng.integers(0, 2, size=slots.size, dtype=np.int64) == 1
        good = ~(negative & (x == 0))
        out[slots[good]] = np.where(negative[good], -x[good], x[good])
        done = np.zeros(pending.size, dtype=bool)
        done[np.flatnonzero(kept)[good]] = True
        pending = pending[~done]
    return out


def _sigma_squared(sigma2) -> Fraction:  # type: ignore[no-untyped-def]
    value = Fraction(sigma2)
    if value <= 0:
        raise ValueError(f"the discrete Gaussian needs sigma^2 > 0: got {sigma2}")
    return value


def discrete_gaussian(rng: np.random.Generator, n: int, sigma2) -> np.ndarray:  # type: ignore[no-untyped-def]
    """n draws of N_Z(0, σ²), P(x) ∝ exp(-x²/(2σ²)) on the integers, exactly (CKS Algorithm 3), for a rational
    σ² (an int, a Fraction, or a float taken at its exact binary value). The proposal is the discrete Laplace of
    integer scale t (t = σ when σ is an integer, else ⌊σ⌋ + 1: any t > 0 is correct, these keep the acceptance
    near CKS's), kept with probability exp(-(|Y| - σ²/t)²/(2σ²))."""
    s2 = _sigma_squared(sigma2)
    root = math.isqrt(s2.numerator // s2.denominator) if s2.denominator == 1 else None
    t = root if root is not None and root * root == s2 and root > 0 else math.floor(math.sqrt(float(s2))) + 1
    # γ = (|Y| - σ²/t)² / (2σ²) = (|Y|·q - p)² · s / (2 q² r) with σ²/t = p/q and σ² = r/s in lowest terms
    shift = s2 / t
    p, q, r, s = shift.numerator, shift.denominator, s2.numerator, s2.denominator
    g = math.gcd(s, 2 * q * q * r)
    scale, den = s // g, 2 * q * q * r // g
    out = np.zeros(n, dtype=np.int64)
    pending = np.arange(n)
    while pending.size:
        y = discrete_laplace(rng, pending.size, t)
        a = np.abs(y)
        accept = np.zeros(pending.size, dtype=bool)
        # int64 where (|Y|q - p)² · scale and den · K stay below 2^62; Python integers elsewhere
        small = (a < (1 << 30) // max(q, 1)) if den < _SAFE and p < (1 << 30) and scale < (1 << 30) else \
            np.zeros(pending.size, dtype=bool)
        if small.any():
            diff = a[small] * q - p
            num = diff * diff
            fits = num < (1 << 62) // scale
            index = np.flatnonzero(small)[fits]
            small[np.flatnonzero(small)[~fits]] = False
            accept[index] = bernoulli_exp(rng, num[fits] * scale, den)
        for i in np.flatnonzero(~small).tolist():
            accept[i] = _bernoulli_exp_scalar(rng, Fraction((int(a[i]) * q - p) ** 2 * scale, den))
        out[pending[accept]] = y[accept]
        pending = pending[~accept]
    return out


def skellam(rng: np.random.Generator, n: int, mu: int) -> np.ndarray:
    """n draws of Skellam(μ, μ) = Poisson(μ) − Poisson(μ): mean 0, variance 2μ (numpy's Poisson samplers:
    inversion below λ = 10, Hörmann's PTRS rejection above)."""
    if not 0 < mu <= SKELLAM_MAX_MU:
        raise ValueError(f"the Skellam mean must be positive and at most 2^{2 * SKELLAM_MAX_BITS - 1} (where numpy's "
                         f"Poisson matches the exact pmf): got {mu}")
    return rng.poisson(mu, size=n).astype(np.int64) - rng.poisson(mu, size=n).astype(np.int64)


def laplace(rng: np.random.Generator, n: int, b: float) -> np.ndarray:
    """n draws of the continuous Laplace(0, b) in float64. Floating point: never add it to a released value
    (Mironov 2012); the Laplace privatizer uses `discrete_laplace` on a lattice."""
    if not b > 0:
        raise ValueError(f"the Laplace scale must be positive: got {b}")
    return rng.laplace(0.0, b, size=n)
