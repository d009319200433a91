"""Attacks on split inference's budgets and requests. Each checks its code *and* that the session's spend, its
debits and its owner are unchanged:

- concurrent overspend: 100 threads, and several processes, on one session never pass its budget;
- replay of another session's id: refused for whoever does not own it, who can neither spend nor read it;
- a client that lies about sigma or epsilon: the server charges its own calibration, compares the declared sigma
  and refuses noise the declared mechanism cannot explain;
- NaN, infinite, oversized and wrongly sized vectors; epsilon <= 0 and other parameters out of range; bodies that
  are not split requests.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from govtrain.errors import Code, InferenceError
from govtrain.inference.budget import SessionStore
from govtrain.inference.mechanism import MAX_DIMENSION, add_noise, clip, release_for, session_budget
from govtrain.inference.wire import SplitRequest, parse_split_request
from tests.test_inference_budget import ADMITTED, BUDGET, REQUEST

REPO = Path(__file__).resolve().parents[1]


def snapshot(store: SessionStore, session: str, owner: str = "alice"):
    return store.session(session, owner=owner), store.debits(session, owner=owner)


# -- concurrent overspend ----------------------------------------------------------------------------------------


def test_a_hundred_concurrent_threads_never_overspend_one_session(tmp_path: Path):
    store = SessionStore(tmp_path / "s.db")
    start = threading.Barrier(100)
    outcomes: list[str] = []

    def attempt() -> None:
        start.wait()  # all at once
        try:
            store.debit("s1", REQUEST, owner="alice", budget=BUDGET)
            outcomes.append("admitted")
        except InferenceError as e:
            outcomes.append(e.code.value)

    threads = [threading.Thread(target=attempt) for _ in range(100)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes.count("admitted") == ADMITTED  # exactly what fits, as if one at a time
    assert outcomes.count("session_budget_exhausted") == 100 - ADMITTED
    state, debits = snapshot(store, "s1")
    assert state.requests == ADMITTED and state.spent_epsilon_u <= BUDGET.epsilon_u
    assert [d.seq for d in debits] == list(range(1, ADMITTED + 1)) and state.mu_sq == sum(d.mu_sq for d in debits)


CHILD = """
import sys, time
from pathlib import Path
from govtrain.errors import InferenceError
from govtrain.inference.budget import SessionStore
from govtrain.inference.mechanism import release_for, session_budget
store = SessionStore(sys.argv[1])
go = Path(sys.argv[2])
while not go.exists():
    time.sleep(0.001)
admitted = refused = 0
for _ in range(int(sys.argv[3])):
    try:
        store.debit("s1", release_for(1.0, 1e-6, 1.0), owner="alice", budget=session_budget(3.0, 1e-6))
        admitted += 1
    except InferenceError as e:
        assert e.code.value == "session_budget_exhausted", e
        refused += 1
print(admitted, refused)
"""


def test_several_processes_never_overspend_one_session(tmp_path: Path):
    path, go = tmp_path / "s.db", tmp_path / "go"
    SessionStore(path).close()  # the file exists before the race; creating it is not what is raced
    children = [subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(go), "25"], cwd=REPO, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(4)]
    time.sleep(1.0)  # let every child import and wait
    go.touch()
    counts = []
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        counts.append(tuple(map(int, out.split())))
    assert sum(a for a, _ in counts) == ADMITTED and sum(r for _, r in counts) == 100 - ADMITTED
    with SessionStore(path) as store:
        state, debits = snapshot(store, "s1")
    assert state.requests == ADMITTED and [d.seq for d in debits] == list(range(1, ADMITTED + 1))


# -- replay of another session's id ------------------------------------------------------------------------------


def test_a_caller_replaying_another_owners_session_id_can_neither_spend_nor_read_it(tmp_path: Path):
    with SessionStore(tmp_path / "s.db") as store:
        store.debit("s-7f3a", REQUEST, owner="alice", budget=BUDGET)
        before = snapshot(store, "s-7f3a")
        for call in (lambda: store.debit("s-7f3a", REQUEST, owner="mallory", budget=session_budget(100.0, 1e-3)),
                     lambda: store.open_session("s-7f3a", owner="mallory", budget=BUDGET),
                     lambda: store.session("s-7f3a", owner="mallory"),
                     lambda: store.debits("s-7f3a", owner="mallory")):
            with pytest.raises(InferenceError) as info:
                call()
            assert info.value.code is Code.SESSION_OWNER_MISMATCH and "alice" not in info.value.detail  # not named
        assert snapshot(store, "s-7f3a") == before


# -- the server's checks: lies, vectors, parameters --------------------------------------------------------------


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    pytest.importorskip("torch")
    import govtrain
    from govtrain.inference.server import SplitHead
    from tests.inference_release import train_release

    folder, base = train_release(tmp_path_factory.mktemp("split-attacks"), "mean")
    return SplitHead(govtrain.load(folder, base=base))


def honest(head, at: float = 1.0, seed: int = 0, **overrides) -> dict:
    """An honest request's body as a dict (epsilon `at`, delta 1e-6, C = 1), with `overrides` applied."""
    release = release_for(at, 1e-6, 1.0)
    rng = np.random.default_rng(seed)
    vector = add_noise(clip(rng.normal(size=head.dimension) * 5, 1.0), release, rng)
    body = json.loads(SplitRequest.of("s1", release, vector).model_dump_json())
    body.update(overrides)
    return body


def refused(head, store: SessionStore, body, code: Code, owner: str = "alice") -> None:
    """`body` is refused with `code`, and alice's session is as it was."""
    from govtrain.inference.server import HTTP_STATUS, serve_split

    before = snapshot(store, "s1")
    with pytest.raises(InferenceError) as info:
        request = parse_split_request(body if isinstance(body, (bytes, str)) else json.dumps(body).encode())
        serve_split(head, request, store, owner=owner, budget=BUDGET)
    assert info.value.code is code, info.value.line()
    assert code in HTTP_STATUS
    assert snapshot(store, "s1") == before


@pytest.fixture
def server_store(tmp_path: Path, head):
    from govtrain.inference.server import serve_split

    store = SessionStore(tmp_path / "server.db")
    serve_split(head, parse_split_request(json.dumps(honest(head))), store, owner="alice", budget=BUDGET)
    yield store
    store.close()


def test_the_server_refuses_another_owners_session_and_an_exhausted_budget(head, server_store):
    from govtrain.inference.server import http_status, serve_split

    refused(head, server_store, honest(head, seed=1), Code.SESSION_OWNER_MISMATCH, owner="mallory")
    for seed in range(2, ADMITTED + 1):
        serve_split(head, parse_split_request(json.dumps(honest(head, seed=seed))), server_store, owner="alice",
                    budget=BUDGET)
    refused(head, server_store, honest(head, seed=99), Code.SESSION_BUDGET_EXHAUSTED)
    assert http_status(InferenceError(Code.SESSION_BUDGET_EXHAUSTED, "")) == 429
    assert http_status(InferenceError(Code.SESSION_OWNER_MISMATCH, "")) == 403


def test_a_client_lying_about_sigma_is_refused_and_never_charged_what_it_declares(head, server_store):
    sigma = honest(head)["sigma"]
    for declared in (sigma * 10, sigma / 10, sigma - 2e-6, 0.0, -sigma, 1e300):
        refused(head, server_store, honest(head, sigma=declared), Code.SIGMA_MISMATCH)
    for declared in ("7.46", None, True):
        refused(head, server_store, honest(head, sigma=declared), Code.BAD_SPLIT_REQUEST)
    refused(head, server_store, b'{"sigma": NaN}', Code.BAD_SPLIT_REQUEST)  # missing fields


def test_a_client_lying_about_epsilon_is_caught_where_the_noise_tells(head, server_store):
    # It declares epsilon 0.1 (sigma 62) but sends the noise of epsilon 1 (sigma 7.5): too little noise to be that.
    vector = honest(head, at=1.0)["vector"]
    lie = honest(head, at=0.1, vector=vector)
    refused(head, server_store, lie, Code.NOISE_IMPLAUSIBLE)
    refused(head, server_store, honest(head, vector=clip(np.ones(head.dimension), 1.0).tolist()),  # no noise at all
            Code.NOISE_IMPLAUSIBLE)
    refused(head, server_store, honest(head, vector=[1e6] * head.dimension), Code.NOISE_IMPLAUSIBLE)  # unclipped


def test_vectors_that_are_not_finite_or_not_the_models_size_are_refused(head, server_store):
    good = honest(head)["vector"]
    for vector, code in [(good[:-1], Code.BAD_VECTOR), (good + [0.0], Code.BAD_VECTOR), ([], Code.BAD_VECTOR),
                         ([1e308] * head.dimension, Code.NOISE_IMPLAUSIBLE)]:  # finite, but its norm is not
        refused(head, server_store, honest(head, vector=vector), code)
    for bad in ("NaN", "Infinity", "-Infinity", "1e999"):
        body = json.dumps(honest(head)).replace(repr(good[3]), bad, 1).encode()
        assert bad.encode() in body
        refused(head, server_store, body, Code.BAD_VECTOR)
    refused(head, server_store, honest(head, vector=[0.0] * (MAX_DIMENSION + 1)), Code.BAD_SPLIT_REQUEST)
    refused(head, server_store, honest(head, vector=["1.0"] * head.dimension), Code.BAD_SPLIT_REQUEST)
    refused(head, server_store, honest(head, vector=[[0.0]] * head.dimension), Code.BAD_SPLIT_REQUEST)


@pytest.mark.parametrize("field, value", [
    ("epsilon", 0.0), ("epsilon", -1.0), ("epsilon", 1e-9), ("epsilon", 1e6), ("delta", 0.0), ("delta", 1.0),
    ("delta", -1e-6), ("delta", 1e-15), ("clip_norm", 0.0), ("clip_norm", -1.0),
])
def test_privacy_parameters_out_of_range_are_refused(head, server_store, field, value):
    refused(head, server_store, honest(head, **{field: value}), Code.BAD_PRIVACY_REQUEST)
    body = json.dumps(honest(head)).replace('"epsilon": 1.0', '"epsilon": NaN').encode()
    refused(head, server_store, body, Code.BAD_PRIVACY_REQUEST)
    assert not math.isnan(honest(head)["epsilon"])


def test_bodies_that_are_not_split_requests_are_refused(head, server_store):
    for body in (b"", b"not json", b"[]", b'"s1"', json.dumps({**honest(head), "extra": 1}).encode(),
                 json.dumps({k: v for k, v in honest(head).items() if k != "session_id"}).encode()):
        refused(head, server_store, body, Code.BAD_SPLIT_REQUEST)
    for session in ("", "../../etc", "x" * 129, "a b"):
        refused(head, server_store, honest(head, session_id=session), Code.BAD_SPLIT_REQUEST)
