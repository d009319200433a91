"""Adversarial review of the inference gate and split inference (issue 22 items 2 and 3). Each test is an attack
that succeeds today: it asserts the secure behaviour, so it fails until the defect is fixed. The docstring names
the adversary, the attack and its impact. Real uvicorn on 127.0.0.1 where the route matters (tests/serve_setup.py)."""

from __future__ import annotations

import dataclasses
import shutil
import sqlite3
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from govtrain.attest.keys import generate_key_pair, load_private_key, public_key_pem  # noqa: E402
from govtrain.errors import Code, InferenceError  # noqa: E402
from tests.release_setup import Released, negate_tensor, trained_release  # noqa: E402
from tests.serve_setup import TEXTS, Deployment, deploy, split_body  # noqa: E402


@pytest.fixture
def deployment(tmp_path_factory, tmp_path: Path) -> Deployment:
    return deploy(trained_release(tmp_path_factory).copy(tmp_path / "copy"))


def _logits(answer) -> list[list[float]]:  # type: ignore[no-untyped-def]
    assert answer.status_code == 200, answer.text
    return [row["logits"] for row in answer.json()["results"]]


def _no_taint_cache(deployment: Deployment) -> None:
    deployment.policy_path.write_text(deployment.policy_path.read_text().replace(
        'ledger = "', 'taint_check_seconds = 0\nledger = "'))


# -- 2. the operator: the base model is read in place (mmap) after the start-up hash -----------------------------


def test_a_base_model_changed_on_disk_after_start_is_not_what_the_gate_serves(tmp_path_factory, tmp_path: Path):
    """Adversary: the operator (or anyone who can write the base model's folder, e.g. a shared Hugging Face cache).
    Attack: start `govtrain serve` on the released adapter and the base the release binds by tree hash (both
    checks pass), then rewrite bytes of the base's model.safetensors in place. The base's tensors are memory-mapped
    from that file, not copied (unlike the adapter, which is snapshotted into a private folder), so the running gate
    serves the edited weights at once: no restart, no check, `release` in every response unchanged.
    Impact: the operator serves a model other than the released one (here the word embeddings negated; any weight
    can be set). Fix: load the base from bytes read once and
    hashed (or copy every tensor out of the mapping and hash what was read), as the adapter is."""
    released = trained_release(tmp_path_factory).copy(tmp_path / "copy")
    base = tmp_path / "base"
    shutil.copytree(released.base, base)
    deployment = deploy(Released(released.root, base))
    with deployment.serving() as (client, _):
        headers = deployment.rights()
        before = _logits(client.post("/v1/classify", json={"texts": TEXTS}, headers=headers))
        negate_tensor(base / "model.safetensors", "bert.embeddings.word_embeddings.weight")
        after = client.post("/v1/classify", json={"texts": TEXTS}, headers=headers)
        assert after.status_code == 200, after.text
        assert _logits(after) == before


# -- 3. sessions: owners are subjects, whoever issued them ------------------------------------------------------


def test_a_second_issuer_cannot_spend_or_read_a_session_of_another_issuers_subject(deployment: Deployment):
    """Adversary: a second issuer the policy trusts only partly (`classes = ["public", "sensitive"]`: a partner
    office), or whoever holds its key. Attack: issue an envelope for subject "alice" (a name the first issuer gave
    someone else) naming alice's session id, and spend it. Sessions are bound to `rights.subject` alone
    (`Gate.split`: `owner=admission.rights.subject`), not to (issuer, subject), so the partner's "alice" is the
    same owner: the debit succeeds, and the 200 answer states alice's spend and budget.
    Impact: `session_owner_mismatch` and the claim "nobody but its owner can spend or read it" hold only if every
    issuer of the policy shares one subject namespace; a class-limited issuer can exhaust (deny) and read any other
    issuer's subjects' sessions. Fix: bind a session to the issuer's kid (or name) and the subject."""
    generate_key_pair(deployment.root, "partner")
    partner = load_private_key(deployment.root / "partner.key")
    (deployment.root / "partner.pub").write_bytes(public_key_pem(partner.public_key()))
    deployment.policy_path.write_text(deployment.policy_path.read_text().replace("[release]\n", (
        '[[issuers]]\nname = "partner"\npublic_key_file = "partner.pub"\nclasses = ["public", "sensitive"]\n\n'
        "[release]\n"), 1))
    with deployment.serving() as (client, gate):
        mine = deployment.rights("alice", sessions=["alice-1"])
        assert client.post("/v1/split", content=split_body("alice-1", 16), headers=mine).status_code == 200
        alice = deployment.owner("alice")  # (the issuer's kid, "alice"): the session's owner as the gate binds it
        before = gate.store.session("alice-1", owner=alice)
        theirs = deployment.rights("alice", classes=["public", "sensitive"], sessions=["alice-1"], key=partner)
        answer = client.post("/v1/split", content=split_body("alice-1", 16, seed=1), headers=theirs)
        assert answer.status_code == 403 and answer.json()["code"] == "session_owner_mismatch", answer.text
        assert gate.store.session("alice-1", owner=alice) == before


# -- 4. taint: a reading the gate has seen can be unseen ----------------------------------------------------------


def _copy_database(source: Path, target: Path) -> None:
    with sqlite3.connect(source) as a, sqlite3.connect(target) as b:
        a.backup(b)


def test_a_ledger_rolled_back_behind_a_withdrawal_the_gate_saw_does_not_untaint_the_release(deployment: Deployment,
                                                                                            tmp_path: Path):
    """Adversary: the operator, or whoever can write the ledger database the policy names. Attack: keep a copy of
    the ledger from before a withdrawal; once the withdrawal taints the release (409 `release_tainted`), put the
    copy back. The gate re-reads the ledger, finds the release's checkpoint still extended and no withdrawal since,
    and serves it again as untainted (`"tainted": false`): it keeps no memory of the tree size or the withdrawals it
    has already seen. (The same stale copy, named by the policy from the start, is never noticed either.)
    Impact: withdrawals are not authoritative for the gate (seed 004): a withdrawn contributor's data is served
    again, with responses that say the release is clean. Fix: remember the largest tree (size, root) and the
    withdrawals read; refuse (`taint_unknown`) a ledger whose tree is smaller or not consistent with it, and never
    drop a withdrawal once seen."""
    _no_taint_cache(deployment)
    database = deployment.released.root / "ledger.db"
    with deployment.serving() as (client, _):
        headers = deployment.rights()
        assert client.post("/v1/classify", json={"texts": TEXTS}, headers=headers).status_code == 200
        _copy_database(database, tmp_path / "before-withdrawal.db")
        with deployment.released.open() as ledger:
            ledger.withdraw("restr", "the contributor asked", now=ledger.store.head().time)
        refused = client.post("/v1/classify", json={"texts": TEXTS}, headers=headers)
        assert refused.status_code == 409 and refused.json()["code"] == "release_tainted"
        _copy_database(tmp_path / "before-withdrawal.db", database)  # the ledger, rolled back
        again = client.post("/v1/classify", json={"texts": TEXTS}, headers=headers)
        assert again.status_code in (409, 503), again.text
        assert again.json()["code"] in ("release_tainted", "taint_unknown")


# -- 5. information leaks: the ledger's URL, password included, to callers without an envelope -------------------


def test_the_ledger_url_and_its_password_never_reach_a_caller(deployment: Deployment, pg_url: str):
    """Adversary: any network caller, without an envelope. Attack: GET /v1/info (or any POST: the 503 detail) while
    the PostgreSQL database the policy names holds no ledger (dropped, restored empty, re-created: reachable, but
    without its tables). `ledger_store.LedgerStore.open` words that error with the URL as given, password
    included ("postgresql+psycopg://user:PASSWORD@host/db is not a govtrain ledger"), and `Gate.info` returns the
    taint error's detail verbatim to everyone. (With SQLite, the same path shows the ledger file's location.)
    Impact: the ledger database's credentials, which can append to and rewrite the ledger, disclosed to
    unauthenticated callers. Fix: redact the URL (`render_as_string(hide_password=True)`) everywhere, and answer
    callers with the code and a fixed detail, keeping the cause for the server's log."""
    from sqlalchemy.engine import make_url

    from govtrain.serve.gate import TaintWatch
    from govtrain.serve.service import _taint_reader

    password = make_url(pg_url).password
    assert password, "the test needs a PostgreSQL URL with a password (GOVTRAIN_TEST_PG_URL)"
    with deployment.serving() as (client, gate):
        # the policy's ledger, as it becomes after the start: a reachable PostgreSQL database holding no ledger
        policy = dataclasses.replace(gate.policy, ledger_url=pg_url)
        gate.taint = TaintWatch(_taint_reader(gate.envelope, policy), ttl_s=0, grace_s=0, clock=deployment.now)
        info = client.get("/v1/info")
        refused = client.post("/v1/classify", json={"texts": TEXTS}, headers=deployment.rights())
    assert info.json()["taint"]["tainted"] is None and refused.status_code == 503
    assert password not in info.text and password not in refused.text


# -- 6. stable codes ------------------------------------------------------------------------------------------------


def test_a_wrong_method_is_refused_with_the_status_its_code_is_documented_with(deployment: Deployment):
    """Adversary: a hostile or sloppy client. Attack: GET /v1/classify, POST /v1/info. The gate answers 405 with
    code `bad_request`, which docs/serving.md's table (and `app.STATUS`) give as 400: one code, two statuses.
    Impact: a client that maps codes to statuses (or the reverse) misreads the refusal. Fix: a code of its own for
    405, in the refusal table, or answer 400."""
    from govtrain.serve.app import STATUS

    with deployment.serving() as (client, _):
        for answer in (client.get("/v1/classify"), client.post("/v1/info")):
            code = Code(answer.json()["code"])
            assert answer.status_code == STATUS[code], (answer.status_code, answer.text)


# -- 7. calibration at small epsilon ----------------------------------------------------------------------------------


@pytest.mark.parametrize("epsilon, delta", [(1e-5, 1e-12), (1e-6, 1e-6), (1e-6, 1e-12)])
def test_a_request_either_gets_a_sigma_that_meets_its_delta_or_a_stable_refusal(epsilon, delta):
    """Adversary: a client (or a policy whose `split.min_epsilon` is small). Attack: ask for epsilon of 1e-5 or 1e-6
    at C = 1. `analytic_sigma` evaluates delta(eps) as A(1 - e^(log B - log A)), which cancels catastrophically at
    tiny epsilon, so the bisection settles on a sigma whose true delta (50-digit arithmetic) exceeds the target
    (1e-6: by 1.4e-11 relative), or `calibrate_sigma_u`'s own check fails and `release_for` raises RuntimeError:
    a 500 `internal` from /v1/split, a traceback from the client, not `bad_privacy_request`.
    Impact: low (tiny epsilon only): a refusal without a stable code, and sigma rounded against privacy where the
    docs promise "sigma meets delta" checked in 50 digits. Fix: evaluate delta(eps) without the cancellation
    (e.g. expm1-based or mpmath near eps -> 0), or refuse epsilon below a floor with `bad_privacy_request`."""
    mpmath = pytest.importorskip("mpmath")
    from govtrain.inference.mechanism import release_for

    try:
        release = release_for(epsilon, delta, 1.0)
    except InferenceError as refused:
        assert refused.code is Code.BAD_PRIVACY_REQUEST
        return
    with mpmath.workdps(60):
        eps, mu = mpmath.mpf(release.epsilon_u) / 10**6, mpmath.mpf(release.sensitivity_u) / release.sigma_u
        exact = mpmath.ncdf(mu / 2 - eps / mu) - mpmath.exp(eps) * mpmath.ncdf(-mu / 2 - eps / mu)
        assert exact <= mpmath.mpf(release.delta_p) / 10**12, (release, float(exact))
