"""The plain records the accountants compose (no torch, no numpy): a `Charge`, and the *item* one spend adds to a
contribution's history (docs/privatizers.md, "What the ledger records and charges").

They are defined here, at the floor the verifier relies on, because accounting composes them and knows nothing
of what produces them: a privatizer (`govtrain.privatizers`) *produces* a `Charge` from its record (its rule,
`govtrain.privatizers.rules`), and the callers above accounting (the ledger's scheduler, the planner, the
verifier) turn a spend's record into an item (`govtrain.privatizers.charges`) and hand accounting the items. A
contribution's history is the sequence of its spends' items, in epoch order:

- a Gaussian-family charge with no family parameters is the bucket (rate_u, sigma_u, rounds), exactly what a
  history held before privatizers: the i.i.d. Gaussian's is (q_u, sigma_u, steps), so its ε, cache keys and
  caches are unchanged bit for bit; a matrix-factorization privatizer amplified over a cycle of b steps charges
  the same kind of bucket, (min(1, b·q), sigma, ceil(steps / b));
- any other charge stays a `Charge`, and a history holding one is accounted by
  `govtrain.accounting.families.epsilon_u(accountant, delta_p, charges)` (`SpendCalculator`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

__all__ = ["Charge", "Item", "Bucketer", "as_item", "family_charges"]


@dataclass(frozen=True, kw_only=True)
class Charge:
    """What one spend entry charges, as the accountant reads it: `family` names the mechanism the accountant
    composes (gaussian, laplace, discrete-gaussian, skellam), at rate `sampling_rate_u` (micro), noise multiplier
    `noise_multiplier_u` (micro; for laplace the scale over the L1 clip norm) over `rounds` compositions.
    `params`: what else the family's accountant needs, as ints from the privatizer's record (the quantised
    sensitivities of the integer families); empty for gaussian and laplace. Hashable: the accountants key on it."""

    family: str
    sampling_rate_u: int
    noise_multiplier_u: int
    rounds: int
    params: tuple[int, ...] = ()


Item = Union[tuple[int, int, int], Charge]  # one spend's charge in a history
Bucketer = Callable[[int, int, int], Item]  # (q_u, sigma_u, steps) -> the item a spend of them charges


def as_item(charge: Charge) -> Item:
    """A Gaussian charge as the bucket a history has always held; any other as itself."""
    if charge.family == "gaussian" and not charge.params:
        return (charge.sampling_rate_u, charge.noise_multiplier_u, charge.rounds)
    return charge


def family_charges(history) -> tuple[Charge, ...]:  # type: ignore[no-untyped-def]
    """A history holding a charge of another family, as the charges `families.epsilon_u` composes, in epoch order:
    Gaussian buckets as Gaussian charges; free ones (rate 0 or no rounds) dropped."""
    out = []
    for item in history:
        charge = item if type(item) is Charge else Charge(family="gaussian", sampling_rate_u=item[0],
                                                          noise_multiplier_u=item[1], rounds=item[2])
        if charge.sampling_rate_u and charge.rounds:
            out.append(charge)
    return tuple(out)
