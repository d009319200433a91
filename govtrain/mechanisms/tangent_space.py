"""The tangent space of the rank-r manifold, where PRISM clips and noises (arXiv 2606.00944; seed 000 in
docs/design.md): Gram pseudo-inverses, the canonical lift of factor gradients, the intrinsic and projected norms,
isotropic tangent noise. The routing layer (`routing/tangent.py`) clips and noises through these functions, and
`mechanisms/prism.py` moves the factors; the way back onto the manifold is `mechanisms/retraction.py`.

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
a batch of per-sample gradients [b, m, r] goes through with the factors [m, r], and so does a stack of P pairs
of one shape, [P, m, r] (per-sample gradients of such a stack: factors [P, 1, m, r], gradients [P, b, m, r]).
`Prism` moves its pairs that way, one stack per shape (`stacking.shape_groups`), and runs the r × r and 2r × 2r
factorizations of every stack of one rank in one batched call each (`retraction._retractions`).

Precision. Float64 wherever a product squares a condition number or a factorization reads small
eigenvalues: the Gram matrices M, N, gAᵀgA and `align`'s cross product, the r × r eigendecompositions and
SVDs and the pseudo-inverses taken from them, and the retraction's orthonormal bases, which come from the
2r × 2r Gram matrices of [A, dA] and [B, dB] (`retraction._orthonormal`). In float32 any of these would lose the
small eigenvalues that pseudo-inverses, floors and rank decisions read. Work that squares nothing (the
first moments, a tall factor times an r × r preconditioner) runs in the factors' dtype, float32 at least.
The routing-layer functions (`tangent_lift`, `tangent_noise`, `factor_gradients`, `canonical`) lift in float64
throughout; `projected_sq_norm` forms its tall products in the gradients' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Gram", "gram", "grams", "tangent_lift", "intrinsic_sq_norm", "projected_sq_norm", "tangent_noise",
           "tangent_dimension", "factor_gradients", "canonical", "tangent_matrix"]


@dataclass(frozen=True)
class Gram:
    """A Gram matrix's pseudo-inverse and the square root of that, from one eigendecomposition."""

    inverse: Tensor  # M†        [..., r, r], float64
    inverse_sqrt: Tensor  # M^{†/2} [..., r, r], float64
    rank: Tensor  # numerical rank [...]


def gram(F: Tensor, *, rtol: float | None = None) -> Gram:
    """M = FᵀF and its pseudo-inverses. Eigenvalues at or below rtol·λ_max (default: r times the machine
    epsilon of F's dtype, the usual numerical-rank rule) count as zero."""
    return grams(F, rtol=rtol)[0]


def grams(*factors: Tensor, rtol: float | None = None) -> list[Gram]:
    """`gram` of each of `factors`, [..., m_i, r] of one r and dtype (the m_i and the leading shapes may
    differ), from one batched eigendecomposition of all their Gram matrices: on a GPU an eigh waits for the
    device, so the routing layer takes those of all its pairs of one rank in one call per step."""
    r, dtype = factors[0].shape[-1], factors[0].dtype
    if any(F.shape[-1] != r or F.dtype != dtype for F in factors):
        raise ValueError("grams needs factors of one rank and dtype")
    squares = []
    for F in factors:
        F64 = F.to(torch.float64)
        squares.append((F64.transpose(-1, -2) @ F64).reshape(-1, r, r))
    M = torch.cat(squares) if len(squares) > 1 else squares[0]
    M = (M + M.transpose(-1, -2)) / 2
    values, vectors = torch.linalg.eigh(M)
    if rtol is None:
        rtol = r * torch.finfo(dtype).eps
    cutoff = values.amax(-1, keepdim=True).clamp(min=0) * rtol
    keep = values > cutoff
    safe = torch.where(keep, values, torch.ones_like(values))
    inverse = torch.where(keep, 1 / safe, torch.zeros_like(values))
    inverse_sqrt = torch.where(keep, safe.rsqrt(), torch.zeros_like(values))
    inverse = (vectors * inverse.unsqueeze(-2)) @ vectors.transpose(-1, -2)
    inverse_sqrt = (vectors * inverse_sqrt.unsqueeze(-2)) @ vectors.transpose(-1, -2)
    rank = keep.sum(-1)
    out, start = [], 0
    for F in factors:
        lead = F.shape[:-2]
        end = start + lead.numel()
        out.append(Gram(inverse[start:end].reshape(*lead, r, r), inverse_sqrt[start:end].reshape(*lead, r, r),
                        rank[start:end].reshape(lead)))
        start = end
    return out


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


def tangent_noise(A: Tensor, B: Tensor, std: float | Tensor, generator: torch.Generator | None, *,
                  grams: tuple[Gram, Gram] | None = None, omega: tuple[Tensor, Tensor] | None = None
                  ) -> tuple[Tensor, Tensor]:
    """A pair (ξA, ξB) whose dZ = ξA Bᵀ + A ξBᵀ is distributed as std · P_{A,B}(Ξ), Ξ an m × n standard
    Gaussian, drawn from two small Gaussians Ω_A (m × r) and Ω_B (n × r):

        ξA = std · (I − Π_A) Ω_A N^{†/2},    ξB = std · Ω_B M^{†/2}.

    (Π_A Ξ = Q_A (Q_AᵀΞ) with Q_A = A M^{†/2} orthonormal, and Q_AᵀΞ is an r × n standard Gaussian; the
    rest, (I − Π_A) Ξ Π_B, is (I − Π_A)(Ξ Q_B) Q_Bᵀ with Ξ Q_B an m × r standard Gaussian independent of it.)
    The energy is E‖dZ‖² = std² · r(m + n − r) at full rank. The pair is not the canonical lift of its
    dZ; `canonical` gives that.

    `omega` = (Ω_A, Ω_B) passes Gaussians drawn elsewhere instead (then `generator` is unused): for a stack
    of pairs [P, m, r], drawing Ω_A [P, m, r] and Ω_B [P, n, r] at once draws in another order than a loop
    over the pairs, and the same Ω give the same noise either way. For such a stack `std` may be one per
    pair, [P, 1, 1].
    """
    GM, GN = grams if grams is not None else (gram(A), gram(B))
    A64 = A.to(torch.float64)
    if omega is None:
        omega_A = torch.randn(A.shape, generator=generator, dtype=torch.float64, device=A.device)
        omega_B = torch.randn(B.shape, generator=generator, dtype=torch.float64, device=B.device)
    else:
        omega_A, omega_B = (w.to(torch.float64) for w in omega)
    xi_A = (omega_A - _project(A64, GM.inverse, omega_A)) @ GN.inverse_sqrt
    xi_B = omega_B @ GM.inverse_sqrt
    return std * xi_A, std * xi_B


def tangent_dimension(m: int, n: int, r: int) -> int:
    """dim T_Z M_r = r(m + n − r): the expected squared norm of a standard tangent Gaussian."""
    return r * (m + n - r)


def canonical(A: Tensor, B: Tensor, dA: Tensor, dB: Tensor, *, grams: tuple[Gram, Gram] | None = None
              ) -> tuple[Tensor, Tensor]:
    """The canonical lift of the tangent vector dZ = dA Bᵀ + A dBᵀ, from any pair representing it:
    the lift of its factor gradients (`factor_gradients`)."""
    return tangent_lift(A, B, *factor_gradients(A, B, dA, dB), grams=grams)


def factor_gradients(A: Tensor, B: Tensor, dA: Tensor, dB: Tensor) -> tuple[Tensor, Tensor]:
    """The factor gradients dZ B = dA N + A (dBᵀB) and dZᵀA = dB M + B (dAᵀA) of the tangent vector
    dZ = dA Bᵀ + A dBᵀ, in float64: what `tangent_lift` takes, so that the lift of a sum of factor gradients
    and of such a vector's is the sum of their canonical lifts (the lift is linear)."""
    A, B, dA, dB = (t.to(torch.float64) for t in (A, B, dA, dB))
    M = A.transpose(-1, -2) @ A
    N = B.transpose(-1, -2) @ B
    return dA @ N + A @ (dB.transpose(-1, -2) @ B), dB @ M + B @ (dA.transpose(-1, -2) @ A)


def tangent_matrix(A: Tensor, B: Tensor, dA: Tensor, dB: Tensor) -> Tensor:
    """dZ = dA Bᵀ + A dBᵀ as an m × n matrix: for tests and small models only."""
    A, B, dA, dB = (t.to(torch.float64) for t in (A, B, dA, dB))
    return dA @ B.transpose(-1, -2) + A @ dB.transpose(-1, -2)
