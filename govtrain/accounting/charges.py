"""What a spend charges, through the privatizer it records (docs/privatizers.md; no torch).

A spend entry records (q, sigma_eff, steps) and the record of its privatizer. The privatizer, rebuilt from that
record (`privatizers.from_record`), says what the accountant composes (`Privatizer.charge`): a `Charge` of a
family at a rate, a multiplier and a number of rounds. A contribution's history is the sequence of its spends'
charges, in epoch order, each one *item*:

- a Gaussian-family charge with no family parameters is the bucket (rate_u, sigma_u, rounds), exactly what a
  history held before privatizers: the i.i.d. Gaussian's is (q_u, sigma_u, steps), so its ε, cache keys and
  caches are unchanged bit for bit; a matrix-factorization privatizer amplified over a cycle of b steps charges
  the same kind of bucket, (min(1, b·q), sigma, ceil(steps / b));
- any other charge stays a `Charge`, and a history holding one is accounted by
  `govtrain.accounting.families.epsilon_u(accountant, delta_p, charges)` (`SpendCalculator`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Mapping, Union

from govtrain.privatizers.base import Charge

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


def _check(charge: Charge, name: str) -> Charge:
    if type(charge) is not Charge or not 0 <= charge.sampling_rate_u <= 1_000_000 or charge.noise_multiplier_u <= 0 \
            or charge.rounds < 0 or any(type(p) is not int for p in charge.params):
        raise ValueError(f"privatizer {name!r} charged an invalid {charge!r}")
    return charge


@functools.lru_cache(maxsize=64)
def _rebuilt(frozen: tuple[tuple[str, Any], ...]) -> "Privatizer":
    from govtrain.privatizers import from_record

    return from_record({k: list(v) if type(v) is tuple else v for k, v in frozen})


def _frozen(record: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A record as a cache key: its lists (a strategy's integers) as tuples, which `_rebuilt` turns back."""
    return tuple(sorted((k, tuple(v) if type(v) is list else v) for k, v in record.items()))


def charge_item(record: Mapping[str, Any] | None, sampling_rate_u: int, noise_multiplier_u: int, steps: int) -> Item:
    """The item a spend of `steps` steps at (q, sigma) under the privatizer `record` (None: the i.i.d. Gaussian)
    charges. Raises `ConfigError` (`privatizer_unknown`, `privatizer_invalid`) for a record it cannot rebuild."""
    if record is None or dict(record) == {"name": "gaussian"}:  # today's bucket, without importing a class
        return (sampling_rate_u, noise_multiplier_u, steps)
    from govtrain.errors import Code, ConfigError

    try:  # anything a record makes the charge raise is the record's fault: coded (the verifier's bad_privatizer)
        torch_free = _TORCH_FREE.get(record.get("name")) if isinstance(record, Mapping) else None
        if torch_free is not None:  # matrix factorization: the charge from the record alone, without torch
            from govtrain.privatizers.mf import charge as mf_charge

            rate_u, sigma_u, rounds = getattr(mf_charge, torch_free)(
                record, sampling_rate_u=sampling_rate_u, noise_multiplier_u=noise_multiplier_u, steps=steps)
            if sigma_u <= 0:
                raise ValueError("the charge leaves no noise (its multiplier rounds to 0)")
            return (rate_u, sigma_u, rounds)
        privatizer = _rebuilt(_frozen(record))
        return bucketer(privatizer)(sampling_rate_u, noise_multiplier_u, steps)
    except ConfigError:
        raise
    except (ValueError, TypeError, KeyError, RuntimeError, ArithmeticError) as e:
        raise ConfigError(Code.PRIVATIZER_INVALID, f"privatizer record {record!r}: {e}") from e


def check_record(record: Mapping[str, Any] | None) -> None:
    """Raise `ConfigError` for a privatizer record its privatizer would not have written (the verifier's check of a
    run entry's record), torch-free: a matrix factorization's through `mf.charge`, any other through its class."""
    from govtrain.errors import Code, ConfigError

    name = record.get("name") if isinstance(record, Mapping) else None
    if name not in _TORCH_FREE:
        from govtrain.privatizers import from_record

        from_record(record)
        return
    from govtrain.privatizers.mf import charge as mf_charge

    try:
        checked = mf_charge.check_banded(record) if name == "banded-mf" else mf_charge.check_blt(record)
    except (ValueError, TypeError, KeyError, ArithmeticError) as e:
        raise ConfigError(Code.PRIVATIZER_INVALID, f"privatizer record {record!r}: {e}") from e
    if not checked:
        raise ConfigError(Code.PRIVATIZER_INVALID, f"privatizer record {record!r} is empty")


# Privatizers whose charge follows from their record by torch-free functions (the verifier never imports torch):
# name -> the function of govtrain.privatizers.mf.charge. Their classes' `charge` calls the same functions.
_TORCH_FREE = {"banded-mf": "banded_charge", "blt": "blt_charge"}


def spend_item(entry: Mapping[str, Any]) -> Item:
    """The item a decoded spend entry (or a redacted one, as its summary recorded it) charges."""
    return charge_item(entry.get("privatizer"), entry["sampling_rate_u"], entry["noise_multiplier_u"], entry["steps"])


def bucketer(privatizer: "Privatizer | None") -> Bucketer:
    """(q_u, sigma_u, steps) -> item, through `privatizer.charge` (None: the i.i.d. Gaussian's buckets)."""
    if privatizer is None:
        return lambda q_u, sigma_u, steps: (q_u, sigma_u, steps)

    def bucket(q_u: int, sigma_u: int, steps: int) -> Item:
        from govtrain.errors import Code, ConfigError

        try:  # a charge the accountant cannot compose (no noise left, a rate out of range) is the record's fault
            return as_item(_check(privatizer.charge(sampling_rate_u=q_u, noise_multiplier_u=sigma_u, steps=steps),
                                  privatizer.name))
        except (ValueError, ArithmeticError) as e:
            raise ConfigError(Code.PRIVATIZER_INVALID, f"privatizer {privatizer.name!r}: {e}") from e

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
