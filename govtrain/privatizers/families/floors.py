"""Policy floors per noise family (docs/privatizers.md, "Noise families"): the policy's `[floor.families]` table
gives each family its own minimum noise multiplier, because one number means different things in different
families (a Laplace multiplier is the Laplace scale over the L1 clip norm, and buys pure ε of 1/σ per step).

    check_family_floor(policy, privatizer.family, charged)    # before the run's first spend

A family outside the four govtrain knows (`policy.model.NOISE_FAMILIES`: gaussian, laplace, discrete-gaussian,
skellam, spelled exactly) is refused, table or not. Without the table every known family may train at the corpus
floor the attestations already meet. With it, only the families it names may train (gaussian always: at the corpus
floor, or at its own if named), and every contribution a run would charge must be charged at a multiplier at least
its family's floor. The check reads public numbers only and raises before anything is written.
"""

from __future__ import annotations

from typing import Iterable

from govtrain import units
from govtrain.errors import Code, ConfigError
from govtrain.policy.model import NOISE_FAMILIES, Policy

__all__ = ["family_floor", "check_family_floor"]


def family_floor(policy: Policy, family: str) -> int | None:
    """The family's minimum noise multiplier (micro), or None if the policy does not let it train (or govtrain
    does not know it)."""
    if family not in NOISE_FAMILIES:
        return None
    if family in policy.family_floors:
        return max(policy.family_floors[family], policy.floor_min_noise_multiplier_u if family == "gaussian" else 0)
    if family == "gaussian" or not policy.family_floors:
        return policy.floor_min_noise_multiplier_u
    return None


def check_family_floor(policy: Policy, family: str, charged: Iterable[tuple[str, int]]) -> None:
    """Refuse a run whose privatizer's `family` the policy does not allow (`family_not_allowed`), or that would
    charge any of `charged` — (what: a contribution id or a class, the noise multiplier it would be charged at,
    micro) — below the family's floor (`below_family_floor`)."""
    floor = family_floor(policy, family)
    if floor is None:
        allowed = ", ".join(sorted({"gaussian", *policy.family_floors} if policy.family_floors else NOISE_FAMILIES))
        why = "is not a noise family govtrain knows" if family not in NOISE_FAMILIES else \
            "is a noise family the policy's [floor.families] does not name"
        raise ConfigError(Code.FAMILY_NOT_ALLOWED, f"{family!r} {why}: this corpus trains with {allowed} only; "
                                                   "choose one of them in RUN.toml [noise]")
    for what, multiplier_u in charged:
        if multiplier_u < floor:
            raise ConfigError(Code.BELOW_FAMILY_FLOOR,
                              f"{what} would be charged at noise multiplier {multiplier_u / units.MICRO:g}, below the "
                              f"{family} floor {floor / units.MICRO:g} of the policy's [floor.families]: raise the "
                              "noise (the contributions' signed multipliers) or train with another family")
