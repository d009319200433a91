"""How a sequence classifier turns token states into one vector: the architecture's own pooler, or the
masked mean over each example's tokens that sentence-transformers models (the bundled MiniLM among them)
were trained with.

`pooling = "mean"` swaps a BERT-style model's pooler (`<encoder>.pooler`, [CLS] -> dense -> tanh) for
`MaskedMean`. The pooler sees only the hidden states, so a forward pre-hook on the encoder hands it that
call's attention mask. The mean runs over the example's own tokens only: padding, which depends on the
other examples in the batch, never enters it, so each example's loss stays a function of that example.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from govtrain.errors import Code, ConfigError


class MaskedMean(nn.Module):
    """Mean of the final hidden states over the tokens whose attention mask is set (no parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.mask: Tensor | None = None

    def forward(self, hidden: Tensor) -> Tensor:
        mask, self.mask = self.mask, None  # one forward's mask, never a stale one
        if mask is None:
            return hidden.mean(dim=1)
        weights = mask.to(hidden.dtype).unsqueeze(-1)
        return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)


def token_mask(mask: Tensor) -> Tensor:
    """[batch, tokens] of which tokens are real, from a 2-D 0/1 mask or a 4-D boolean attention mask."""
    if mask.dim() == 2:
        return mask != 0
    if mask.dim() == 4 and mask.dtype == torch.bool:
        return mask[:, 0].any(dim=-2)  # a key any query may attend to is a real token
    raise ValueError(f"mean pooling needs a 2-D attention mask or a 4-D boolean one, not {tuple(mask.shape)} "
                     f"{mask.dtype}")


def use_pooling(model: nn.Module, pooling: str) -> nn.Module:
    """`model` with the pooling RUN.toml names ("model": unchanged; "mean": `MaskedMean`), in place."""
    if pooling == "model":
        return model
    encoder = getattr(model, "base_model", None)
    if encoder is None or encoder is model or not isinstance(getattr(encoder, "pooler", None), nn.Module):
        raise ConfigError(Code.RUN_CONFIG_INVALID, f"model.pooling = {pooling!r} needs a BERT-style encoder with a "
                                                   f"pooler; {type(model).__name__} has none: use pooling = \"model\"")
    pooler = MaskedMean()
    encoder.pooler = pooler

    def hand_over_mask(module: nn.Module, args: tuple, kwargs: dict) -> None:
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        pooler.mask = None if mask is None else token_mask(mask)

    encoder.register_forward_pre_hook(hand_over_mask, with_kwargs=True)
    return model
