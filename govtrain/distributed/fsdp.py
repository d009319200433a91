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

A run with RUN.toml `training.fsdp = true` (`govtrain/train/run.py`) shards with `shard` after the lead's initial
weights are shared, gathers the trainable weights and the update's state whole after each step (`whole`: they are
the adapter's size, not the model's) so that the lead alone can write its run state and adapter, and puts a
resumed state back as each rank's shards (`load_whole`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["is_sharded", "full", "local", "prepare", "reshard", "chunks", "blocks", "shard", "whole", "load_whole"]


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


def reshard(model: nn.Module) -> None:
    """Every FSDP module of `model` back to its sharded parameters: a forward with no backward after it (the
    router's probe, a check) leaves the root's gathered, registered in place of the shards, and the run's guard
    holds the shards (`GovernedRun`'s `Weights`)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def chunks(count: int, group: Any = None) -> int:
    """The number of chunks every rank runs this step: the largest `count` over the ranks (a collective)."""
    import torch.distributed as dist

    value = torch.tensor([count], dtype=torch.long)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return int(value.item())



def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks, each sharded on its own: the `ModuleList` of as many modules as the config's
    layers (Llama's `model.layers`, BERT's `encoder.layer`, GPT-2's `h`); none found is an error."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    layers = next((getattr(config, key) for key in ("num_hidden_layers", "n_layer", "num_layers")
                   if isinstance(getattr(config, key, None), int)), None)
    found = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == layers]
    if layers is None or not found:
        raise ValueError(f"{type(model).__name__}: no list of its {layers} transformer blocks to shard")
    return list(found[0])


def shard(model: nn.Module, world: Any, device: torch.device) -> None:
    """Shard `model` over the run's ranks with FSDP2: each transformer block, then the root (its embeddings and
    head), on a one-dimensional mesh of `device`'s type; FSDP moves each rank's shards to the device. Gradient sync
    off (`prepare`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world.size,))
    for block in blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    prepare(model)


def whole(value: Any) -> Any:
    """`value` (a tensor, or dicts, lists and tuples of them, such as an optimizer's state) with every DTensor
    all-gathered whole and detached: a collective every rank makes, in the same order."""
    if is_sharded(value):
        return value.detach().full_tensor()
    if isinstance(value, dict):
        return {key: whole(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(whole(item) for item in value)
    return value


def load_whole(model: nn.Module, update: Any, trainable: dict[str, Tensor], state: dict) -> None:
    """Put whole `trainable` weights and a whole update `state` (as `whole` gathered them, e.g. from a run state)
    into a sharded model and its update: each rank takes its own shards, with no communication."""
    with torch.no_grad():
        for name, value in trainable.items():
            param = model.get_parameter(name)
            param.copy_(local(value.to(param.device, param.dtype), param))
    optimizer = state.get("optimizer")
    if optimizer is not None and update.optimizer is not None:
        from govtrain.mechanisms.update import saved_params

        param_of = saved_params(optimizer, update.optimizer)
        if param_of is None:  # `resume.check_state_shapes` refused such a state before it came here
            raise ValueError("the saved optimizer state holds another number of parameters than the update")
        state = {**state, "optimizer": {**optimizer, "state": {
            index: {key: local(value.to(param_of[index].device), param_of[index])
                    if isinstance(value, Tensor) and tuple(value.shape) == tuple(param_of[index].shape)
                    and value.dim() > 0 else value
                    for key, value in entries.items()}
            for index, entries in optimizer["state"].items()}}}
    update.load_state_dict(state)


def share_resumed(world: Any, model: nn.Module, update: Any, saved: tuple[dict, dict] | None) -> None:
    """A resumed run's weights and update state, from the lead's run state (`saved`: its trainable weights and its
    update's state, on the lead), as every rank's shards."""
    trainable, state = world.broadcast(saved if world.lead else None)
    load_whole(model, update, trainable, state)


def gathered(world: Any, model: nn.Module, update: Any) -> dict:
    """(Every rank.) The trainable weights and the update's state gathered whole, for the lead's run state and
    adapter: a step's last collective, so that the lead writes them with no other rank in a collective."""
    return world.guarded(lambda: {
        "trainable": {n: full(p) for n, p in model.named_parameters() if p.requires_grad},
        "update": whole(update.state_dict())})
