"""The client side of split inference: each query pooled by the public base model, where the query is.

    encoder = PooledEncoder.from_release("adapter")               # the base the release names, bound by tree hash
    with SessionStore("sessions.db") as store, httpx.Client(base_url="https://gate.example") as http:
        client = SplitClient(encoder, http, store, session_id=new_session_id(), budget=session_budget(8.0, 1e-6))
        answer = client.classify("a fine film", epsilon=1.0, delta=1e-6, clip_norm=1.0)

For each query, in this order: the pooled state of the base model (pooled exactly as the released model pools it:
`govtrain.json`'s pooling and max_length, the run's tokenizer), clipped to C; the client's own session budget
debited (a refusal stops here: nothing is drawn, nothing leaves the machine); N(0, sigma^2 I) added, sigma from the
analytic Gaussian mechanism at Delta = 2C (`mechanism.py`), drawn from the operating system's entropy unless a
generator is injected; then `POST /v1/split` through the injected httpx client. The debit stands whatever the
server answers: once the vector has left, the privacy it costs is spent.
"""

from __future__ import annotations

import secrets
from typing import Any, Sequence

import numpy as np

from govtrain.errors import Code, InferenceError
from govtrain.inference.budget import SessionState, SessionStore
from govtrain.inference.mechanism import (SessionBudget, add_noise, check_session_id, clip, noise_rng, release_for)
from govtrain.inference.pooled import PooledEncoder
from govtrain.inference.wire import SPLIT_PATH, ErrorResponse, SplitRequest, SplitResponse


def new_session_id() -> str:
    """A fresh session id: 128 random bits, so that no one guesses it (the server binds it to its owner anyway)."""
    return f"s-{secrets.token_hex(16)}"


class SplitClient:
    """Queries a split-inference server for one session: each query pooled, clipped, charged to the client's own
    budget in `store`, noised and posted through `http` (an `httpx.Client` with the server's base_url and whatever
    headers its rights envelope needs). `rng` defaults to OS entropy; tests inject a seeded one."""

    def __init__(self, encoder: PooledEncoder, http: Any, store: SessionStore, *, session_id: str,
                 budget: SessionBudget, owner: str = "local", rng: np.random.Generator | None = None) -> None:
        self.encoder = encoder
        self.http = http
        self.store = store
        self.session_id = check_session_id(session_id)
        self.owner = owner
        self.budget = budget
        self.rng = rng if rng is not None else noise_rng()
        store.open_session(session_id, owner=owner, budget=budget)

    @property
    def state(self) -> SessionState:
        """The session as the client's own store has it."""
        state = self.store.session(self.session_id, owner=self.owner)
        assert state is not None  # opened in __init__; sessions are never deleted
        return state

    def prepare(self, pooled: np.ndarray, *, epsilon: float, delta: float, clip_norm: float) -> SplitRequest:
        """The request for one pooled state: clipped, charged to the client's session (`session_budget_exhausted`
        stops here, before any noise is drawn), then noised."""
        release = release_for(epsilon, delta, clip_norm)
        clipped = clip(np.asarray(pooled, dtype=np.float64), release.clip_norm)
        self.store.debit(self.session_id, release, owner=self.owner, budget=self.budget)
        return SplitRequest.of(self.session_id, release, add_noise(clipped, release, self.rng))

    def send(self, request: SplitRequest) -> SplitResponse:
        """POST the request; the server's refusal is raised with its own code (`InferenceError`), and anything
        that is not a split response is `split_transport`."""
        import httpx

        try:
            response = self.http.post(SPLIT_PATH, content=request.model_dump_json(),
                                      headers={"content-type": "application/json"})
        except httpx.HTTPError as e:
            raise InferenceError(Code.SPLIT_TRANSPORT, f"{SPLIT_PATH}: {type(e).__name__}: {e}") from None
        if response.status_code == 200:
            try:
                return SplitResponse.model_validate_json(response.content)
            except ValueError:
                raise InferenceError(Code.SPLIT_TRANSPORT, f"{SPLIT_PATH} answered 200 with no split response") \
                    from None
        try:
            refusal = ErrorResponse.model_validate_json(response.content)
            code = Code(refusal.code)
        except ValueError:
            raise InferenceError(Code.SPLIT_TRANSPORT, f"{SPLIT_PATH} answered {response.status_code} with no "
                                                       "govtrain error") from None
        raise InferenceError(code, f"the server refused ({response.status_code}): {refusal.detail}")

    def classify(self, text: str, *, epsilon: float, delta: float, clip_norm: float) -> SplitResponse:
        """One query, end to end."""
        return self.classify_many([text], epsilon=epsilon, delta=delta, clip_norm=clip_norm)[0]

    def classify_many(self, texts: Sequence[str], *, epsilon: float, delta: float,
                      clip_norm: float) -> list[SplitResponse]:
        """Each text its own request (and its own debit), in order; the base model pools them in batches. A refusal
        raises at the text it reaches: the ones before it were answered and charged."""
        release_for(epsilon, delta, clip_norm)  # a bad request is refused before the model runs
        return [self.send(self.prepare(row, epsilon=epsilon, delta=delta, clip_norm=clip_norm))
                for row in self.encoder.pooled(texts)]
