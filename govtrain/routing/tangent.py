"""PRISM's part of the routing layer (`mechanisms.prism`): the LoRA pairs moved as stacks, one per shape.

Per step PRISM measures every sample's pairs by the norms of their tangent parts, sums the clipped
per-sample factor gradients, lifts that sum to each pair's tangent space and adds the group's tangent
noise. Pair by pair, each of these is a few small kernels, and each pair's Gram pseudo-inverses take an
eigendecomposition that waits for the device: with dozens of pairs the loop, not the arithmetic, set the
time of a GPU step. Here the pairs are grouped by shape (`stacking.shape_groups` on m, n, r, dtype and
device) and every operation runs once per group on [P, ...] stacks, the Gram matrices of all the groups of
one rank in one batched eigh per step (`tangent_space.grams`).

The arithmetic is the per-pair arithmetic: the PRISM functions broadcast over the stack's leading axis.
Only the order of the noise draws differs from a loop over the pairs: Ω_A of a whole stack [P, m, r], then
its Ω_B [P, n, r], stack after stack, drawn by the router's privatizer (`routing/slots.py`) and handed to
`tangent_space.tangent_noise`. Each pair's noise is distributed as before,
isotropic on its tangent space with the standard deviation of the one group that holds it.

A sample whose class does not reach a pair adds nothing to it: its per-sample gradients are zeroed in the
stack before they are measured or summed. Classes reach a pair whole or not at all (`reach.check_reach`), so
a pair never takes a partial mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Mapping, Sequence

import torch
from torch import Tensor

from govtrain.distributed import fsdp
from govtrain.mechanisms import tangent_space
from govtrain.mechanisms.stacking import shape_groups
from govtrain.routing.persample import Calls

__all__ = ["TangentStacks", "Measured"]


@dataclass(frozen=True, kw_only=True)
class _Stack:
    lora_B: tuple[str, ...]  # the pairs, named by their lora_B weight
    lora_A: tuple[str, ...]  # their lora_A weights, in the same order
    reached_by: Mapping[str, tuple[bool, ...]]  # class -> whether it reaches each pair
    reach: Tensor  # the same as a [P, classes] bool table on the pairs' device


@dataclass(frozen=True, kw_only=True)
class _Geometry:
    """A stack's factors in this step, (A, B) = (lora_B.weight, lora_A.weightᵀ), and their Gram
    pseudo-inverses: the factors do not move within a step. Float64, as the lift takes them; cast from the
    parameters' dtype, so the per-sample norms cast them back exactly."""

    A: Tensor  # [P, m, r]
    B: Tensor  # [P, n, r]
    grams: tuple[tangent_space.Gram, tangent_space.Gram]


@dataclass(frozen=True, kw_only=True)
class Measured:
    """One chunk's per-sample factor gradients of a stack, zero where the sample's class does not reach
    the pair: kept from `measure` to `clipped_sums`, then dropped."""

    gA: Tensor  # [P, b, m, r]: lora_B's
    gBt: Tensor  # [P, b, r, n]: lora_A's, gBᵀ as lora_A is laid out


class TangentStacks:
    """The LoRA pairs some class reaches, stacked by shape; a `Router` under PRISM asks them for the pairs'
    share of each sample's squared norm, the clipped sums, and the lifted, noised release."""

    def __init__(self, params: Mapping[str, Tensor], pairs: Mapping[str, str],
                 reach: Mapping[str, Collection[str]]) -> None:
        """`params`: trainable parameters by name; `pairs`: lora_B name -> lora_A name (`lora_pairs`);
        `reach`: class -> the names of the parameters it reaches."""
        self.params = params
        self.classes = {data_class: i for i, data_class in enumerate(sorted(reach))}
        reached = {b: (params[b], params[a]) for b, a in pairs.items()
                   if any(b in names for names in reach.values())}  # a pair no class reaches never gets a gradient
        self.stacks: list[_Stack] = []
        for keys in shape_groups(reached, lambda p: (p[0].shape, p[1].shape, p[0].dtype, p[0].device)):
            reached_by = {c: tuple(b in reach[c] for b in keys) for c in self.classes}
            table = [[reached_by[c][i] for c in self.classes] for i in range(len(keys))]
            self.stacks.append(_Stack(lora_B=keys, lora_A=tuple(pairs[b] for b in keys), reached_by=reached_by,
                                      reach=torch.tensor(table, dtype=torch.bool, device=params[keys[0]].device)))
        self._geometry: list[_Geometry] | None = None

    def begin(self) -> None:
        """A new step: the factors may have moved since the last."""
        self._geometry = None

    def geometry(self) -> list[_Geometry]:
        """Each stack's factors and Gram pseudo-inverses, once per step: one eigh for the Gram matrices of
        every stack of one rank, dtype and device."""
        if self._geometry is not None:
            return self._geometry
        f64 = torch.float64
        factors = [(torch.stack([fsdp.full(self.params[b]) for b in stack.lora_B]).to(f64),  # whole, if sharded
                    torch.stack([fsdp.full(self.params[a]) for a in stack.lora_A]).transpose(-1, -2).to(f64))
                   for stack in self.stacks]
        kinds: dict[tuple, list[int]] = {}
        for i, ((A, _), stack) in enumerate(zip(factors, self.stacks)):
            kinds.setdefault((A.shape[-1], self.params[stack.lora_B[0]].dtype, A.device), []).append(i)
        grams: dict[int, tuple[tangent_space.Gram, tangent_space.Gram]] = {}
        for (r, dtype, _), members in kinds.items():  # `gram`'s numerical rank: that of the parameters' dtype
            found = tangent_space.grams(*(F for i in members for F in factors[i]), rtol=r * torch.finfo(dtype).eps)
            grams.update((i, (found[2 * j], found[2 * j + 1])) for j, i in enumerate(members))
        self._geometry = [_Geometry(A=A, B=B, grams=grams[i]) for i, (A, B) in enumerate(factors)]
        return self._geometry

    def measure(self, calls: Mapping[str, tuple[Calls, str]], rows: Mapping[str, Tensor], batch: int,
                dtype: torch.dtype) -> tuple[Tensor, list[Measured | None]]:
        """Every sample's Σ over the pairs its class reaches of ‖P_{A,B}(G_i)‖²_F, [b] in `dtype`, and the
        stacks' per-sample factor gradients for `clipped_sums` (None for a stack with none in `calls`). `rows`:
        each class present -> the indices of its samples among the `batch`."""
        device = self.stacks[0].reach.device if self.stacks else torch.device("cpu")
        square = torch.zeros(batch, dtype=dtype, device=device)
        present = set(rows)
        ids = None
        measured: list[Measured | None] = []
        for stack, geometry in zip(self.stacks, self.geometry()):
            if not any(b in calls for b in stack.lora_B):
                measured.append(None)
                continue
            gA = torch.stack([self._per_sample(calls, b, batch, dtype) for b in stack.lora_B])
            gBt = torch.stack([self._per_sample(calls, a, batch, dtype) for a in stack.lora_A])
            if not all(all(stack.reached_by[c]) for c in present):
                if ids is None:  # each sample's class, as its column in the reach table
                    ids = torch.zeros(batch, dtype=torch.long, device=device)
                    for data_class, index in rows.items():
                        ids.index_fill_(0, index.to(device), self.classes[data_class])
                keep = stack.reach.index_select(1, ids)[..., None, None]  # [P, b, 1, 1]
                gA, gBt = torch.where(keep, gA, 0), torch.where(keep, gBt, 0)
            GM, GN = geometry.grams
            per_sample_grams = _per_sample_gram(GM), _per_sample_gram(GN)
            square += tangent_space.projected_sq_norm(geometry.A.unsqueeze(1), geometry.B.unsqueeze(1), gA,
                                              gBt.transpose(-1, -2), grams=per_sample_grams).sum(0).to(dtype)
            measured.append(Measured(gA=gA, gBt=gBt))
        return square, measured

    def clipped_sums(self, measured: Sequence[Measured | None], coefficients: Tensor) -> dict[str, Tensor]:
        """Σ_i coefficients_i · (per-sample gradient of sample i) of every factor of every stack, by parameter
        name, in the coefficients' dtype (views into one stacked sum per stack and factor)."""
        totals: dict[str, Tensor] = {}
        for stack, chunk, geometry in zip(self.stacks, measured, self.geometry()):
            if chunk is None:  # no per-sample gradient in this chunk: zeros, so every chunk sums the same names
                (P, m, r), n = geometry.A.shape, geometry.B.shape[-2]
                totals.update(zip(stack.lora_B, coefficients.new_zeros(P, m, r).unbind(0)))
                totals.update(zip(stack.lora_A, coefficients.new_zeros(P, r, n).unbind(0)))
                continue
            weights = coefficients.to(chunk.gA.dtype)
            # a sample of coefficient 0 (a non-finite norm: `Router._clip`) is zeroed, not scaled: 0 * nan is nan
            keep = (weights != 0)[None, :, None, None]
            gA, gBt = torch.where(keep, chunk.gA, 0), torch.where(keep, chunk.gBt, 0)
            sum_A = torch.tensordot(weights, gA, dims=([0], [1]))  # [P, m, r]
            sum_Bt = torch.tensordot(weights, gBt, dims=([0], [1]))  # [P, r, n]: lora_A's layout
            totals.update(zip(stack.lora_B, sum_A.unbind(0)))
            totals.update(zip(stack.lora_A, sum_Bt.unbind(0)))
        return totals

    def release(self, totals: dict[str, Tensor], std: Mapping[str, float],
                omega: Sequence[tuple[Tensor, Tensor]]) -> None:
        """Replace each pair's clipped sum in `totals` by the canonical lift of its tangent part plus the
        canonical lift of tangent noise with standard deviation `std[lora_B name]` (none where that is 0 or
        missing), in the sums' dtype. `omega`: each stack's standard Gaussians (Ω_A [P, m, r], Ω_B [P, n, r],
        float64), drawn by the router's privatizer (`routing/slots.py`)."""
        for stack, geometry, drawn in zip(self.stacks, self.geometry(), omega, strict=True):
            A, B, grams = geometry.A, geometry.B, geometry.grams
            dtype = totals[stack.lora_B[0]].dtype
            gA = torch.stack([totals[b] for b in stack.lora_B]).to(A.dtype)
            gB = torch.stack([totals[a] for a in stack.lora_A]).transpose(-1, -2).to(A.dtype)
            stds = [max(0.0, float(std.get(b, 0.0))) for b in stack.lora_B]
            if any(s > 0 for s in stds):
                scale: float | Tensor = stds[0] if len(set(stds)) == 1 else \
                    torch.tensor(stds, dtype=A.dtype, device=A.device).view(-1, 1, 1)
                # the noise as factor gradients, so one lift gives the sum's canonical lift plus the noise's
                xi_A, xi_B = tangent_space.tangent_noise(A, B, scale, None, grams=grams, omega=drawn)
                noise_A, noise_B = tangent_space.factor_gradients(A, B, xi_A, xi_B)
                gA, gB = gA + noise_A, gB + noise_B
            dA, dB = tangent_space.tangent_lift(A, B, gA, gB, grams=grams)
            totals.update(zip(stack.lora_B, dA.to(dtype).unbind(0)))
            totals.update(zip(stack.lora_A, dB.to(dtype).transpose(-1, -2).unbind(0)))

    def _per_sample(self, calls: Mapping[str, tuple[Calls, str]], name: str, batch: int, dtype: torch.dtype
                    ) -> Tensor:
        if name not in calls:  # no gradient reached this factor in this chunk
            return torch.zeros(batch, *self.params[name].shape, dtype=dtype, device=self.params[name].device)
        source, leaf = calls[name]
        return source.per_sample(leaf, None)


def _per_sample_gram(g: tangent_space.Gram) -> tangent_space.Gram:
    """A stack's Gram [P, r, r] as [P, 1, r, r], to broadcast against per-sample gradients [P, b, ...]."""
    return tangent_space.Gram(g.inverse.unsqueeze(1), g.inverse_sqrt.unsqueeze(1), g.rank.unsqueeze(1))
