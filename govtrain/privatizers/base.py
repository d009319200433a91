"""The privatizer interface (docs/design.md §9; seed 003): what turns the router's clipped sums into the released
gradient, with state that may carry noise from one step to the next.

    privatizer = build(spec)                           # which privatizer, and its parameters (a PrivatizerSpec)
    state = privatizer.init(slots)                     # once per run: one Slot per tensor the step noises
    noisy, state = privatizer.update(sums, state, std=std, keep=keep, step=t)   # once per logical step

`sums` maps a slot key to the step's clipped sum (the router's accumulator dtype, fp32 or wider); `std` maps it to
the group's noise scale s_g (an absolute standard deviation, not a multiplier; a key with no std, or std 0, gets no
noise); `keep` maps it to a 0/1 mask over the tensor where only part of it is the slot's (attention heads), or None.
`noisy[k]` is `sums[k] + noise_k * keep[k]`, formed **in place and in slot order**: two slots may name one tensor
(a parameter split between noise groups), and each adds its noise to it in turn, exactly as the router did before
privatizers existed. The i.i.d. Gaussian draws in that order from one generator, so its noise is byte-identical
to the router's before this interface.

What the ledger charges follows from the privatizer's public record alone (`record`, `charge`,
`participation`): the verifier rebuilds the privatizer from a spend entry's record and recomputes the charge.
State is secret (it is, or determines, the noise: whoever holds it can subtract the noise): `state_dict` is
written only into the run state (0600), never logged, and deleted with it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Protocol, Sequence

# What a spend charges is accounting's plain record: a privatizer produces it (`charge`), accounting composes it.
from govtrain.accounting.records import Charge
from govtrain.errors import Code, ConfigError

if TYPE_CHECKING:  # the verifier charges records through `rules.py` and never imports torch; nor does this module
    import torch
    from torch import Tensor

# The RUN.toml [noise] fields that parametrise a privatizer; any other field of the section configures the router.
FIELDS = ("bands", "buffers", "min_separation", "granularity_bits", "beta_exp")

State = Any  # a privatizer's own state: secret; persisted only through `state_dict` / `load_state`


@dataclass(frozen=True, kw_only=True)
class PrivatizerSpec:
    """What a privatizer is built from: its `name` (a key of `privatizers.REGISTRY`), the parameters set for it
    (`params`: some of `FIELDS`, each set), and the `microbatches` each step's noise is split into. The config layer
    makes one from its section (`govtrain.train.config.NoiseSection.privatizer_spec`, RUN.toml [noise]): the
    privatizers take their own parameters and know nothing of the configuration file."""

    name: str = "gaussian"
    params: Mapping[str, Any] = field(default_factory=dict)
    microbatches: int = 1

    def __post_init__(self) -> None:
        # what RUN.toml's schema refuses for the section, refused for a spec made by hand too (the review of issue 35)
        unknown = sorted(set(self.params) - set(FIELDS))
        if unknown:
            raise ConfigError(Code.PRIVATIZER_INVALID, f"privatizer {self.name!r}: no parameter {', '.join(unknown)}; a "
                                                       f"privatizer takes some of {', '.join(FIELDS)}")
        if type(self.microbatches) is not int or self.microbatches < 1:
            raise ConfigError(Code.PRIVATIZER_INVALID, f"microbatches must be a whole number of at least 1, not "
                                                       f"{self.microbatches!r}")


class SpecSource(Protocol):
    """A configuration section that makes a privatizer's spec (RUN.toml [noise]: `NoiseSection`)."""

    def privatizer_spec(self) -> PrivatizerSpec: ...


@dataclass(frozen=True, kw_only=True)
class Slot:
    """One tensor the step noises. `key` is stable across steps (the router's name for it), so state can be
    kept per slot; shape, dtype and device are those of the clipped sum it will be handed."""

    key: str
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True, kw_only=True)
class Participation:
    """The sampling the privatizer's accounting assumes. `poisson`: each unit joins each step independently at
    rate q. `cyclic`: the units are split by a public rule into `cycle` parts, step t draws only from part
    t mod cycle, each of its units independently at rate min(1, cycle·q) (so the expected batch is unchanged),
    and a unit can take part at most once in any `cycle` consecutive steps (b-min-separation)."""

    scheme: str  # "poisson" | "cyclic"
    cycle: int = 1


class Privatizer(ABC):
    name: ClassVar[str]  # the RUN.toml [noise] privatizer name, and the record's "name"
    family: ClassVar[str] = "gaussian"  # the accounting family of what it releases
    correlated: ClassVar[bool] = False  # whether its noise depends on earlier steps' (then its state must be kept)
    # The per-sample side (the router's materialized path, for the noise families): the norm each clipping unit is
    # clipped in ("l2", or "l1" for laplace), and whether each clipped per-sample gradient is quantised
    # (`quantize`) before the sum, so that integer noise is added in the quantised domain.
    norm: ClassVar[str] = "l2"
    quantized: ClassVar[bool] = False
    # The RUN.toml [noise] fields it takes besides `privatizer` (`from_parameters` refuses any other that is set).
    parameters: ClassVar[tuple[str, ...]] = ()
    # Whether it adds per-microbatch noise (RUN.toml [noise] microbatches > 1, the router's mode): then its record
    # holds "microbatches" where it is more than 1 (`build` refuses microbatches > 1 for the others).
    per_microbatch: ClassVar[bool] = False
    # Where its noise is drawn from: the run's generator (`build` sets it: OS entropy unless insecure_seed). None: a
    # privatizer that draws seeds its own from the OS when it first needs one.
    generator: "torch.Generator | None" = None

    @classmethod
    def from_parameters(cls, params: Mapping[str, Any], *, horizon: int | None = None,
                        insecure_seed: int | None = None) -> "Privatizer":
        """From the parameters set for it (`PrivatizerSpec.params`: RUN.toml [noise]'s, whose `privatizer` names
        this class) and what the run knows: its `horizon` (total steps), and `insecure_seed` (tests only; never
        recorded). Refuses (ValueError, one line saying what to change) a parameter that it does not take, then
        rebuilds from the record those parameters make. A privatizer whose record is not its parameters one to one
        overrides it."""
        return cls.from_record({"name": cls.name, **cls.check_parameters(params)})

    @classmethod
    def check_parameters(cls, params: Mapping[str, Any]) -> dict[str, Any]:
        """The parameters set that parametrise a privatizer (`FIELDS`; the section's others configure the router),
        after refusing (ValueError) any this class does not take."""
        given = {k: v for k, v in params.items() if k in FIELDS and v is not None}
        other = sorted(set(given) - set(cls.parameters))
        if other:
            takes = f"it takes {', '.join(cls.parameters)}" if cls.parameters else "it takes none"
            raise ValueError(f"noise.{other[0]} does not apply to privatizer {cls.name!r} ({takes}): remove it")
        return given

    def quantize(self, clipped: Tensor, clip: Tensor, generator: torch.Generator) -> Tensor:
        """Integer families: each row of `clipped` ([units, d], already clipped to its `clip`) as an integer
        vector in the quantised domain whose norm the accountant's sensitivity bounds. Others never call it."""
        raise NotImplementedError(f"{self.name} does not quantise")

    @abstractmethod
    def record(self) -> dict[str, Any]:
        """Its public parameters as CBOR-ready ints and strings, "name" first: recorded in the run and spend
        entries, and enough to rebuild it (`from_record`) and recompute every charge."""

    @classmethod
    @abstractmethod
    def from_record(cls, record: Mapping[str, Any]) -> "Privatizer":
        """Rebuild it from `record()` (raises ValueError on a record it did not write)."""

    def participation(self) -> Participation:
        return Participation(scheme="poisson")

    def charge(self, *, sampling_rate_u: int, noise_multiplier_u: int, steps: int) -> Charge:
        """A spend of `steps` steps at rate q and effective multiplier sigma (the router's Poisson rate and
        s_g / C_i), as the accountant composes it. The i.i.d. Gaussian: DP-SGD, one round per step."""
        return Charge(family=self.family, sampling_rate_u=sampling_rate_u, noise_multiplier_u=noise_multiplier_u,
                      rounds=steps)

    @abstractmethod
    def init(self, slots: Sequence[Slot]) -> State: ...

    @abstractmethod
    def update(self, sums: Mapping[str, Tensor], state: State, *, std: Mapping[str, float],
               keep: Mapping[str, Tensor | None] | None = None,
               step: int | None = None) -> tuple[dict[str, Tensor], State]:
        """`step`: the run's global step (the sampler's), when the caller knows it; a privatizer whose state counts
        steps raises ValueError if its state is at another one. A std < 0 or not finite raises ValueError."""

    def state_dict(self, state: State) -> dict[str, Any]:
        """What the run state must keep to resume the noise stream exactly (tensors and ints). Secret."""
        return {}

    def load_state(self, slots: Sequence[Slot], saved: Mapping[str, Any]) -> State:
        """The state `state_dict` saved, for these slots (raises ValueError if it does not fit them)."""
        return self.init(slots)
