"""Back onto the rank-r manifold after a step along a tangent vector (notation of `mechanisms/tangent_space.py`):
the retraction to the best rank-r approximation, as balanced factors, and the alignment that keeps the factors'
gauge (and so PRISM's moments, kept in factor coordinates) continuous from one step to the next.

Every function broadcasts over leading dimensions, and `_retractions` takes stacks of pairs of one rank at once:
on a GPU each factorization waits for the device, so PRISM retracts all its pairs of a rank in one call. Float64
throughout (the orthonormal bases come from 2r × 2r Gram matrices, `_orthonormal`); results in the factors' dtype.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

__all__ = ["retract", "retract_aligned", "align"]


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
