"""The policy file: TOML validated by pydantic, converted to a `Policy` (docs/design.md §4).

Numbers are read as exact decimals and converted to integer micro-units in the
direction that favours privacy (`govtrain.units`). Every invalid field is reported
by its dotted path in one `error[policy_invalid]: …` line. `schemas/policy.schema.json`
is generated from `PolicyFile` (`python -m govtrain.policy.config --schema`) and a
test keeps the two identical.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tomllib
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    WithJsonSchema,
    model_validator,
)

from govtrain import units
from govtrain.attest.keys import parse_public_key
from govtrain.errors import Code, ConfigError, GovtrainError
from govtrain.policy.model import Attester, DataClass, DepthProfile, LedgerKey, Policy


def _number(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float, Decimal)):
        raise ValueError("must be a number")
    return units.to_decimal(value)


Real = Annotated[Decimal, BeforeValidator(_number), WithJsonSchema({"type": "number"})]
PositiveReal = Annotated[Decimal, BeforeValidator(_number), Field(gt=0),
                         WithJsonSchema({"type": "number", "exclusiveMinimum": 0})]
NonNegativeInt = Annotated[StrictInt, Field(ge=0)]
PositiveInt = Annotated[StrictInt, Field(ge=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FloorFile(_Strict):
    """Corpus-wide floors every class must respect."""

    min_noise_multiplier: PositiveReal
    max_clip_norm: PositiveReal
    families: dict[Literal["gaussian", "laplace", "discrete-gaussian", "skellam"], PositiveReal] | None = Field(
        None, description="noise family -> its own minimum noise multiplier (for laplace: the Laplace scale over the "
                          "L1 clip norm); when given, only the families named (and gaussian) may train")


class ClassFile(_Strict):
    """One admissibility class: bounds, budgets and a depth profile."""

    clip_norm: PositiveReal
    min_noise_multiplier: PositiveReal
    eps_budget: PositiveReal = Field(description="default budget a contributor of this class signs")
    max_eps_budget: PositiveReal
    band: tuple[NonNegativeInt, NonNegativeInt] | None = Field(None, description="[first, last] layer index")
    fraction: tuple[Real, Real] | None = Field(None, description="[low, high] normalized depth in [0, 1]")
    layers: list[NonNegativeInt] | None = Field(None, description="sparse set of layer indices")
    heads: dict[Annotated[str, Field(pattern=r"^[0-9]+$")], list[NonNegativeInt]] | None = Field(
        None, description="layer index -> permitted attention heads, inside the permitted layers"
    )
    adapter: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")] | None = Field(
        None, description="the class trains only this named LoRA adapter"
    )
    head: StrictBool = Field(False, description="whether the class may reach the classifier head")
    experts: dict[Annotated[str, Field(pattern=r"^[0-9]+$")], list[NonNegativeInt]] | None = Field(
        None, description="layer index -> permitted mixture-of-experts experts, inside the permitted layers"
    )
    router: StrictBool = Field(False, description="whether the class may reach the MoE routers of its layers")

    @model_validator(mode="after")
    def _relations(self) -> "ClassFile":
        if self.eps_budget > self.max_eps_budget:
            raise ValueError("eps_budget must not exceed max_eps_budget")
        if self.fraction is not None and not 0 <= self.fraction[0] < self.fraction[1] <= 1:
            raise ValueError("fraction must be [low, high] with 0 <= low < high <= 1")
        return self


class KeyFile(_Strict):
    """A public key given inline (PEM or base64 of the raw 32 bytes) or as a file next to the policy."""

    name: Annotated[StrictStr, Field(min_length=1, max_length=128)]
    public_key: StrictStr | None = None
    public_key_file: StrictStr | None = None

    @model_validator(mode="after")
    def _one_source(self) -> "KeyFile":
        if (self.public_key is None) == (self.public_key_file is None):
            raise ValueError("give exactly one of public_key and public_key_file")
        return self


class AttesterFile(KeyFile):
    classes: Annotated[list[StrictStr], Field(min_length=1)]


class PolicyFile(_Strict):
    """A govtrain corpus policy (`govtrain init --policy`)."""

    origin: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9._~:/@+-]{1,255}$")]
    delta: PositiveReal
    accountant: Literal["prv", "rdp", "pld"]
    privacy_unit: Literal["example", "contribution"] = Field(
        "example", description="what a neighbouring dataset differs by: one example, or one whole contribution "
                               "(sampled at the policy's rate, its examples' gradients averaged, clipped together)")
    examples_per_contribution: PositiveInt | None = Field(
        None, description="with privacy_unit = 'contribution': the most examples a sampled contribution uses per "
                          "step, drawn uniformly from it (public)")
    sampling_rate: PositiveReal | None = Field(
        None, description="Poisson rate q over the eligible units (examples, or contributions)")
    expected_batch_size: PositiveInt | None = Field(
        None, description="expected units per step (examples, or contributions); q = this over the eligible units")
    steps_per_epoch: PositiveInt
    retention_epochs: PositiveInt
    max_validity_days: PositiveInt = 365
    clock_skew_seconds: NonNegativeInt = 300
    floor: FloorFile
    classes: Annotated[dict[Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")], ClassFile],
                       Field(min_length=1)]
    attesters: Annotated[list[AttesterFile], Field(min_length=1)]
    ledger_keys: Annotated[list[KeyFile], Field(min_length=1)]
    release_keys: Annotated[list[KeyFile], Field(min_length=1)] | None = Field(
        None, description="the Ed25519 keys that may sign a release manifest (`govtrain release`) of a run on "
                          "this ledger")

    @model_validator(mode="after")
    def _relations(self) -> "PolicyFile":
        if (self.sampling_rate is None) == (self.expected_batch_size is None):
            raise ValueError("give exactly one of sampling_rate and expected_batch_size")
        if self.sampling_rate is not None and self.sampling_rate > 1:
            raise ValueError("sampling_rate must be at most 1")
        if self.delta >= 1:
            raise ValueError("delta must be less than 1")
        if (self.privacy_unit == "contribution") != (self.examples_per_contribution is not None):
            raise ValueError("examples_per_contribution is required with privacy_unit = 'contribution' and applies "
                             "to it only")
        for name, cls in self.classes.items():
            if cls.clip_norm > self.floor.max_clip_norm:
                raise ValueError(f"classes.{name}.clip_norm exceeds floor.max_clip_norm")
            if cls.min_noise_multiplier < self.floor.min_noise_multiplier:
                raise ValueError(f"classes.{name}.min_noise_multiplier is below floor.min_noise_multiplier")
        for i, attester in enumerate(self.attesters):
            for cls_name in attester.classes:
                if cls_name not in self.classes:
                    raise ValueError(f"attesters[{i}] names unknown class {cls_name!r}")
        return self


def _profile(cls: ClassFile) -> DepthProfile:
    kinds = [k for k in ("band", "fraction", "layers", "adapter") if getattr(cls, k) is not None]
    return DepthProfile(
        kind=kinds[0] if len(kinds) == 1 else "+".join(kinds) or "none",
        band=tuple(cls.band) if cls.band is not None else None,
        # a narrower band favours privacy: the low end rounds up, the high end down
        fraction_u=(units.to_micro(cls.fraction[0], "up"), units.to_micro(cls.fraction[1], "down"))
        if cls.fraction is not None else None,
        layers=tuple(cls.layers) if cls.layers is not None else None,
        heads=tuple(sorted((int(layer), tuple(heads)) for layer, heads in cls.heads.items()))
        if cls.heads is not None else None,
        adapter=cls.adapter,
        head=cls.head,
        experts=tuple(sorted((int(layer), tuple(experts)) for layer, experts in cls.experts.items()))
        if cls.experts is not None else None,
        router=cls.router,
    )


def _key_bytes(entry: KeyFile, base: Path, where: str) -> bytes:
    if entry.public_key is not None:
        text, source = entry.public_key, f"{where}.public_key"
    else:
        path = base / entry.public_key_file  # type: ignore[operator]
        try:
            text = path.read_text("ascii")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(Code.KEY_UNREADABLE, f"{where}.public_key_file: cannot read {path}") from e
        source = f"{where}.public_key_file ({path})"
    try:
        return parse_public_key(text, source=source)
    except GovtrainError as e:
        raise ConfigError(Code.BAD_PUBLIC_KEY, e.detail) from e


def policy_from_file(model: PolicyFile, base: Path) -> Policy:
    """Convert a validated file to integers (rounding toward privacy) and screen its keys."""
    policy = Policy(
        origin=model.origin,
        delta_p=units.delta_p(model.delta),
        accountant=model.accountant,
        privacy_unit=model.privacy_unit,
        examples_per_contribution=model.examples_per_contribution,
        sampling_rate_u=units.to_micro(model.sampling_rate, "up") if model.sampling_rate is not None else None,
        expected_batch_size=model.expected_batch_size,
        steps_per_epoch=model.steps_per_epoch,
        retention_epochs=model.retention_epochs,
        max_validity_s=model.max_validity_days * 86_400,
        clock_skew_s=model.clock_skew_seconds,
        floor_min_noise_multiplier_u=units.noise_multiplier_u(model.floor.min_noise_multiplier),
        floor_max_clip_norm_u=units.clip_norm_u(model.floor.max_clip_norm),
        classes={
            name: DataClass(
                name=name,
                clip_norm_u=units.clip_norm_u(cls.clip_norm),
                min_noise_multiplier_u=units.noise_multiplier_u(cls.min_noise_multiplier),
                eps_budget_u=units.eps_budget_u(cls.eps_budget),
                max_eps_budget_u=units.eps_budget_u(cls.max_eps_budget),
                profile=_profile(cls),
            )
            for name, cls in model.classes.items()
        },
        attesters=tuple(
            Attester(name=a.name, public_key=_key_bytes(a, base, f"attesters[{i}]"), classes=frozenset(a.classes))
            for i, a in enumerate(model.attesters)
        ),
        ledger_keys=tuple(
            LedgerKey(name=k.name, public_key=_key_bytes(k, base, f"ledger_keys[{i}]"))
            for i, k in enumerate(model.ledger_keys)
        ),
        release_keys=tuple(
            LedgerKey(name=k.name, public_key=_key_bytes(k, base, f"release_keys[{i}]"))
            for i, k in enumerate(model.release_keys or ())
        ),
        family_floors={family: units.noise_multiplier_u(floor) for family, floor in (model.floor.families or {}).items()},
    )
    return policy.validate(ConfigError)


def _loc_part(part: object) -> str:
    """One step of a field's path as an error line shows it: a key the file spelled with a newline or another
    control character (a quoted TOML key) is escaped, so the error stays one line."""
    text = str(part)
    return text if text.isprintable() else ascii(text)


def format_errors(error: ValidationError) -> str:
    """Every invalid field of a pydantic error, by dotted path, on one line."""
    parts = []
    for item in error.errors():
        where = ".".join(_loc_part(p) for p in item["loc"] if not str(p).startswith("function-after"))
        message = item["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)


def first_error(error: ValidationError, whole: str) -> str:
    """The first invalid field of a pydantic error as `where: what`, `whole` naming the document where the error is
    the document's own: the one-line form of a wire message refused at the first problem."""
    item = error.errors()[0]
    where = ".".join(_loc_part(p) for p in item["loc"]) or whole
    return f"{where}: {item['msg']}"


def read_toml_file(path: Path, model: type[BaseModel], *, what: str, unreadable: Code, invalid: Code,
                   parse_float: Any = float) -> tuple[Any, bytes]:
    """Read a TOML config file and validate it against `model`: (the model, the file's bytes). Every
    failure is one `ConfigError` line: `unreadable` for I/O and syntax, `invalid` for the fields."""
    try:
        raw = path.read_bytes()
        document = tomllib.loads(raw.decode("utf-8"), parse_float=parse_float)
    except OSError as e:
        raise ConfigError(unreadable, f"cannot read {what} {path}: {e.strerror}") from e
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(unreadable, f"{path} is not valid TOML: {e}") from e
    except RecursionError as e:  # tomllib recurses once per nested array or inline table
        raise ConfigError(unreadable, f"{path} is not valid TOML: arrays or tables nested too deep") from e
    except ValueError as e:  # an integer past Python's digit limit (sys.get_int_max_str_digits)
        raise ConfigError(unreadable, f"{path} is not valid TOML: a number too long to read") from e
    try:
        return model.model_validate(document), raw
    except ValidationError as e:
        raise ConfigError(invalid, f"{path}: {format_errors(e)}") from e


def load_policy(path: str | Path) -> tuple[Policy, bytes]:
    """Read and validate a policy file. Returns the policy and the SHA-256 of the file's bytes."""
    path = Path(path)
    model, raw = read_toml_file(path, PolicyFile, what="policy", unreadable=Code.POLICY_UNREADABLE,
                                invalid=Code.POLICY_INVALID, parse_float=Decimal)
    return policy_from_file(model, path.parent), hashlib.sha256(raw).digest()


def schema_of(model: type[BaseModel], file_name: str) -> dict:
    """The JSON Schema (2020-12) of a config file model, as written to schemas/`file_name`."""
    schema = model.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = f"https://govtrain.invalid/schemas/{file_name}"
    return schema


def json_schema() -> dict:
    return schema_of(PolicyFile, "policy.schema.json")


if __name__ == "__main__" and sys.argv[1:] == ["--schema"]:
    print(json.dumps(json_schema(), indent=2, sort_keys=True))
