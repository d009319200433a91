"""Split inference (seed 002, done right): the client pools its query with the public base model, clips the pooled
state to C, adds N(0, sigma^2 I) with sigma from the analytic Gaussian mechanism at Delta = 2C, and sends only that
to the server, which applies the released classifier's head. Sessions compose exactly (mu^2 = sum (Delta/sigma_i)^2)
and their budgets live in SQLite on both sides. docs/split-inference.md.

    mechanism.py  one request's mechanism (`release_for`, `clip`, `add_noise`), the server's checks; no torch
    budget.py     `SessionStore`: session budgets in SQLite, atomic check-and-debit, owners; no torch
    wire.py       `SplitRequest` / `SplitResponse`: what POST /v1/split carries; no torch
    pooled.py     `PooledEncoder`: the base model's pooled state, pooled as the release pools
    client.py     `SplitClient`: pool, clip, debit, noise, send
    server.py     `SplitHead`, `serve_split`, `HTTP_STATUS`: the server's side, without HTTP
    snr.py        seed 002's signal-to-noise claim, computed and measured

Importing this package imports no torch: `PooledEncoder`, `SplitClient`, `SplitHead` and `serve_split` load it
on first use.
"""

from typing import TYPE_CHECKING, Any

from govtrain.accounting.gaussian import calibrate_sigma
from govtrain.inference.budget import SessionState, SessionStore
from govtrain.inference.mechanism import GaussianRelease, SessionBudget, release_for, session_budget
from govtrain.inference.wire import SPLIT_PATH, SplitRequest, SplitResponse, parse_split_request

__all__ = ["GaussianRelease", "PooledEncoder", "SPLIT_PATH", "SessionBudget", "SessionState", "SessionStore",
           "SplitClient", "SplitHead", "SplitRequest", "SplitResponse", "calibrate_sigma", "new_session_id",
           "parse_split_request", "release_for", "serve_split", "session_budget"]

_LAZY = {"PooledEncoder": "pooled", "SplitClient": "client", "new_session_id": "client", "SplitHead": "server",
         "serve_split": "server"}

if TYPE_CHECKING:
    from govtrain.inference.client import SplitClient, new_session_id
    from govtrain.inference.pooled import PooledEncoder
    from govtrain.inference.server import SplitHead, serve_split


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"govtrain.inference.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'govtrain.inference' has no attribute {name!r}")
