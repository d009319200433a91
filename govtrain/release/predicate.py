"""The release manifest's payload: an in-toto Statement v1 whose predicate (`PREDICATE_TYPE`) states what a run's
adapter carries in privacy. Never imports torch.

Validated with pydantic at this edge (strict: exact fields, exact types, no floats: ε in micro-units `*_u`, δ in
pico-units `delta_p`, as in the ledger). `schemas/release.schema.json` is generated from `Statement`
(`python -m govtrain.release.predicate --schema`); a test keeps the two identical and validates emitted statements
against the file with an independent JSON Schema validator. `statement_bytes` is the one function that gives the
bytes a manifest signs. The fields are documented in docs/release-manifest.md.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from govtrain.errors import Code, IntegrityError
from govtrain.policy.config import first_error
from govtrain.release.artifact import ADAPTER_CONFIG, WEIGHTS

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://govtrain.invalid/release/v1"  # the project's reserved name, as the schemas' $id use it
VERSION = 1

Hex32 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
U63 = Annotated[int, Field(ge=0, le=2**63 - 1)]
Name = Annotated[str, Field(min_length=1, max_length=255)]
# A file of the adapter folder: its path relative to the folder, "/"-separated, no empty, "." or ".." part.
_PART = r"(?:\.\.[^/\x00]+|\.[^./\x00][^/\x00]*|[^./\x00][^/\x00]*)"
SUBJECT_NAME = rf"^{_PART}(?:/{_PART})*$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Digest(_Strict):
    sha256: Hex32


class Subject(_Strict):
    """One file of the adapter folder and its SHA-256."""

    name: Annotated[str, Field(pattern=SUBJECT_NAME, max_length=4096)]
    digest: Digest


class RunEntry(_Strict):
    """The run entry as the ledger records it (`ledger.proof` carries its bytes): where, and what it states."""

    run_id: Name
    seq: U63
    leaf_hash: Hex32
    mechanism: Name
    config_sha256: Hex32
    adapter_sha256: Hex32
    device: Name
    precision: Name


class LedgerRef(_Strict):
    """The ledger: its origin, and the run entry's inclusion proof as c2sp.org/tlog-proof@v1 text (`ledger/proof.py`:
    the entry's bytes on its extra line, then the signed checkpoint note it proves against, verbatim)."""

    origin: Name
    checkpoint_size: U63
    proof: Annotated[str, Field(max_length=1 << 20)]


class BaseModelRef(_Strict):
    name: Name
    revision: Name | None
    sha256: Hex32  # its tree hash (`train.run.tree_sha256`), as the run entry records it


class AdapterRef(_Strict):
    sha256: Hex32  # the run entry's adapter hash: every subject but README.md (`artifact.adapter_sha256`)
    task: Literal["sequence-classification", "causal-lm"]
    adapters: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]+$")]]  # "default" first, then each class's own


class Privacy(_Strict):
    unit: Literal["example", "contribution"]
    examples_per_contribution: U63 | None
    accountant: Literal["prv", "rdp", "pld"]
    delta_p: U63  # δ × 10¹²
    mechanism: Name
    sampling_rates_u: list[U63]  # q of each ledger epoch the run trained, × 10⁶
    steps: U63


class Tune(_Strict):
    """The `tune` entry that lists the run as a trial: ε covers every trial."""

    tune_id: Name
    seq: U63
    leaf_hash: Hex32
    trials: list[Name]
    selected_run_id: Name | None


class ClassEps(_Strict):
    data_class: Name
    eps_u: U63


class LayerIndices(_Strict):
    layer: U63
    indices: list[U63]


class Group(_Strict):
    """Trained coordinates reached by the same classes (`release/groups.py`)."""

    classes: Annotated[list[ClassEps], Field(min_length=1)]  # every class whose profile reaches it, with its ε
    adapters: Annotated[list[Name], Field(min_length=1)]  # the peft adapters its parameters belong to
    layers: list[U63]
    heads: list[LayerIndices]  # where it holds only some attention heads of a layer
    experts: list[LayerIndices]  # where it holds only some experts of a layer
    outside: list[Name]  # modules outside the layer stack (the classifier head)
    tensors: U63
    scalars: U63


class ClassReach(_Strict):
    """One class of the policy: its ε (the largest of a contribution of it the run, or its tune, charged), how many
    of its contributions were charged, its profile, the groups it reached (indices into `groups`), and `adapter`:
    the name of its own LoRA adapter where it reached that adapter and nothing else (null otherwise)."""

    data_class: Name
    eps_u: U63
    contributions: U63
    profile: Annotated[str, Field(max_length=4096)]
    groups: list[U63]
    adapter: Name | None


class Withdrawal(_Strict):
    contribution_id: Name
    data_class: Name
    seq: U63
    leaf_hash: Hex32


class Predicate(_Strict):
    """What the adapter carries in privacy, bound to the ledger by the run entry's inclusion proof."""

    version: Literal[1]
    released_at: U63
    run: RunEntry
    ledger: LedgerRef
    base_model: BaseModelRef
    adapter: AdapterRef
    privacy: Privacy
    tune: Tune | None
    classes: list[ClassReach]
    groups: list[Group]
    withdrawn: list[Withdrawal]  # contributions the run trained on, withdrawn before the checkpoint


class Statement(_Strict):
    """An in-toto Statement v1 (github.com/in-toto/attestation, spec/v1/statement.md) of govtrain's predicate."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, validate_by_alias=True, validate_by_name=False)

    type: Literal["https://in-toto.io/Statement/v1"] = Field(alias="_type")
    subject: Annotated[list[Subject], Field(min_length=1)]
    predicateType: Literal["https://govtrain.invalid/release/v1"]
    predicate: Predicate


def statement_bytes(statement: Statement) -> bytes:
    """The bytes a manifest signs: the statement as compact JSON, keys sorted, UTF-8. Only integers, strings, lists
    and null, so every reader parses back what was signed; a verifier reads the bytes it received, never these."""
    document = statement.model_dump(mode="json", by_alias=True)
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def read_statement(document: object) -> Statement:
    """A decoded payload as a `Statement`, its schema and the relations between its fields checked
    (`bad_statement`)."""
    try:
        statement = Statement.model_validate(document)
    except ValidationError as e:
        raise IntegrityError(Code.BAD_STATEMENT, f"{first_error(e, 'the statement')} (an in-toto Statement v1 of "
                                                 f"predicate "
                                                 f"{PREDICATE_TYPE} is what this govtrain reads)") from None
    _relations(statement)
    return statement


def _relations(statement: Statement) -> None:
    def bad(detail: str) -> IntegrityError:
        return IntegrityError(Code.BAD_STATEMENT, detail)

    names = [s.name for s in statement.subject]
    if len(set(names)) != len(names):
        raise bad("a subject is listed twice")
    p = statement.predicate
    classes = {c.data_class: c for c in p.classes}
    if [c.data_class for c in p.classes] != sorted(classes):
        raise bad("predicate.classes lists each class once, sorted by name")
    if not p.adapter.adapters or p.adapter.adapters[0] != "default":
        raise bad("predicate.adapter.adapters lists 'default' first")
    files = set(names)
    for name in p.adapter.adapters[1:]:  # a class's own adapter is a sub-folder of the release, as peft saves it
        if name == "default" or not {f"{name}/{ADAPTER_CONFIG}", f"{name}/{WEIGHTS}"} <= files:
            raise bad(f"predicate.adapter.adapters names {name!r}, whose {ADAPTER_CONFIG} and {WEIGHTS} are not "
                      "among the subjects")
    signatures = [tuple(c.data_class for c in g.classes) for g in p.groups]
    if len(set(signatures)) != len(signatures) or any(list(s) != sorted(set(s)) for s in signatures):
        raise bad("predicate.groups: each group names its classes once, sorted, and no two groups the same classes")
    reached: dict[str, set[int]] = {name: set() for name in classes}
    for index, group in enumerate(p.groups):
        unknown = sorted(set(group.adapters) - set(p.adapter.adapters))
        if unknown:
            raise bad(f"predicate.groups[{index}] lies in adapter {unknown[0]!r}, which predicate.adapter.adapters "
                      "does not list")
        for item in group.classes:
            if item.data_class not in classes or classes[item.data_class].eps_u != item.eps_u:
                raise bad(f"predicate.groups[{index}] names class {item.data_class!r} with another ε than "
                          "predicate.classes, or a class it does not list")
            reached[item.data_class].add(index)
    for name, cls in classes.items():
        if sorted(reached[name]) != cls.groups:
            raise bad(f"predicate.classes: {name!r} lists groups {cls.groups}, the groups name it in "
                      f"{sorted(reached[name])}")
        if cls.contributions and not cls.groups:
            raise bad(f"predicate.classes: {name!r} had {cls.contributions} contribution(s) trained on, and reaches "
                      "no group")
        adapter = own_adapter(name, [p.groups[i] for i in cls.groups])
        if cls.adapter != adapter:
            raise bad(f"predicate.classes: {name!r} states adapter {cls.adapter!r}, its groups say {adapter!r}")
        if adapter is not None and cls.profile != adapter_profile(adapter):
            raise bad(f"predicate.classes: {name!r} reaches only its own adapter {adapter!r}, and states the profile "
                      f"{cls.profile!r}, not {adapter_profile(adapter)!r}")


def adapter_profile(adapter: str) -> str:
    """The profile text (`resolver.profile.describe_profile`) of a class whose profile is `adapter = NAME`."""
    return f"adapter {adapter!r}"


def own_adapter(data_class: str, groups: list[Group]) -> str | None:
    """The class's own LoRA adapter where `groups` (those it reached) all lie in that one adapter, not the default
    one, and no other class reaches them; else None: it reached shared parameters (layers, the head)."""
    adapters = {name for group in groups for name in group.adapters}
    if not groups or len(adapters) != 1 or adapters == {"default"}:
        return None
    if any([c.data_class for c in group.classes] != [data_class] for group in groups):
        return None
    return adapters.pop()


def json_schema() -> dict:
    """The JSON Schema (2020-12) of the statement, as written to schemas/release.schema.json."""
    schema = Statement.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = "https://govtrain.invalid/schemas/release.schema.json"
    return schema


if __name__ == "__main__" and sys.argv[1:] == ["--schema"]:
    print(json.dumps(json_schema(), indent=2, sort_keys=True))
