"""PRISM: clipping and noise in the tangent space of the rank-r manifold (arXiv 2606.00944;
seed 000 in docs/design.md), and the optimizer that moves each LoRA pair along it.

The geometry is in two modules, in the paper's notation (A = lora_B.weight, B = lora_A.weightᵀ, Z = A Bᵀ):
`mechanisms/tangent_space.py` (Gram pseudo-inverses, the canonical lift, the intrinsic norm, tangent noise: what
the routing layer clips and noises with) and `mechanisms/retraction.py` (back to rank r, and the alignment of the
gauge). This module holds what PRISM adds on top: the floored preconditioner, whose floor is the noise's share of
the second moments, and `Prism`, which keeps the moments and takes each step.

`Prism` moves its pairs as stacks, one per shape (`stacking.shape_groups`), and runs the r × r and 2r × 2r
factorizations of every stack of one rank in one batched call each (`retraction._retractions`). Precision is that
of the geometry (float64 wherever a product squares a condition number or a factorization reads small
eigenvalues); the first moments and a tall factor times an r × r preconditioner run in the factors' dtype,
float32 at least.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
from torch import Tensor, nn

from govtrain.mechanisms.retraction import _retractions
from govtrain.mechanisms.stacking import shape_groups, write

__all__ = ["floored_inverse_sqrt", "Prism"]


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
