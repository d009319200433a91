"""A released adapter for the split-inference tests: the tiny BERT trained for two governed steps, and the
in-process server that answers `POST /v1/split` with `serve_split` (what the gate server's route calls)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from govtrain.errors import GovtrainError
from govtrain.inference.budget import SessionStore
from govtrain.inference.mechanism import SessionBudget
from govtrain.inference.wire import SPLIT_PATH, parse_split_request


def train_release(root: Path, pooling: str) -> tuple[Path, Path]:
    """(adapter folder, base model folder): a tiny BERT classifier trained with `pooling`, released."""
    from tests.test_release import _corpus, _run_toml, _train
    from tests.test_train import save_tiny_bert

    base = root / "tiny-bert"
    base.mkdir()
    save_tiny_bert(base)
    corpus = _corpus(root, "corpus")
    _train(_run_toml(corpus, str(base), pooling=pooling, steps=2), corpus)
    return corpus.dir / "adapter", base


def split_server(head, store: SessionStore, budget: SessionBudget, *, owner: str = "alice",
                 seen: list | None = None) -> Callable:
    """An httpx.MockTransport handler: the route as the gate server builds it (parse, serve, map refusals)."""
    import httpx

    from govtrain.inference.server import http_status, serve_split

    def handle(request: "httpx.Request") -> "httpx.Response":
        if seen is not None:
            seen.append(request)
        assert request.method == "POST" and request.url.path == SPLIT_PATH
        try:
            response = serve_split(head, parse_split_request(request.content), store, owner=owner, budget=budget)
        except GovtrainError as e:
            return httpx.Response(http_status(e), json=e.as_json())
        return httpx.Response(200, content=response.model_dump_json(), headers={"content-type": "application/json"})

    return handle
