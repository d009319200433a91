"""The pooled state split inference releases: the base model's, pooled exactly as the released model pools it.

A release's `govtrain.json` names its base model (bound by tree hash), its pooling (`mean`: the masked mean of the
token states; `model`: the architecture's own pooler) and its max_length; the folder holds the run's tokenizer.
`PooledEncoder` loads that base the way training loaded it (`models.loading.load_pretrained`, `models.pooling`) and
returns, per text, the vector the released classifier's head reads, but computed without the adapter's LoRA: the
client holds only the public base. Split inference serves BERT-style classifiers, whose head reads one pooled
vector; any other is `split_unsupported`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from govtrain.errors import Code, ConfigError
from govtrain.release.artifact import ArtifactRecord, read_record


def pooling_encoder(model: Any) -> Any:
    """The encoder of a sequence classifier whose head reads one pooled vector (a BERT-style model: its
    `pooler`, or govtrain's masked mean in its place), else `split_unsupported`."""
    encoder = getattr(model, "base_model", None)
    if encoder is None or encoder is model or getattr(encoder, "pooler", None) is None:
        raise ConfigError(Code.SPLIT_UNSUPPORTED, f"{type(model).__name__}: split inference needs a BERT-style "
                                                  "classifier whose head reads one pooled vector (the encoder's "
                                                  "pooler, or pooling = \"mean\"); this model has none")
    return encoder


def pooled_states(encoder: Any, inputs: dict[str, Any]) -> Any:
    """The encoder's pooled output for `inputs` ([batch, hidden]), without gradients."""
    import torch

    with torch.no_grad():
        output = encoder(**inputs)
    pooled = getattr(output, "pooler_output", None)
    if pooled is None or pooled.dim() != 2:
        raise ConfigError(Code.SPLIT_UNSUPPORTED, f"{type(encoder).__name__} returns no pooled vector per example")
    return pooled


@dataclass(frozen=True)
class PooledEncoder:
    """A release's public base model, pooling as the released model pools: `model` (the base classifier with the
    run's pooling, eval mode; its own head is never used), `tokenizer` (the run's), `record` (govtrain.json)."""

    model: Any
    tokenizer: Any
    record: ArtifactRecord

    @classmethod
    def from_release(cls, folder: str | os.PathLike[str], *, base: str | os.PathLike[str] | None = None,
                     device: str = "cpu") -> "PooledEncoder":
        """The base model that the release in `folder` names (or `base`), bound by the tree hash its
        govtrain.json records, loaded as training loaded it. Only the folder's govtrain.json and tokenizer are
        read: the adapter's weights stay with the server."""
        from govtrain.release.load import hold_in_memory, private_base, read_tokenizer
        from govtrain.models.loading import load_pretrained
        from govtrain.models.pooling import use_pooling

        folder = Path(folder)
        record = read_record(folder)
        if record.task != "sequence-classification":
            raise ConfigError(Code.SPLIT_UNSUPPORTED, f"{folder}: a {record.task} release; split inference serves "
                                                      "a sequence classifier's head")
        tokenizer = read_tokenizer(folder)
        with private_base(folder, record, base) as path:  # loaded from exactly the bytes hashed, as govtrain.load
            model = use_pooling(load_pretrained(path, record.task, record.num_labels, tokenizer, record.pooling),
                                record.pooling)
            hold_in_memory(model)
        pooling_encoder(model)
        return cls(model=model.to(device).eval(), tokenizer=tokenizer, record=record)

    @property
    def dimension(self) -> int:
        return int(self.model.config.hidden_size)

    def pooled(self, texts: Sequence[str], *, batch_size: int = 32) -> np.ndarray:
        """[len(texts), dimension] float64: each text's pooled state, encoded as training encoded it (right padding,
        cut at the run's max_length). Each row depends on its own text only."""
        if isinstance(texts, str):
            raise TypeError("pass a list of texts, not one string")
        device = next(self.model.parameters()).device
        encoder = pooling_encoder(self.model)
        rows = []
        for start in range(0, len(texts), batch_size):
            inputs = self.tokenizer(list(texts[start:start + batch_size]), padding=True, padding_side="right",
                                    truncation=True, max_length=self.record.max_length, return_tensors="pt")
            rows.append(pooled_states(encoder, dict(inputs.to(device))).double().cpu().numpy())
        return np.concatenate(rows) if rows else np.zeros((0, self.dimension))
