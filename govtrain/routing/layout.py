"""Which tapped calls the routing layer can split per sample: those with the batch first.

`persample` reads sample i's gradient off row i of a call's input and output gradient. A call on a tensor
the whole batch shares (DeBERTa's `query_proj` and `key_proj` on its relative position embeddings,
[1, 2k, D]) or laid out sequence-first ([T, B, D]) has an output gradient already summed over samples:
read row by row, one sample's gradient lands in others' rows, clipping bounds the wrong thing and a
neighbouring batch moves the clipped sum by more than C_i while σ_i is charged. Such calls are refused.

One step's shapes cannot tell a sequence-first call from a batch-first one when T = B, nor a call on a
fixed-size tensor [n, ...] from one at batch size n; `Router.probe` runs the model once on batches of two
sizes, neither equal to any other dimension of the inputs, before a run spends anything.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor

from govtrain.errors import Code, ConfigError


def check_batch_first(name: str, inputs: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], batch: int) -> None:
    """Refuse the module `name` unless every recorded call's input and output (their shapes) have `batch`
    rows first."""
    for a, o in zip(inputs, outputs):
        if len(a) < 2:
            raise ConfigError(Code.ROUTING_UNCOVERED,
                              f"{name} is called on a {len(a)}-dimensional tensor {tuple(a)}, which has no "
                              f"batch dimension (batch {batch}): its per-sample gradients cannot be separated; "
                              "remove it from lora.target_modules or freeze it")
        for what, shape in (("is called on", a), ("returns", o)):
            if shape[0] != batch:
                raise ConfigError(Code.ROUTING_UNCOVERED,
                                  f"{name} {what} a tensor whose first dimension ({shape[0]}) is not the batch "
                                  f"({batch}): its per-sample gradients cannot be separated; remove it from "
                                  "lora.target_modules or freeze it")


def probe_batches(tokenizer: Callable[..., Mapping[str, Any]], max_length: int,
                  sizes: Sequence[int] = (2, 3)) -> list[Mapping[str, Any]]:
    """Keyword inputs for `Router.probe`: a fixed public text padded to `max_length` tokens, at each batch
    size of `sizes`. No example is read: which calls have the batch first does not depend on content."""
    return [tokenizer(["govtrain layout probe"] * size, padding="max_length", truncation=True, max_length=max_length,
                      return_tensors="pt") for size in sizes]


def probe_size(batch: Mapping[str, Any]) -> int:
    """The batch size of one probe batch. A probe whose batch size is 1, or equals another dimension of one
    of its inputs, could not tell the batch apart: that is a programmer error."""
    tensors = {key: value for key, value in batch.items() if isinstance(value, Tensor)}
    sizes = {value.shape[0] for value in tensors.values() if value.dim() > 0}
    if len(sizes) != 1 or min(sizes) < 2:
        raise ValueError(f"a layout probe batch needs one batch size larger than 1 in all its inputs: got {sizes}")
    size = sizes.pop()
    for key, value in tensors.items():
        if size in value.shape[1:]:
            raise ValueError(f"layout probe input {key} {tuple(value.shape)} has another dimension equal to its batch "
                             f"size {size}: pad or truncate it to another length")
    return size


def probe(router: Any, batches: Iterable[Mapping[str, Any]]) -> None:
    """`Router.probe`: run `router`'s model forward on each of `batches` under its capture and refuse every
    tapped call whose input or output does not have that batch's size first.

    One step's shapes cannot tell a sequence-first [T, B, D] call from a batch-first one when T = B, nor a call on
    a fixed-size tensor [n, ...] from one at batch size n. So the probe batches must come in at least two different
    sizes, each larger than one and different from every other dimension of its inputs (`probe_size`): then a
    leading dimension that follows the batch size through all of them is the batch."""
    batches = list(batches)
    sizes = [probe_size(batch) for batch in batches]
    if len(set(sizes)) < 2:
        raise ValueError(f"a layout probe needs batches of at least two different sizes: got {sizes}")
    device = next(iter(router.params.values())).device if router.params else torch.device("cpu")
    try:
        for batch, size in zip(batches, sizes):
            inputs = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}
            with router.capture(), torch.no_grad():
                router.model(**inputs)
            router._check_layout(size)
    finally:
        for tap in router.taps.values():
            tap.clear()
