"""Per-sample gradients of the module types the routing layer taps, from what a forward hook saw
(the module's input) and what autograd returned for its output.

Each function takes the saved input `a` and the output gradient `g` of one call, both with the
batch first, and returns {parameter leaf name: per-sample gradient [B, *param.shape]}. Everything
between the batch dimension and the feature dimension (sequence positions) is summed over, which
is what autograd does for the batch gradient. An embedding's per-sample gradient is sparse, so
`embedding_norms` and `embedding_sum` work on its rows without ever forming [B, V, D].

The router never needs the per-sample gradients themselves, only their squared norms and their
clipped, weighted sum. `Calls` gives both without keeping a per-sample gradient (book-keeping,
Bu et al. 2023): the sum is one contraction of the saved inputs with the weighted output gradients,
and a Linear weight's norms come either from ghost norms, ‖Σ_t g_t a_tᵀ‖² = ⟨A Aᵀ, G Gᵀ⟩ (T² per
sample), or from the per-sample gradient formed for that one parameter and dropped at once (out·in
per sample), whichever is smaller for that layer (fastDP's hybrid: ghost when 2T² < out·in). A class
that reaches only some rows or columns of a weight (attention heads) masks the output gradient's or
the input's features, which masks the gradient exactly.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from govtrain.routing.rounding import gamma, roundoff

# Modules whose weight gradient is Σ_t g_t a_tᵀ: nn.Linear ([out, in]) and GPT-2's Conv1D, which stores the
# same matrix transposed ([in, out], y = x W + b) and gets the transposed gradient.
LINEAR = (nn.Linear, Conv1D)


def _flat(x: Tensor) -> Tensor:
    """[B, ..., F] -> [B, T, F] (T = 1 for a 2-D input)."""
    return x.reshape(x.shape[0], -1, x.shape[-1])


def linear(module: nn.Module, a: Tensor, g: Tensor) -> dict[str, Tensor]:
    """An nn.Linear's per-sample gradients, or a Conv1D's (its weight is [in, out]: the transpose)."""
    a, g = _flat(a), _flat(g)
    grads = {}
    if module.weight.requires_grad:
        grads["weight"] = torch.einsum("bto,bti->bio" if isinstance(module, Conv1D) else "bto,bti->boi", g, a)
    if module.bias is not None and module.bias.requires_grad:
        grads["bias"] = g.sum(1)
    return grads


def layer_norm(module: nn.LayerNorm, a: Tensor, g: Tensor) -> dict[str, Tensor]:
    normalized = F.layer_norm(a, module.normalized_shape, None, None, module.eps)
    dims = tuple(range(1, a.dim() - len(module.normalized_shape)))
    grads = {}
    if module.weight is not None and module.weight.requires_grad:
        grads["weight"] = (g * normalized).sum(dims) if dims else g * normalized
    if module.bias is not None and module.bias.requires_grad:
        grads["bias"] = g.sum(dims) if dims else g
    return grads


class Mismatch(ValueError):
    """A module that does not compute what its per-sample rule assumes (found by a probe before a run)."""


RMS_NORMS = ("RMSNorm",)  # Hugging Face's Llama, Mistral, Qwen2 and Mixtral norms, and torch's own


def rms_normalized(module: nn.Module, a: Tensor) -> Tensor:
    """x/rms(x) exactly as the module computes it (Llama's norms normalize in fp32 whatever the input dtype):
    its own forward with a weight of ones, which `check_rms_norm` has shown to be linear in the weight. It
    runs on a shallow copy with its own parameter table, and `forward` is called directly, so neither the
    model's module nor any hook on it (the router's own among them) is touched."""
    bare = copy.copy(module)
    bare._parameters = {**module._parameters, "weight": torch.ones(module.weight.shape, dtype=a.dtype,
                                                                    device=a.device)}
    with torch.no_grad():
        return bare.forward(a)


def rms_norm(module: nn.Module, a: Tensor, g: Tensor) -> dict[str, Tensor]:
    """y = w ⊙ x/rms(x): the per-sample gradient of w is Σ_t g_t ⊙ x_t/rms(x_t)."""
    normalized = rms_normalized(module, a).to(g.dtype)
    dims = tuple(range(1, a.dim() - 1))
    return {"weight": (g * normalized).sum(dims) if dims else g * normalized}


def is_rms_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith(RMS_NORMS) and isinstance(getattr(module, "weight", None), nn.Parameter) \
        and module.weight.dim() == 1 and getattr(module, "bias", None) is None


def check_rms_norm(module: nn.Module, name: str) -> None:
    """Refuse an RMSNorm whose output is not its weight times what it computes at weight one (Gemma's
    (1 + w), a bias, w²): on a random probe at a random weight, both its output and its weight's gradient
    must match the rule's, else the rule would clip and sum something other than the sample's gradient.
    The probe runs in float64 on a CPU copy; the model is not touched."""
    probe_module = _float64_copy(module)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, module.weight.shape[0], generator=generator, dtype=torch.float64)
    g = torch.randn(2, 3, module.weight.shape[0], generator=generator, dtype=torch.float64)
    with torch.enable_grad():
        out = probe_module(x)
        (grad,) = torch.autograd.grad(out, probe_module.weight, g)
    expected = probe_module.weight.detach() * rms_normalized(probe_module, x)
    if not (torch.allclose(out, expected, rtol=1e-9, atol=1e-12)
            and torch.allclose(grad, rms_norm(probe_module, x, g)["weight"].sum(0), rtol=1e-9, atol=1e-12)):
        raise Mismatch(f"{name}: {type(module).__name__} does not compute weight * x / rms(x)")


def _float64_copy(module: nn.Module) -> nn.Module:
    clone = copy.deepcopy(module).to(device="cpu", dtype=torch.float64)  # the probe's tensors are on the CPU
    with torch.no_grad():  # a weight of ones would hide a (1 + w) or w² form: probe at a random point
        clone.weight.copy_(torch.rand(clone.weight.shape, generator=torch.Generator().manual_seed(1),
                                      dtype=torch.float64) + 0.5)
    clone.weight.requires_grad_(True)
    return clone


def grads_of(module: nn.Module, a: Tensor, g: Tensor) -> dict[str, Tensor]:
    """The per-sample gradients of one call of a Linear, Conv1D, LayerNorm or RMSNorm module."""
    if isinstance(module, LINEAR):
        return linear(module, a, g)
    if isinstance(module, nn.LayerNorm):
        return layer_norm(module, a, g)
    return rms_norm(module, a, g)


def _embedding_rows(module: nn.Embedding, ids: Tensor, g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(sample of each row, token of each row, summed gradient of each row) over the distinct
    (sample, token) pairs of the batch; the padding token's gradient is zero, as in autograd."""
    ids = ids.reshape(ids.shape[0], -1)
    g = g.reshape(ids.shape[0], ids.shape[1], -1)
    batch = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1).expand_as(ids)
    if module.padding_idx is not None:
        g = g * (ids != module.padding_idx).unsqueeze(-1).to(g.dtype)
    keys = (batch * module.num_embeddings + ids).reshape(-1)
    unique, inverse = torch.unique(keys, return_inverse=True)
    rows = torch.zeros(unique.shape[0], g.shape[-1], dtype=g.dtype, device=g.device)
    rows.index_add_(0, inverse, g.reshape(-1, g.shape[-1]))
    return unique // module.num_embeddings, unique % module.num_embeddings, rows


def embedding_norms(module: nn.Embedding, ids: Tensor, g: Tensor) -> Tensor:
    """Per-sample squared Frobenius norm of the embedding gradient: [B]."""
    sample, _, rows = _embedding_rows(module, ids, g)
    out = torch.zeros(ids.shape[0], dtype=g.dtype, device=g.device)
    return out.index_add_(0, sample, rows.pow(2).sum(1))


def embedding_sum(module: nn.Embedding, ids: Tensor, g: Tensor, weights: Tensor) -> Tensor:
    """sum_i weights[i] * (per-sample gradient of sample i): [V, D]."""
    sample, token, rows = _embedding_rows(module, ids, g)
    out = torch.zeros(module.weight.shape, dtype=g.dtype, device=g.device)  # full-size, also if sharded
    return out.index_add_(0, token, rows * weights[sample].unsqueeze(1))


def embedding_per_sample(module: nn.Embedding, ids: Tensor, g: Tensor) -> Tensor:
    """The per-sample gradients themselves, dense: [B, V, D] (only a parameter that an embedding shares with
    another module needs them: `Shared`)."""
    sample, token, rows = _embedding_rows(module, ids, g)
    out = torch.zeros(ids.shape[0], *module.weight.shape, dtype=g.dtype, device=g.device)
    return out.index_put_((sample, token), rows, accumulate=True)


def check_embedding(module: nn.Embedding, name: str) -> None:
    if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
        raise ValueError(f"{name}: embeddings with max_norm, scale_grad_by_freq or sparse gradients are not supported")


STRATEGIES = ("auto", "ghost", "materialize")

def _keep(size: int, index: Tensor, like: Tensor) -> Tensor:
    keep = torch.zeros(size, dtype=like.dtype, device=like.device)
    keep[index] = 1
    return keep


def use_ghost(tokens: int, fan_in: int, fan_out: int, strategy: str = "auto") -> bool:
    """Whether a Linear weight's per-sample norms are cheaper as ghost norms (T² per sample) than from its
    per-sample gradient (out·in per sample): fastDP's per-layer rule, 2T² < out·in."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown per-sample strategy {strategy!r}: one of {', '.join(STRATEGIES)}")
    return strategy == "ghost" or (strategy == "auto" and 2 * tokens * tokens < fan_in * fan_out)


def _take(tensor: Tensor, rows: Tensor | None) -> Tensor:
    """The samples `rows` of a batch-first tensor; None means all of them (no copy)."""
    return tensor if rows is None else tensor.index_select(0, rows)


def _zeroed(per: Tensor, weights: Tensor) -> Tensor:
    """`per` (batch first) with the rows of the samples whose weight is 0 replaced by zeros: a where, not a
    product, so a nan or inf row becomes exactly zero. Rows of non-zero weight are returned bit for bit."""
    keep = (weights != 0).reshape(-1, *([1] * (per.dim() - 1)))
    return torch.where(keep, per, torch.zeros((), dtype=per.dtype, device=per.device))


def form_early(a: Tensor, g: Tensor, strategy: str = "auto") -> bool:
    """Whether a Linear call's per-sample gradients should be formed as soon as its output gradient exists
    (then its input and output gradient are dropped): where they take less memory than those two,
    out·in ≤ T·(in + out), as a LoRA factor's do. `ghost` and `materialize` keep every pair instead."""
    tokens = _flat(a).shape[1]
    fan_in, fan_out = a.shape[-1], g.shape[-1]
    return strategy == "auto" and fan_in * fan_out <= tokens * (fan_in + fan_out)


class Calls:
    """Every call one tapped module made in one chunk's forward, with its output gradients, as the
    router asks of them: per-sample squared norms, a weighted sum over samples, or (PRISM) the
    per-sample gradients of a few rows. `mask` is None or (dim, index) of the parameter."""

    def __init__(self, module: nn.Module, inputs: list[Tensor], grads: list[Tensor], *,
                 strategy: str = "auto", formed: dict[str, Tensor] | None = None) -> None:
        """`inputs` and `grads` of the calls kept whole; `formed` the per-sample gradients already formed
        from others (`form_early`), summed over those calls."""
        self.module, self.strategy = module, strategy
        self.precision = torch.get_float32_matmul_precision()  # read here, outside any compiled stage (`bounded`)
        per = dict(formed or {})
        if isinstance(module, nn.Embedding):  # calls side by side along the token axis: a sample's rows of
            # every call are summed before the norm (a module called twice has the sum of both calls' gradients)
            if len(inputs) > 1:
                inputs = [torch.cat([ids.reshape(ids.shape[0], -1) for ids in inputs], 1)]
                grads = [torch.cat([g.reshape(g.shape[0], -1, g.shape[-1]) for g in grads], 1)]
            self.pairs = list(zip(inputs, grads))
            return
        self.transposed = isinstance(module, Conv1D)  # its weight is [in, out]: dim 0 is the input features
        if isinstance(module, LINEAR) and not per:  # calls concatenated along the token axis: one sum over t
            self.a = _flat(inputs[0]) if len(inputs) == 1 else torch.cat([_flat(a) for a in inputs], 1)
            self.g = _flat(grads[0]) if len(grads) == 1 else torch.cat([_flat(g) for g in grads], 1)
            self.per = None
            return
        for a, g in zip(inputs, grads):  # a LayerNorm's, or calls of a module some of whose calls were formed
            for leaf, value in grads_of(module, a, g).items():
                per[leaf] = per[leaf] + value if leaf in per else value
        self.per = per

    def _linear(self, leaf: str, rows: Tensor, mask) -> tuple[Tensor, Tensor]:
        a, g = _take(self.a, rows), _take(self.g, rows)
        if mask is not None:
            dim, index = mask
            if leaf == "bias" or dim == (1 if self.transposed else 0):  # the output features
                g = g * _keep(g.shape[-1], index, g)
            else:  # columns of the weight: input features
                a = a * _keep(a.shape[-1], index, a)
        return a, g

    @staticmethod
    def _masked(per: Tensor, mask) -> Tensor:
        if mask is None:
            return per
        dim, index = mask
        return per * _keep(per.shape[dim + 1], index, per).reshape([-1 if d == dim + 1 else 1 for d in range(per.dim())])

    def sq_norms(self, leaf: str, rows: Tensor | None, mask=None) -> Tensor:
        """‖masked per-sample gradient‖² of parameter `leaf` for the samples `rows` (None: all): [len(rows)]."""
        if isinstance(self.module, nn.Embedding):
            if mask is not None:
                raise ValueError("an embedding cannot be reached in part")
            size = self.pairs[0][1].shape[0] if rows is None else len(rows)
            out = torch.zeros(size, dtype=self.pairs[0][1].dtype, device=self.pairs[0][1].device)
            for ids, g in self.pairs:
                out += embedding_norms(self.module, _take(ids, rows), _take(g, rows))
            return out
        if self.per is None:
            a, g = self._linear(leaf, rows, mask)
            if leaf == "bias":
                return g.sum(1).pow(2).sum(1)
            if use_ghost(a.shape[1], a.shape[2], g.shape[2], self.strategy):
                return ((a @ a.transpose(1, 2)) * (g @ g.transpose(1, 2))).sum((1, 2))
            return torch.einsum("bto,bti->boi", g, a).pow(2).sum((1, 2))  # formed for this parameter only
        return self._masked(_take(self.per[leaf], rows), mask).pow(2).flatten(1).sum(1)

    def bounded(self, leaf: str, rows: Tensor | None, mask=None) -> tuple[Tensor, Tensor]:
        """(s, r) for the samples `rows` (None: all), each [len(rows)]: s ≥ the masked per-sample gradient's squared
        norm as measured here, r ≥ 0 the rounding allowance, so that ‖exact gradient‖ + ‖what `weighted_sum`
        releases of it, over its weight, minus the exact gradient‖ ≤ √s + r (the allowance above `SAFETY`). Where
        the norm and the sum are computed from one formed per-sample tensor (a LayerNorm's, a formed LoRA factor's,
        an expert's), the released part of a sample is that very vector, scaled: r covers only the sum over samples
        (γ_B, relative to the vector's own norm)."""
        if isinstance(self.module, nn.Embedding):
            if mask is not None:
                raise ValueError("an embedding cannot be reached in part")
            sq = self.sq_norms(leaf, rows)
            magnitude = torch.zeros_like(sq)
            tokens = 0
            for ids, g in self.pairs:  # each row of a sample is a sum over its tokens' gradients (padding: zero)
                ids, g = _take(ids, rows).reshape(sq.shape[0], -1), _take(g, rows)
                g = g.reshape(ids.shape[0], ids.shape[1], -1)
                if self.module.padding_idx is not None:
                    g = g * (ids != self.module.padding_idx).unsqueeze(-1).to(g.dtype)
                magnitude += g.norm(dim=-1).sum(1)
                tokens += ids.shape[1]
            batch, width = self.pairs[0][1].shape[0], self.pairs[0][1].shape[-1]
            # the rows, twice (norms, sum: index_add_ need not sum alike twice), then the sum over samples
            return sq, magnitude * 2 * gamma(2 * tokens + batch + width + 2, roundoff(sq.dtype, self.precision))
        if self.per is None:
            a, g = self._linear(leaf, rows, mask)
            batch, tokens = self.a.shape[0], a.shape[1]
            units = roundoff(g.dtype, self.precision)
            if leaf == "bias":  # Σ_t g_t per sample, against Σ_{b,t} w_b g_bt
                sq = g.sum(1).pow(2).sum(1)
                return sq, g.norm(dim=-1).sum(1) * gamma(tokens + batch * tokens + g.shape[2] + 2, units)
            magnitude = (a.norm(dim=-1) * g.norm(dim=-1)).sum(1)  # Σ_t ‖a_t‖·‖g_t‖ ≥ Σ|terms|
            release = gamma(batch * tokens + 2, units)  # the contraction over every sample's tokens at once
            if use_ghost(a.shape[1], a.shape[2], g.shape[2], self.strategy):
                # ⟨AAᵀ, GGᵀ⟩ errs by γ·M² (its T² + in + out terms' magnitudes sum to at most M²): taken in float64,
                # where that is negligible, and added to the square
                wide = torch.promote_types(a.dtype, torch.float64)
                a64, g64 = a.to(wide), g.to(wide)
                sq = ((a64 @ a64.transpose(1, 2)) * (g64 @ g64.transpose(1, 2))).sum((1, 2))
                m64 = magnitude.to(wide)
                sq = (sq.clamp(min=0) + m64.pow(2) * gamma(tokens * tokens + a.shape[2] + g.shape[2] + 2,
                                                           roundoff(wide, self.precision))).to(g.dtype)
                return sq, magnitude * (release + gamma(2, units))  # + the square's cast back
            sq = torch.einsum("bto,bti->boi", g, a).pow(2).sum((1, 2))  # formed for this parameter only
            return sq, magnitude * (release + gamma(tokens + a.shape[2] * g.shape[2] + 2, units))
        per = self._masked(_take(self.per[leaf], rows), mask)
        sq = per.pow(2).flatten(1).sum(1)
        size = per.shape[0] if rows is None else self.per[leaf].shape[0]
        return sq, sq.sqrt() * gamma(size + per.shape[1:].numel() + 2, roundoff(per.dtype, self.precision))

    def weighted_sum(self, leaf: str, rows: Tensor, weights: Tensor, mask=None) -> Tensor:
        """Σ_i weights_i · (masked per-sample gradient of sample rows_i): the parameter's shape. A sample of
        weight 0 adds exactly nothing: its rows are replaced by zeros before anything is scaled or summed, so a
        nan or inf in them (0 · nan is nan) never reaches the sum (the router weighs a non-finite unit 0). Only
        the samples `rows` are read: another class's sample, nan or not, is not touched."""
        if isinstance(self.module, nn.Embedding):
            return sum(embedding_sum(self.module, _take(ids, rows), _zeroed(_take(g, rows), weights), weights)
                       for ids, g in self.pairs)
        if self.per is None:
            a, g = self._linear(leaf, rows, mask)
            g = _zeroed(g, weights) * weights.to(g.dtype)[:, None, None]
            if leaf == "bias":
                return g.sum((0, 1))
            return torch.einsum("bto,bti->io" if self.transposed else "bto,bti->oi", g, _zeroed(a, weights))
        per = _zeroed(self._masked(_take(self.per[leaf], rows), mask), weights)
        return torch.tensordot(weights.to(per.dtype), per, dims=([0], [0]))

    def per_sample(self, leaf: str, rows: Tensor) -> Tensor:
        """The per-sample gradients themselves, [len(rows), *shape] (PRISM's tangent norms need LoRA factors')."""
        if isinstance(self.module, nn.Embedding):  # dense [B, V, D]: asked for by `Shared` only
            return sum(embedding_per_sample(self.module, _take(ids, rows), _take(g, rows)) for ids, g in self.pairs)
        if self.per is None:
            a, g = _take(self.a, rows), _take(self.g, rows)
            if leaf == "bias":
                return g.sum(1)
            return torch.einsum("bto,bti->bio" if self.transposed else "bto,bti->boi", g, a)
        return _take(self.per[leaf], rows)


class Shared:
    """One parameter that several modules hold (GPT-2's tied embeddings: `wte` looks rows up, `lm_head`
    multiplies by the same matrix), asked as `Calls` is. A sample's gradient is the sum of every holder's
    per-sample gradient, so its norm has cross terms no one module's shortcut (ghost norms, an embedding's
    rows) can give: the per-sample gradient is formed whole, [B, *shape], once per chunk. The clipped sum is
    linear, so each holder adds its own."""

    def __init__(self, sources: list[tuple[Calls, str]]) -> None:
        self.sources = sources  # (a holder's calls, the parameter's leaf name in that holder)

    def per_sample(self, _leaf: str, rows: Tensor | None) -> Tensor:
        return sum(calls.per_sample(leaf, rows) for calls, leaf in self.sources)

    def sq_norms(self, leaf: str, rows: Tensor | None, mask=None) -> Tensor:
        if mask is not None:
            raise ValueError("a parameter modules share cannot be reached in part")
        return self.per_sample(leaf, rows).pow(2).flatten(1).sum(1)

    def bounded(self, leaf: str, rows: Tensor | None, mask=None) -> tuple[Tensor, Tensor]:
        """As `Calls.bounded`: the norm is of the holders' per-sample gradients formed and summed here, the release
        each holder's own `weighted_sum`; so the allowance is every holder's, twice (each of the two evaluations
        is within a holder's allowance of the exact gradient), plus this sum's own relative rounding."""
        if mask is not None:
            raise ValueError("a parameter modules share cannot be reached in part")
        per = self.per_sample(leaf, rows)
        sq = per.pow(2).flatten(1).sum(1)
        allowance = sq.sqrt() * gamma(len(self.sources) + per.shape[1:].numel() + 2,
                                      roundoff(per.dtype, self.sources[0][0].precision))
        for calls, held in self.sources:
            allowance = allowance + 2 * calls.bounded(held, rows)[1]
        return sq, allowance

    def weighted_sum(self, _leaf: str, rows: Tensor | None, weights: Tensor, mask=None) -> Tensor:
        if mask is not None:
            raise ValueError("a parameter modules share cannot be reached in part")
        return sum(calls.weighted_sum(leaf, rows, weights) for calls, leaf in self.sources)
