"""The inference gate (`govtrain/serve/`, docs/serving.md) on a real uvicorn at 127.0.0.1, driven by httpx: what it
serves against the released model loaded directly, a refusal test for each way a request fails, session budgets that
survive a restart and hold under 100 concurrent requests, the split client end to end, a causal LM's generate route,
and the `govtrain serve` command in its own process."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import govtrain  # noqa: E402
from govtrain.release import dsse  # noqa: E402
from tests.conftest import REPO  # noqa: E402
from tests.release_setup import Released, trained_release  # noqa: E402
from tests.serve_setup import TEXTS, Deployment, deploy, split_body  # noqa: E402


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One deployment and server for the tests that only read or use sessions of their own."""
    deployment = deploy(trained_release(tmp_path_factory).copy(tmp_path_factory.mktemp("serve") / "copy"))
    with deployment.serving() as (client, gate):
        yield deployment, client, gate


@pytest.fixture
def deployment(tmp_path_factory, tmp_path: Path) -> Deployment:
    return deploy(trained_release(tmp_path_factory).copy(tmp_path / "copy"))


def _refusal(response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["ok"] is False and body["code"] == code and set(body) == {"ok", "code", "detail"}, body
    return body["detail"]


def _loaded(released: Released, active: list[str] | None = None):
    loaded = govtrain.load(released.adapter, base=released.base)
    if active is not None:
        loaded.model.base_model.set_adapter(active)
    return loaded


# -- what is served -----------------------------------------------------------------------------------------------


def test_info_states_the_release_its_classes_and_taint(shared):
    deployment, client, _ = shared
    info = client.get("/v1/info").json()
    payload = dsse.parse(deployment.envelope).payload
    assert info["release"] == hashlib.sha256(payload).hexdigest() and info["run_id"] == "release-run"
    assert info["task"] == "sequence-classification" and info["adapters"] == ["default", "restricted"]
    assert info["classes"]["restricted"]["adapter"] == "restricted" and info["classes"]["public"]["adapter"] is None
    assert info["taint"]["tainted"] is False and info["taint"]["withdrawn_since"] == []
    assert info["routes"] == ["/v1/info", "/v1/classify", "/v1/split"]


def test_classify_serves_the_released_models_logits_and_drops_an_excluded_own_adapter(shared):
    deployment, client, _ = shared
    full = client.post("/v1/classify", json={"texts": TEXTS}, headers=deployment.rights())
    assert full.status_code == 200, full.text
    body = full.json()
    expected = _loaded(deployment.released).logits(TEXTS)
    assert torch.allclose(torch.tensor([r["logits"] for r in body["results"]], dtype=torch.float64),
                          expected.double(), atol=1e-6)
    assert [r["label_id"] for r in body["results"]] == expected.argmax(-1).tolist()
    assert body["disabled_adapters"] == [] and body["subject"] == "alice"

    without = client.post("/v1/classify", json={"texts": TEXTS},
                          headers=deployment.rights(classes=["public", "sensitive"])).json()
    assert without["disabled_adapters"] == ["restricted"] and without["excluded_classes"] == ["restricted"]
    assert without["adapters"] == ["default"]
    oracle = _loaded(deployment.released, ["default"]).logits(TEXTS)  # peft with the class adapter inactive
    served = torch.tensor([r["logits"] for r in without["results"]], dtype=torch.float64)
    assert torch.allclose(served, oracle.double(), atol=1e-6) and not torch.allclose(served, expected.double())
    # and the next caller with every class gets the whole model again
    again = client.post("/v1/classify", json={"texts": TEXTS}, headers=deployment.rights()).json()
    assert [r["logits"] for r in again["results"]] == [r["logits"] for r in body["results"]]


# -- one refusal each ---------------------------------------------------------------------------------------------


def test_no_envelope_is_refused_401(shared):
    deployment, client, _ = shared
    assert "Govtrain-Rights" in _refusal(client.post("/v1/classify", json={"texts": TEXTS}), 401, "rights_missing")


def test_a_bad_signature_is_refused_401(shared):
    deployment, client, _ = shared
    header = deployment.rights()["Govtrain-Rights"]
    forged = header[:-3] + ("AAA" if header[-3:] != "AAA" else "BBB")
    _refusal(client.post("/v1/classify", json={"texts": TEXTS}, headers={"Govtrain-Rights": forged}), 401,
             "bad_signature")


def test_an_expired_envelope_is_refused_401(shared):
    deployment, client, _ = shared
    old = deployment.rights(valid_seconds=600, now=int(deployment.now()) - 3600)
    assert "expired" in _refusal(client.post("/v1/classify", json={"texts": TEXTS}, headers=old), 401, "expired")


def test_an_envelope_from_another_issuer_is_refused_401(shared, tmp_path: Path):
    from govtrain.attest.keys import generate_key_pair, load_private_key

    deployment, client, _ = shared
    generate_key_pair(tmp_path, "stranger")
    headers = deployment.rights(key=load_private_key(tmp_path / "stranger.key"))
    _refusal(client.post("/v1/classify", json={"texts": TEXTS}, headers=headers), 401, "unknown_key")


def test_a_class_not_permitted_in_shared_layers_is_refused_403_naming_layers_and_classes(shared):
    deployment, client, _ = shared
    detail = _refusal(client.post("/v1/classify", json={"texts": TEXTS},
                                  headers=deployment.rights(classes=["public", "restricted"])), 403,
                      "class_not_permitted")
    assert "sensitive" in detail and "layers 4-5 of adapter default" in detail
    detail = _refusal(client.post("/v1/classify", json={"texts": TEXTS}, headers=deployment.rights(classes=[])), 403,
                      "class_not_permitted")
    assert "public, sensitive" in detail and "classifier" in detail  # public reached the head


def test_a_tainted_release_is_refused_409_and_signing_it_again_does_not_clear_it(deployment: Deployment):
    deployment.policy_path.write_text(deployment.policy_path.read_text().replace(
        'ledger = "', 'taint_check_seconds = 0\nledger = "'))
    with deployment.serving() as (client, _):
        assert client.post("/v1/classify", json={"texts": TEXTS}, headers=deployment.rights()).status_code == 200
        with deployment.released.open() as ledger:
            ledger.withdraw("restr", "the contributor asked", now=ledger.store.head().time)
        detail = _refusal(client.post("/v1/classify", json={"texts": TEXTS}, headers=deployment.rights()), 409,
                          "release_tainted")
        assert "restr" in detail and "no grace period" in detail
        assert client.get("/v1/info").json()["taint"]["withdrawn_since"] == ["restr"]
    # the same adapter signed again, after it: a new signature is no retraining (seed 004; issue 34 item 5)
    (deployment.root / "release.dsse").write_bytes(deployment.released.build(confirm=True))
    with deployment.serving() as (client, _):
        detail = _refusal(client.post("/v1/classify", json={"texts": TEXTS}, headers=deployment.rights()), 409,
                          "release_tainted")
        assert "restr" in detail and "before it was signed" in detail
        assert client.get("/v1/info").json()["withdrawn_at_release"][0]["contribution_id"] == "restr"


def test_a_grace_period_serves_a_tainted_release_until_it_ends(deployment: Deployment):
    deployment.policy_path.write_text(deployment.policy_path.read_text().replace(
        'ledger = "', 'grace_period_seconds = 600\ntaint_check_seconds = 0\nledger = "'))
    with deployment.released.open() as ledger:
        # now, by the gate's clock: the session's release may be older than the grace period
        withdrawn_at = ledger.withdraw("pub", "the contributor asked",
                                       now=max(ledger.store.head().time, int(deployment.clock[0])))
        time_of = ledger.store.entry(withdrawn_at.seq).time
    with deployment.serving() as (client, _):
        served = client.post("/v1/classify", json={"texts": TEXTS}, headers=deployment.rights())
        assert served.status_code == 200 and served.json()["tainted"] is True
        assert served.json()["grace_until"] == time_of + 600
        deployment.clock[0] = time_of + 600  # the grace period is over
        _refusal(client.post("/v1/classify", json={"texts": TEXTS}, headers=deployment.rights(now=time_of + 599)),
                 409, "release_tainted")


def test_a_ledger_that_cannot_be_read_refuses_503_until_it_can(deployment: Deployment):
    deployment.policy_path.write_text(deployment.policy_path.read_text().replace(
        'ledger = "', 'taint_check_seconds = 0\nledger = "'))
    database = deployment.released.root / "ledger.db"
    with deployment.serving() as (client, _):
        database.rename(database.with_suffix(".moved"))
        detail = _refusal(client.post("/v1/classify", json={"texts": TEXTS}, headers=deployment.rights()), 503,
                          "taint_unknown")
        assert "ledger" in detail
        assert client.get("/v1/info").json()["taint"]["tainted"] is None
        database.with_suffix(".moved").rename(database)
        assert client.post("/v1/classify", json={"texts": TEXTS}, headers=deployment.rights()).status_code == 200


def test_a_session_past_its_budget_is_refused_429_and_charged_nothing(shared):
    deployment, client, gate = shared
    headers = deployment.rights(sessions=["budget"])
    answers = [client.post("/v1/split", content=split_body("budget", 16, epsilon=2.0, seed=i), headers=headers)
               for i in range(8)]
    statuses = [a.status_code for a in answers]
    admitted = statuses.index(429)
    assert admitted >= 1 and set(statuses[admitted:]) == {429}
    last = answers[admitted - 1].json()
    _refusal(answers[admitted], 429, "session_budget_exhausted")
    state = gate.store.session("budget", owner=deployment.owner())
    assert state.requests == admitted == last["requests"]
    assert state.spent_epsilon == last["epsilon_spent"] <= 4.0


# -- sessions: restarts and concurrency ---------------------------------------------------------------------------


def test_a_restart_keeps_session_budgets(deployment: Deployment):
    headers = deployment.rights(sessions=["kept", "fresh"])

    def until_refused(client, session: str) -> int:
        count = 0
        while client.post("/v1/split", content=split_body(session, 16, epsilon=2.0, seed=count),
                          headers=headers).status_code == 200:
            count += 1
        return count

    with deployment.serving() as (client, gate):
        first = client.post("/v1/split", content=split_body("kept", 16, epsilon=2.0), headers=headers).json()
        before = gate.store.session("kept", owner=deployment.owner())
        whole = until_refused(client, "fresh")  # what one session admits in one life of the server
    assert first["requests"] == 1 and whole >= 2
    with deployment.serving() as (client, gate):  # a new gate on the same SQLite file: a restart
        assert gate.store.session("kept", owner=deployment.owner()) == before
        assert 1 + until_refused(client, "kept") == whole
        assert gate.store.session("kept", owner=deployment.owner()).spent_epsilon_u == \
            gate.store.session("fresh", owner=deployment.owner()).spent_epsilon_u


def test_100_concurrent_requests_on_one_session_never_overspend(shared):
    deployment, client, gate = shared
    headers = deployment.rights(sessions=["sequential", "concurrent"])
    sequential = 0
    while client.post("/v1/split", content=split_body("sequential", 16, seed=sequential),
                      headers=headers).status_code == 200:
        sequential += 1
    assert 3 <= sequential < 100  # the budget admits some, not all, of what follows

    bodies = [split_body("concurrent", 16, seed=i) for i in range(100)]
    with ThreadPoolExecutor(max_workers=100) as pool:
        statuses = list(pool.map(lambda body: client.post("/v1/split", content=body, headers=headers).status_code,
                                 bodies))
    assert statuses.count(200) == sequential and statuses.count(429) == 100 - sequential
    one_at_a_time = gate.store.session("sequential", owner=deployment.owner())
    together = gate.store.session("concurrent", owner=deployment.owner())
    assert (together.requests, together.spent_epsilon_u, together.mu_sq) == (
        one_at_a_time.requests, one_at_a_time.spent_epsilon_u, one_at_a_time.mu_sq)
    assert together.spent_epsilon_u <= together.budget.epsilon_u
    assert [d.seq for d in gate.store.debits("concurrent", owner=deployment.owner())] == list(range(1, sequential + 1))


def test_the_split_client_is_served_through_the_gate(shared, tmp_path: Path):
    import httpx

    from govtrain.inference import PooledEncoder, SessionStore, SplitClient, session_budget

    deployment, client, gate = shared
    encoder = PooledEncoder.from_release(deployment.released.adapter, base=deployment.released.base)
    with SessionStore(tmp_path / "client.db") as store, httpx.Client(
            base_url=str(client.base_url), headers=deployment.rights(sessions=["client"])) as http:
        split = SplitClient(encoder, http, store, session_id="client", owner="alice",
                            budget=session_budget(4.0, 1e-6))
        answers = split.classify_many(TEXTS[:2], epsilon=1.0, delta=1e-8, clip_norm=1.0)
        assert [a.requests for a in answers] == [1, 2]
        mine, theirs = store.session("client", owner="alice"), gate.store.session("client", owner=deployment.owner())
        assert mine.spent_epsilon_u == theirs.spent_epsilon_u == round(answers[1].epsilon_spent * 1e6)


# -- a causal LM --------------------------------------------------------------------------------------------------


def test_a_causal_lm_release_is_served_by_generate(tmp_path: Path):
    from tests import causal_models
    from tests.conftest import make_corpus
    from tests.release_setup import release_policy
    from tests.test_api import BATCH_POLICY
    from tests.test_causal_lm import _contribution, _rows
    from tests.test_release import _run_toml, _train
    from govtrain.attest.keys import generate_key_pair

    model = causal_models.save(tmp_path / "tiny-llama", "llama", layers=6)
    root = tmp_path / "lm"
    (root / "keys").mkdir(parents=True)
    generate_key_pair(root / "keys", "release")
    corpus = make_corpus(root, f"sqlite:///{root / 'ledger.db'}", release_policy(BATCH_POLICY))
    _contribution(corpus, "text", _rows("text", 20))
    _contribution(corpus, "chats", _rows("chat", 20), data_class="restricted", clip_norm_u=500_000,
                  noise_multiplier_u=1_500_000, eps_budget_u=1_000_000)
    _train(_run_toml(corpus, str(model), task="causal-lm", targets='["q_proj", "v_proj"]', steps=2), corpus)
    deployment = deploy(Released(root, model))
    with deployment.serving() as (client, gate):
        assert gate.head is None and client.get("/v1/info").json()["routes"] == ["/v1/info", "/v1/generate"]
        answer = client.post("/v1/generate", json={"prompt": "the cat sat", "max_new_tokens": 5},
                             headers=deployment.rights(classes=["public"]))
        assert answer.status_code == 200, answer.text
        assert answer.json()["disabled_adapters"] == ["restricted"]
        loaded = _loaded(deployment.released, ["default"])
        inputs = loaded.tokenizer("the cat sat", return_tensors="pt")
        out = loaded.model.generate(**inputs, max_new_tokens=5, do_sample=False,
                                    pad_token_id=loaded.tokenizer.pad_token_id)
        assert answer.json()["text"] == loaded.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:],
                                                                skip_special_tokens=True)
        _refusal(client.post("/v1/classify", json={"texts": ["a"]}, headers=deployment.rights()), 404, "not_served")
        _refusal(client.post("/v1/split", content=split_body("s-1", 16), headers=deployment.rights()), 404,
                 "not_served")
        _refusal(client.post("/v1/generate", json={"prompt": "a", "max_new_tokens": 10_000},
                             headers=deployment.rights()), 400, "bad_request")


# -- the command ---------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow  # a process of its own: torch and transformers imported again (~15 s)
def test_govtrain_serve_runs_uvicorn_and_stops_cleanly_on_interrupt(deployment: Deployment):
    import httpx

    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "govtrain.cli.main", "serve", "--release", str(deployment.root / "release.dsse"),
         "--adapter", str(deployment.released.adapter), "--policy", str(deployment.policy_path), "--base",
         str(deployment.released.base), "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.communicate()
            try:
                info = httpx.get(f"http://127.0.0.1:{port}/v1/info", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert info.json()["run_id"] == "release-run"
        deployment.clock[0] = time.time()
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/classify", json={"texts": TEXTS}, headers=deployment.rights())
        assert answer.status_code == 200 and len(answer.json()["results"]) == len(TEXTS)
    finally:
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    assert out.startswith("serving release ") and "restricted (own adapter)" in out and out.endswith("stopped\n")


def test_govtrain_serve_refuses_a_bad_policy_with_one_line_and_exit_2(deployment: Deployment):
    from click.testing import CliRunner

    from govtrain.cli.main import cli

    deployment.policy_path.write_text(deployment.policy_path.read_text().replace("[split]", "[split]\nbogus = 1"))
    result = CliRunner().invoke(cli, ["serve", "--release", str(deployment.root / "release.dsse"), "--adapter",
                                      str(deployment.released.adapter), "--policy", str(deployment.policy_path)])
    assert result.exit_code == 2 and result.stderr.startswith("error[inference_policy_invalid]") and \
        "split.bogus" in result.stderr and result.stderr.count("\n") == 1
    assert json.loads((REPO / "schemas" / "inference.schema.json").read_text()) == \
        __import__("govtrain.serve.policy", fromlist=["json_schema"]).json_schema()


def test_the_refusal_table_of_docs_serving_is_the_gates():
    import re

    from govtrain.serve.app import STATUS

    section = (REPO / "docs" / "serving.md").read_text().split("## Refusals")[1].split("\n## ")[0]
    documented: dict[str, int] = {}
    for status, codes in re.findall(r"^\| (\d{3}) \| ([^|]+) \|", section, re.M):
        for code in re.findall(r"`([a-z_]+)`", codes):
            documented[code] = int(status)
    mapped = {code.value: status for code, status in STATUS.items()}
    assert {code: documented[code] for code in mapped if code in documented} == \
        {code: status for code, status in mapped.items() if code in documented}
    # what the table leaves to "the encoding and COSE codes" row is exactly the envelope's 401s
    assert {code for code, status in mapped.items() if code not in documented} <= \
        {code for code, status in mapped.items() if status == 401}
    assert set(documented) - set(mapped) == {"internal"}
