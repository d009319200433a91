"""Per-microbatch noise (docs/privatizers.md, seed 004 alternative 2): which microbatch each unit of a step is in.

A step's Poisson batch is split into k microbatches by a public rule fixed before the step, that depends only on
the unit's own id and the step:

    microbatch(unit, step) = HMAC-SHA-256(key, "govtrain-microbatch" ‖ 0x00 ‖ step (8 bytes, big-endian) ‖ id)
                             mod k

(`id` the unit's UTF-8 id.) Never on the unit's position in the batch: removing one unit would then move every
unit after it to another microbatch, and a neighbouring dataset would change every microbatch's sum, not one.
With this rule a unit's microbatch is the same whether or not any other unit is drawn, so removing unit i
changes the clipped sum of microbatch(i, step) alone, by at most C_i.

The rule need not be secret (no example's content enters it), and `key` may be any fixed bytes of the run: the
run's sampling key is fine, since HMAC under another label reveals nothing of the draws. The unit's id must not
depend on other units either: a contribution's id, or for the example unit its contribution's id and the
example's index within that contribution (`example_id`), never an index into the corpus.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Sequence

from govtrain.errors import Code, ConfigError

LABEL = b"govtrain-microbatch\0"


def assign(key: bytes, step: int, unit: str, microbatches: int) -> int:
    """The microbatch in [0, microbatches) of `unit` at `step`."""
    if microbatches < 1:
        raise ValueError(f"microbatches must be a positive integer: got {microbatches!r}")
    if step < 0:
        raise ValueError(f"a step is a non-negative integer: got {step}")
    digest = hmac.new(key, LABEL + step.to_bytes(8, "big") + unit.encode("utf-8"), hashlib.sha256).digest()
    return int.from_bytes(digest, "big") % microbatches


def split(key: bytes, step: int, units: Sequence[str], microbatches: int) -> list[list[int]]:
    """The positions in `units` (a step's drawn units, by id) of each microbatch's units, in their order."""
    parts: list[list[int]] = [[] for _ in range(microbatches)]
    for position, unit in enumerate(units):
        parts[assign(key, step, unit, microbatches)].append(position)
    return parts


def example_id(contribution_id: str, index: int) -> str:
    """The id of a contribution's `index`-th example, for the example unit: unchanged by any other contribution."""
    return f"{contribution_id}/{index}"


def check_count(microbatches: int, privatizer) -> None:  # type: ignore[no-untyped-def]
    """Refuse a count of microbatches that is not a positive integer, and k > 1 with a correlated privatizer, whose
    state advances once per step (`Router`'s `microbatches`)."""
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive integer: got {microbatches!r}")
    if microbatches > 1 and privatizer is not None and privatizer.correlated:
        raise ConfigError(Code.PRIVATIZER_UNSUPPORTED,
                          f"the {privatizer.name} privatizer's noise is correlated across steps and its state "
                          "advances once per step: per-microbatch noise (microbatches > 1) takes the i.i.d. "
                          "gaussian or a noise family; set microbatches = 1")
