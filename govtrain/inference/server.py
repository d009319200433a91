"""The server side of split inference, without HTTP: what `POST /v1/split` does once the caller is known.

    head = SplitHead(govtrain.load("adapter"))                      # the released classifier's head
    store = SessionStore("server-sessions.db")                        # authoritative budgets
    response = serve_split(head, parse_split_request(body), store, owner=subject, budget=policy_budget)

`serve_split` checks, in order, and refuses with the first failure (nothing changed, nothing charged):

1. the session id's form (`bad_split_request`);
2. epsilon, delta and the clip norm C (`bad_privacy_request`), from which it calibrates sigma itself (the analytic
   Gaussian mechanism at Delta = 2C); the client's declared sigma must be that one (`sigma_mismatch`);
3. the vector: the model's hidden size, finite numbers (`bad_vector`);
4. its norm against what a clipped state plus that noise can have (`noise_implausible`, `mechanism.check_noise`);
5. the session's budget, in one transaction with the debit (`session_owner_mismatch`, `session_budget_exhausted`);

then applies the head. The head reads the **base** model's pooled state (what the client can compute), while the
adapter trained it on the LoRA-adapted one: how well it predicts from noised base states is measured
(by the inference bench), not assumed. Note that a refusal at step 5 comes after the vector arrived: the server holds
what it was sent. The client's own budget, debited before sending, is what keeps the vector from leaving.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from govtrain.errors import Code, ConfigError, GovtrainError
from govtrain.inference.budget import SessionStore
from govtrain.inference.pooled import pooled_states, pooling_encoder
from govtrain.inference.mechanism import (SessionBudget, as_vector, check_declared_sigma, check_noise,
                                          check_session_id, release_for)
from govtrain.inference.wire import SplitRequest, SplitResponse

# The HTTP status of each refusal `serve_split` and `parse_split_request` raise.
HTTP_STATUS: dict[Code, int] = {
    Code.BAD_SPLIT_REQUEST: 400,
    Code.SESSION_OWNER_MISMATCH: 403,
    Code.BAD_PRIVACY_REQUEST: 422,
    Code.SIGMA_MISMATCH: 422,
    Code.BAD_VECTOR: 422,
    Code.NOISE_IMPLAUSIBLE: 422,
    Code.SESSION_BUDGET_EXHAUSTED: 429,
}


def http_status(error: GovtrainError) -> int:
    """The status a refusal is answered with (500 for a code split inference does not raise)."""
    return HTTP_STATUS.get(error.code, 500)


class SplitHead:
    """The released classifier's head, over pooled vectors: the model `govtrain.load` returns, from the pooled state
    on. At construction it checks, on probe texts, that the head applied to the model's own pooled states gives the
    model's logits, so that what it serves is the released head and nothing else (`split_unsupported`)."""

    def __init__(self, loaded: Any) -> None:
        import torch

        from govtrain.tasks.base import probe_texts

        if loaded.record.task != "sequence-classification":
            raise ConfigError(Code.SPLIT_UNSUPPORTED, f"a {loaded.record.task} release: split inference serves a "
                                                      "sequence classifier's head")
        self.loaded = loaded
        model = loaded.model.get_base_model() if hasattr(loaded.model, "get_base_model") else loaded.model
        self._head = getattr(model, "classifier", None)
        if not isinstance(self._head, torch.nn.Module):
            raise ConfigError(Code.SPLIT_UNSUPPORTED, f"{type(model).__name__} has no `classifier` head")
        self.dimension = int(model.config.hidden_size)
        self.id2label = dict(loaded.record.id2label)
        inputs = loaded.encode(probe_texts())
        with torch.no_grad():
            expected = loaded.model(**inputs).logits
        found = self._apply(pooled_states(pooling_encoder(model), inputs))
        if found.shape != expected.shape or not torch.allclose(found, expected, rtol=1e-5, atol=1e-5):
            raise ConfigError(Code.SPLIT_UNSUPPORTED, f"{type(model).__name__}: its logits are not its classifier "
                                                      "applied to its pooled state, so a pooled vector cannot be "
                                                      "served")

    def _apply(self, pooled: Any) -> Any:
        import torch

        with torch.no_grad():  # eval mode: the dropout before the classifier is the identity
            return self._head(pooled)

    def logits(self, vectors: np.ndarray) -> np.ndarray:
        """[n, num_labels] float64 logits for [n, dimension] pooled vectors."""
        import torch

        parameter = next(self._head.parameters())
        batch = torch.as_tensor(np.asarray(vectors), dtype=parameter.dtype, device=parameter.device)
        if batch.dim() != 2 or batch.shape[1] != self.dimension:
            raise ValueError(f"expected [n, {self.dimension}] vectors, got {tuple(batch.shape)}")
        return self._apply(batch).double().cpu().numpy()


def split_logits(head: SplitHead, vector: Any) -> tuple[np.ndarray, int]:
    """(logits, label id) of one noised pooled vector, checked (`bad_vector`) but not charged to any session."""
    logits = head.logits(as_vector(vector, head.dimension)[None, :])[0]
    return logits, int(np.argmax(logits))


def serve_split(head: SplitHead, request: SplitRequest, store: SessionStore, *, owner: str,
                budget: SessionBudget) -> SplitResponse:
    """Answer one split request for `owner` (the rights envelope's subject), charging the session in `store`
    (created with `budget` on its first request; an existing session keeps its own). See the module's steps."""
    check_session_id(request.session_id)  # 1
    release = release_for(request.epsilon, request.delta, request.clip_norm)  # 2: the server's own sigma
    check_declared_sigma(release, request.sigma)
    vector = as_vector(request.vector, head.dimension)  # 3
    check_noise(vector, release)  # 4
    state = store.debit(request.session_id, release, owner=owner, budget=budget)  # 5
    logits = head.logits(vector[None, :])[0]
    label = int(np.argmax(logits))
    return SplitResponse(session_id=request.session_id, label=label,
                         label_name=head.id2label.get(str(label), str(label)),
                         logits=[float(x) for x in logits], sigma=release.sigma, epsilon_spent=state.spent_epsilon,
                         epsilon_budget=state.budget.epsilon, delta=state.budget.delta, requests=state.requests)
