"""What a privatizer's record charges, from the record alone: the path the verifier, the planner and the scheduler
take (docs/privatizers.md, "What the ledger records and charges"). It imports neither torch nor numpy: the audit
path never does, and a record (signed by whoever holds the ledger key) must not choose what the auditor imports.

    check_record(record)                                   # ConfigError privatizer_unknown / _invalid, or nothing
    charge = record_charge(record, sampling_rate_u=q_u, noise_multiplier_u=sigma_u, steps=steps)   # a Charge

`RULES` maps each privatizer name to "module:function", its *rule*: `rule(record)` refuses (raises) a record the
privatizer's charge cannot follow from, or returns what it charges, a callable with `Privatizer.charge`'s keyword
signature. The classes (`privatizers.REGISTRY`) are the writer's, and draw the noise; each class's `charge` is
computed by the same functions as its rule (`mf.charge`, `families.lattice.check_lattice`), and the two registries
name the same privatizers (tests/test_privatizer_rules.py).

A record is untrusted input. Whatever exception a rule or its charge raises on it is the record's fault, and
becomes `privatizer_invalid` (the verifier's `bad_privatizer`); so does a charge the accountant cannot compose, or
one the record brought to (next to) no noise: a BLT whose participation factor m exceeds σ² charges ⌊σ/√m⌋ = 0
(`checked`, `MIN_CHARGED_MULTIPLIER_U`). Nothing else escapes.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Hashable, Mapping

from govtrain import units
from govtrain.errors import Code, ConfigError, GovtrainError
from govtrain.accounting.records import Charge
from govtrain.privatizers.mf.charge import BLT_MAX_BUFFERS  # check_blt's bound (the class refuses no less)

__all__ = ["RULES", "BLT_MAX_BUFFERS", "MIN_CHARGED_MULTIPLIER_U", "Charger", "check_record", "record_charge",
           "checked", "cache_clear"]

Charger = Callable[..., Charge]  # (*, sampling_rate_u, noise_multiplier_u, steps) -> Charge

RULES: dict[str, str] = {
    "gaussian": "govtrain.privatizers.rules:gaussian",
    "banded-mf": "govtrain.privatizers.rules:banded_mf",
    "blt": "govtrain.privatizers.rules:blt",
    "laplace": "govtrain.privatizers.rules:laplace",
    "discrete-gaussian": "govtrain.privatizers.rules:discrete_gaussian",
    "skellam": "govtrain.privatizers.rules:skellam",
}

# The least multiplier a record may bring a charge down to (micro-units: 0.1), unless the spend's own σ is lower.
# Below it there is next to no noise (an unsampled step at 0.1 already costs ε in the tens), and the accountants'
# cost grows as 1/σ² (the PLD of one unsampled Gaussian at 0.1 takes a gigabyte; at 10⁻⁶, petabytes): a forged BLT
# with m near 10¹² must not choose how much memory the auditor's verifier needs.
MIN_CHARGED_MULTIPLIER_U = 100_000
_CACHE_SIZE = 256


# -- the rules -------------------------------------------------------------------------------------------------

def _gaussian_charge(*, sampling_rate_u: int, noise_multiplier_u: int, steps: int) -> Charge:
    return Charge(family="gaussian", sampling_rate_u=sampling_rate_u, noise_multiplier_u=noise_multiplier_u,
                  rounds=steps)


def gaussian(record: Mapping[str, Any]) -> Charger:
    """The i.i.d. Gaussian records its name (and microbatches k > 1, `gaussian.check_gaussian`); DP-SGD: one round a
    step at (q, σ), whatever k (parallel composition over the microbatches)."""
    from govtrain.privatizers.gaussian import check_gaussian

    check_gaussian(record)
    return _gaussian_charge


def banded_mf(record: Mapping[str, Any]) -> Charger:
    """DP-SGD at rate min(1, b·q) over ⌈steps/b⌉ rounds (`mf.charge.banded_charge`)."""
    from govtrain.privatizers.mf.charge import banded_charge, check_banded

    check_banded(record)

    def charge(*, sampling_rate_u: int, noise_multiplier_u: int, steps: int) -> Charge:
        rate_u, multiplier_u, rounds = banded_charge(record, sampling_rate_u=sampling_rate_u,
                                                     noise_multiplier_u=noise_multiplier_u, steps=steps)
        return Charge(family="gaussian", sampling_rate_u=rate_u, noise_multiplier_u=multiplier_u, rounds=rounds)

    return charge


def blt(record: Mapping[str, Any]) -> Charger:
    """Unsampled Gaussians at ⌊σ/√m⌋, one per possible participation (`mf.charge.blt_charge`)."""
    from govtrain.privatizers.mf.charge import blt_charge, check_blt

    check_blt(record)  # at most BLT_MAX_BUFFERS

    def charge(*, sampling_rate_u: int, noise_multiplier_u: int, steps: int) -> Charge:
        rate_u, multiplier_u, rounds = blt_charge(record, sampling_rate_u=sampling_rate_u,
                                                  noise_multiplier_u=noise_multiplier_u, steps=steps)
        return Charge(family="gaussian", sampling_rate_u=rate_u, noise_multiplier_u=multiplier_u, rounds=rounds)

    return charge


def _lattice(name: str, record: Mapping[str, Any]) -> Charger:
    from govtrain.privatizers.families.lattice import check_lattice, lattice_charge

    params = check_lattice(name, record)

    def charge(*, sampling_rate_u: int, noise_multiplier_u: int, steps: int) -> Charge:
        return lattice_charge(name, params, sampling_rate_u=sampling_rate_u, noise_multiplier_u=noise_multiplier_u,
                              steps=steps)

    return charge


def laplace(record: Mapping[str, Any]) -> Charger:
    return _lattice("laplace", record)


def discrete_gaussian(record: Mapping[str, Any]) -> Charger:
    return _lattice("discrete-gaussian", record)


def skellam(record: Mapping[str, Any]) -> Charger:
    return _lattice("skellam", record)


# -- resolving a record ----------------------------------------------------------------------------------------

def entry(table: Mapping[str, str], name: Any, what: str) -> Any:
    """The object `table[name]` ("module:attribute") names, imported now. ConfigError `privatizer_unknown` for a name
    not in the table, or one whose module is not in this installation; a module that fails on a missing import of
    its own is a broken installation, and raises as it is. `what`: what the table holds, for the messages."""
    if not isinstance(name, str) or name not in table:
        raise ConfigError(Code.PRIVATIZER_UNKNOWN, f"privatizer {name!r} is not one of {', '.join(table)}: name "
                                                   "one of them in RUN.toml [noise] privatizer")
    module_name, _, attribute = table[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not module_name.startswith(e.name):
            raise  # a module it imports is missing: a broken installation, not an unknown privatizer
        raise ConfigError(Code.PRIVATIZER_UNKNOWN, f"privatizer {name!r} is not in this installation of govtrain "
                                                   f"({module_name} is missing): upgrade govtrain, or use another "
                                                   "privatizer") from e
    found = getattr(module, attribute, None)
    if found is None:
        raise RuntimeError(f"{table[name]} is not the {what} of privatizer {name!r}")
    return found


def _rule(name: str) -> Callable[[Mapping[str, Any]], Charger]:
    found = entry(RULES, name, "rule")
    if not callable(found):
        raise RuntimeError(f"{RULES[name]} is not the rule of privatizer {name!r}")
    return found


def _invalid(record: Mapping[str, Any], error: Exception) -> ConfigError:
    return ConfigError(Code.PRIVATIZER_INVALID, f"privatizer record {_shown(record)}: {error}")


def _shown(record: Mapping[str, Any]) -> str:
    text = repr(dict(record))
    return text if len(text) <= 300 else text[:297] + "..."


def _freeze(value: Any) -> Hashable:
    """A cache key equal for equal records of equal types: lists (a matrix factorization's coefficients) become
    tuples tagged with their type, so a list and a tuple of the same ints stay two keys."""
    if isinstance(value, Mapping):
        return (dict, tuple(sorted(((_freeze(k), _freeze(v)) for k, v in value.items()), key=repr)))
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_freeze(v) for v in value))
    hash(value)  # TypeError: anything else unhashable
    return (type(value), value)


_CHARGERS: dict[Hashable, Charger] = {}


def _charger(record: Any) -> Charger:
    """The rule of `record`'s privatizer applied to a copy of it (cached by its frozen value)."""
    if not isinstance(record, Mapping) or not isinstance(record.get("name"), str):
        raise ConfigError(Code.PRIVATIZER_INVALID, "a privatizer record is a map with a text \"name\"")
    try:
        key = _freeze(record)
    except Exception as e:  # noqa: BLE001 - an unhashable value: not a record any rule takes
        raise _invalid(record, e) from e
    found = _CHARGERS.get(key)
    if found is None:
        rule = _rule(record["name"])
        copy = {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in record.items()}
        try:
            found = rule(copy)
        except GovtrainError:
            raise
        except Exception as e:  # noqa: BLE001 - untrusted input: whatever it makes the rule raise, the rule refuses it
            raise _invalid(record, e) from e
        if len(_CHARGERS) >= _CACHE_SIZE:
            _CHARGERS.clear()
        _CHARGERS[key] = found
    return found


def cache_clear() -> None:
    """Forget every record resolved so far (after `RULES` changes: tests)."""
    _CHARGERS.clear()


def check_record(record: Any) -> None:
    """Refuse a record no rule takes: ConfigError `privatizer_unknown` (a name this installation lacks) or
    `privatizer_invalid` (a record its privatizer's charge cannot follow from)."""
    _charger(record)


def record_charge(record: Any, *, sampling_rate_u: int, noise_multiplier_u: int, steps: int) -> Charge:
    """What a spend of `steps` steps at (q, σ) under the privatizer `record` charges, checked: ConfigError as in
    `check_record`, and `privatizer_invalid` for a charge the accountant cannot compose (`checked`)."""
    charger = _charger(record)
    try:
        charge = charger(sampling_rate_u=sampling_rate_u, noise_multiplier_u=noise_multiplier_u, steps=steps)
    except GovtrainError:
        raise
    except Exception as e:  # noqa: BLE001 - as in `_charger`
        raise _invalid(record, e) from e
    return checked(charge, record["name"], noise_multiplier_u)


def checked(charge: Any, name: str, noise_multiplier_u: int) -> Charge:
    """`charge` if the accountant can compose it, else ConfigError `privatizer_invalid`: a rate outside [0, 1],
    negative rounds, or a multiplier the record brought below `MIN_CHARGED_MULTIPLIER_U` (0: no noise at all)."""
    if type(charge) is not Charge or type(charge.sampling_rate_u) is not int \
            or not 0 <= charge.sampling_rate_u <= units.MICRO or type(charge.rounds) is not int or charge.rounds < 0 \
            or any(type(p) is not int for p in charge.params):
        raise ConfigError(Code.PRIVATIZER_INVALID, f"privatizer {name!r} charged {charge!r}, which no accountant "
                                                   "composes")
    least = min(noise_multiplier_u, MIN_CHARGED_MULTIPLIER_U) if type(noise_multiplier_u) is int else 1
    if type(charge.noise_multiplier_u) is not int or charge.noise_multiplier_u < max(1, least):
        raise ConfigError(Code.PRIVATIZER_INVALID, f"privatizer {name!r} at noise multiplier {noise_multiplier_u} "
                                                   f"micro-units leaves no noise to speak of in its charge ({charge!r}:"
                                                   f" below {MIN_CHARGED_MULTIPLIER_U}): its strategy needs a larger "
                                                   "multiplier")
    return charge
