"""The routing layer on a model sharded by FSDP2 (`torch.distributed.fsdp.fully_shard`; docs/design.md §5).

FSDP2 keeps each parameter as a `DTensor` sharded on dim 0 across the ranks, and all-gathers a module's
parameters into plain unsharded tensors for its forward and again for its backward. What that means for the
router:

- **Per-sample norms need no collective.** Each rank runs its own examples through the full weights, so the
  inputs and output gradients the router's hooks see are the examples' whole activations, and every per-sample
  gradient it forms (Σ_t g_t a_tᵀ for a Linear or LoRA factor, g ⊙ x/rms(x) for a norm, an embedding's rows) is
  the whole parameter's. No per-sample gradient is ever formed from a shard, so nothing is computed per shard
  and all-reduced before clipping (tensor parallelism would need that; FSDP does not).
- **Autograd must be asked for the tapped outputs, not the parameters.** The sharded `DTensor` parameters are
  not in the forward's graph (the unsharded copies are), so `autograd.grad` on them differentiates nothing: no
  output-gradient hook fires and every norm is zero. The router asks for the gradient edges of the tapped
  calls' outputs (`Router._clipped_sum`), which also skips autograd's own weight gradients.
- **FSDP's reduce-scatter never sees a gradient.** `autograd.grad` accumulates nothing into `.grad`, so the
  post-backward reduce-scatter (which would sum non-private gradients across ranks) has nothing to reduce;
  `prepare` also turns gradient sync off, so a stray `backward()` cannot sum one either.
- **Clipped sums are full-size**; the router builds them with `torch.zeros(param.shape)` (a DTensor reports
  its global shape), the ranks' sums are summed and noised once (`govtrain.distributed.world`), and `local`
  turns each rank's copy of the released gradient into its own shard, with no communication.
- **Values of parameters** (PRISM's LoRA factors, for the tangent geometry) are read whole with `full`, an
  all-gather: every rank must make the same calls.
- **Every rank runs the same number of forwards and backwards per step**: each is a sequence of all-gathers
  (a rank that runs one more waits in it until the group's timeout). A rank with fewer chunks of the step's
  draw runs `chunks(n) - n` fillers: one public example (`task.probe_examples()[:1]`, any resolved class,
  clip norm 1) whose per-example loss is multiplied by zero before `accumulate`. Its gradient is exactly zero,
  so its norm is 0 and its clipped contribution +0.0, and it makes the same collectives as a real chunk.
  (A batch of zero examples cannot stand in: Llama's attention cannot reshape an empty batch.)
- **Build the Router, and the optimizer, after `fully_shard`**, which replaces every parameter; the router
  refuses a step on parameters the model no longer holds.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["is_sharded", "full", "local", "prepare", "chunks"]


def _dtensor() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def is_sharded(param: Tensor) -> bool:
    """Whether `param` is a DTensor (FSDP2's sharded parameter)."""
    dtensor = _dtensor()
    return dtensor is not None and isinstance(param, dtensor)


def full(param: Tensor) -> Tensor:
    """The whole value of a parameter, detached: a DTensor's is all-gathered (a collective every rank makes)."""
    return param.detach().full_tensor() if is_sharded(param) else param.detach()


def local(whole: Tensor, param: Tensor) -> Tensor:
    """`whole` (a full-size tensor every rank holds identically, such as the released gradient) laid out as
    `param` is: for a sharded parameter, this rank's shard as a DTensor of the parameter's mesh and placements,
    sliced locally without any communication (`src_data_rank=None`); a plain parameter's is `whole`."""
    if not is_sharded(param):
        return whole
    from torch.distributed.tensor import distribute_tensor

    if tuple(whole.shape) != tuple(param.shape):
        raise RuntimeError(f"a gradient of shape {tuple(whole.shape)} for a parameter of shape {tuple(param.shape)}")
    return distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)


def prepare(model: nn.Module) -> None:
    """Turn FSDP's gradient sync (the post-backward reduce-scatter of `.grad`) off on every FSDP module of
    `model`: a governed step writes `.grad` itself, from the ranks' clipped sums and the noise. A model without
    FSDP modules is left as it is."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(False, recurse=False)


def chunks(count: int, group: Any = None) -> int:
    """The number of chunks every rank runs this step: the largest `count` over the ranks (a collective)."""
    import torch.distributed as dist

    value = torch.tensor([count], dtype=torch.long)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return int(value.item())

