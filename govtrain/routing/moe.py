"""Per-sample gradients of a Mixtral-style mixture-of-experts block: its top-k router and its experts module.

Both see the block's tokens flattened: `MixtralSparseMoeBlock.forward` views its [B, T, D] input as [B·T, D]
before calling `gate` and `experts`, so token row n belongs to sample n // T. The router records each call's
(B, T) from a pre-hook on the block, and `check_block` confirms the map (and everything else assumed here) on
a random probe before a run starts: a block that permuted or mixed its tokens would let one sample's gradient
land in another's row, and is refused (`routing_uncovered`).

- Router (`weight` [E, D], logits = x Wᵀ): a Linear on the flattened tokens; its per-sample gradient is
  Σ_t g_t x_tᵀ over the sample's tokens, with g the gradient of the logits (both of its paths, through the
  top-k weights into the experts' outputs and into any auxiliary loss, meet there).
- Experts (`gate_up_proj` [E, 2I, D], `down_proj` [E, D, I]; token x routed to expert e with weight w gives
  w · down_e(act(gate_e x) ⊙ up_e x)): the backward hook recomputes, for each expert, the hidden activations
  of the tokens routed to it and forms per-token outer products (d_out ⊗ h for down_proj, d_h ⊗ x for
  gate_up_proj, d_h from autograd through the activation), summed per sample: [B, E, ...]. A class's
  `experts` profile then keeps its experts' slices (dimension 1 of these) and zeroes the others.

Cost: the experts' per-sample gradients are formed whole, B × (every expert's weights) per call, as a
materialized Linear's are; there is no ghost-norm shortcut for them yet. Fine for small MoE models and
physical chunks of a few examples; a full-size Mixtral needs `training.physical_batch` kept small.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from govtrain.routing.persample import Mismatch

EXPERT_LEAVES = frozenset({"gate_up_proj", "down_proj"})
_FLOAT32 = {"rtol": 1e-4, "atol": 1e-5}  # float32 rounding on a probe of unit-scale values


def is_router(module: nn.Module) -> bool:
    """A top-k router: `…TopKRouter` with one [E, D] weight."""
    leaves = dict(module.named_parameters(recurse=False))
    return type(module).__name__.endswith("TopKRouter") and leaves.keys() == {"weight"} and leaves["weight"].dim() == 2


def is_experts(module: nn.Module) -> bool:
    """A Mixtral-layout experts module: fused [gate; up] and down, no biases, not transposed, no post-norm."""
    leaves = dict(module.named_parameters(recurse=False))
    return (type(module).__name__.endswith("Experts") and leaves.keys() == EXPERT_LEAVES
            and all(p.dim() == 3 for p in leaves.values()) and getattr(module, "has_gate", True)
            and not getattr(module, "has_bias", False) and not getattr(module, "is_transposed", False)
            and getattr(module, "is_concatenated", True) and not getattr(module, "has_post_expert_norm", False))


def is_moe(module: nn.Module) -> bool:
    return is_router(module) or is_experts(module)


def record(module: nn.Module, args: tuple, output, grid: tuple[int, ...]):
    """What a forward hook keeps of one router or experts call: (saved input, (input shape, output shape),
    the output tensor whose gradient the router needs). Shapes are recorded as [B, T, …] when the call has
    B·T token rows (its block's [B, T] grid), else as they are, and the layout check refuses them."""
    x = args[0]
    out = output[0] if is_router(module) else output  # the router's logits carry its whole gradient
    flat = len(grid) == 2 and x.dim() == 2 and x.shape[0] == grid[0] * grid[1]
    in_shape = (*grid, x.shape[-1]) if flat else tuple(x.shape)
    out_shape = (*grid, out.shape[-1]) if flat else tuple(out.shape)
    # The experts' weights as this call used them: under peft's LoRA on the fused parameters (target_parameters)
    # they are W + s·B·A only while the wrapper's forward runs, so they are kept now, not read in backward.
    saved = x.detach() if is_router(module) else (x.detach(), args[1].detach(), args[2].detach(),
                                                    module.gate_up_proj.detach(), module.down_proj.detach())
    return saved, (torch.Size(in_shape), torch.Size(out_shape)), out


def grads(module: nn.Module, saved, g: Tensor, shapes, dtype: torch.dtype, *, every: bool = False) -> dict[str, Tensor]:
    """The per-sample gradients [B, *param.shape] of one router or experts call (`every`: of both expert
    weights, trainable or not, as LoRA factors on them need)."""
    batch, tokens = shapes[0][0], shapes[0][1]
    if is_router(module):
        a = saved.to(dtype).reshape(batch, tokens, -1)
        return {"weight": torch.einsum("bto,bti->boi", g.to(dtype).reshape(batch, tokens, -1), a)}
    x, index, weights, gate_up, down = saved
    return experts_grads(module, x.to(dtype), index, weights.to(dtype), g.to(dtype), batch, tokens,
                         weights_used=(gate_up, down), every=every)


def experts_grads(module: nn.Module, x: Tensor, index: Tensor, weights: Tensor, g: Tensor, batch: int,
                  tokens: int, *, weights_used: tuple[Tensor, Tensor] | None = None,
                  every: bool = False) -> dict[str, Tensor]:
    """Per-sample gradients of the experts' fused weights from the call's tokens x [N, D], their top-k experts
    `index` and routing `weights` [N, K], and the output gradient g [N, D]; `weights_used` are the (gate_up,
    down) weights the call computed with (default: the module's now)."""
    gate_up, down = weights_used if weights_used is not None else (module.gate_up_proj, module.down_proj)
    gate_up, down = gate_up.detach().to(x.dtype), down.detach().to(x.dtype)
    per_gate_up = torch.zeros(batch, *gate_up.shape, dtype=x.dtype, device=x.device)
    per_down = torch.zeros(batch, *down.shape, dtype=x.dtype, device=x.device)
    for expert in range(gate_up.shape[0]):
        token, slot = torch.where(index == expert)
        if token.numel() == 0:
            continue
        xs, d_out = x[token], g[token] * weights[token, slot, None]  # the expert's output is scaled by w
        with torch.enable_grad():
            h = F.linear(xs, gate_up[expert]).requires_grad_(True)
            gate, up = h.chunk(2, dim=-1)
            act = module.act_fn(gate) * up
            (d_h,) = torch.autograd.grad(act, h, d_out @ down[expert])
        # each sample's tokens in its own row ([B, T, ...], zero where a token went to other experts), so a sample's
        # sum runs over its own tokens only: a nan or inf in one sample never reaches another's gradient (a
        # one-hot product over every token did: 0 · nan is nan)
        per_down[:, expert] = torch.einsum("btd,bti->bdi", _by_sample(d_out, token, batch, tokens),
                                           _by_sample(act.detach(), token, batch, tokens))
        per_gate_up[:, expert] = torch.einsum("btj,btd->bjd", _by_sample(d_h, token, batch, tokens),
                                              _by_sample(xs, token, batch, tokens))
    out = {}
    if every or module.gate_up_proj.requires_grad:
        out["gate_up_proj"] = per_gate_up
    if every or module.down_proj.requires_grad:
        out["down_proj"] = per_down
    return out


def _by_sample(rows: Tensor, token: Tensor, batch: int, tokens: int) -> Tensor:
    """Rows of some of the flattened tokens ([n, F], token indices `token` into B·T) laid out as [B, T, F]."""
    out = rows.new_zeros(batch * tokens, rows.shape[-1])
    out[token] = rows
    return out.reshape(batch, tokens, rows.shape[-1])


# -- peft's LoRA on the fused expert parameters (LoraConfig.target_parameters) ------------------------------

def innermost(module: nn.Module) -> nn.Module:
    """The module under peft's parameter wrappers (ParamWrapper.base_layer, nested once per targeted parameter)."""
    while type(module).__name__ == "ParamWrapper":
        module = module.base_layer
    return module


def is_fused_lora(wrapper: nn.Module) -> bool:
    """A peft ParamWrapper whose factors act on a Mixtral-layout experts module's fused [E, out, in] parameter."""
    return (type(wrapper).__name__ == "ParamWrapper" and is_experts(innermost(wrapper))
            and getattr(wrapper, "_did_swap_in_out_features", False) and getattr(wrapper, "num_experts", 1) > 1)


def lora_grads(wrapper: nn.Module, adapter: str, per_weight: Tensor) -> dict[str, Tensor]:
    """Per-sample gradients of one adapter's factors on one fused expert parameter, from that parameter's
    per-sample gradients G [B, E, out, in] (`experts_grads`) by the chain rule through the weight peft computes,
    W_e + s·B_e A_e with A_e = lora_A.reshape(E, r, in)[e] and B_e = lora_B.reshape(out, r, E)[:, :, e]:
    dA_e = s·B_eᵀ G_e and dB_e = s·G_e A_eᵀ, laid out as the factors are ({"A": [B, E·r, in], "B": [B, out, r·E]})."""
    experts, scaling = wrapper.num_experts, wrapper.scaling[adapter]
    a = wrapper.lora_A[adapter].weight.detach().to(per_weight.dtype)
    b = wrapper.lora_B[adapter].weight.detach().to(per_weight.dtype)
    a3 = a.reshape(experts, -1, a.shape[-1])  # [E, r, in]
    b3 = b.reshape(b.shape[0], -1, experts)  # [out, r, E]
    d_a = scaling * torch.einsum("ore,beoi->beri", b3, per_weight).reshape(per_weight.shape[0], *a.shape)
    d_b = scaling * torch.einsum("beoi,eri->bore", per_weight, a3).reshape(per_weight.shape[0], *b.shape)
    return {"A": d_a, "B": d_b}


def check_block(block: nn.Module, name: str) -> None:
    """Confirm on a random probe of a float32 copy of the block (the model is not touched; float32 because
    transformers' grouped-matmul experts take nothing wider) what the rules assume: the router and the
    experts see the block's [B, T, D] input flattened row by row (token n is sample n // T, exactly); the
    router's logits are x Wᵀ; and the experts' weight gradients, summed over samples, are autograd's (to
    float32 rounding). Raises `Mismatch` naming the first thing that differs."""
    probe = copy.deepcopy(block).to(device="cpu", dtype=torch.float32)  # the probe's tensors are on the CPU
    probe._forward_hooks.clear()
    probe._forward_pre_hooks.clear()
    for param in probe.parameters():
        param.requires_grad_(True)
    children = {child_name: innermost(child) for child_name, child in probe.named_children()
                if is_moe(innermost(child))}
    routers = [c for c in children.values() if is_router(c)]
    experts = [c for c in children.values() if is_experts(c)]
    if len(routers) != 1 or len(experts) != 1:
        raise Mismatch(f"{name} does not hold exactly one top-k router and one experts module")
    seen: dict[str, list[tuple]] = {"router": [], "experts": []}

    def keep(key: str):  # a forward hook that returns None, so the output stands
        def hook(module: nn.Module, args: tuple, out) -> None:
            used = (module.gate_up_proj.detach(), module.down_proj.detach()) if key == "experts" else None
            seen[key].append((args, out, used))
        return hook

    handles = [module.register_forward_hook(keep(key)) for key, module in (("router", routers[0]),
                                                                            ("experts", experts[0]))]
    generator = torch.Generator().manual_seed(0)
    dim = experts[0].gate_up_proj.shape[-1]
    x = torch.randn(2, 3, dim, generator=generator, dtype=torch.float32)
    try:
        with torch.enable_grad():
            probe(x)
    finally:
        for handle in handles:
            handle.remove()
    if len(seen["router"]) != 1 or len(seen["experts"]) != 1:
        raise Mismatch(f"{name} did not call its router and its experts once each on a probe")
    _check_router(routers[0], seen["router"][0], x, name)
    _check_experts(experts[0], seen["experts"][0], x, name, generator)


def _check_router(router: nn.Module, call: tuple, x: Tensor, name: str) -> None:
    args, out, _ = call
    if len(args) != 1 or not isinstance(out, tuple):
        raise Mismatch(f"{name} does not call its router on the tokens alone, returning (logits, ...)")
    tokens = args[0]
    if not torch.equal(tokens, x.reshape(-1, x.shape[-1])):
        raise Mismatch(f"{name}'s router does not see the block's tokens flattened sample by sample")
    if not torch.allclose(out[0], F.linear(tokens, router.weight), **_FLOAT32):
        raise Mismatch(f"{name}'s router logits are not x Wᵀ")


def _check_experts(experts: nn.Module, call: tuple, x: Tensor, name: str, generator: torch.Generator) -> None:
    args, out, used = call
    if len(args) != 3:
        raise Mismatch(f"{name} does not call its experts as experts(tokens, top_k_index, top_k_weights)")
    tokens, index, weights = args
    if not torch.equal(tokens, x.reshape(-1, x.shape[-1])):
        raise Mismatch(f"{name}'s experts do not see the block's tokens flattened sample by sample")
    g = torch.randn(out.shape, generator=generator, dtype=torch.float32)
    params = [experts.gate_up_proj, experts.down_proj]
    expected = torch.autograd.grad(out, params, g)
    wide = {"dtype": torch.float64}
    per = experts_grads(experts, tokens.detach().to(**wide), index, weights.detach().to(**wide), g.to(**wide),
                        x.shape[0], x.shape[1], weights_used=used, every=True)
    for leaf, total in zip(("gate_up_proj", "down_proj"), expected):
        if not torch.allclose(per[leaf].sum(0), total.to(**wide), **_FLOAT32):
            raise Mismatch(f"{name}'s experts do not compute w · down(act(gate x) ⊙ up x) per token")
