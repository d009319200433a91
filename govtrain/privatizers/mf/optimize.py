"""Strategy optimisation for a horizon of T steps: small, deterministic (torch float64 L-BFGS from a fixed start).

Both objectives are the mean squared prefix-sum error at unit noise times the squared sensitivity the charge uses,
so that they are invariant to the strategy's scale and compare directly with DP-SGD's (T+1)/2:

- banded (`banded_column`): err(C) · max column norm², the per-participation sensitivity of amplified banded MF
  (b-separated participations touch disjoint rows of a b-banded C). c_0 is fixed at 1 and c_1..c_{b-1} are free.
- BLT (`blt_parameters`): err(C) · m(C), m the per-participation factor of `charge.participation_factor` at the
  strategy's min separation (its unamplified multi-participation charge), with θ ∈ (0, 1), ω > 0, Σω < 1 by
  construction (θ = sigmoid(a), ω = sigmoid(g)·softmax(β)), so C's column is positive and non-increasing.

Results are what the record carries (integers), so nothing downstream re-runs an optimisation: the verifier rebuilds
from the record. Optimising twice on one machine gives the same coefficients.
"""

from __future__ import annotations

import functools
import math

import torch

from govtrain.privatizers.mf.toeplitz import prefix_error_t

_ITERATIONS = 300


def _minimise(params: list[torch.Tensor], loss) -> None:
    optimiser = torch.optim.LBFGS(params, lr=1.0, max_iter=_ITERATIONS, tolerance_grad=1e-10,
                                  tolerance_change=1e-13, history_size=20, line_search_fn="strong_wolfe")

    def closure():
        optimiser.zero_grad()
        value = loss()
        value.backward()
        return value

    optimiser.step(closure)


def sqrt_column(length: int) -> list[float]:
    """The first coefficients of (1-x)^(-1/2), A^{1/2}'s column: C(2k, k) / 4^k. The optimal unbanded
    factorisation's neighbourhood, and the banded optimiser's start."""
    out = [1.0]
    for k in range(1, length):
        out.append(out[-1] * (2 * k - 1) / (2 * k))
    return out


@functools.lru_cache(maxsize=32)
def banded_column(bands: int, horizon: int) -> tuple[float, ...]:
    """The b coefficients of the banded Toeplitz strategy minimising err(C)·‖c‖² for T = horizon, scaled so that
    ‖c‖ = 1 (float64; the record rounds them)."""
    if not 1 <= bands <= horizon:
        raise ValueError(f"bands must be in [1, horizon], got {bands} for horizon {horizon}")
    if bands == 1:
        return (1.0,)
    with torch.no_grad():
        start = torch.tensor(sqrt_column(bands)[1:], dtype=torch.float64)
    tail = start.clone().requires_grad_(True)
    one = torch.ones(1, dtype=torch.float64)

    def loss():
        column = torch.cat([one, tail])
        return torch.log(prefix_error_t(column, horizon)) + torch.log(torch.dot(column, column))

    _minimise([tail], loss)
    column = torch.cat([one, tail.detach()])
    column = column / torch.linalg.vector_norm(column)
    return tuple(float(v) for v in column)


def blt_column_t(theta: torch.Tensor, omega: torch.Tensor, horizon: int) -> torch.Tensor:
    """c_0 = 1, c_k = Σ_j ω_j θ_j^{k-1}: the raw BLT strategy's first column over the horizon."""
    k = torch.arange(horizon - 1, dtype=torch.float64)
    tail = (omega[:, None] * torch.exp(k[None, :] * torch.log(theta)[:, None])).sum(0)
    return torch.cat([torch.ones(1, dtype=torch.float64), tail])


def blt_factor_t(theta: torch.Tensor, omega: torch.Tensor, separation: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(r(0), r(0) + 2·Σ_{i≥1} r(i·sep)) of the raw column, r(L) = Σ_k c_k c_{k+L} over the infinite horizon, in
    closed form (see charge.participation_factor, its float64 twin; the charge computes it exactly, charge.factor_p)."""
    cross = omega[:, None] * omega[None, :] / (1 - theta[:, None] * theta[None, :])
    r0 = 1 + cross.sum()
    tb = theta ** separation
    lagged = (omega * theta ** (separation - 1) / (1 - tb)).sum() + (cross * (tb / (1 - tb))[None, :]).sum()
    return r0, r0 + 2 * lagged


def _blt_start(buffers: int, horizon: int) -> tuple[list[float], list[float]]:
    # decays spread on a log scale between ~1/2 and 1 - 1/T: one buffer per time scale of the horizon
    theta = [1 - 0.5 * (2.0 / horizon) ** ((j + 1) / (buffers + 1)) for j in range(buffers)]
    return theta, [0.5 / buffers] * buffers


@functools.lru_cache(maxsize=32)
def blt_parameters(buffers: int, horizon: int, separation: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(θ, ω) of the d-buffer BLT minimising err(C)·m(C) for T = horizon and min separation `separation`."""
    if buffers < 1 or horizon < 2 or not 1 <= separation <= horizon:
        raise ValueError("a BLT needs buffers ≥ 1, horizon ≥ 2 and a separation in [1, horizon]")
    theta0, omega0 = _blt_start(buffers, horizon)
    a = torch.tensor([math.log(t / (1 - t)) for t in theta0], dtype=torch.float64, requires_grad=True)
    beta = torch.zeros(buffers, dtype=torch.float64, requires_grad=True)
    g = torch.tensor([math.log(sum(omega0) / (1 - sum(omega0)))], dtype=torch.float64, requires_grad=True)

    def unpack():
        return torch.sigmoid(a), torch.sigmoid(g) * torch.softmax(beta, 0)

    def loss():
        theta, omega = unpack()
        _, factor = blt_factor_t(theta, omega, separation)
        return torch.log(prefix_error_t(blt_column_t(theta, omega, horizon), horizon)) + torch.log(factor)

    _minimise([a, beta, g], loss)
    theta, omega = (v.detach() for v in unpack())
    order = torch.argsort(theta)
    return tuple(float(v) for v in theta[order]), tuple(float(v) for v in omega[order])
