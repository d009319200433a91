"""DP-Muon's orthogonalization (seed 001 in docs/design.md, arXiv 2605.12994): orient, normalize, Newton–Schulz.

    Y₀ = 𝒯(m) / max(1, ‖𝒯(m)‖_F),   Y_j = p_κ(Y_{j−1} Y_{j−1}ᵀ) Y_{j−1}  (j = 1 … q),   O = 𝒯⁻¹(Y_q)

𝒯 transposes a matrix with more rows than columns, so the Gram matrix Y Yᵀ is the small side. p_κ is the
degree-κ Taylor polynomial of λ^{-1/2} at 1,

    p_κ(λ) = Σ_{s=0}^{κ} (2s)! / (4^s (s!)²) · (1 − λ)^s,

so each iteration maps a singular value y to y·p_κ(y²), whose fixed point is 1: for y in (0, 1] it
increases monotonically towards 1 (y ≤ 1 after the Frobenius normalization), the faster the larger κ.
Zero rows and columns stay zero (the iteration multiplies by polynomials in Y Yᵀ on the left), so
coordinates no class reaches are never moved by the orthogonalized step.

`quintic` is `torch.optim.Muon`'s iteration instead, with that class's own default coefficients and step
count: tuned for speed, it leaves singular values spread around 1 (about 0.7–1.2) rather than converging.

Privacy: matrices clipped separately, one mechanism
---------------------------------------------------
The seed clips every matrix W to its own C_W and noises it at σ·C_W. Clipped separately, L matrices
together have sensitivity ‖(C_{W_1}, …, C_{W_L})‖₂, so noising each at σ·C_W is *one* Gaussian mechanism
with the multiplier σ / √L (for equal C_W), not σ: charging σ would understate ε. (Charging "L-fold
composition" of σ-mechanisms is no fix either: all L releases see the same Poisson batch, which is one
subsampled mechanism, not L independently subsampled ones.) govtrain takes the other branch, which keeps
the charge exactly as DP-SGD's: a contribution i whose profile reaches L_i parameters clips each of
them, per sample, to C_i / √L_i (`unit_clip_norms`), so the joint norm is at most C_i, and the routing
layer noises every coordinate at the group's s_g ≥ σ_i·C_i = σ_i·‖C‖₂. `joint_noise_multiplier` states
the rule for any clip norms and standard deviations, and the tests check both branches against it.
"""

from __future__ import annotations

import inspect
import math
from typing import Literal, Mapping, Sequence

import torch
from torch import Tensor, nn

from govtrain.mechanisms.stacking import shape_groups

__all__ = ["orient", "unorient", "ns_coefficients", "newton_schulz", "quintic", "QUINTIC", "QUINTIC_STEPS",
           "DPMuon", "unit_clip_norms", "joint_noise_multiplier"]


def orient(X: Tensor) -> Tensor:
    """𝒯: the transpose of a matrix with more rows than columns, the matrix itself otherwise."""
    return X.transpose(-1, -2) if X.shape[-2] > X.shape[-1] else X


def unorient(Y: Tensor, shape: torch.Size | tuple[int, ...]) -> Tensor:
    """𝒯⁻¹ for a matrix that had `shape` before `orient`."""
    return Y.transpose(-1, -2) if shape[-2] > shape[-1] else Y


def ns_coefficients(kappa: int) -> list[float]:
    """The coefficients of p_κ in powers of (1 − λ): (2s)! / (4^s (s!)²) = C(2s, s) / 4^s."""
    if kappa < 1:
        raise ValueError(f"the Newton–Schulz degree kappa must be at least 1, not {kappa}")
    return [math.comb(2 * s, s) / 4 ** s for s in range(kappa + 1)]


def newton_schulz(X: Tensor, kappa: int = 2, steps: int = 6) -> Tensor:
    """The seed's orthogonalization of X (any 2-D shape, batched over leading dimensions): q = `steps`
    iterations of Y ← p_κ(Y Yᵀ) Y from Y₀ = 𝒯(X)/max(1, ‖𝒯(X)‖_F), returned in X's orientation and dtype.
    Runs in float32 at least. Each matrix is normalized on its own, so a stack [P, rows, cols] gives what
    P separate calls give, in (κ + 2) batched products per iteration."""
    if steps < 0:
        raise ValueError(f"the number of Newton–Schulz iterations must be non-negative, not {steps}")
    coefficients = ns_coefficients(kappa)
    dtype = torch.promote_types(X.dtype, torch.float32)
    Y = orient(X.to(dtype))
    shape = Y.shape
    Y = Y.reshape(-1, *shape[-2:])
    Y = Y / Y.norm(dim=(-2, -1), keepdim=True).clamp(min=1)
    eye = torch.eye(Y.shape[-2], dtype=dtype, device=Y.device)
    scaled = [c * eye for c in coefficients]
    for _ in range(steps):
        E = torch.baddbmm(eye, Y, Y.transpose(-1, -2), alpha=-1)  # I − Y Yᵀ
        P = torch.add(scaled[-2], E, alpha=coefficients[-1])  # Horner in (1 − λ), its first step without a product
        for s in range(kappa - 2, -1, -1):
            P = torch.baddbmm(scaled[s], E, P)
        Y = P @ Y
    return unorient(Y.reshape(shape), X.shape).to(X.dtype)


def _muon_defaults() -> tuple[tuple[float, float, float], int, float]:
    parameters = inspect.signature(torch.optim.Muon.__init__).parameters
    return (tuple(parameters["ns_coefficients"].default), int(parameters["ns_steps"].default),
            float(parameters["eps"].default))


QUINTIC, QUINTIC_STEPS, _EPS = _muon_defaults()


def quintic(X: Tensor, steps: int = QUINTIC_STEPS, coefficients: tuple[float, float, float] = QUINTIC) -> Tensor:
    """`torch.optim.Muon`'s quintic iteration Y ← aY + (bΛ + cΛ²)Y, Λ = Y Yᵀ, from Y₀ = 𝒯(X)/‖𝒯(X)‖_F
    (torch.optim.Muon's defaults for a, b, c and the step count; float32 here where torch uses bfloat16).
    Batched over leading dimensions, each matrix normalized on its own."""
    a, b, c = coefficients
    dtype = torch.promote_types(X.dtype, torch.float32)
    Y = orient(X.to(dtype))
    shape = Y.shape
    Y = Y.reshape(-1, *shape[-2:])
    Y = Y / Y.norm(dim=(-2, -1), keepdim=True).clamp(min=_EPS)
    for _ in range(steps):
        L = Y @ Y.transpose(-1, -2)
        Y = torch.baddbmm(Y, torch.baddbmm(L, L, L, beta=b, alpha=c), Y, beta=a)
    return unorient(Y.reshape(shape), X.shape).to(X.dtype)


def unit_clip_norms(clip_norm: float, units: int) -> list[float]:
    """Per-matrix clip norms for one contribution: `units` equal shares whose ℓ2 norm is `clip_norm`."""
    if units < 1:
        raise ValueError("a contribution reaches at least one parameter")
    return [clip_norm / math.sqrt(units)] * units


def joint_noise_multiplier(clip_norms: Sequence[float], stds: Sequence[float]) -> float:
    """The noise multiplier of releasing L separately clipped matrices (clip C_ℓ, isotropic noise s_ℓ each)
    as one Gaussian mechanism: scaled to unit noise, the sensitivity is √(Σ (C_ℓ/s_ℓ)²), so the multiplier
    is 1 / √(Σ (C_ℓ/s_ℓ)²). For C_ℓ = C/√L and s_ℓ = σC it is σ; for C_ℓ = C_W and s_ℓ = σC_W it is σ/√L."""
    if len(clip_norms) != len(stds) or not clip_norms:
        raise ValueError("need one standard deviation per clip norm")
    if any(s <= 0 for s in stds) or any(c <= 0 for c in clip_norms):
        raise ValueError("clip norms and standard deviations must be positive")
    return 1 / math.sqrt(sum((c / s) ** 2 for c, s in zip(clip_norms, stds)))


class DPMuon:
    """DP-Muon's update for matrices whose `.grad` already holds the privatized average g̃_t:

        m_t = β m_{t−1} + g̃_t,    θ_t = θ_{t−1} − η · NS(m_t)

    with NS the seed's `newton_schulz` (degree `kappa`, `steps` iterations) or `torch.optim.Muon`'s
    `quintic`. Post-processing of g̃_t only; the clipping and noise happen in the routing layer.

    Batched: the matrices with a gradient are grouped by their shape after `orient` (so a 384 × 8 lora_B
    and an 8 × 384 lora_A share a stack) and dtype, and each group's momentum and iteration run as one
    stack [P, rows, cols] (each matrix is still normalized on its own). `state[name]` is a view into its
    group's stacked buffer, in the parameter's own orientation, so `state_dict()` keeps one momentum
    buffer per matrix.
    """

    def __init__(self, params: Mapping[str, nn.Parameter], *, lr: float, momentum: float = 0.9, kappa: int = 3,
                 steps: int | None = None, iteration: Literal["seed", "quintic"] = "seed") -> None:
        if not lr > 0 or not 0 <= momentum < 1:
            raise ValueError("DP-Muon needs lr > 0 and momentum in [0, 1)")
        if any(p.dim() != 2 for p in params.values()):
            raise ValueError("DP-Muon orthogonalizes matrices only")
        ns_coefficients(kappa)
        if steps is None:
            steps = QUINTIC_STEPS if iteration == "quintic" else 6
        self.params = dict(params)
        self.lr, self.momentum, self.kappa, self.steps, self.iteration = lr, momentum, kappa, steps, iteration
        self.state: dict[str, Tensor] = {}
        self._stacks: dict[tuple[str, ...], tuple[Tensor, list[Tensor]]] = {}

    def orthogonalize(self, X: Tensor) -> Tensor:
        if self.iteration == "quintic":
            return quintic(X, self.steps)
        return newton_schulz(X, self.kappa, self.steps)

    @torch.no_grad()
    def step(self) -> None:
        ready = {name: p for name, p in self.params.items() if p.grad is not None}
        for names in shape_groups(ready, lambda p: (orient(p).shape, p.dtype, p.device)):
            params = [self.params[name] for name in names]
            buffer = self._stacked(names)
            buffer.mul_(self.momentum).add_(torch.stack([orient(p.grad) for p in params]))
            update = self.orthogonalize(buffer)
            torch._foreach_add_(params, [unorient(u, p.shape) for u, p in zip(update.unbind(0), params)],
                                alpha=-self.lr)
            for p in params:
                p.grad = None

    def _stacked(self, names: tuple[str, ...]) -> Tensor:
        """The stacked, oriented momentum of `names`, whose `state` entries are views into it; built again
        (from `state`, zeros for a first step: β·0 + g̃ is g̃ exactly) when the group is new or changed."""
        cached = self._stacks.get(names)
        if cached is not None and all(self.state.get(n) is view for n, view in zip(names, cached[1])):
            return cached[0]
        first = self.params[names[0]]
        buffer = torch.stack([orient(self.state[n]).to(device=first.device, dtype=first.dtype) if n in self.state
                              else torch.zeros_like(orient(self.params[n])) for n in names])
        views = [unorient(b, self.params[n].shape) for b, n in zip(buffer.unbind(0), names)]
        for stale in [other for other in self._stacks if set(other) & set(names)]:
            del self._stacks[stale]
        self.state.update(zip(names, views))
        self._stacks[names] = buffer, views
        return buffer

    def zero_grad(self) -> None:
        for param in self.params.values():
            param.grad = None

    def state_dict(self) -> dict:
        return {"state": dict(self.state)}

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state["state"])
        self._stacks = {}
