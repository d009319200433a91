"""Every rank trains what the lead trains, or none trains (docs/distributed.md, joining).

Before any spend is written, each rank states a fingerprint of what it is about to train (`fingerprint`): the
RUN.toml's hash, the ledger it opened, the base model's tree hash, its examples in the order the lead's draw
indexes them (each one's contribution and parsed record), whether it is a check, the trainable parameters and their profiles, the world size, its device type, and the versions of
govtrain and torch. `check_agreement` gathers them on every rank: a rank whose fingerprint is not the lead's is
refused (`rank_mismatch`) on every rank, naming what differs. Then `share_weights` gives every rank the lead's
trainable weights (a fresh LoRA's random initialisation, or a resumed run's) and, on resume, its update's state.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from govtrain.distributed.world import World
from govtrain.errors import Code, ConfigError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["fingerprint", "check_agreement", "share_weights"]


def fingerprint(*, config_sha256: bytes, ledger: tuple[str, bytes], base_sha256: bytes, owners: Sequence[str],
                items: Sequence[Any], model: "nn.Module", reach: Mapping[str, Any], processes: int, device: str,
                precision: str, insecure_seed: int | None, check: bool) -> dict[str, Any]:
    """What a run (prepared up to its model and data) is about to train, as comparable values: its RUN.toml's hash,
    the ledger's identity, the base model's tree hash, each example's contribution (`owners`) and parsed record
    (`items`), the `model`'s trainable parameters, each class's reach (`reach`), and how it runs. The run hands over
    these values, not itself: the agreement compares them and knows nothing of training."""
    import torch

    from govtrain.version import __version__

    # the examples in the order the lead's draw indexes them: each one's contribution and its record as parsed
    # (files of the same bytes under other names, on another node, load in another order: refused, never trained)
    data = hashlib.sha256()
    for owner, item in zip(owners, items):
        data.update(repr((owner, item)).encode() + b"\0")
    trainable = hashlib.sha256(repr([(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()
                                     if p.requires_grad]).encode()).hexdigest()
    profiles = hashlib.sha256(repr(sorted((c, sorted(repr(part) for part in parts))
                                          for c, parts in reach.items())).encode()).hexdigest()
    origin, header = ledger
    return {"config": config_sha256.hex(), "ledger": f"{origin} {bytes(header).hex()}",
            "base model": base_sha256.hex(), "data": data.hexdigest(), "trainable parameters": trainable,
            "profiles": profiles, "processes": processes, "device": device,
            "precision": precision, "insecure seed": insecure_seed, "check": check,
            "govtrain": __version__, "torch": torch.__version__}


def check_agreement(world: World, mine: dict[str, Any]) -> None:
    """Refuse, on every rank, a run whose ranks would not train the same thing (`rank_mismatch`)."""
    stated = world.gather(mine)
    lead = stated[0]
    for rank, theirs in enumerate(stated[1:], start=1):
        differ = [key for key in lead if theirs.get(key) != lead[key]]
        if differ:
            raise ConfigError(Code.RANK_MISMATCH, f"rank {rank} joined with another {', '.join(differ)} than rank 0's "
                                                  "(nothing was written): start every rank with the same RUN.toml, "
                                                  "model, data, ledger and installation")


def share_weights(world: World, model: "nn.Module", update: Any, *, resumed: bool) -> None:
    """The lead's trainable weights on every rank; on resume, its update's state too (a fresh one is the same
    everywhere)."""
    if not world.many:
        return
    import torch

    with torch.no_grad():
        world.share_([p for _, p in model.named_parameters() if p.requires_grad])
    if resumed:
        state = world.broadcast(update.state_dict() if world.lead else None)
        if not world.lead:
            update.load_state_dict(state)
