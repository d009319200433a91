"""What a spend charges, through the privatizer it records (docs/privatizers.md; no torch, no numpy): the
conversion from a privatizer's record to the item accounting composes (`govtrain.accounting.records`).

A spend entry records (q, sigma_eff, steps) and the record of its privatizer. The record's rule
(`govtrain.privatizers.rules`, torch-free) says what the accountant composes: a `Charge` of a family at a rate, a
multiplier and a number of rounds. The writer's scheduler charges the record of the privatizer it runs through the
same rule, so what it writes is what the verifier recomputes. It lives here, above accounting, because accounting
takes the items and never imports what produces them: the ledger's scheduler, the planner and the verifier call it
and hand accounting the items (or, for a schedule, the `bucketer` that makes them).

Every exception a record causes is a `ConfigError` (`privatizer_unknown`, `privatizer_invalid`): the verifier
flags the entry (`bad_privatizer`), the writer refuses it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from govtrain.accounting.records import Bucketer, Item, as_item
from govtrain.privatizers.rules import check_record, record_charge

if TYPE_CHECKING:
    from govtrain.privatizers.base import Privatizer

__all__ = ["charge_item", "check_record", "spend_item", "bucketer"]


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
