"""What a spend charges, through the privatizer it records (docs/privatizers.md; no torch, no numpy).

A spend entry records (q, sigma_eff, steps) and the record of its privatizer. The record's rule
(`govtrain.privatizers.rules`, torch-free) says what the accountant composes: a `Charge` of a family at a rate, a
multiplier and a number of rounds. The writer's scheduler charges the record of the privatizer it runs through the
same rule, so what it writes is what the verifier recomputes. A contribution's history is the sequence of its
spends' charges, in epoch order, each one *item*:

- a Gaussian-family charge with no family parameters is the bucket (rate_u, sigma_u, rounds), exactly what a
  history held before privatizers: the i.i.d. Gaussian's is (q_u, sigma_u, steps), so its ε, cache keys and
  caches are unchanged bit for bit; a matrix-factorization privatizer amplified over a cycle of b steps charges
  the same kind of bucket, (min(1, b·q), sigma, ceil(steps / b));
- any other charge stays a `Charge`, and a history holding one is accounted by
  `govtrain.accounting.families.epsilon_u(accountant, delta_p, charges)` (`SpendCalculator`).

Every exception a record causes is a `ConfigError` (`privatizer_unknown`, `privatizer_invalid`): the verifier
flags the entry (`bad_privatizer`), the writer refuses it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Union

from govtrain.privatizers.base import Charge
from govtrain.privatizers.rules import check_record, record_charge

if TYPE_CHECKING:
    from govtrain.privatizers.base import Privatizer

Item = Union[tuple[int, int, int], Charge]  # one spend's charge in a history
Bucketer = Callable[[int, int, int], Item]  # (q_u, sigma_u, steps) -> the item a spend of them charges

__all__ = ["Item", "Bucketer", "as_item", "charge_item", "check_record", "spend_item", "bucketer", "family_charges"]


def as_item(charge: Charge) -> Item:
    """A Gaussian charge as the bucket a history has always held; any other as itself."""
    if charge.family == "gaussian" and not charge.params:
        return (charge.sampling_rate_u, charge.noise_multiplier_u, charge.rounds)
    return charge


def charge_item(record: Mapping[str, Any] | None, sampling_rate_u: int, noise_multiplier_u: int, steps: int) -> Item:
    """The item a spend of `steps` steps at (q, sigma) under the privatizer `record` (None: the i.i.d. Gaussian)
    charges. Raises `ConfigError` (`privatizer_unknown`, `privatizer_invalid`) for a record its rule refuses or a
    charge no accountant composes."""
    if record is None or (isinstance(record, Mapping) and dict(record) == {"name": "gaussian"}):
        return (sampling_rate_u, noise_multiplier_u, steps)  # today's bucket, as before privatizers
    return as_item(record_charge(record, sampling_rate_u=sampling_rate_u, noise_multiplier_u=noise_multiplier_u,
                                 steps=steps))


def spend_item(entry: Mapping[str, Any]) -> Item:
    """The item a decoded spend entry (or a redacted one, as its summary recorded it) charges."""
    return charge_item(entry.get("privatizer"), entry["sampling_rate_u"], entry["noise_multiplier_u"], entry["steps"])


def bucketer(privatizer: "Privatizer | None") -> Bucketer:
    """(q_u, sigma_u, steps) -> item, through the rule of `privatizer`'s record (None: the i.i.d. Gaussian's
    buckets): the charge the verifier will recompute from the record the spend carries."""
    if privatizer is None:
        return lambda q_u, sigma_u, steps: (q_u, sigma_u, steps)

    def bucket(q_u: int, sigma_u: int, steps: int) -> Item:
        return charge_item(privatizer.record(), q_u, sigma_u, steps)

    return bucket


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
