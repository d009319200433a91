"""PRISM: clipping and noise in the tangent space of the rank-r manifold (arXiv 2606.00944;
seed 000 in docs/design.md).

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
factorizations of every stack of one rank in one batched call each (`_retractions`).

Precision. Float64 wherever a product squares a condition number or a factorization reads small
eigenvalues: the Gram matrices M, N, gAᵀgA and `align`'s cross product, the r × r eigendecompositions and
SVDs and the pseudo-inverses taken from them, and the retraction's orthonormal bases, which come from the
2r × 2r Gram matrices of [A, dA] and [B, dB] (`_orthonormal`). In float32 any of these would lose the
small eigenvalues that pseudo-inverses, floors and rank decisions read. Work that squares nothing (the
first moments, a tall factor times an r × r preconditioner) runs in the factors' dtype, float32 at least.
The routing-layer functions (`tangent_lift`, `tangent_noise`, `factor_gradients`, `canonical`) lift in float64
throughout; `projected_sq_norm` forms its tall products in the gradients' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import Tensor, nn

from govtrain.mechanisms.stacking import shape_groups, write
from govtrain.resolver.reach import lora_pairs

__all__ = ["Gram", "gram", "grams", "tangent_lift", "intrinsic_sq_norm", "projected_sq_norm", "tangent_noise",
           "tangent_dimension", "factor_gradients", "retract", "retract_aligned", "canonical", "tangent_matrix",
           "align", "lora_pairs", "floored_inverse_sqrt", "Prism"]


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


def retract(A: Tensor, B: Tensor, dA: Tensor, dB: Tensor, step: float) -> tuple[Tensor, Tensor]:
    """Back to rank r: the best rank-r approximation of A Bᵀ + step · (dA Bᵀ + A dBᵀ), as balanced factors
    (A'ᵀA' = B'ᵀB' = Σ_r). With Q_A R_A = [A, dA] and Q_B R_B = [B, dB],

        A Bᵀ + step · dZ = Q_A · R_A [[I, step I], [step I, 0]] R_Bᵀ · Q_Bᵀ,

    so a truncated SVD U Σ Vᵀ of that 2r × 2r core gives the answer (Eckart–Young) at O((m + n) r²):
    A' = Q_A U_r Σ_r^{1/2}, B' = Q_B V_r Σ_r^{1/2}. Pass step = −lr to descend. Returns tensors of A's
    dtype; batched over leading dimensions.

    Q_A and Q_B come from Gram matrices in float64 (`_orthonormal`, not Householder QR, which batched on
    CUDA is one factorization per matrix); the core and its SVD are float64 as well.
    """
    return _retractions([(A, B, dA, dB)], step)[0]


def retract_aligned(A: Tensor, B: Tensor, dA: Tensor, dB: Tensor, step: float) -> tuple[Tensor, Tensor]:
    """`align(*retract(A, B, dA, dB, step), A, B)` without the m × r and n × r products of `align`: A is
    the first r columns of [A, dA] = Q_A R_A, so with A' = Q_A W_A (W_A = U_r Σ_r^{1/2}),

        A'ᵀA + B'ᵀB = W_Aᵀ R_A[:, :r] + W_Bᵀ R_B[:, :r],

    an r × r product of 2r × r matrices (float64); its polar factor Q is folded into W_A before the one
    tall product per factor, Q_A (W_A Q). Z and the balance are those of `retract`."""
    return _retractions([(A, B, dA, dB)], step, aligned=True)[0]


def _retractions(stacks: Sequence[tuple[Tensor, Tensor, Tensor, Tensor]], step: float, *, aligned: bool = False
                 ) -> list[tuple[Tensor, Tensor]]:
    """`retract` (`retract_aligned` if `aligned`) of each (A, B, dA, dB) of `stacks`, all of one rank r (their
    m, n and leading shapes may differ): the tall products per stack, and each factorization (the bases'
    eigh and Cholesky, the core's SVD, the alignment's SVD) once over the small matrices of all the stacks.
    On a GPU each of those calls waits for the device, so PRISM retracts all its pairs of a rank in one
    call. Float64 throughout, as `retract` says; results in each A's and B's dtype."""
    f64 = torch.float64
    r = stacks[0][0].shape[-1]
    tall_A, tall_B, dtypes = [], [], []
    for A, B, dA, dB in stacks:
        lead = torch.broadcast_shapes(A.shape[:-2], dA.shape[:-2], B.shape[:-2], dB.shape[:-2])
        dtypes.append((A.dtype, B.dtype))
        A, dA, B, dB = (t.to(f64).expand(*lead, *t.shape[-2:]) for t in (A, dA, B, dB))
        tall_A.append(torch.cat([A, dA], -1))
        tall_B.append(torch.cat([B, dB], -1))
    first, inverse_T, R = _orthonormal(tall_A + tall_B)
    RA, RB = R.chunk(2)  # the A sides, then the B sides: as many of each
    # R_A [[I, s I], [s I, 0]] R_Bᵀ without forming the 2r × 2r block: (R_A1 + s R_A2) R_B1ᵀ + s R_A1 R_B2ᵀ
    core = (RA[..., :r] + step * RA[..., r:]) @ RB[..., :r].transpose(-1, -2) \
        + step * (RA[..., :r] @ RB[..., r:].transpose(-1, -2))
    U, S, Vh = torch.linalg.svd(core)
    root = S[..., :r].sqrt().unsqueeze(-2)
    WA, WB = U[..., :r] * root, Vh[..., :r, :].transpose(-1, -2) * root
    if aligned:
        U, _, Vh = torch.linalg.svd(WA.transpose(-1, -2) @ RA[..., :r] + WB.transpose(-1, -2) @ RB[..., :r])
        Q = U @ Vh
        WA, WB = WA @ Q, WB @ Q
    # Q W = Q₁ (L^{-T} W): the basis is never formed, one tall product per factor
    right = (inverse_T @ torch.cat([WA, WB])).split([X.shape[:-2].numel() for X in first])
    new = [X @ C.reshape(*X.shape[:-2], *C.shape[-2:]) for X, C in zip(first, right)]
    count = len(stacks)
    return [(new_A.to(dtype_A), new_B.to(dtype_B))
            for new_A, new_B, (dtype_A, dtype_B) in zip(new[:count], new[count:], dtypes)]


def _orthonormal(tall: Sequence[Tensor]) -> tuple[list[Tensor], Tensor, Tensor]:
    """X = Q R for each float64 X [..., m, k] of `tall` (one k; m and the leading shapes may differ): Q with
    orthonormal columns spanning X's numerical column space and zero columns for the rest, R k × k. Returns
    each X's Q₁ below, and L^{-T} and R of all of them, [Σ, k, k]: the X's, each flattened over its leading
    dimensions, in order. Q = Q₁ L^{-T}, left to the caller to fold into its next product.

    From Gram matrices rather than Householder QR, so that stacks of pairs take a few batched products per
    stack and one batched eigh, one batched Cholesky and one batched triangular inverse over all of them,
    whatever the device (a batched QR runs one factorization per matrix on CUDA). With D the columns'
    norms, G = D⁻¹XᵀXD⁻¹ = V Λ Vᵀ gives Q₁ = XD⁻¹ V Λ^{-1/2} over the eigenvalues above k·ε₆₄·λ_max (the
    numerical rank of a float64 Gram matrix: what it drops is less than √(k·ε₆₄), 6e-8 for k = 16, of the
    column norms, about float32's unit roundoff), and a Cholesky pass Q₁ᵀQ₁ = L Lᵀ restores the
    orthogonality that forming G cost (CholeskyQR2): Q = Q₁ L^{-T}, R = Lᵀ Λ^{1/2} Vᵀ D. L is well
    conditioned (Q₁ is orthonormal but for the rounding that forming G cost; a dropped direction gets a unit
    diagonal), so Q₁ times its inverse, one batched call for all the X's, agrees with a triangular solve
    against each tall Q₁ to rounding, near-dependent columns included. Float64 throughout: a Gram matrix
    squares X's condition number.
    """
    f64 = torch.float64
    k = tall[0].shape[-1]
    sizes = [X.shape[:-2].numel() for X in tall]
    scales = [X.norm(dim=-2, keepdim=True) for X in tall]
    scales = [torch.where(d > 0, d, torch.ones_like(d)) for d in scales]
    tall = [X / d for X, d in zip(tall, scales)]
    values, vectors = torch.linalg.eigh(torch.cat([(X.transpose(-1, -2) @ X).reshape(-1, k, k) for X in tall]))
    keep = values > values.amax(-1, keepdim=True) * (k * torch.finfo(f64).eps)
    root = torch.where(keep, values, torch.zeros_like(values)).sqrt()
    inverse_root = torch.where(keep, 1 / torch.where(keep, root, torch.ones_like(root)), torch.zeros_like(root))
    whiten = (vectors * inverse_root.unsqueeze(-2)).split(sizes)
    first = [X @ W.reshape(*X.shape[:-2], k, k) for X, W in zip(tall, whiten)]
    gram2 = torch.cat([(Q.transpose(-1, -2) @ Q).reshape(-1, k, k) for Q in first]) \
        + torch.diag_embed((~keep).to(f64))
    L, _ = torch.linalg.cholesky_ex(gram2)  # info unread: reading it would wait for the device
    eye = torch.eye(k, dtype=f64, device=L.device).expand_as(L)
    inverse_T = torch.linalg.solve_triangular(L.transpose(-1, -2), eye, upper=True, left=False)
    D = torch.cat([d.reshape(-1, 1, k) for d in scales])
    return first, inverse_T, L.transpose(-1, -2) @ (vectors * root.unsqueeze(-2)).transpose(-1, -2) * D


def align(A: Tensor, B: Tensor, previous_A: Tensor, previous_B: Tensor) -> tuple[Tensor, Tensor]:
    """(A Q, B Q) for the orthogonal Q closest to mapping the new factors onto the previous ones
    (orthogonal Procrustes on AᵀA_prev + BᵀB_prev). Z and the balance are unchanged; the optimizer's
    moments, kept in factor coordinates, stay meaningful from one step to the next.

    The cross product is a Gram-like r × r matrix (its small singular values are the squares of the
    factors' and decide Q), so it and its SVD are float64; the rotation itself runs in A's dtype (float32
    at least) and changes no singular value. After `retract`, `retract_aligned` does both for less."""
    f64 = torch.float64
    U, _, Vh = torch.linalg.svd(A.to(f64).transpose(-1, -2) @ previous_A.to(f64)
                                + B.to(f64).transpose(-1, -2) @ previous_B.to(f64))
    work = torch.promote_types(A.dtype, torch.float32)
    Q = (U @ Vh).to(work)
    return (A.to(work) @ Q).to(A.dtype), (B.to(work) @ Q).to(B.dtype)


def floored_inverse_sqrt(V: Tensor, floor: float | Tensor, max_condition: float, eps: float) -> Tensor:
    """V^{-1/2} for a symmetric r × r second moment, with every eigenvalue first raised to at least
    `floor` (the noise's share, so the preconditioner cannot whiten DP noise into signal) and to at least
    λ_max / max_condition (so a collapsing direction cannot blow the step up). Batched over leading
    dimensions; `floor` is a number or a tensor of V's leading shape (one floor per matrix)."""
    values, vectors = torch.linalg.eigh((V + V.transpose(-1, -2)) / 2)
    return _floored(values, vectors, floor, max_condition, eps)


def _floored(values: Tensor, vectors: Tensor, floor: float | Tensor, max_condition: float, eps: float) -> Tensor:
    values = values.clamp(min=0) + eps
    if isinstance(floor, Tensor):
        values = torch.maximum(values, floor.to(values.dtype).unsqueeze(-1))
    else:
        values = values.clamp(min=floor)
    values = torch.maximum(values, values.amax(-1, keepdim=True) / max_condition)
    return (vectors * values.rsqrt().unsqueeze(-2)) @ vectors.transpose(-1, -2)


def _pinv_trace(values: Tensor, rtol: float) -> Tensor:
    """tr(M†) from M's eigenvalues, with `gram`'s numerical-rank cutoff."""
    keep = values > values.amax(-1, keepdim=True).clamp(min=0) * rtol
    return torch.where(keep, 1 / torch.where(keep, values, torch.ones_like(values)), torch.zeros_like(values)).sum(-1)


@dataclass(frozen=True, kw_only=True)
class _Stack:
    """The pairs of one shape with a gradient this step, gathered: factors in float64, moments updated."""

    keys: tuple[str, ...]
    A: Tensor  # [P, m, r], float64
    B: Tensor  # [P, n, r], float64
    moments: dict[str, Tensor]  # m_A [P, m, r], m_B [P, n, r] in the work dtype; v_A, v_B [P, r, r] float64
    steps: list[int]  # each pair's step count, this step included
    work: torch.dtype


class Prism:
    """PRISM's update for the LoRA pairs: an Adam-like step made gauge-aware and DP-aware, then a retraction.

    After the routing layer has written each pair's privatized gradient, the canonical lift of the noisy
    sum divided by the expected batch size (lora_B.grad = ĝ_A, m × r; lora_A.grad = ĝ_Bᵀ, r × n), and the
    per-coordinate noise standard deviation τ of that average, one step is, per pair:

        m_A ← β₁ m_A + (1 − β₁) ĝ_A                         (the same for B; bias-corrected)
        V_A ← β₂ V_A + (1 − β₂) ĝ_Aᵀ ĝ_A / m                (r × r; bias-corrected)
        U_A = m̂_A · floor(V̂_A)^{-1/2}
        (A, B) ← align(Retr_r(A, B, U_A, U_B, −lr))         (`retract_aligned`)

    The floor: the canonical lift of tangent noise τ·P(Ξ) has E[ξ_Aᵀξ_A]/m = τ²(1 − 3r/4m) N†, so the
    eigenvalues of V̂_A are raised to at least `floor` × the mean eigenvalue of that, τ²(1 − 3r/4m) tr(N†)/r
    (for B, with m ↔ n and N ↔ M), and then to at least λ_max / `max_condition`. Without the floor, a
    direction where the average is pure noise would be whitened to unit scale, the very "learning the noise"
    the paper warns of. Everything here is post-processing of the privatized gradient.

    Gauge: the privatized input depends on Z alone; the moments live in factor coordinates, so the step is
    equivariant under orthogonal gauges (A Q, B Q) and not under every R in GL(r). The retraction returns
    balanced factors (AᵀA = BᵀB), which pins the gauge down to O(r), and `align` picks the element of O(r)
    closest to the previous factors, so the moments keep meaning the same directions from step to step.

    Batched: the pairs with a gradient are grouped by shape (`stacking.shape_groups`) and each group moves as
    one stack [P, m, r], one kernel per tall operation and group. The small linear algebra runs once per
    rank over every group of that rank: one eigh (of M, N, V̂_A and V̂_B of every pair), then
    `_retractions`: one eigh, one Cholesky and one triangular inverse for the bases of both sides, and two
    SVDs. On a GPU each such call is a launch and a wait for the device whatever its batch, so a step costs
    six of them per rank, not six per shape (nor per pair); nothing else in the step reads the device.
    Each pair's moments are views into the group's stacked buffers, so `state` and `state_dict()` keep one
    entry per pair ({"step", "m_A", "m_B", "v_A", "v_B"}). The first moments are kept in the factors' dtype
    (float32 at least), like torch's Adam; the r × r second moments in float64, being Gram matrices that are
    eigendecomposed. A saved state of either dtype loads.
    """

    def __init__(self, pairs: Mapping[str, tuple[nn.Parameter, nn.Parameter]], *, lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), floor: float = 1.0, max_condition: float = 1e4,
                 eps: float = 1e-12) -> None:
        if not lr > 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1 or floor < 0 or not max_condition >= 1:
            raise ValueError("PRISM needs lr > 0, betas in [0, 1), floor >= 0 and max_condition >= 1")
        self.pairs = dict(pairs)  # lora_B name -> (lora_A parameter, lora_B parameter)
        self.lr, self.betas, self.floor, self.max_condition, self.eps = lr, betas, floor, max_condition, eps
        self.state: dict[str, dict[str, Tensor | int]] = {}
        self._stacks: dict[tuple[str, ...], tuple[dict[str, Tensor], list[dict]]] = {}

    @torch.no_grad()
    def step(self, noise_std: Mapping[str, float]) -> None:
        """Move every pair that has a gradient; `noise_std[lora_B name]` is τ for that pair (0 if none)."""
        ready = {k: pair for k, pair in self.pairs.items() if pair[0].grad is not None and pair[1].grad is not None}
        ranks: dict[tuple, list[_Stack]] = {}
        for keys in shape_groups(ready, lambda pair: (pair[0].shape, pair[1].shape, pair[1].dtype, pair[1].device)):
            stack = self._gather(keys)
            ranks.setdefault((stack.A.shape[-1], self.pairs[keys[0]][1].dtype, stack.A.device), []).append(stack)
        for (r, dtype, device), stacks in ranks.items():
            self._move(stacks, r, dtype, device, noise_std)

    def _gather(self, keys: tuple[str, ...]) -> _Stack:
        """The pairs `keys`, all of one shape, as one stack, their moments updated with their gradients."""
        f64 = torch.float64
        beta1, beta2 = self.betas
        lora_A = [self.pairs[k][0] for k in keys]
        lora_B = [self.pairs[k][1] for k in keys]
        A = torch.stack([p.detach() for p in lora_B])  # [P, m, r]
        B = torch.stack([p.detach() for p in lora_A]).transpose(-1, -2)  # [P, n, r]
        work = torch.promote_types(A.dtype, torch.float32)
        gA = torch.stack([p.grad for p in lora_B]).to(work)
        gB = torch.stack([p.grad for p in lora_A]).transpose(-1, -2).to(work)
        _, m, r = A.shape
        n = B.shape[-2]
        moments, entries = self._stacked(keys, m, n, r, work, A.device)
        for entry in entries:
            entry["step"] = int(entry["step"]) + 1
        moments["m_A"].lerp_(gA, 1 - beta1)  # β₁ m + (1 − β₁) g
        moments["m_B"].lerp_(gB, 1 - beta1)
        gA64, gB64 = gA.to(f64), gB.to(f64)
        moments["v_A"].mul_(beta2).add_(gA64.transpose(-1, -2) @ gA64, alpha=(1 - beta2) / m)
        moments["v_B"].mul_(beta2).add_(gB64.transpose(-1, -2) @ gB64, alpha=(1 - beta2) / n)
        return _Stack(keys=keys, A=A.to(f64), B=B.to(f64), moments=moments, work=work,
                      steps=[int(entry["step"]) for entry in entries])

    def _move(self, stacks: list[_Stack], r: int, dtype: torch.dtype, device: torch.device,
              noise_std: Mapping[str, float]) -> None:
        """Precondition and retract the gathered stacks of rank r, each small factorization once for all."""
        beta1, beta2 = self.betas
        P = sum(len(stack.keys) for stack in stacks)
        # One eigendecomposition for the four r × r matrices of every pair of every stack, in float64 (Gram
        # matrices): M and N (their pseudo-inverses' traces set the floors) and the bias-corrected second
        # moments V̂_A, V̂_B (floored, inverted). In the batch: all M, all N, all V̂_A, all V̂_B.
        c2 = [_per_pair([1 - beta2 ** t for t in stack.steps], device, (-1, 1, 1)) for stack in stacks]
        square = torch.cat([*(stack.A.transpose(-1, -2) @ stack.A for stack in stacks),
                            *(stack.B.transpose(-1, -2) @ stack.B for stack in stacks),
                            *(stack.moments["v_A"] / c for stack, c in zip(stacks, c2)),
                            *(stack.moments["v_B"] / c for stack, c in zip(stacks, c2))])
        values, vectors = torch.linalg.eigh((square + square.transpose(-1, -2)) / 2)
        trace_M, trace_N = _pinv_trace(values[:2 * P], r * torch.finfo(dtype).eps).split(P)  # `gram`'s rank
        # the floors: floor·τ²(1 − 3r/4m)·tr(N†)/r for V̂_A, floor·τ²(1 − 3r/4n)·tr(M†)/r for V̂_B
        tau2 = [(float(noise_std.get(k, 0.0)) ** 2, stack.A.shape[-2], stack.B.shape[-2])
                for stack in stacks for k in stack.keys]
        share = _per_pair([self.floor * t * (1 - 0.75 * r / m) for t, m, _ in tau2]
                          + [self.floor * t * (1 - 0.75 * r / n) for t, _, n in tau2], device)
        floors = share * torch.cat([trace_N, trace_M]) / r
        # m̂ floor(V̂)^{-1/2} = m (floor(V̂)^{-1/2} / c1): the bias correction rides on the r × r factor
        c1 = _per_pair([1 - beta1 ** t for stack in stacks for t in stack.steps] * 2, device, (-1, 1, 1))
        roots = _floored(values[2 * P:], vectors[2 * P:], floors, self.max_condition, self.eps) / c1
        sizes = [len(stack.keys) for stack in stacks]
        root_A, root_B = (part.split(sizes) for part in roots.to(stacks[0].work).split(P))
        moved = _retractions([(stack.A, stack.B, stack.moments["m_A"] @ a, stack.moments["m_B"] @ b)
                              for stack, a, b in zip(stacks, root_A, root_B)], -self.lr, aligned=True)
        for stack, (new_A, new_B) in zip(stacks, moved):
            lora_A = [self.pairs[k][0] for k in stack.keys]
            lora_B = [self.pairs[k][1] for k in stack.keys]
            write(lora_B, new_A)
            write(lora_A, new_B.transpose(-1, -2))
            for p in lora_A + lora_B:
                p.grad = None

    def _stacked(self, keys: tuple[str, ...], m: int, n: int, r: int, work: torch.dtype, device: torch.device
                 ) -> tuple[dict[str, Tensor], list[dict]]:
        """The stacked moments of `keys` and each pair's state entry, whose tensors are views into them.
        Built again (from `state`, zeros for a pair's first step) when the stack is new, when its pairs'
        entries were replaced (`load_state_dict`), or when the set of pairs with a gradient changed."""
        cached = self._stacks.get(keys)
        if cached is not None and all(self.state.get(k) is entry for k, entry in zip(keys, cached[1])):
            return cached
        shapes = {"m_A": ((m, r), work), "m_B": ((n, r), work), "v_A": ((r, r), torch.float64),
                  "v_B": ((r, r), torch.float64)}
        moments = {field: torch.stack([self.state[k][field].to(device=device, dtype=dtype) if k in self.state
                                       else torch.zeros(shape, dtype=dtype, device=device) for k in keys])
                   for field, (shape, dtype) in shapes.items()}
        entries = [{"step": int(self.state[k]["step"]) if k in self.state else 0,
                    **{field: moments[field][i] for field in shapes}} for i, k in enumerate(keys)]
        for stale in [other for other in self._stacks if set(other) & set(keys)]:
            del self._stacks[stale]
        self.state.update(zip(keys, entries))
        self._stacks[keys] = moments, entries
        return moments, entries

    def zero_grad(self) -> None:
        for lora_A, lora_B in self.pairs.values():
            lora_A.grad = lora_B.grad = None

    def state_dict(self) -> dict:
        return {"state": {k: dict(v) for k, v in self.state.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.state = {k: dict(v) for k, v in state["state"].items()}
        self._stacks = {}


def _per_pair(values: list[float], device: torch.device, shape: tuple[int, ...] = (-1,)) -> float | Tensor:
    """One number when all `values` agree (the usual case: nothing to copy), else a float64 tensor of them on
    `device`, viewed as `shape`, copied without waiting: a plain copy to a GPU waits for the work queued
    before it."""
    if len(set(values)) == 1:
        return values[0]
    host = torch.tensor(values, dtype=torch.float64)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True).view(shape)
