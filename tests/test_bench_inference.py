"""bench/inference.py end to end on the tiny release tests/serve_setup.py deploys (kept from rotting; its figures are
the bench's own, on the demo, and nothing here times anything), and the demo's inference policy against the demo's
keys."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import sqlite3
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from govtrain.attest.keys import load_private_key, load_public_key, public_key_pem  # noqa: E402
from govtrain.inference import SessionStore  # noqa: E402
from govtrain.inference.mechanism import SessionBudget, release_for  # noqa: E402
from govtrain.policy.config import load_policy  # noqa: E402
from govtrain.serve.policy import load_inference_policy  # noqa: E402
from tests.conftest import KEYS_EXAMPLE, REPO  # noqa: E402
from tests.release_setup import trained_release  # noqa: E402
from tests.serve_setup import TEXTS, deploy  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_inference", REPO / "bench" / "inference.py")
bench = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules["bench_inference"] = bench  # dataclasses look their module up
_spec.loader.exec_module(bench)  # type: ignore[union-attr]

LABELS = [1, 0, 1, 0]


@pytest.fixture
def target(tmp_path_factory, tmp_path: Path):
    deployment = deploy(trained_release(tmp_path_factory).copy(tmp_path / "copy"))
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in zip(TEXTS, LABELS)))
    return deployment, heldout, bench.Deployment(
        release=deployment.root / "release.dsse", adapter=deployment.released.adapter, policy=deployment.policy_path,
        issuer_key=deployment.root / "issuer.key", base=str(deployment.released.base))


@pytest.mark.slow  # two server processes, each importing torch and loading the model (~10-20 s on 2 cores)
def test_the_bench_runs_end_to_end_through_both_server_processes(target, capsys):
    _, heldout, deployment = target
    import govtrain

    measured, runs, admit = bench.run(deployment, heldout, rows=0, epsilons=(0.5, 2.0, math.inf), draws=2,
                                      requests=6, concurrency=2, reps=2, threads=1)
    accuracy = measured.rows
    assert [r.n for r in accuracy] == [4] * 8 and all(0 <= r.accuracy <= 1 for r in accuracy)
    assert accuracy[0].setting == "always the majority label" and accuracy[0].accuracy == 0.5
    predicted = govtrain.load(deployment.adapter, base=deployment.base).predict(TEXTS)
    assert accuracy[1].accuracy == sum(p == y for p, y in zip(predicted, LABELS)) / 4  # the full model's row
    split = [r for r in accuracy if math.isfinite(r.epsilon)]
    assert [(r.epsilon, r.spread is None) for r in split] == [(0.5, True), (0.5, False), (2.0, True), (2.0, False)]
    assert all(r.accuracy * 4 == round(r.accuracy * 4) for r in split if r.spread is None)  # one pass of 4 requests
    assert all(r.sigma == release_for(r.epsilon, 1e-7, 1.0).sigma for r in split) and measured.margin > 0
    assert set(runs) == {"gate", "bare"}
    assert all(len(loads) == 2 and all(load.requests_per_s > 0 and 0 < load.p50_ms <= load.p99_ms for load in loads)
               for loads in runs.values())
    assert 0 < admit < 1
    out = capsys.readouterr().out
    assert "seed 002 at ε 1, δ 1e-05, C 1, d = 16" in out and "gate / bare: throughput" in out
    assert "per request δ 1e-07, C 1 (sensitivity 2C)" in out


def test_each_split_request_goes_through_the_gate_in_a_session_of_its_own(target, tmp_path: Path):
    served, _, deployment = target
    from govtrain.inference import PooledEncoder

    policy = deployment.inference_policy()
    classes = bench.released_classes(deployment, policy)
    assert classes == ["public", "restricted", "sensitive"]
    encoder = PooledEncoder.from_release(deployment.adapter, base=deployment.base)
    pooled = encoder.pooled(TEXTS * 17)  # 68 requests: two envelopes of at most 64 sessions
    budget = SessionBudget(epsilon_u=policy.session_epsilon_u, delta_p=policy.session_delta_p)
    with served.serving() as (client, gate), SessionStore(tmp_path / "client.db") as store:
        labels = bench.through_gate(str(client.base_url), lambda s: bench.rights(deployment, policy, classes, s),
                                    encoder, store, budget, pooled, epsilon=0.5, delta=1e-7, clip_norm=1.0)
        assert len(labels) == 68 and set(labels) <= {0, 1}
    with sqlite3.connect(policy.session_store) as db:
        rows = db.execute("SELECT owner, requests, spent_epsilon_u FROM sessions").fetchall()
    from govtrain.attest.keys import key_id
    from govtrain.serve.rights import session_owner

    bench_owner = session_owner(key_id(load_private_key(deployment.issuer_key).public_key().public_bytes_raw()), "bench")
    assert len(rows) == 68 and {(owner, requests) for owner, requests, _ in rows} == {(bench_owner, 1)}
    assert all(0 < spent <= 500_000 for _, _, spent in rows)  # ε 0.5 at δ 1e-7, counted at the session's δ 1e-6


def test_the_boundary_margin_is_the_distance_to_the_heads_decision_boundary(tmp_path_factory):
    import numpy as np

    import govtrain
    from govtrain.inference import SplitHead

    released = trained_release(tmp_path_factory)
    loaded = govtrain.load(released.adapter, base=released.base)
    head = SplitHead(loaded)
    classifier = loaded.model.get_base_model().classifier  # the oracle: the head's own parameters
    weight, bias = (p.detach().double().numpy() for p in (classifier.weight, classifier.bias))
    vectors = np.random.default_rng(5).normal(size=(9, head.dimension))
    normal = weight[1] - weight[0]
    expected = np.median(np.abs(vectors @ normal + bias[1] - bias[0]) / np.linalg.norm(normal))
    assert bench.boundary_margin(head, vectors) == pytest.approx(expected, rel=1e-5)


def test_the_demos_inference_policy_pins_the_demos_keys(tmp_path: Path):
    keys = tmp_path / "keys"
    shutil.copytree(KEYS_EXAMPLE, keys)
    for name in ("attester.key", "ledger.key", "release.key", "issuer.key"):
        (keys / name).chmod(0o600)  # git keeps no modes
    policy = load_inference_policy(REPO / "examples" / "inference.toml")
    pem = public_key_pem

    def raw(name: str) -> bytes:
        return load_public_key(keys / f"{name}.pub")

    for name in ("release", "issuer", "ledger"):  # each published pair is a pair
        assert pem(load_private_key(keys / f"{name}.key").public_key()) == (keys / f"{name}.pub").read_bytes()
    assert policy.release_key == raw("release") and policy.ledger_keys == (raw("ledger"),)
    assert [i.public_key for i in policy.issuers] == [raw("issuer")]
    corpus, _ = load_policy(keys / "policy.toml")
    assert [k.public_key for k in corpus.release_keys] == [raw("release")]
    assert policy.ledger_url == "sqlite:///./demo-out/ledger.db" and policy.audience.startswith(corpus.origin)
    assert 500_000 >= policy.min_epsilon_u and policy.max_epsilon_u >= 8_000_000  # the bench's ε 0.5 to 8
