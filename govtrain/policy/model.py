"""The corpus policy as govtrain uses it inside: frozen values, integers only (docs/design.md §4).

`Policy.to_record()` is the canonical form stored in the ledger's `header` entry and
`Policy.from_record()` reads it back without trusting it: every field is checked for
shape and meaning again, and every public key is screened again.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from govtrain.attest.descriptor import CLASS_NAME
from govtrain.attest.keys import check_public_key, key_id
from govtrain.encoding import cbor
from govtrain.encoding.fields import check_shape
from govtrain.errors import Code, GovtrainError, IntegrityError

ACCOUNTANTS = ("prv", "rdp", "pld")
NOISE_FAMILIES = ("gaussian", "laplace", "discrete-gaussian", "skellam")  # accounting/families.py FAMILIES
PRIVACY_UNITS = ("example", "contribution")
PROFILE_KINDS = ("band", "fraction", "layers", "adapter")
ADAPTER_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
ORIGIN = re.compile(r"[A-Za-z0-9._~:/@+-]{1,255}")  # a C2SP origin line: schema-less, no spaces


def _invalid(error: type[GovtrainError], detail: str) -> GovtrainError:
    code = Code.BAD_LEDGER_HEADER if issubclass(error, IntegrityError) else Code.POLICY_INVALID
    return error(code, detail)


@dataclass(frozen=True, slots=True, kw_only=True)
class DepthProfile:
    """Which part of the model a class may reach; resolved against a model by the resolver."""

    kind: str
    band: tuple[int, int] | None = None
    fraction_u: tuple[int, int] | None = None
    layers: tuple[int, ...] | None = None
    heads: tuple[tuple[int, tuple[int, ...]], ...] | None = None
    adapter: str | None = None
    head: bool = False  # the classifier head and other parameters outside the layer stack
    experts: tuple[tuple[int, tuple[int, ...]], ...] | None = None  # layer -> the MoE experts it may reach there
    router: bool = False  # the MoE routers (gates) of its layers: reached only when granted, as the head is

    def to_record(self) -> dict:
        record = {
            "kind": self.kind,
            "band": list(self.band) if self.band is not None else None,
            "fraction_u": list(self.fraction_u) if self.fraction_u is not None else None,
            "layers": list(self.layers) if self.layers is not None else None,
            "heads": [[layer, list(heads)] for layer, heads in self.heads] if self.heads is not None else None,
            "adapter": self.adapter,
            "head": self.head,
        }
        # Written only when set, so that every policy without them keeps its canonical bytes (and header hash).
        if self.experts is not None:
            record["experts"] = [[layer, list(experts)] for layer, experts in self.experts]
        if self.router:
            record["router"] = True
        return record

    def validate(self, where: str, error: type[GovtrainError]) -> None:
        def bad(detail: str) -> GovtrainError:
            return _invalid(error, f"{where}: {detail}")

        present = {
            "band": self.band is not None,
            "fraction": self.fraction_u is not None,
            "layers": self.layers is not None,
            "adapter": self.adapter is not None,
        }
        chosen = [name for name, is_set in present.items() if is_set]
        if len(chosen) != 1:
            raise bad("a class needs exactly one depth profile: band, fraction, layers or adapter "
                      f"(found {', '.join(chosen) or 'none'})")
        if self.kind != chosen[0]:
            raise bad(f"profile kind {self.kind!r} does not match its fields")
        if self.band is not None:
            first, last = self.band
            if first < 0 or last < first:
                raise bad("band must be [first, last] with 0 <= first <= last")
        if self.fraction_u is not None:
            low, high = self.fraction_u
            if not 0 <= low < high <= 1_000_000:
                raise bad("fraction must be [low, high] with 0 <= low < high <= 1")
        if self.layers is not None:
            if not self.layers or any(i < 0 for i in self.layers) or list(self.layers) != sorted(set(self.layers)):
                raise bad("layers must be a non-empty list of distinct non-negative layer indices")
        if self.adapter is not None and not ADAPTER_NAME.fullmatch(self.adapter):
            raise bad("adapter must be 1-64 characters from [A-Za-z0-9_-]")
        for what, mask in (("heads", self.heads), ("experts", self.experts)):
            if mask is not None:
                self._validate_mask(what, mask, bad)
        if self.router and self.kind == "adapter":
            raise bad("router reaches the MoE routers of the class's layers; an adapter profile has no layers")

    def _validate_mask(self, what: str, mask: tuple[tuple[int, tuple[int, ...]], ...], bad) -> None:
        """heads or experts: {layer: [index, ...]} inside the profile's own layers."""
        unit = what.removesuffix("s")
        if self.kind == "adapter":
            raise bad(f"{what} restrict layers; they cannot be combined with an adapter profile")
        if not mask:
            raise bad(f"{what} must name at least one layer")
        layers = [layer for layer, _ in mask]
        if layers != sorted(set(layers)):
            raise bad(f"{what} must name each layer once")
        for layer, indices in mask:
            if self.band is not None and not self.band[0] <= layer <= self.band[1]:
                raise bad(f"{what} names layer {layer}, outside the band {list(self.band)}")
            if self.layers is not None and layer not in self.layers:
                raise bad(f"{what} names layer {layer}, which is not in layers")
            if not indices or any(i < 0 for i in indices) or list(indices) != sorted(set(indices)):
                raise bad(f"{what} of layer {layer} must be a non-empty list of distinct {unit} indices")


@dataclass(frozen=True, slots=True, kw_only=True)
class DataClass:
    name: str
    clip_norm_u: int
    min_noise_multiplier_u: int
    eps_budget_u: int
    max_eps_budget_u: int
    profile: DepthProfile

    def to_record(self) -> dict:
        return {
            "clip_norm_u": self.clip_norm_u,
            "min_noise_multiplier_u": self.min_noise_multiplier_u,
            "eps_budget_u": self.eps_budget_u,
            "max_eps_budget_u": self.max_eps_budget_u,
            "profile": self.profile.to_record(),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Attester:
    name: str
    public_key: bytes
    classes: frozenset[str]

    @property
    def key_id(self) -> bytes:
        return key_id(self.public_key)

    def to_record(self) -> dict:
        return {"name": self.name, "public_key": self.public_key, "classes": sorted(self.classes)}


@dataclass(frozen=True, slots=True, kw_only=True)
class LedgerKey:
    name: str
    public_key: bytes

    def to_record(self) -> dict:
        return {"name": self.name, "public_key": self.public_key}


@dataclass(frozen=True, kw_only=True)
class Policy:
    origin: str
    delta_p: int
    accountant: str
    # What neighbouring datasets differ by (docs/design.md §5): one example, or one whole contribution. Fixed in the
    # header: a later policy entry may not change it, nor examples_per_contribution.
    privacy_unit: str
    examples_per_contribution: int | None  # contribution unit: most examples of a sampled contribution per step
    sampling_rate_u: int | None  # q over the eligible units
    expected_batch_size: int | None  # units per step
    steps_per_epoch: int
    retention_epochs: int
    max_validity_s: int
    clock_skew_s: int
    floor_min_noise_multiplier_u: int
    floor_max_clip_norm_u: int
    classes: Mapping[str, DataClass]
    attesters: tuple[Attester, ...]
    ledger_keys: tuple[LedgerKey, ...]
    # The keys that may sign a release manifest of this ledger's runs (govtrain/release/manifest.py). Recorded only
    # when the policy names some, so that every policy without them keeps its canonical bytes (and header hash).
    release_keys: tuple[LedgerKey, ...] = ()
    # [floor.families]: noise family -> its own minimum noise multiplier (micro). When the table is there, only the
    # families it names may train (gaussian always, at the corpus floor unless named). Recorded only when set, so
    # that every policy without it keeps its canonical bytes (and header hash). `privatizers/families/floors.py`.
    family_floors: Mapping[str, int] = field(default_factory=dict)
    _digest: bytes = field(default=b"", repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "classes", MappingProxyType(dict(self.classes)))
        object.__setattr__(self, "family_floors", MappingProxyType(dict(self.family_floors)))

    def validate(self, error: type[GovtrainError]) -> "Policy":
        """Check every relation docs/design.md §4 requires; `error` is ConfigError at init, IntegrityError on audit."""

        def bad(detail: str) -> GovtrainError:
            return _invalid(error, detail)

        if not ORIGIN.fullmatch(self.origin):
            raise bad("origin must be 1-255 characters with no spaces (e.g. example.org/corpus/1)")
        if not 0 < self.delta_p < 10**12:
            raise bad("delta must be in (0, 1) and at least 1e-12")
        if self.accountant not in ACCOUNTANTS:
            raise bad(f"accountant must be one of {', '.join(ACCOUNTANTS)}")
        if self.privacy_unit not in PRIVACY_UNITS:
            raise bad(f"privacy_unit must be one of {', '.join(PRIVACY_UNITS)}")
        if (self.privacy_unit == "contribution") != (self.examples_per_contribution is not None):
            raise bad("examples_per_contribution is required with privacy_unit = 'contribution' and applies to it only")
        if self.examples_per_contribution is not None and self.examples_per_contribution < 1:
            raise bad("examples_per_contribution must be at least 1")
        if (self.sampling_rate_u is None) == (self.expected_batch_size is None):
            raise bad("give exactly one of sampling_rate and expected_batch_size")
        if self.sampling_rate_u is not None and not 0 < self.sampling_rate_u <= 1_000_000:
            raise bad("sampling_rate must be in (0, 1]")
        if self.expected_batch_size is not None and self.expected_batch_size < 1:
            raise bad("expected_batch_size must be at least 1")
        for name in ("steps_per_epoch", "retention_epochs", "max_validity_s"):
            if getattr(self, name) < 1:
                raise bad(f"{name} must be at least 1")
        if self.floor_min_noise_multiplier_u <= 0 or self.floor_max_clip_norm_u <= 0:
            raise bad("floor.min_noise_multiplier and floor.max_clip_norm must be greater than 0")
        for family, floor in self.family_floors.items():
            if family not in NOISE_FAMILIES or type(floor) is not int or floor <= 0:
                raise bad(f"floor.families: {family!r} must be one of {', '.join(NOISE_FAMILIES)} with a minimum "
                          "noise multiplier greater than 0")
        if not self.classes:
            raise bad("the policy needs at least one class")
        for name, cls in self.classes.items():
            where = f"classes.{name}"
            if name != cls.name or not CLASS_NAME.fullmatch(name):
                raise bad(f"{where}: class names are 1-64 characters from [A-Za-z0-9._-]")
            if not 0 < cls.clip_norm_u <= self.floor_max_clip_norm_u:
                raise bad(f"{where}.clip_norm must be > 0 and <= floor.max_clip_norm")
            if cls.min_noise_multiplier_u < self.floor_min_noise_multiplier_u:
                raise bad(f"{where}.min_noise_multiplier must be >= floor.min_noise_multiplier")
            if not 0 < cls.eps_budget_u <= cls.max_eps_budget_u:
                raise bad(f"{where}: need 0 < eps_budget <= max_eps_budget")
            cls.profile.validate(where, error)
        if not self.attesters:
            raise bad("the policy needs at least one attester")
        seen: set[bytes] = set()
        for i, attester in enumerate(self.attesters):
            _screen(attester.public_key, f"attesters[{i}] ({attester.name})", error)
            if attester.public_key in seen:
                raise bad(f"attesters[{i}] ({attester.name}) repeats another attester's key")
            seen.add(attester.public_key)
            if not attester.classes:
                raise bad(f"attesters[{i}] ({attester.name}) may attest no class")
            for cls_name in sorted(attester.classes):
                if cls_name not in self.classes:
                    raise bad(f"attesters[{i}] ({attester.name}) names unknown class {cls_name!r}")
        if not self.ledger_keys:
            raise bad("the policy needs at least one ledger key")
        for i, ledger_key in enumerate(self.ledger_keys):
            _screen(ledger_key.public_key, f"ledger_keys[{i}] ({ledger_key.name})", error)
        names = set()
        for i, release_key in enumerate(self.release_keys):
            where = f"release_keys[{i}] ({release_key.name})"
            if not 1 <= len(release_key.name) <= 128 or release_key.name in names:
                raise bad(f"{where}: a release key has a name of 1-128 characters, not another release key's")
            names.add(release_key.name)
            _screen(release_key.public_key, where, error)
            if release_key.public_key in {k.public_key for k in self.release_keys[:i]}:
                raise bad(f"{where} repeats another release key")
        return self

    def to_record(self) -> dict:
        return {
            "origin": self.origin,
            "delta_p": self.delta_p,
            "accountant": self.accountant,
            "privacy_unit": self.privacy_unit,
            "examples_per_contribution": self.examples_per_contribution,
            "sampling_rate_u": self.sampling_rate_u,
            "expected_batch_size": self.expected_batch_size,
            "steps_per_epoch": self.steps_per_epoch,
            "retention_epochs": self.retention_epochs,
            "max_validity_s": self.max_validity_s,
            "clock_skew_s": self.clock_skew_s,
            "floor": {
                "min_noise_multiplier_u": self.floor_min_noise_multiplier_u,
                "max_clip_norm_u": self.floor_max_clip_norm_u,
                **({"families": dict(sorted(self.family_floors.items()))} if self.family_floors else {}),
            },
            "classes": {name: cls.to_record() for name, cls in self.classes.items()},
            "attesters": [a.to_record() for a in self.attesters],
            "ledger_keys": [k.to_record() for k in self.ledger_keys],
            **({"release_keys": [k.to_record() for k in self.release_keys]} if self.release_keys else {}),
        }

    @property
    def unit(self) -> str:
        """The privacy unit as the header fixes it: 'example', or 'contribution (at most N examples)'."""
        if self.privacy_unit == "contribution":
            return f"contribution (at most {self.examples_per_contribution} examples)"
        return self.privacy_unit

    def sampling_units(self, records: int) -> int:
        """How many sampling units a contribution of `records` examples is: each example, or the whole of it."""
        return 1 if self.privacy_unit == "contribution" else records

    def digest(self) -> bytes:
        """SHA-256 of the canonical record; identifies the policy a gate or cache was built for."""
        if not self._digest:
            object.__setattr__(self, "_digest", hashlib.sha256(cbor.encode(self.to_record())).digest())
        return self._digest

    @classmethod
    def from_record(cls, record: Any, *, error: type[GovtrainError] = IntegrityError) -> "Policy":
        shape = _RecordShape(error)
        top = shape.map(record, _POLICY_SPEC, "policy", optional=_POLICY_OPTIONAL)
        floor = shape.map(top["floor"], _FLOOR_SPEC, "policy.floor", optional=_FLOOR_OPTIONAL)
        classes = {}
        for name, raw in shape.typed(top["classes"], dict, "policy.classes").items():
            cls_map = shape.map(raw, _CLASS_SPEC, f"policy.classes.{name}")
            prof = shape.map(cls_map["profile"], _PROFILE_SPEC, f"policy.classes.{name}.profile",
                             optional=_PROFILE_OPTIONAL)
            classes[name] = DataClass(
                name=name,
                clip_norm_u=cls_map["clip_norm_u"],
                min_noise_multiplier_u=cls_map["min_noise_multiplier_u"],
                eps_budget_u=cls_map["eps_budget_u"],
                max_eps_budget_u=cls_map["max_eps_budget_u"],
                profile=DepthProfile(
                    kind=prof["kind"],
                    band=shape.int_tuple(prof["band"], "band", 2),
                    fraction_u=shape.int_tuple(prof["fraction_u"], "fraction_u", 2),
                    layers=shape.int_tuple(prof["layers"], "layers"),
                    heads=shape.heads(prof["heads"]),
                    adapter=prof["adapter"],
                    head=prof["head"],
                    experts=shape.heads(prof.get("experts"), "experts"),
                    router=prof.get("router", False),
                ),
            )
        attesters = []
        for i, raw in enumerate(shape.typed(top["attesters"], list, "policy.attesters")):
            a = shape.map(raw, _ATTESTER_SPEC, f"policy.attesters[{i}]")
            names = [shape.typed(c, str, f"policy.attesters[{i}].classes") for c in a["classes"]]
            if names != sorted(set(names)):
                raise _invalid(error, f"policy.attesters[{i}].classes must be sorted and distinct")
            attesters.append(Attester(name=a["name"], public_key=a["public_key"], classes=frozenset(names)))
        ledger_keys = []
        for i, raw in enumerate(shape.typed(top["ledger_keys"], list, "policy.ledger_keys")):
            k = shape.map(raw, _LEDGER_KEY_SPEC, f"policy.ledger_keys[{i}]")
            ledger_keys.append(LedgerKey(name=k["name"], public_key=k["public_key"]))
        release_keys = []
        for i, raw in enumerate(shape.typed(top.get("release_keys", []), list, "policy.release_keys")):
            k = shape.map(raw, _LEDGER_KEY_SPEC, f"policy.release_keys[{i}]")
            release_keys.append(LedgerKey(name=k["name"], public_key=k["public_key"]))
        policy = cls(
            origin=top["origin"],
            delta_p=top["delta_p"],
            accountant=top["accountant"],
            privacy_unit=top["privacy_unit"],
            examples_per_contribution=top["examples_per_contribution"],
            sampling_rate_u=top["sampling_rate_u"],
            expected_batch_size=top["expected_batch_size"],
            steps_per_epoch=top["steps_per_epoch"],
            retention_epochs=top["retention_epochs"],
            max_validity_s=top["max_validity_s"],
            clock_skew_s=top["clock_skew_s"],
            floor_min_noise_multiplier_u=floor["min_noise_multiplier_u"],
            floor_max_clip_norm_u=floor["max_clip_norm_u"],
            classes=classes,
            attesters=tuple(attesters),
            ledger_keys=tuple(ledger_keys),
            release_keys=tuple(release_keys),
            family_floors=shape.typed(floor.get("families", {}), dict, "policy.floor.families"),
        )
        policy.validate(error)
        if policy.to_record() != record:
            raise _invalid(error, "policy record is not in its canonical form")
        return policy


def _screen(raw: bytes, where: str, error: type[GovtrainError]) -> None:
    try:
        check_public_key(raw)
    except GovtrainError as e:
        raise error(Code.BAD_PUBLIC_KEY, f"{where}: {e.detail}") from e


_NULLABLE_INT = (int, type(None))
_POLICY_SPEC = {
    "origin": str, "delta_p": int, "accountant": str, "privacy_unit": str,
    "examples_per_contribution": _NULLABLE_INT, "sampling_rate_u": _NULLABLE_INT,
    "expected_batch_size": _NULLABLE_INT, "steps_per_epoch": int, "retention_epochs": int,
    "max_validity_s": int, "clock_skew_s": int, "floor": dict, "classes": dict, "attesters": list,
    "ledger_keys": list, "release_keys": list,
}
_POLICY_OPTIONAL = frozenset({"release_keys"})  # absent unless the policy names release keys (`Policy.to_record`)
_FLOOR_SPEC = {"min_noise_multiplier_u": int, "max_clip_norm_u": int, "families": dict}
_FLOOR_OPTIONAL = frozenset({"families"})  # absent unless the policy sets [floor.families]
_CLASS_SPEC = {"clip_norm_u": int, "min_noise_multiplier_u": int, "eps_budget_u": int,
               "max_eps_budget_u": int, "profile": dict}
_PROFILE_SPEC = {"kind": str, "band": (list, type(None)), "fraction_u": (list, type(None)),
                 "layers": (list, type(None)), "heads": (list, type(None)), "adapter": (str, type(None)),
                 "head": bool, "experts": list, "router": bool}
_PROFILE_OPTIONAL = frozenset({"experts", "router"})  # absent unless set (`DepthProfile.to_record`)
_ATTESTER_SPEC = {"name": str, "public_key": bytes, "classes": list}
_LEDGER_KEY_SPEC = {"name": str, "public_key": bytes}


class _RecordShape:
    """Shape checks for a stored policy record, raising the caller's error type."""

    def __init__(self, error: type[GovtrainError]) -> None:
        self.error = error

    def map(self, obj: Any, spec: dict, what: str, optional: frozenset[str] = frozenset()) -> dict:
        try:
            return check_shape(obj, spec, what=what, error=self.error, optional=optional)
        except GovtrainError as e:
            raise _invalid(self.error, e.detail) from e

    def typed(self, obj: Any, kind: type, what: str) -> Any:
        if type(obj) is not kind:
            raise _invalid(self.error, f"{what} must be a {kind.__name__}")
        return obj

    def int_tuple(self, obj: Any, what: str, length: int | None = None) -> tuple[int, ...] | None:
        if obj is None:
            return None
        if any(type(i) is not int for i in obj) or (length is not None and len(obj) != length):
            raise _invalid(self.error, f"profile.{what} must be a list of {length or 'some'} integers")
        return tuple(obj)

    def heads(self, obj: Any, what: str = "heads") -> tuple[tuple[int, tuple[int, ...]], ...] | None:
        """heads or experts: a list of [layer, [index, ...]] pairs."""
        if obj is None:
            return None
        result = []
        for pair in obj:
            if type(pair) is not list or len(pair) != 2 or type(pair[0]) is not int or type(pair[1]) is not list:
                raise _invalid(self.error, f"profile.{what} must be a list of [layer, [index, ...]] pairs")
            result.append((pair[0], self.int_tuple(pair[1], what) or ()))
        return tuple(result)
