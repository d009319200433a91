"""PRISM: clipping and noise in the tangent space of the rank-r manifold (seed 000, arXiv 2606.00944).

Notation is the paper's. A LoRA module's update is Z = A Bᵀ with

    A = lora_B.weight            (m × r)
    B = lora_A.weight transposed (n × r)
    M = AᵀA, N = BᵀB             (r × r)
    Π_A = A M† Aᵀ, Π_B = B N† Bᵀ (never formed: m × m and n × n)

(peft multiplies Z by alpha / r in the forward pass; everything here is about the raw product, which is
what the factors' gradients are gradients of.) The tangent space at Z is the image of

    P_{A,B}(G) = Π_A G + G Π_B − Π_A G Π_B,

which depends on A and B only through Π_A and Π_B, so it is the same for every gauge (AR, BR⁻ᵀ). A tangent
vector is carried as a pair (dA, dB) with dZ = dA Bᵀ + A dBᵀ; nothing here forms an m × n matrix.

Every function takes the factors as [..., m, r] and [..., n, r] and broadcasts over leading dimensions, so
a batch of per-sample gradients [b, m, r] goes through with the factors [m, r]. The r × r algebra runs in
float64 whatever the input's dtype, because M and N are squares of the factors and lose half the digits.

Ranks below r (peft starts lora_B at zero, so A = 0 and M = 0 at step 0) are handled with pseudo-inverses
from one eigendecomposition per Gram matrix: then the "tangent space" is the image of P with Π_A, Π_B the
projections onto the column spaces actually present, every identity below still holds, and the noise is
isotropic on that (public) subspace. At A = 0 the first step is dZ = G Π_B, the gradient seen through B.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
from torch import Tensor, nn

from govtrain.mechanisms.reach import lora_pairs

__all__ = ["Gram", "gram", "tangent_lift", "intrinsic_sq_norm", "projected_sq_norm", "tangent_noise", "tangent_dimension", "retract",
           "canonical", "tangent_matrix", "align", "lora_pairs", "floored_inverse_sqrt", "Prism"]


@dataclass(frozen=True)
class Gram:
    """A Gram matrix's pseudo-inverse and the square root of that, from one eigendecomposition."""

    inverse: Tensor  # M†        [..., r, r], float64
    inverse_sqrt: Tensor  # M^{†/2} [..., r, r], float64
    rank: Tensor  # numerical rank [...]


def gram(F: Tensor, *, rtol: float | None = None) -> Gram:
    """M = FᵀF and its pseudo-inverses. Eigenvalues at or below rtol·λ_max (default: r times the machine
    epsilon of F's dtype, the usual numerical-rank rule) count as zero."""
    F64 = F.to(torch.float64)
    M = F64.transpose(-1, -2) @ F64
    M = (M + M.transpose(-1, -2)) / 2
    values, vectors = torch.linalg.eigh(M)
    if rtol is None:
        rtol = F.shape[-1] * torch.finfo(F.dtype).eps
    cutoff = values.amax(-1, keepdim=True).clamp(min=0) * rtol
    keep = values > cutoff
    safe = torch.where(keep, values, torch.ones_like(values))
    inverse = torch.where(keep, 1 / safe, torch.zeros_like(values))
    inverse_sqrt = torch.where(keep, safe.rsqrt(), torch.zeros_like(values))
    return Gram((vectors * inverse.unsqueeze(-2)) @ vectors.transpose(-1, -2),
                (vectors * inverse_sqrt.unsqueeze(-2)) @ vectors.transpose(-1, -2), keep.sum(-1))


def _project(F: Tensor, inverse: Tensor, X: Tensor) -> Tensor:
    """Π_F X = F (F F)† Fᵀ X, through r × r products only."""
    return F @ (inverse @ (F.transpose(-1, -2) @ X))


def tangent_lift(A: Tensor, B: Tensor, gA: Tensor, gB: Tensor, *, grams: tuple[Gram, Gram] | None = None
                 ) -> tuple[Tensor, Tensor]:
    """The canonical horizontal lift of the factor gradients gA = G B, gB = Gᵀ A:

        dA = gA N† − ½ Π_A (gA N†),    dB = gB M† − ½ Π_B (gB M†),

    so that dA Bᵀ + A dBᵀ = P_{A,B}(G). The ½-projections remove the gauge direction (A X, −B Xᵀ) that
    a lift could otherwise carry, which makes the lift a function of G and Z alone.
    """
    A, B, gA, gB = (t.to(torch.float64) for t in (A, B, gA, gB))
    GM, GN = grams if grams is not None else (gram(A), gram(B))
    XA = gA @ GN.inverse
    XB = gB @ GM.inverse
    return XA - 0.5 * _project(A, GM.inverse, XA), XB - 0.5 * _project(B, GN.inverse, XB)


def intrinsic_sq_norm(A: Tensor, B: Tensor, dA: Tensor, dB: Tensor) -> Tensor:
    """‖dA Bᵀ + A dBᵀ‖²_F by the trace formula

        tr(dAᵀdA N) + tr(dBᵀdB M) + 2 tr((AᵀdA)(BᵀdB)),

    at O((m + n) r²) per sample; clamped at zero against rounding."""
    A, B, dA, dB = (t.to(torch.float64) for t in (A, B, dA, dB))
    M = A.transpose(-1, -2) @ A
    N = B.transpose(-1, -2) @ B
    first = ((dA @ N) * dA).sum((-1, -2))
    second = ((dB @ M) * dB).sum((-1, -2))
    cross = ((A.transpose(-1, -2) @ dA) * (B.transpose(-1, -2) @ dB).transpose(-1, -2)).sum((-1, -2))
    return (first + second + 2 * cross).clamp(min=0)


def projected_sq_norm(A: Tensor, B: Tensor, gA: Tensor, gB: Tensor, *, grams: tuple[Gram, Gram] | None = None
                      ) -> Tensor:
    """‖P_{A,B}(G)‖²_F straight from the factor gradients gA = G B, gB = Gᵀ A, without lifting them:

        ‖Π_A G‖² + ‖G Π_B‖² − ‖Π_A G Π_B‖² = ⟨gBᵀgB, M†⟩ + ⟨gAᵀgA, N†⟩ − ⟨Kᵀ M† K, N†⟩,  K = Aᵀ gA.

    Equal to `intrinsic_sq_norm` of `tangent_lift(A, B, gA, gB)`, at three r × r Gram products per sample;
    the routing layer clips with it and lifts only the clipped sum (the lift is linear)."""
    GM, GN = grams if grams is not None else (gram(A), gram(B))
    dtype = gA.dtype
    Mp, Np = GM.inverse.to(dtype), GN.inverse.to(dtype)
    K = A.to(dtype).transpose(-1, -2) @ gA
    S_A = gA.transpose(-1, -2) @ gA
    S_B = gB.transpose(-1, -2) @ gB
    square = (S_B * Mp).sum((-1, -2)) + (S_A * Np).sum((-1, -2)) - ((K.transpose(-1, -2) @ Mp @ K) * Np).sum((-1, -2))
    return square.clamp(min=0)


def tangent_noise(A: Tensor, B: Tensor, std: float, generator: torch.Generator, *,
                  grams: tuple[Gram, Gram] | None = None) -> tuple[Tensor, Tensor]:
    """A pair (ξA, ξB) whose dZ = ξA Bᵀ + A ξBᵀ is distributed as std · P_{A,B}(Ξ), Ξ an m × n standard
    Gaussian, drawn from two small Gaussians Ω_A (m × r) and Ω_B (n × r):

        ξA = std · (I − Π_A) Ω_A N^{†/2},    ξB = std · Ω_B M^{†/2}.

    (Π_A Ξ = Q_A (Q_AᵀΞ) with Q_A = A M^{†/2} orthonormal, and Q_AᵀΞ is an r × n standard Gaussian; the
    rest, (I − Π_A) Ξ Π_B, is (I − Π_A)(Ξ Q_B) Q_Bᵀ with Ξ Q_B an m × r standard Gaussian independent of it.)
    The energy is E‖dZ‖² = std² · r(m + n − r) at full rank. The pair is not the canonical lift of its
    dZ; `canonical` gives that.
    """
    GM, GN = grams if grams is not None else (gram(A), gram(B))
    A64, B64 = A.to(torch.float64), B.to(torch.float64)
    omega_A = torch.randn(A.shape, generator=generator, dtype=torch.float64, device=A.device)
    omega_B = torch.randn(B.shape, generator=generator, dtype=torch.float64, device=B.device)
    xi_A = (omega_A - _project(A64, GM.inverse, omega_A)) @ GN.inverse_sqrt
    xi_B = omega_B @ GM.inverse_sqrt
    return std * xi_A, std * xi_B


def tangent_dimension(m: int, n: int, r: int) -> int:
    """dim T_Z M_r = r(m + n − r): the expected squared norm of a standard tangent Gaussian."""
    return r * (m + n - r)


def canonical(A: Tensor, B: Tensor, dA: Tensor, dB: Tensor, *, grams: tuple[Gram, Gram] | None = None
              ) -> tuple[Tensor, Tensor]:
    """The canonical lift of the tangent vector dZ = dA Bᵀ + A dBᵀ, from any pair representing it:
    the lift of the factor gradients dZ B = dA N + A (dBᵀB) and dZᵀA = dB M + B (dAᵀA)."""
    A, B, dA, dB = (t.to(torch.float64) for t in (A, B, dA, dB))
    M = A.transpose(-1, -2) @ A
    N = B.transpose(-1, -2) @ B
    gA = dA @ N + A @ (dB.transpose(-1, -2) @ B)
    gB = dB @ M + B @ (dA.transpose(-1, -2) @ A)
    return tangent_lift(A, B, gA, gB, grams=grams)


def tangent_matrix(A: Tensor, B: Tensor, dA: Tensor, dB: Tensor) -> Tensor:
    """dZ = dA Bᵀ + A dBᵀ as an m × n matrix: for tests and small models only."""
    A, B, dA, dB = (t.to(torch.float64) for t in (A, B, dA, dB))
    return dA @ B.transpose(-1, -2) + A @ dB.transpose(-1, -2)


def retract(A: Tensor, B: Tensor, dA: Tensor, dB: Tensor, step: float) -> tuple[Tensor, Tensor]:
    """Back to rank r: the best rank-r approximation of A Bᵀ + step · (dA Bᵀ + A dBᵀ), as balanced factors
    (A'ᵀA' = B'ᵀB' = Σ_r). With Q_A R_A = [A, dA] and Q_B R_B = [B, dB],

        A Bᵀ + step · dZ = Q_A · R_A [[I, step I], [step I, 0]] R_Bᵀ · Q_Bᵀ,

    so a truncated SVD of that 2r × 2r core gives the answer (Eckart–Young) at O((m + n) r²).
    Pass step = −lr to descend. Returns tensors of A's dtype.
    """
    r = A.shape[-1]
    A64, B64, dA64, dB64 = (t.to(torch.float64) for t in (A, B, dA, dB))
    QA, RA = torch.linalg.qr(torch.cat([A64, dA64], -1))
    QB, RB = torch.linalg.qr(torch.cat([B64, dB64], -1))
    eye = torch.eye(r, dtype=torch.float64, device=A.device)
    K = torch.cat([torch.cat([eye, step * eye], -1), torch.cat([step * eye, torch.zeros_like(eye)], -1)], -2)
    U, S, Vh = torch.linalg.svd(RA @ K @ RB.transpose(-1, -2))
    k = min(r, S.shape[-1])
    root = S[..., :k].sqrt().unsqueeze(-2)
    new_A = (QA @ U[..., :k]) * root
    new_B = (QB @ Vh[..., :k, :].transpose(-1, -2)) * root
    if k < r:  # fewer than r rows or columns in the core: the missing directions are zero
        new_A = torch.nn.functional.pad(new_A, (0, r - k))
        new_B = torch.nn.functional.pad(new_B, (0, r - k))
    return new_A.to(A.dtype), new_B.to(B.dtype)


def align(A: Tensor, B: Tensor, previous_A: Tensor, previous_B: Tensor) -> tuple[Tensor, Tensor]:
    """(A Q, B Q) for the orthogonal Q closest to mapping the new factors onto the previous ones
    (orthogonal Procrustes on AᵀA_prev + BᵀB_prev). Z and the balance are unchanged; the optimizer's
    moments, kept in factor coordinates, stay meaningful from one step to the next."""
    A64, B64 = A.to(torch.float64), B.to(torch.float64)
    U, _, Vh = torch.linalg.svd(A64.transpose(-1, -2) @ previous_A.to(torch.float64)
                                + B64.transpose(-1, -2) @ previous_B.to(torch.float64))
    Q = U @ Vh
    return (A64 @ Q).to(A.dtype), (B64 @ Q).to(B.dtype)


def floored_inverse_sqrt(V: Tensor, floor: float, max_condition: float, eps: float) -> Tensor:
    """V^{-1/2} for a symmetric r × r second moment, with every eigenvalue first raised to at least
    `floor` (the noise's share, so the preconditioner cannot whiten DP noise into signal) and to at least
    λ_max / max_condition (so a collapsing direction cannot blow the step up)."""
    V = (V + V.transpose(-1, -2)) / 2
    values, vectors = torch.linalg.eigh(V)
    values = values.clamp(min=0) + eps
    values = torch.maximum(values, torch.full_like(values, floor))
    values = torch.maximum(values, values.amax(-1, keepdim=True) / max_condition)
    return (vectors * values.rsqrt().unsqueeze(-2)) @ vectors.transpose(-1, -2)


class Prism:
    """PRISM's update for the LoRA pairs: an Adam-like step made gauge-aware and DP-aware, then a retraction.

    After the routing layer has written each pair's privatized gradient, the canonical lift of the noisy
    sum divided by the expected batch size (lora_B.grad = ĝ_A, m × r; lora_A.grad = ĝ_Bᵀ, r × n), and the
    per-coordinate noise standard deviation τ of that average, one step is, per pair:

        m_A ← β₁ m_A + (1 − β₁) ĝ_A                         (the same for B; bias-corrected)
        V_A ← β₂ V_A + (1 − β₂) ĝ_Aᵀ ĝ_A / m                (r × r; bias-corrected)
        U_A = m̂_A · floor(V̂_A)^{-1/2}
        (A, B) ← align(Retr_r(A, B, U_A, U_B, −lr))

    The floor: the canonical lift of tangent noise τ·P(Ξ) has E[ξ_Aᵀξ_A]/m = τ²(1 − 3r/4m) N†, so the
    eigenvalues of V̂_A are raised to at least `floor` × the mean eigenvalue of that, τ²(1 − 3r/4m) tr(N†)/r
    (for B, with m ↔ n and N ↔ M), and then to at least λ_max / `max_condition`. Without the floor, a
    direction where the average is pure noise would be whitened to unit scale, the very "learning the noise"
    the paper warns of. Everything here is post-processing of the privatized gradient.

    Gauge: the privatized input depends on Z alone; the moments live in factor coordinates, so the step is
    equivariant under orthogonal gauges (A Q, B Q) and not under every R in GL(r). The retraction returns
    balanced factors (AᵀA = BᵀB), which pins the gauge down to O(r), and `align` picks the element of O(r)
    closest to the previous factors, so the moments keep meaning the same directions from step to step.
    """

    def __init__(self, pairs: Mapping[str, tuple[nn.Parameter, nn.Parameter]], *, lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), floor: float = 1.0, max_condition: float = 1e4,
                 eps: float = 1e-12) -> None:
        if not lr > 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1 or floor < 0 or not max_condition >= 1:
            raise ValueError("PRISM needs lr > 0, betas in [0, 1), floor >= 0 and max_condition >= 1")
        self.pairs = dict(pairs)  # lora_B name -> (lora_A parameter, lora_B parameter)
        self.lr, self.betas, self.floor, self.max_condition, self.eps = lr, betas, floor, max_condition, eps
        self.state: dict[str, dict[str, Tensor | int]] = {}

    @torch.no_grad()
    def step(self, noise_std: Mapping[str, float]) -> None:
        """Move every pair that has a gradient; `noise_std[lora_B name]` is τ for that pair (0 if none)."""
        beta1, beta2 = self.betas
        for key, (lora_A, lora_B) in self.pairs.items():
            if lora_B.grad is None or lora_A.grad is None:
                continue
            A, B = lora_B.detach(), lora_A.detach().transpose(0, 1)
            gA = lora_B.grad.to(torch.float64)
            gB = lora_A.grad.transpose(0, 1).to(torch.float64)
            (m, r), n = A.shape, B.shape[0]
            state = self.state.setdefault(key, {"step": 0, "m_A": torch.zeros_like(gA), "m_B": torch.zeros_like(gB),
                                                "v_A": gA.new_zeros(r, r), "v_B": gA.new_zeros(r, r)})
            state["step"] = t = int(state["step"]) + 1
            state["m_A"].mul_(beta1).add_(gA, alpha=1 - beta1)
            state["m_B"].mul_(beta1).add_(gB, alpha=1 - beta1)
            state["v_A"].mul_(beta2).add_(gA.T @ gA / m, alpha=1 - beta2)
            state["v_B"].mul_(beta2).add_(gB.T @ gB / n, alpha=1 - beta2)
            tau2 = float(noise_std.get(key, 0.0)) ** 2
            GM, GN = gram(A), gram(B)
            floor_A = self.floor * tau2 * (1 - 0.75 * r / m) * float(torch.trace(GN.inverse)) / r
            floor_B = self.floor * tau2 * (1 - 0.75 * r / n) * float(torch.trace(GM.inverse)) / r
            correction1, correction2 = 1 - beta1 ** t, 1 - beta2 ** t
            U_A = state["m_A"] / correction1 @ floored_inverse_sqrt(state["v_A"] / correction2, floor_A,
                                                                    self.max_condition, self.eps)
            U_B = state["m_B"] / correction1 @ floored_inverse_sqrt(state["v_B"] / correction2, floor_B,
                                                                    self.max_condition, self.eps)
            new_A, new_B = retract(A, B, U_A, U_B, -self.lr)
            new_A, new_B = align(new_A, new_B, A, B)
            lora_B.copy_(new_A)
            lora_A.copy_(new_B.transpose(0, 1))
            lora_A.grad = lora_B.grad = None

    def zero_grad(self) -> None:
        for lora_A, lora_B in self.pairs.values():
            lora_A.grad = lora_B.grad = None

    def state_dict(self) -> dict:
        return {"state": {k: dict(v) for k, v in self.state.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.state = {k: dict(v) for k, v in state["state"].items()}
