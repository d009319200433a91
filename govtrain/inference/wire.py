"""What `POST /v1/split` carries, for the client and the server alike (pydantic at the edge; no torch).

The request states the mechanism the client ran: per-request epsilon and delta, the clip norm C (the sensitivity
is 2C: `mechanism.py`), the sigma it drew with, and the noised pooled vector. The server checks every value itself
and recomputes sigma from (epsilon, delta, C): a declared sigma is compared, never charged. A refusal is the
project's error object, `{"ok": false, "code": ..., "detail": ...}`, with the status `server.HTTP_STATUS` gives.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from govtrain.errors import Code, InferenceError
from govtrain.inference.mechanism import MAX_DIMENSION, GaussianRelease
from govtrain.policy.config import first_error

SPLIT_PATH = "/v1/split"


class _Wire(BaseModel):
    # strict: no strings for numbers, no numbers for strings; values are checked by the mechanism, with codes
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class SplitRequest(_Wire):
    """One query's noised pooled state and the mechanism that made it."""

    session_id: str = Field(description="the client's session (1-128 of A-Z a-z 0-9 . _ : -)")
    epsilon: float = Field(description="this request's epsilon")
    delta: float = Field(description="this request's delta")
    clip_norm: float = Field(description="C: the pooled state was clipped to L2 norm C; the sensitivity is 2C")
    sigma: float = Field(description="the noise's standard deviation, as the client calibrated it")
    vector: list[float] = Field(max_length=MAX_DIMENSION, description="clip(pooled state) + N(0, sigma^2 I)")

    @classmethod
    def of(cls, session_id: str, release: GaussianRelease, vector: Any) -> "SplitRequest":
        """The request for `vector` made under `release` (its values exactly as the release's integers)."""
        return cls(session_id=session_id, epsilon=release.epsilon, delta=release.delta, clip_norm=release.clip_norm,
                   sigma=release.sigma, vector=[float(x) for x in vector])


class SplitResponse(_Wire):
    """The released head's answer, and the server's account of the session after the request."""

    session_id: str
    label: int
    label_name: str
    logits: list[float]
    sigma: float = Field(description="the sigma the server charged (its own calibration)")
    epsilon_spent: float = Field(description="the session's epsilon after this request, at its delta")
    epsilon_budget: float
    delta: float = Field(description="the session's delta")
    requests: int = Field(description="requests the session has been charged for, this one included")


class ErrorResponse(_Wire):
    """A refusal: `GovtrainError.as_json()`."""

    ok: bool
    code: str
    detail: str


def parse_split_request(body: bytes | str | dict) -> SplitRequest:
    """A request body (JSON bytes or text, or an already decoded object) as a `SplitRequest`, else
    `bad_split_request` naming the first problem."""
    try:
        if isinstance(body, dict):
            return SplitRequest.model_validate(json.loads(json.dumps(body)))  # JSON's types, as the wire has them
        return SplitRequest.model_validate_json(body)
    except ValidationError as e:
        raise InferenceError(Code.BAD_SPLIT_REQUEST, f"{first_error(e, 'the body')} (a split request is a JSON object "
                                                     f"with exactly: {', '.join(SplitRequest.model_fields)})") from None
    except (TypeError, ValueError) as e:
        raise InferenceError(Code.BAD_SPLIT_REQUEST, f"the body is not JSON ({e})") from None
