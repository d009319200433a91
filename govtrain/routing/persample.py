"""Per-sample gradients of the module types the routing layer taps, from what a forward hook saw
(the module's input) and what autograd returned for its output.

Each function takes the saved input `a` and the output gradient `g` of one call, both with the
batch first, and returns {parameter leaf name: per-sample gradient [B, *param.shape]}. Everything
between the batch dimension and the feature dimension (sequence positions) is summed over, which
is what autograd does for the batch gradient. An embedding's per-sample gradient is sparse, so
`embedding_norms` and `embedding_sum` work on its rows without ever forming [B, V, D].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _flat(x: Tensor) -> Tensor:
    """[B, ..., F] -> [B, T, F] (T = 1 for a 2-D input)."""
    return x.reshape(x.shape[0], -1, x.shape[-1])


def linear(module: nn.Linear, a: Tensor, g: Tensor) -> dict[str, Tensor]:
    a, g = _flat(a), _flat(g)
    grads = {}
    if module.weight.requires_grad:
        grads["weight"] = torch.einsum("bto,bti->boi", g, a)
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
    out = torch.zeros_like(module.weight, dtype=g.dtype)
    return out.index_add_(0, token, rows * weights[sample].unsqueeze(1))


def check_embedding(module: nn.Embedding, name: str) -> None:
    if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
        raise ValueError(f"{name}: embeddings with max_norm, scale_grad_by_freq or sparse gradients are not supported")
