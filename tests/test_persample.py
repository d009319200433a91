"""Per-sample norms and clipped sums without per-sample gradients (`persample.Calls`) against the
per-sample gradients themselves, in float64: ghost norms, materialized norms and book-keeping sums, for
Linear weights and biases, LayerNorm and Embedding, unmasked and masked to rows or columns."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch import nn  # noqa: E402

from govtrain.routing import persample  # noqa: E402


def _explicit(module: nn.Module, calls) -> dict[str, torch.Tensor]:
    """Per-sample gradients by the old per-call formulas, summed over calls: the oracle."""
    total: dict[str, torch.Tensor] = {}
    for a, g in calls:
        per = persample.linear(module, a, g) if isinstance(module, nn.Linear) else persample.layer_norm(module, a, g)
        for leaf, value in per.items():
            total[leaf] = total[leaf] + value if leaf in total else value
    return total


def _mask(per: torch.Tensor, mask) -> torch.Tensor:
    if mask is None:
        return per
    dim, index = mask
    keep = torch.zeros(per.shape[dim + 1], dtype=per.dtype)
    keep[index] = 1
    return per * keep.reshape([-1 if d == dim + 1 else 1 for d in range(per.dim())])


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 5), tokens=st.lists(st.integers(1, 6), min_size=1, max_size=3),
       fan_in=st.integers(1, 7), fan_out=st.integers(1, 7), seed=st.integers(0, 10_000))
def test_linear_norms_and_sums_equal_the_per_sample_gradients(batch, tokens, fan_in, fan_out, seed):
    generator = torch.Generator().manual_seed(seed)
    module = nn.Linear(fan_in, fan_out).double()
    calls = [(torch.randn(batch, t, fan_in, generator=generator, dtype=torch.float64),
              torch.randn(batch, t, fan_out, generator=generator, dtype=torch.float64)) for t in tokens]
    per = _explicit(module, calls)
    rows = torch.arange(batch - 1, -1, -1)  # any order of any subset
    weights = torch.rand(batch, generator=generator, dtype=torch.float64)
    masks = [None, (0, torch.tensor([0])), (1, torch.tensor([fan_in - 1]))]
    for strategy in ("ghost", "materialize", "auto"):
        source = persample.Calls(module, [a for a, _ in calls], [g for _, g in calls], strategy=strategy)
        for leaf in ("weight", "bias"):
            for mask in masks if leaf == "weight" else masks[:2]:
                expected = _mask(per[leaf], mask).index_select(0, rows)
                norms = source.sq_norms(leaf, rows, mask)
                assert torch.allclose(norms, expected.pow(2).flatten(1).sum(1), atol=1e-6, rtol=1e-9), (leaf, mask)
                summed = source.weighted_sum(leaf, rows, weights, mask)
                assert torch.allclose(summed, torch.tensordot(weights, expected, dims=([0], [0])), atol=1e-6, rtol=1e-9)
            assert torch.allclose(source.per_sample(leaf, rows), per[leaf].index_select(0, rows), atol=1e-12)


def test_layer_norm_and_embedding_norms_and_sums_equal_the_per_sample_gradients():
    generator = torch.Generator().manual_seed(3)
    norm = nn.LayerNorm(5).double()
    calls = [(torch.randn(4, 3, 5, generator=generator, dtype=torch.float64),
              torch.randn(4, 3, 5, generator=generator, dtype=torch.float64)) for _ in range(2)]
    per = _explicit(norm, calls)
    source = persample.Calls(norm, [a for a, _ in calls], [g for _, g in calls])
    rows, weights = torch.tensor([2, 0, 3]), torch.tensor([0.5, 1.0, 0.25], dtype=torch.float64)
    for leaf in ("weight", "bias"):
        for mask in (None, (0, torch.tensor([1, 4]))):
            expected = _mask(per[leaf], mask).index_select(0, rows)
            assert torch.allclose(source.sq_norms(leaf, rows, mask), expected.pow(2).sum(1), atol=1e-12)
            assert torch.allclose(source.weighted_sum(leaf, rows, weights, mask),
                                  torch.tensordot(weights, expected, dims=([0], [0])), atol=1e-12)

    embedding = nn.Embedding(9, 3, padding_idx=0).double()
    ids = torch.tensor([[1, 2, 2, 0], [3, 3, 3, 3], [0, 0, 5, 8]])
    g = torch.randn(3, 4, 3, generator=generator, dtype=torch.float64)
    dense = torch.zeros(3, 9, 3, dtype=torch.float64)  # the per-sample gradients, formed by hand
    for i in range(3):
        for t in range(4):
            if ids[i, t] != 0:
                dense[i, ids[i, t]] += g[i, t]
    source = persample.Calls(embedding, [ids], [g])
    rows, weights = torch.tensor([2, 1]), torch.tensor([0.3, 2.0], dtype=torch.float64)
    assert torch.allclose(source.sq_norms("weight", rows), dense[rows].pow(2).sum((1, 2)), atol=1e-12)
    assert torch.allclose(source.weighted_sum("weight", rows, weights),
                          torch.tensordot(weights, dense[rows], dims=([0], [0])), atol=1e-12)
    with pytest.raises(ValueError):
        source.sq_norms("weight", rows, (0, torch.tensor([1])))


def test_the_hybrid_rule_picks_ghost_norms_where_they_are_cheaper():
    assert persample.use_ghost(tokens=48, fan_in=384, fan_out=384)  # 2·48² < 384²
    assert not persample.use_ghost(tokens=48, fan_in=384, fan_out=8)  # a LoRA factor: form it
    assert persample.use_ghost(tokens=512, fan_in=8, fan_out=8, strategy="ghost")
    assert not persample.use_ghost(tokens=1, fan_in=4096, fan_out=4096, strategy="materialize")
    with pytest.raises(ValueError):
        persample.use_ghost(1, 1, 1, strategy="fast")


def _autograd_per_sample(module: nn.Module, a: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each sample's gradient of <module(a_i), g_i> by autograd, one sample at a time."""
    out: dict[str, list[torch.Tensor]] = {}
    for i in range(a.shape[0]):
        params = dict(module.named_parameters())
        grads = torch.autograd.grad((module(a[i:i + 1]) * g[i:i + 1]).sum(), list(params.values()))
        for leaf, grad in zip(params, grads):
            out.setdefault(leaf, []).append(grad)
    return {leaf: torch.stack(values) for leaf, values in out.items()}


@pytest.mark.parametrize("strategy", ["ghost", "materialize", "auto"])
def test_conv1d_weight_is_the_transpose_and_masks_follow_its_layout(strategy: str):
    """GPT-2's Conv1D stores [in, out]: dim 0 masks input features, dim 1 output features."""
    from transformers.pytorch_utils import Conv1D

    generator = torch.Generator().manual_seed(3)
    module = Conv1D(5, 3).double()  # nf = 5 outputs, nx = 3 inputs: weight [3, 5]
    nn.init.normal_(module.weight, generator=generator)
    a = torch.randn(4, 6, 3, generator=generator, dtype=torch.float64)
    g = torch.randn(4, 6, 5, generator=generator, dtype=torch.float64)
    per = _autograd_per_sample(module, a, g)
    assert per["weight"].shape == (4, 3, 5)
    weights = torch.rand(4, generator=generator, dtype=torch.float64)
    for formed in (False, True):
        source = persample.Calls(module, [] if formed else [a], [] if formed else [g], strategy=strategy,
                                 formed=persample.linear(module, a, g) if formed else None)
        for mask in [None, (0, torch.tensor([0, 2])), (1, torch.tensor([1, 4]))]:
            expected = _mask(per["weight"], mask)
            assert torch.allclose(source.sq_norms("weight", None, mask), expected.pow(2).flatten(1).sum(1), rtol=1e-9)
            assert torch.allclose(source.weighted_sum("weight", None, weights, mask),
                                  torch.tensordot(weights, expected, dims=([0], [0])), rtol=1e-9)
        bias_mask = (0, torch.tensor([4]))
        assert torch.allclose(source.weighted_sum("bias", None, weights, bias_mask),
                              torch.tensordot(weights, _mask(per["bias"], bias_mask), dims=([0], [0])), rtol=1e-9)
        assert torch.allclose(source.per_sample("weight", torch.arange(4)), per["weight"], rtol=1e-9)


def test_rms_norm_rule_and_its_check():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    generator = torch.Generator().manual_seed(4)
    module = LlamaRMSNorm(6).double()
    nn.init.uniform_(module.weight, 0.5, 1.5, generator=generator)
    persample.check_rms_norm(module, "norm")  # passes: w * x / rms(x)
    a = torch.randn(3, 5, 6, generator=generator, dtype=torch.float64)
    g = torch.randn(3, 5, 6, generator=generator, dtype=torch.float64)
    per = _autograd_per_sample(module, a, g)
    weight = module.weight
    source = persample.Calls(module, [a], [g])
    assert module.weight is weight and isinstance(weight, nn.Parameter)  # the rule ran on a copy
    assert torch.allclose(source.per_sample("weight", torch.arange(3)), per["weight"], rtol=1e-9)
    assert torch.allclose(source.sq_norms("weight", None), per["weight"].pow(2).sum(1), rtol=1e-9)

    class OnePlusRMSNorm(LlamaRMSNorm):  # Gemma's form: (1 + w) * x / rms(x)
        def forward(self, x):
            return super().forward(x) / self.weight * (1 + self.weight)

    with pytest.raises(ValueError, match="does not compute"):
        persample.check_rms_norm(OnePlusRMSNorm(6).double(), "norm")
