"""inference.toml: what a `govtrain serve` deployment trusts and allows (docs/serving.md has the reference).

Validated by pydantic (`InferencePolicyFile`), every invalid field named by its dotted path in one
`error[inference_policy_invalid]: …` line, then converted to the frozen `InferencePolicy`: numbers in integer
micro- and pico-units rounded the way that favours privacy (a session budget and the per-request epsilon bound
down, deltas down, the clip norm down), key files read relative to the policy and screened for prime order.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Annotated

from pydantic import Field, StrictStr, model_validator

from govtrain import units
from govtrain.errors import Code, ConfigError
from govtrain.policy.config import (KeyFile, PositiveInt, PositiveReal, NonNegativeInt, _key_bytes, _Strict,
                                    read_toml_file, schema_of)
from govtrain.serve.rights import AUDIENCE, Issuer

ClassName = Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")]


class IssuerFile(KeyFile):
    """A key that may sign rights envelopes, and the classes it may grant (default: any)."""

    classes: list[ClassName] | None = Field(None, description="the classes this issuer may grant; all when absent")


class ReleaseSection(_Strict):
    """The release key served releases must be signed by, and the ledger their taint is read from."""

    public_key: StrictStr | None = Field(None, description="the release key (PEM, or base64 of the raw 32 bytes)")
    public_key_file: StrictStr | None = Field(None, description="the release key's PEM file, beside this policy")
    ledger: Annotated[StrictStr, Field(min_length=1)] = Field(
        description="the ledger URL withdrawals are read from (sqlite:///PATH or postgresql+psycopg://…)")
    ledger_keys: Annotated[list[KeyFile], Field(min_length=1)] = Field(
        description="the ledger's checkpoint keys, pinned: the release's checkpoint must be signed by one")
    grace_period_seconds: NonNegativeInt = Field(
        0, description="how long a tainted release is still served after the first withdrawal since it; 0: never")
    taint_check_seconds: NonNegativeInt = Field(
        60, description="how long a taint reading is reused before the ledger is read again; 0: every request")

    @model_validator(mode="after")
    def _one_key(self) -> "ReleaseSection":
        if (self.public_key is None) == (self.public_key_file is None):
            raise ValueError("give exactly one of public_key and public_key_file")
        return self


class SessionsSection(_Strict):
    """Split inference's session budgets: each session composes its requests exactly up to (epsilon, delta)."""

    store: Annotated[StrictStr, Field(min_length=1)] = Field(
        description="the SQLite file of session budgets, beside this policy unless absolute")
    epsilon: PositiveReal = Field(description="each session's budget epsilon")
    delta: PositiveReal = Field(description="each session's delta")

    @model_validator(mode="after")
    def _delta(self) -> "SessionsSection":
        if self.delta >= 1:
            raise ValueError("delta must be less than 1")
        return self


class SplitSection(_Strict):
    """What one `POST /v1/split` request may ask for."""

    clip_norm: PositiveReal = Field(description="C: the pooled state is clipped to L2 norm C (sensitivity 2C)")
    min_epsilon: PositiveReal = Field(description="the smallest per-request epsilon served")
    max_epsilon: PositiveReal = Field(description="the largest per-request epsilon served")
    max_delta: PositiveReal = Field(description="the largest per-request delta served")

    @model_validator(mode="after")
    def _bounds(self) -> "SplitSection":
        if self.min_epsilon > self.max_epsilon:
            raise ValueError("min_epsilon must not exceed max_epsilon")
        if self.max_delta >= 1:
            raise ValueError("max_delta must be less than 1")
        return self


class LimitsSection(_Strict):
    """Sizes a request may have: anything larger is refused before it is read in full."""

    max_body_bytes: PositiveInt = Field(1_048_576, description="the largest request body")
    max_texts: PositiveInt = Field(32, description="texts in one classify request")
    max_text_chars: PositiveInt = Field(4096, description="characters in one text or prompt")
    max_new_tokens: PositiveInt = Field(64, description="the most tokens one generate request may ask for")


class InferencePolicyFile(_Strict):
    """A govtrain inference policy (`govtrain serve --policy`)."""

    audience: Annotated[StrictStr, Field(pattern=f"^{AUDIENCE.pattern}$")] = Field(
        description="this deployment's name: rights envelopes must name it as their audience")
    clock_skew_seconds: NonNegativeInt = 60
    max_rights_days: PositiveInt = Field(30, description="the longest validity window a rights envelope may have")
    issuers: Annotated[list[IssuerFile], Field(min_length=1)]
    release: ReleaseSection
    sessions: SessionsSection
    split: SplitSection
    limits: LimitsSection = LimitsSection()

    @model_validator(mode="after")
    def _relations(self) -> "InferencePolicyFile":
        names = [issuer.name for issuer in self.issuers]
        if len(set(names)) != len(names):
            raise ValueError("issuers must have distinct names")
        if self.split.max_epsilon > self.sessions.epsilon:
            raise ValueError("split.max_epsilon exceeds sessions.epsilon: no request of that size could be served")
        return self


@dataclass(frozen=True, slots=True, kw_only=True)
class InferencePolicy:
    """inference.toml, checked and converted. Epsilons in micro-units, deltas in pico-units, C in micro-units."""

    audience: str
    clock_skew_s: int
    max_rights_s: int
    issuers: tuple[Issuer, ...]
    release_key: bytes
    ledger_keys: tuple[bytes, ...]
    ledger_url: str
    grace_s: int
    taint_check_s: int
    session_store: Path
    session_epsilon_u: int
    session_delta_p: int
    clip_norm_u: int
    min_epsilon_u: int
    max_epsilon_u: int
    max_delta_p: int
    max_body_bytes: int
    max_texts: int
    max_text_chars: int
    max_new_tokens: int

    def issuers_by_kid(self) -> dict[bytes, Issuer]:
        return {issuer.kid: issuer for issuer in self.issuers}


def _down(value: Decimal) -> int:
    return units.to_micro(value, "down")


def policy_from_file(model: InferencePolicyFile, base: Path) -> InferencePolicy:
    """Convert a validated file: integers rounded toward privacy, keys read and screened, paths made absolute."""
    release_key = _key_bytes(KeyFile(name="release", public_key=model.release.public_key,
                                     public_key_file=model.release.public_key_file), base, "release")
    ledger_keys = tuple(_key_bytes(k, base, f"release.ledger_keys[{n}]")
                        for n, k in enumerate(model.release.ledger_keys))
    issuers = tuple(Issuer(name=i.name, public_key=_key_bytes(i, base, f"issuers[{n}]"),
                           classes=frozenset(i.classes) if i.classes is not None else None)
                    for n, i in enumerate(model.issuers))
    if len({i.public_key for i in issuers}) != len(issuers):
        raise ConfigError(Code.INFERENCE_POLICY_INVALID, "two issuers share a public key")
    store = Path(model.sessions.store)
    values = {
        "session_epsilon_u": units.eps_budget_u(model.sessions.epsilon),
        "session_delta_p": units.to_pico(model.sessions.delta, "down"),
        "clip_norm_u": units.clip_norm_u(model.split.clip_norm),
        "min_epsilon_u": units.to_micro(model.split.min_epsilon, "up"),
        "max_epsilon_u": _down(model.split.max_epsilon),
        "max_delta_p": units.to_pico(model.split.max_delta, "down"),
    }
    for name, value in values.items():
        if value <= 0:
            raise ConfigError(Code.INFERENCE_POLICY_INVALID, f"{name.rsplit('_', 1)[0]} rounds to 0 in the units "
                                                             "govtrain keeps it in (1e-6, or 1e-12 for delta)")
    return InferencePolicy(
        audience=model.audience, clock_skew_s=model.clock_skew_seconds, max_rights_s=model.max_rights_days * 86_400,
        issuers=issuers, release_key=release_key, ledger_keys=ledger_keys, ledger_url=model.release.ledger,
        grace_s=model.release.grace_period_seconds, taint_check_s=model.release.taint_check_seconds,
        session_store=store if store.is_absolute() else base / store, **values,
        max_body_bytes=model.limits.max_body_bytes, max_texts=model.limits.max_texts,
        max_text_chars=model.limits.max_text_chars, max_new_tokens=model.limits.max_new_tokens,
    )


def load_inference_policy(path: str | Path) -> InferencePolicy:
    """Read and validate inference.toml; `inference_policy_unreadable` / `inference_policy_invalid` (exit 2)."""
    path = Path(path)
    model, _ = read_toml_file(path, InferencePolicyFile, what="inference policy",
                              unreadable=Code.INFERENCE_POLICY_UNREADABLE, invalid=Code.INFERENCE_POLICY_INVALID,
                              parse_float=Decimal)
    try:
        return policy_from_file(model, path.parent)
    except ConfigError as e:
        if e.code is Code.INFERENCE_POLICY_INVALID:
            raise ConfigError(e.code, f"{path}: {e.detail}") from e
        raise


def json_schema() -> dict:
    return schema_of(InferencePolicyFile, "inference.schema.json")


if __name__ == "__main__" and sys.argv[1:] == ["--schema"]:
    print(json.dumps(json_schema(), indent=2, sort_keys=True))
