"""Privatizers: what turns the router's clipped sums into the released gradient (docs/privatizers.md; the
interface is `base.py`). RUN.toml `[noise] privatizer` names one of `REGISTRY`; the `run` and `spend` entries
record its `record()`, from which the verifier recomputes every charge (`rules.py`) and the writer rebuilds it.

    privatizer = build(config.file.noise, horizon=steps)   # RUN.toml [noise] (or a PrivatizerSpec); None: i.i.d.
    privatizer = from_record(spend["privatizer"])          # what a ledger entry recorded

Each name maps to "module:Class", imported only when asked for. The classes are the writer's (they draw the
noise, and the matrix factorizations import torch): the verifier, the planner and the scheduler check records
and charge them through `govtrain.privatizers.rules` (`RULES`: name -> "module:function", torch-free), which
names the same privatizers; `from_record` refuses whatever the rules refuse, then rebuilds the class.

A privatizer takes its own parameters, a `base.PrivatizerSpec`; the config layer makes one from its section
(`train.config.NoiseSection.privatizer_spec`), and `build` takes either: this package never imports the config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from govtrain.errors import Code, ConfigError, GovtrainError

if TYPE_CHECKING:
    import torch

    from govtrain.privatizers.base import Privatizer, PrivatizerSpec, SpecSource

__all__ = ["REGISTRY", "GAUSSIAN_RECORD", "CORRELATED_FIELDS", "privatizer_class", "spec_of", "build",
           "from_record"]

REGISTRY: dict[str, str] = {
    "gaussian": "govtrain.privatizers.gaussian:IIDGaussian",
    "banded-mf": "govtrain.privatizers.mf.banded:BandedMF",
    "blt": "govtrain.privatizers.mf.blt:BLT",
    "laplace": "govtrain.privatizers.families.laplace:Laplace",
    "discrete-gaussian": "govtrain.privatizers.families.discrete_gaussian:DiscreteGaussian",
    "skellam": "govtrain.privatizers.families.skellam:Skellam",
}

# What a spend entry written before privatizers existed charged: the i.i.d. Gaussian (DP-SGD).
GAUSSIAN_RECORD: Mapping[str, Any] = {"name": "gaussian"}


def privatizer_class(name: str) -> "type[Privatizer]":
    """The class `name` maps to (ConfigError `privatizer_unknown`: a name not in the registry, or one whose module
    is not in this installation)."""
    from govtrain.privatizers.base import Privatizer
    from govtrain.privatizers.rules import entry

    found = entry(REGISTRY, name, "class")
    if not (isinstance(found, type) and issubclass(found, Privatizer) and found.name == name):
        raise RuntimeError(f"{REGISTRY[name]} is not the Privatizer named {name!r}")
    return found


# What a correlated privatizer takes from RUN.toml [noise], every field required; the run gives its horizon.
CORRELATED_FIELDS: Mapping[str, tuple[str, ...]] = {"banded-mf": ("bands",), "blt": ("buffers", "min_separation")}


def spec_of(noise: "PrivatizerSpec | SpecSource | None") -> "PrivatizerSpec":
    """`noise` as the privatizer's own parameters: a `PrivatizerSpec` as it is; None, the i.i.d. Gaussian's; a
    configuration section (RUN.toml [noise], `train.config.NoiseSection`) makes its own (`privatizer_spec()`): the
    config layer knows its fields, the privatizers only theirs."""
    from govtrain.privatizers.base import PrivatizerSpec

    if noise is None:
        return PrivatizerSpec()
    if isinstance(noise, PrivatizerSpec):
        return noise
    return noise.privatizer_spec()


def build(noise: "PrivatizerSpec | SpecSource | None" = None, *, horizon: int | None = None,
          generator: "torch.Generator | None" = None, insecure_seed: int | None = None) -> "Privatizer":
    """The privatizer `noise` describes (RUN.toml [noise], or a `PrivatizerSpec`; None: the i.i.d. Gaussian) for
    a run of `horizon` steps (its `training.steps`: a correlated privatizer's strategy is optimised for it), drawing
    from `generator`; `insecure_seed` fixes its own noise (tests only, never recorded). ConfigError
    `privatizer_unknown` for a privatizer not available, `privatizer_invalid` for parameters it refuses,
    `privatizer_unsupported` for `microbatches` > 1 with a privatizer that does not add per-microbatch noise."""
    spec = spec_of(noise)
    cls = check_microbatches(spec)
    try:
        if cls.name in CORRELATED_FIELDS:
            privatizer = _correlated(cls, spec.params, horizon, insecure_seed)
        else:
            privatizer = cls.from_parameters(spec.params, horizon=horizon, insecure_seed=insecure_seed)
        if spec.microbatches > 1:  # recorded by the privatizer: the ledger says how each step was noised
            privatizer = cls.from_record({**privatizer.record(), "microbatches": spec.microbatches})
    except ValueError as e:
        raise ConfigError(Code.PRIVATIZER_INVALID, f"RUN.toml [noise]: {e}") from e
    privatizer.generator = generator
    return privatizer


def check_microbatches(noise: "PrivatizerSpec | SpecSource | None") -> "type[Privatizer]":
    """The class [noise] names, once its `microbatches` is checked: more than 1 only with a privatizer that adds
    per-microbatch noise (ConfigError `privatizer_unsupported`; `privatizer_unknown` for a name not available).
    Cheap: a run checks it before it makes anything."""
    spec = spec_of(noise)
    cls = privatizer_class(spec.name)
    if spec.microbatches > 1 and not cls.per_microbatch:
        why = ("its noise is correlated across steps and its state advances once per step" if cls.correlated else
               "it does not add per-microbatch noise")
        raise ConfigError(Code.PRIVATIZER_UNSUPPORTED, f"RUN.toml [noise]: microbatches = {spec.microbatches} with "
                                                       f"privatizer {cls.name!r}: {why}; per-microbatch noise takes "
                                                       "the i.i.d. gaussian: set microbatches = 1 or privatizer = "
                                                       "\"gaussian\"")
    return cls


def _correlated(cls: "type[Privatizer]", params: Mapping[str, Any], horizon: int | None,
                insecure_seed: int | None) -> "Privatizer":
    """A matrix-factorization privatizer from its [noise] fields and the run's horizon (ValueError: a field
    missing, one it does not take, or values its strategy refuses)."""
    from govtrain.privatizers.base import FIELDS

    takes = CORRELATED_FIELDS[cls.name]
    given = {k: v for k, v in params.items() if k in FIELDS and v is not None}
    other = sorted(set(given) - set(takes))
    if other:
        raise ValueError(f"noise.{other[0]} does not apply to privatizer {cls.name!r} (it takes "
                         f"{', '.join(takes)}): remove it")
    missing = [k for k in takes if k not in given]
    if missing:
        raise ValueError(f"privatizer {cls.name!r} needs noise.{missing[0]}: set it")
    if type(horizon) is not int or horizon < 1:
        raise ValueError(f"privatizer {cls.name!r} is optimised for the run's horizon (training.steps): build it "
                         "with the run's steps")
    for k in ("bands", "min_separation"):
        if k in given and given[k] > horizon:
            raise ValueError(f"noise.{k} = {given[k]} is more than the run's {horizon} steps "
                             "(training.steps): lower it")
    return cls(**given, horizon=horizon, insecure_seed=insecure_seed)


def from_record(record: Mapping[str, Any] | None) -> "Privatizer":
    """The privatizer a `run` or `spend` entry recorded (None, a spend written before privatizers: the i.i.d.
    Gaussian), for the writer. ConfigError `privatizer_unknown` for a name not available, `privatizer_invalid` for
    a record its rule refuses (`rules.check_record`, what the verifier checks) or its class did not write: any
    exception rebuilding it raises becomes `privatizer_invalid`."""
    from govtrain.privatizers.rules import check_record

    if record is None:
        record = GAUSSIAN_RECORD
    check_record(record)  # what the verifier checks (rules.py): the writer refuses no less
    cls = privatizer_class(record["name"])
    try:  # whatever a record makes its class raise is that record's fault: coded, never a traceback
        privatizer = cls.from_record(record)
        written = privatizer.record()
    except GovtrainError:
        raise
    except Exception as e:  # noqa: BLE001 - a record is untrusted: whatever it makes rebuilding raise is its fault
        raise ConfigError(Code.PRIVATIZER_INVALID, f"privatizer record {dict(record)!r}: {e}") from e
    if written != dict(record):  # a record its class would not write: what else did it mean?
        raise ConfigError(Code.PRIVATIZER_INVALID, f"privatizer record {dict(record)!r} is not what privatizer "
                                                   f"{cls.name!r} records ({written!r})")
    return privatizer
