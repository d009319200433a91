"""One split-inference request's Gaussian mechanism, the same on both sides (no torch).

The client clips the pooled hidden state h(x) of its query x to L2 norm C and releases clip(h(x)) + N(0, sigma^2 I).
What the mechanism protects is the query: any two queries x, x' are neighbours, and their clipped states can lie
anywhere in the ball of radius C, so ||clip(h(x)) - clip(h(x'))|| <= 2C. The L2 sensitivity is therefore
**Delta = 2C**, not C: seed 002 calibrated sigma for Delta = C after clipping to C, which only covers queries whose
states lie within C of each other.

sigma comes from the analytic Gaussian mechanism (`govtrain.accounting.gaussian`) for the request's (epsilon, delta)
at Delta = 2C. Every quantity is carried as an integer, rounded the way that favours privacy (docs/design.md §2):
epsilon and delta down, the clip norm down (clipping to less never weakens the bound), sigma up. Client and
server compute sigma from the same integers, so the server never needs the sigma a client declares.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from govtrain import units
from govtrain.accounting import gaussian
from govtrain.errors import Code, InferenceError

MAX_EPSILON = 1000.0  # per request; a request for more is no privacy at all (epsilon = inf is not a request)
MAX_BUDGET_EPSILON = 10_000.0  # per session
MIN_DELTA = 1e-12  # delta is kept in pico-units
MAX_CLIP_NORM = 1e6
MAX_DIMENSION = 65_536
FALSE_REFUSAL = 1e-9  # the probability that an honest client's vector is refused as `noise_implausible`
SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def _refuse(code: Code, detail: str) -> InferenceError:
    return InferenceError(code, detail)


def _finite_in(name: str, value: Any, low: float, high: float, *, low_open: bool = True,
               high_open: bool = False) -> float:
    """`value` if it is a finite number in the interval, else `bad_privacy_request` naming the interval."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _refuse(Code.BAD_PRIVACY_REQUEST, f"{name} = {value!r}: a finite number is needed")
    if (value <= low if low_open else value < low) or (value >= high if high_open else value > high):
        raise _refuse(Code.BAD_PRIVACY_REQUEST, f"{name} = {value!r}: it must lie in {'(' if low_open else '['}"
                                                f"{low:g}, {high:g}{')' if high_open else ']'}")
    return float(value)


@dataclass(frozen=True, kw_only=True, slots=True)
class GaussianRelease:
    """One request's mechanism: (epsilon, delta) in micro- and pico-units, the clip norm C and the noise sigma in
    micro-units. `sigma_u` is always `calibrate_sigma_u(epsilon_u, delta_p, 2 C)`: build it with `release_for`."""

    epsilon_u: int
    delta_p: int
    clip_norm_u: int
    sigma_u: int

    @property
    def sensitivity_u(self) -> int:
        """Delta = 2C: two queries' clipped states differ by at most the ball's diameter."""
        return 2 * self.clip_norm_u

    @property
    def mu_sq(self) -> int:
        """(Delta/sigma)^2, in `gaussian.MU_SQ_SCALE` units rounded up: what the request adds to its session."""
        return gaussian.mu_sq_units(self.sensitivity_u, self.sigma_u)

    @property
    def epsilon(self) -> float:
        return self.epsilon_u / units.MICRO

    @property
    def delta(self) -> float:
        return self.delta_p / units.PICO

    @property
    def clip_norm(self) -> float:
        return self.clip_norm_u / units.MICRO

    @property
    def sigma(self) -> float:
        return self.sigma_u / units.MICRO


def release_for(epsilon: float, delta: float, clip_norm: float) -> GaussianRelease:
    """The mechanism of a request at (`epsilon`, `delta`) whose pooled state is clipped to `clip_norm`; a value out
    of range (epsilon <= 0 or above `MAX_EPSILON`, delta outside [1e-12, 1), C <= 0) is `bad_privacy_request`."""
    _finite_in("epsilon", epsilon, 0.0, MAX_EPSILON)
    _finite_in("delta", delta, MIN_DELTA, 1.0, low_open=False, high_open=True)
    _finite_in("clip_norm", clip_norm, 0.0, MAX_CLIP_NORM)
    epsilon_u, delta_p, clip_u = units.to_micro(epsilon, "down"), units.delta_p(delta), units.clip_norm_u(clip_norm)
    if epsilon_u < 1 or delta_p < 1 or clip_u < 1:
        raise _refuse(Code.BAD_PRIVACY_REQUEST, f"epsilon {epsilon!r}, delta {delta!r} and clip norm {clip_norm!r} "
                                                "are kept to 1e-6, 1e-12 and 1e-6: one rounds to zero")
    sigma_u = gaussian.calibrate_sigma_u(epsilon_u, delta_p, 2 * clip_u)
    return GaussianRelease(epsilon_u=epsilon_u, delta_p=delta_p, clip_norm_u=clip_u, sigma_u=sigma_u)


def check_declared_sigma(release: GaussianRelease, declared: Any) -> None:
    """A sigma a client declares must be the one its (epsilon, delta, C) calibrate to, to the micro-unit: the server
    never charges a declared sigma, and a client that computes another is miscalibrated (`sigma_mismatch`)."""
    if isinstance(declared, bool) or not isinstance(declared, (int, float)) or not math.isfinite(declared) \
            or abs(units.to_micro(declared, "up") - release.sigma_u) > 1:
        raise _refuse(Code.SIGMA_MISMATCH, f"sigma {declared!r} is not what epsilon {release.epsilon:g}, delta "
                                           f"{release.delta:g} and clip norm {release.clip_norm:g} calibrate to "
                                           f"({release.sigma:.6f}, the analytic Gaussian mechanism at Delta = 2C): "
                                           "compute sigma with govtrain.inference.release_for")


def check_session_id(session_id: Any) -> str:
    if not isinstance(session_id, str) or not SESSION_ID.fullmatch(session_id):
        raise _refuse(Code.BAD_SPLIT_REQUEST, f"session id {str(session_id)[:40]!r}: 1 to 128 characters of "
                                              "A-Z a-z 0-9 . _ : - are needed")
    return session_id


def as_vector(values: Any, dimension: int) -> np.ndarray:
    """`values` as a float64 vector of `dimension` finite numbers, else `bad_vector`."""
    try:
        vector = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
        raise _refuse(Code.BAD_VECTOR, "the vector is not a list of numbers") from None
    if vector.ndim != 1 or vector.shape[0] != dimension:
        raise _refuse(Code.BAD_VECTOR, f"the vector has shape {tuple(vector.shape)}; the model's pooled state has "
                                       f"{dimension} numbers")
    if not np.isfinite(vector).all():
        raise _refuse(Code.BAD_VECTOR, f"the vector holds {int((~np.isfinite(vector)).sum())} NaN or infinite "
                                       "value(s)")
    return vector


def clip(vector: np.ndarray, clip_norm: float) -> np.ndarray:
    """`vector` scaled to L2 norm at most `clip_norm` (float64; unchanged when already inside the ball)."""
    vector = np.asarray(vector, dtype=np.float64)
    if not np.isfinite(vector).all():
        raise _refuse(Code.BAD_VECTOR, "the pooled state holds NaN or infinity: the model's output cannot be clipped")
    norm = float(np.linalg.norm(vector))
    if norm <= clip_norm:
        return vector.copy()
    clipped = vector * (clip_norm / norm)
    while float(np.linalg.norm(clipped)) > clip_norm:  # the product's rounding can land one ulp outside the ball
        clipped = clipped * (1 - 2.0 ** -52)
    return clipped


def noise_rng() -> np.random.Generator:
    """A generator seeded with 128 bits of the operating system's entropy (numpy's SeedSequence)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence()))


def add_noise(clipped: np.ndarray, release: GaussianRelease, rng: np.random.Generator) -> np.ndarray:
    """`clipped` + N(0, sigma^2 I), sigma the release's (float64)."""
    return clipped + rng.normal(0.0, release.sigma, size=clipped.shape)


def norm_bounds(release: GaussianRelease, dimension: int) -> tuple[float, float]:
    """(low, high): an honest vector h + n with ||h|| <= C and n ~ N(0, sigma^2 I_d) has ||n|| - C <= ||h + n|| <=
    ||n|| + C, and ||n||^2 / sigma^2 is chi-square with d degrees of freedom; each bound is missed with
    probability FALSE_REFUSAL / 2."""
    from scipy.special import chdtri  # chdtri(d, p): the x with P(chi2_d > x) = p

    low = release.sigma * math.sqrt(float(chdtri(dimension, 1 - FALSE_REFUSAL / 2))) - release.clip_norm
    high = release.sigma * math.sqrt(float(chdtri(dimension, FALSE_REFUSAL / 2))) + release.clip_norm
    return max(low, 0.0), high


def check_noise(vector: np.ndarray, release: GaussianRelease) -> None:
    """Refuse a vector whose norm the declared clip norm and noise cannot explain (`noise_implausible`): one sent
    without noise, with less, or unclipped. A vector inside the bounds may still have been made dishonestly; the
    check catches the gross mistakes (where the noise dominates the signal, a missing noise), not every lie."""
    low, high = norm_bounds(release, vector.shape[0])
    with np.errstate(over="ignore"):  # a norm past the float range is inf, and refused as such
        norm = float(np.linalg.norm(vector))
    if not low <= norm <= high:
        raise _refuse(Code.NOISE_IMPLAUSIBLE, f"the vector's norm {norm:.4g} lies outside [{low:.4g}, {high:.4g}], "
                                              f"where a state clipped to {release.clip_norm:g} plus noise of sigma "
                                              f"{release.sigma:g} in {vector.shape[0]} dimensions lies but with "
                                              f"probability {FALSE_REFUSAL:g}: clip, then add the noise the request "
                                              "declares")


@dataclass(frozen=True, kw_only=True, slots=True)
class SessionBudget:
    """A session's budget: the most epsilon, at delta, that its requests together may spend (micro-, pico-units)."""

    epsilon_u: int
    delta_p: int

    @property
    def epsilon(self) -> float:
        return self.epsilon_u / units.MICRO

    @property
    def delta(self) -> float:
        return self.delta_p / units.PICO


def session_budget(epsilon: float, delta: float) -> SessionBudget:
    """A session budget of `epsilon` at `delta`, both rounded down."""
    _finite_in("session budget epsilon", epsilon, 0.0, MAX_BUDGET_EPSILON)
    _finite_in("session delta", delta, MIN_DELTA, 1.0, low_open=False, high_open=True)
    budget = SessionBudget(epsilon_u=units.eps_budget_u(epsilon), delta_p=units.delta_p(delta))
    if budget.epsilon_u < 1 or budget.delta_p < 1:
        raise _refuse(Code.BAD_PRIVACY_REQUEST, "a session budget's epsilon and delta are kept to 1e-6 and 1e-12: "
                                                "one rounds to zero")
    return budget
