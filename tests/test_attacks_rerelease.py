"""Signing the same adapter again after a withdrawal (issue 34 item 5). Adversary: the release key's holder (or an
operator who asks them), after contribution `pub` is withdrawn and the gate answers 409. Attack: sign the same
run's adapter again, byte for byte; the new manifest verifies (it states `pub` as withdrawn at release) and, before
the fix, the gate served it with `"tainted": false` and `/v1/info` showed nothing of the withdrawal. Seed 004 makes
withdrawals authoritative for gates, and a re-signature is no retraining: now the gate taints such a release
exactly as if the withdrawal came after it (the same grace period), shows `withdrawn_at_release` in `/v1/info` and
in every response, and `govtrain release` refuses to sign such a run without `--yes` (`withdrawn_at_release`,
exit 2, nothing written) and warns with it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from click.testing import CliRunner  # noqa: E402

from govtrain.cli.main import cli  # noqa: E402
from govtrain.errors import Code, ConfigError  # noqa: E402
from tests.release_setup import RUN_ID, Released, trained_release  # noqa: E402
from tests.serve_setup import TEXTS, Deployment, deploy, split_body  # noqa: E402


@pytest.fixture
def deployment(tmp_path_factory, tmp_path: Path) -> Deployment:
    """A deployment with a grace period of 600 s, whose release was signed before `pub` is withdrawn."""
    deployment = deploy(trained_release(tmp_path_factory).copy(tmp_path / "copy"),
                        release_extra="grace_period_seconds = 600\ntaint_check_seconds = 0")
    with deployment.released.open() as ledger:
        deployment.clock[0] = max(ledger.store.head().time, int(time.time()))
    return deployment


def _withdraw_pub(deployment: Deployment) -> int:
    with deployment.released.open() as ledger:
        return ledger.withdraw("pub", "the contributor asked", now=int(deployment.clock[0])).time


def test_the_same_adapter_signed_again_after_a_withdrawal_is_served_as_tainted(deployment: Deployment):
    withdrawn_at = _withdraw_pub(deployment)
    resigned = deployment.released.build(confirm=True)  # the same run's adapter, byte for byte, signed again
    report = deployment.released.verify(resigned, adapter=deployment.released.adapter, ledger=deployment.released.url)
    assert [w.contribution_id for w in report.withdrawn_at_release] == ["pub"] and not report.withdrawn_since
    (deployment.root / "release.dsse").write_bytes(resigned)
    deployment.clock[0] = withdrawn_at + 10
    with deployment.serving() as (client, _):
        info = client.get("/v1/info").json()
        assert [w["contribution_id"] for w in info["withdrawn_at_release"]] == ["pub"]
        assert info["taint"]["tainted"] is True and info["taint"]["withdrawn_at_release"] == ["pub"]
        assert info["taint"]["grace_until"] == withdrawn_at + 600  # as if the withdrawal came after the release
        served = client.post("/v1/classify", json={"texts": TEXTS}, headers=deployment.rights())
        assert served.status_code == 200, served.text
        assert served.json()["tainted"] is True and served.json()["withdrawn_at_release"] == ["pub"]
        assert served.json()["grace_until"] == withdrawn_at + 600
        split = client.post("/v1/split", content=split_body("s-1", 16), headers=deployment.rights())
        assert split.status_code == 200 and split.headers["Govtrain-Withdrawn-At-Release"] == "pub", split.text
        deployment.clock[0] = withdrawn_at + 600  # the grace period is over
        refused = client.post("/v1/classify", json={"texts": TEXTS}, headers=deployment.rights())
        assert refused.status_code == 409 and refused.json()["code"] == "release_tainted", refused.text
        assert "pub" in refused.json()["detail"] and "before it was signed" in refused.json()["detail"]


def test_a_release_of_a_run_with_nothing_withdrawn_shows_an_empty_list(deployment: Deployment):
    with deployment.serving() as (client, _):
        assert client.get("/v1/info").json()["withdrawn_at_release"] == []
        served = client.post("/v1/classify", json={"texts": TEXTS}, headers=deployment.rights())
        assert served.status_code == 200 and served.json()["withdrawn_at_release"] == []
        assert served.json()["tainted"] is False


def _release(released: Released, out: Path, *extra: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(cli, ["release", "--run", RUN_ID, "--adapter", str(released.adapter), "--out",
                                    str(out), "--ledger", released.url, "--key", str(released.release_key_path),
                                    "--base", str(released.base), *extra])


def test_govtrain_release_refuses_a_run_trained_on_a_withdrawn_contribution_without_yes(deployment: Deployment,
                                                                                       tmp_path: Path):
    released = deployment.released
    _withdraw_pub(deployment)
    with released.open() as ledger:
        size = ledger.size()
    out = tmp_path / "again.dsse"
    refused = _release(released, out)
    assert refused.exit_code == 2 and refused.stderr.count("\n") == 1, refused.output
    assert refused.stderr.startswith("error[withdrawn_at_release]: ") and "pub (entry" in refused.stderr
    assert "--yes" in refused.stderr and not out.exists()
    with released.open() as ledger:
        assert ledger.size() == size
    with pytest.raises(ConfigError) as caught:  # the library refuses too
        released.build()
    assert caught.value.code is Code.WITHDRAWN_AT_RELEASE
    confirmed = _release(released, out, "--yes")
    assert confirmed.exit_code == 0 and out.exists(), confirmed.output
    assert confirmed.stderr.startswith("warning: ") and "pub" in confirmed.stderr and "tainted" in confirmed.stderr
    assert "1 withdrawn at release" in confirmed.stdout


def test_release_verify_reads_a_release_stating_withdrawals_at_release_as_tainted(deployment: Deployment,
                                                                                 tmp_path: Path):
    """An auditor's `release verify` and the gate agree (the review's limits): a release that states a withdrawal
    at release is refused as tainted by every gate, so verify exits 6 (`tainted`), offline and against the
    ledger, where it exited 0 with a WARNING line."""
    import json

    released = deployment.released
    _withdraw_pub(deployment)
    out = tmp_path / "again.dsse"
    assert _release(released, out, "--yes").exit_code == 0
    for extra in ([], ["--ledger", released.url]):
        result = CliRunner().invoke(cli, ["release", "verify", str(out), "--key", str(released.keys / "release.pub"),
                                          "--ledger-key", str(released.keys / "ledger.pub"), *extra, "--json"])
        assert result.exit_code == 6, result.output
        report = json.loads(result.stdout)
        assert report["status"] == "tainted" and [w["contribution_id"] for w in report["withdrawn_at_release"]] == \
            ["pub"] and not report["withdrawn_since"]
        text = CliRunner().invoke(cli, ["release", "verify", str(out), "--key", str(released.keys / "release.pub"),
                                        "--ledger-key", str(released.keys / "ledger.pub"), *extra])
        assert text.exit_code == 6 and text.output.startswith("tainted: ") and "TAINTED: its run trained" in \
            text.output, text.output


def test_govtrain_release_refuses_a_ledger_with_an_unsigned_tail_even_confirmed(deployment: Deployment,
                                                                               tmp_path: Path):
    """The gate review's proof 5, with its code: `pub`'s withdrawal left unsigned (its checkpoint rows deleted) is
    neither trusted nor left out of the `withdrawn_at_release` check: `govtrain release` refuses the unsigned tail
    (`unsigned_tail`, exit 4, one line), with `--yes` too, and writes nothing."""
    import sqlite3

    released = deployment.released
    _withdraw_pub(deployment)
    with sqlite3.connect(released.root / "ledger.db") as db:
        db.execute("DROP TRIGGER checkpoints_no_delete")
        db.execute("DELETE FROM checkpoints WHERE size = (SELECT max(size) FROM checkpoints)")
    before = (released.root / "ledger.db").read_bytes()
    out = tmp_path / "again.dsse"
    for extra in ((), ("--yes",)):
        refused = _release(released, out, *extra)
        assert refused.exit_code == 4 and refused.stderr.count("\n") == 1, refused.output
        assert refused.stderr.startswith("error[unsigned_tail]: ") and "govtrain-verify" in refused.stderr
        assert not out.exists() and (released.root / "ledger.db").read_bytes() == before
