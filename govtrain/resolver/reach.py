"""What a mechanism needs of the resolved profiles, checked before anything runs (no torch import:
`govtrain plan --config` checks it on the meta-device layout, the routing layer on the real model).

PRISM works on whole LoRA pairs (A, B) = (lora_B.weight, lora_A.weightᵀ): a class must reach both
factors of a pair entirely, or neither. A `heads` profile reaches rows of the q/k/v `lora_B` (or columns
of the output projection's `lora_A`) and not the other factor, which has no tangent-space meaning.
DP-Muon and DP-SGD take any profile.

It sits with the resolver, below the mechanisms, because it reads only what the resolved profiles reach (the
planner checks it before a run; the router and PRISM's pairing use `lora_pairs`).
"""

from __future__ import annotations

from typing import Iterable, Mapping

from govtrain.errors import Code, ConfigError
from govtrain.resolver.model import role


def lora_pairs(names: Iterable[str]) -> dict[str, str]:
    """{lora_B weight name: lora_A weight name} for every LoRA module (and adapter) whose two factors
    are both among `names`: the (A, B) = (lora_B.weight, lora_A.weightᵀ) pairs PRISM works on."""
    by_key: dict[tuple[str, str | None], dict[str, str]] = {}
    for name in names:
        r = role(name)
        if r.peft_part in ("lora_A", "lora_B") and r.leaf == "weight":
            by_key.setdefault((r.module, r.adapter), {})[r.peft_part] = name
    return {parts["lora_B"]: parts["lora_A"] for parts in by_key.values() if len(parts) == 2}


def check_reach(mechanism: str, reach: Mapping[str, Iterable], trainable: Iterable[str]) -> None:
    """Raise `mechanism_unsupported` if `mechanism` cannot run the classes' resolved parts (`reach`:
    class -> parts with `.name` and `.dim`, None for a whole parameter) on these trainable parameters."""
    if mechanism != "prism":
        return
    pairs = lora_pairs(trainable)
    for data_class, parts in reach.items():
        whole = {part.name for part in parts if part.dim is None}
        partial = {part.name for part in parts if part.dim is not None}
        for b, a in pairs.items():
            if b in partial or a in partial or (b in whole) != (a in whole):
                raise ConfigError(Code.MECHANISM_UNSUPPORTED,
                                  f"mechanism prism needs each LoRA module's two factors reached whole by the same "
                                  f"classes, but class {data_class!r} reaches part of {role(b).module} (a heads "
                                  "profile): use mechanism dpsgd or dp-muon for this policy")
