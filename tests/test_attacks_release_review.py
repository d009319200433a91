"""Adversarial review of release manifests (issue 22 item 1, docs/release-manifest.md): attacks that succeed today.

Each test states the attack, the adversary and the impact, and asserts the secure behaviour; each failed on the
branch under review and passes since its fix (section 6 adds the same root cause's other readers: the policy
chain, and `govtrain-verify`, which never shared it and is kept so). The claim under attack: an auditor pinning the
release key and the ledger keys is never told "ok" about a release whose files or privacy claims differ from the
truth, and a tainted release is reported tainted. Attacks already covered by tests/test_attacks_release.py are not
repeated here.
"""

from __future__ import annotations

import base64
import hashlib
import json
import sqlite3
import unicodedata
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from click.testing import CliRunner  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402

from govtrain.cli.main import cli  # noqa: E402
from govtrain.errors import Code, GovtrainError, IntegrityError  # noqa: E402
from govtrain.release import dsse  # noqa: E402
from tests.release_setup import Released, trained_release  # noqa: E402

# What a verifier may say when the database contradicts the signed tree: the ledger was edited, not the release.
LEDGER_DAMAGED = {Code.LEAF_HASH_MISMATCH, Code.BAD_ENTRY, Code.BAD_SUMMARY, Code.FORK, Code.ROLLBACK,
                  Code.BAD_CHECKPOINT}


@pytest.fixture
def released(tmp_path_factory, tmp_path: Path) -> Released:
    return trained_release(tmp_path_factory).copy(tmp_path / "copy")


def _statement(envelope: bytes) -> dict:
    return json.loads(base64.b64decode(json.loads(envelope)["payload"]))


def _resign(envelope: bytes, change: Callable[[dict], None], key: Ed25519PrivateKey) -> bytes:
    """The envelope's statement changed and signed again by `key`: what the release key's holder can do."""
    statement = _statement(envelope)
    change(statement)
    return dsse.sign(json.dumps(statement, sort_keys=True, separators=(",", ":")).encode(), key).to_json()


def _sql(released: Released, *statements: str, drop_triggers: bool = False) -> None:
    """Edit the ledger's SQLite file directly: a database writer who holds no key."""
    db = sqlite3.connect(released.root / "ledger.db")
    if drop_triggers:  # the file's owner can: the triggers guard honest writers, not the file
        for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall():
            db.execute(f"DROP TRIGGER {name}")
    for statement in statements:
        db.execute(statement)
    db.commit()
    db.close()


def _verify_cli(released: Released, envelope: bytes, tmp_path: Path, *extra: str):  # type: ignore[no-untyped-def]
    path = tmp_path / "release.dsse"
    path.write_bytes(envelope)
    return CliRunner().invoke(cli, ["release", "verify", str(path), "--key", str(released.keys / "release.pub"),
                                    "--ledger-key", str(released.keys / "ledger.pub"), *extra])


def _assert_not_clean(released: Released, envelope: bytes, withdrawn: str) -> None:
    """Against the live ledger, the release is reported tainted by `withdrawn`, or refused: never "ok"."""
    try:
        report = released.verify(envelope, ledger=released.url)
    except GovtrainError as e:
        assert e.code in LEDGER_DAMAGED, e.line()
        return
    assert report.tainted and [w.contribution_id for w in report.withdrawn_since] == [withdrawn], str(report)


# -- 1. a database writer hides a withdrawal: a tainted release reads clean ------------------------------------


def test_a_database_writer_hides_a_withdrawal_by_relabelling_its_kind_column(released: Released, tmp_path: Path):
    """Attack: after a contribution the run trained on is withdrawn (the release is tainted), a database writer
    with no key changes the withdraw row's `kind` column to 'epoch'. Body, leaf hash and checkpoints are untouched,
    so every proof still verifies; `facts.withdrawals` selects rows by that column (`kinds=("withdraw",)`) and never
    sees it. Adversary: a database writer without keys. Impact: `govtrain release verify --ledger` exits 0 "ok,
    nothing withdrawn since" for a tainted release, so an inference gate keeps serving an adapter trained on data
    whose owner withdrew it. Fix: read the entries in [release size, current size) by their decoded body (its own
    `kind`), checking each body against its leaf and those leaves against the signed root, never by the column."""
    envelope = released.build()
    with released.open() as ledger:
        ledger.withdraw("restr", "the contributor asked")
    assert released.verify(envelope, ledger=released.url).tainted  # before the edit
    _sql(released, "UPDATE entries SET kind = 'epoch' WHERE kind = 'withdraw'", drop_triggers=True)
    _assert_not_clean(released, envelope, "restr")
    assert _verify_cli(released, envelope, tmp_path, "--ledger", released.url).exit_code != 0


@pytest.mark.parametrize("how", ["insert an old checkpoint row (triggers intact)", "delete the newer checkpoints"])
def test_a_database_writer_rolls_the_latest_checkpoint_back_to_the_releases(released: Released, tmp_path: Path,
                                                                             how: str):
    """Attack: after a withdrawal taints the release, a database writer makes the release's own checkpoint the
    "latest" row of `checkpoints`: by INSERTing a copy of that validly signed note (the append-only triggers allow
    it: nothing is updated or deleted), or by deleting the newer rows. `current_checkpoint` takes the row with the
    highest id, so the live ledger "extends" the release by zero entries and the withdrawals since are read from
    the empty range [size, size), though the withdraw entry is still stored and signed by a later checkpoint.
    Adversary: a database writer without keys (INSERT only suffices). Impact: a tainted release verifies "ok"
    (exit 0). Fix: take the largest verified checkpoint, not the last row, and refuse (or scan to the store's end)
    where stored entries or checkpoints go past the checkpoint used."""
    envelope = released.build()
    size = _statement(envelope)["predicate"]["ledger"]["checkpoint_size"]
    with released.open() as ledger:
        ledger.withdraw("restr", "the contributor asked")
    if how.startswith("insert"):
        _sql(released, f"INSERT INTO checkpoints (size, root, note, time) SELECT size, root, note, time FROM "
                        f"checkpoints WHERE size = {size} ORDER BY id LIMIT 1")
    else:
        _sql(released, f"DELETE FROM checkpoints WHERE size > {size}", drop_triggers=True)
    _assert_not_clean(released, envelope, "restr")
    assert _verify_cli(released, envelope, tmp_path, "--ledger", released.url).exit_code != 0


# -- 2. a release key holder misstates which classes reached what ---------------------------------------------


def _shared_group(statement: dict) -> int:
    groups = statement["predicate"]["groups"]
    return next(i for i, g in enumerate(groups) if [c["data_class"] for c in g["classes"]] == ["public", "sensitive"])


def test_a_key_holder_claims_adapter_only_for_a_class_that_reached_shared_layers(released: Released):
    """Attack: the release key's holder re-signs the manifest so that `sensitive` (profile `band [4, 5]`: it
    reached layers 4-5 of the default adapter, shared with `public`) is the only class of that group, and the group
    lies in the `restricted` LoRA adapter: the relations hold, so `classes['sensitive'].adapter_only` is True. With
    --ledger the profile string `band [4, 5]` is checked, yet nothing compares it, or the groups, with the ledger:
    the spend entries' `noise_groups` recorded the class sets {public, sensitive}. Adversary: a key-holding operator.
    Impact: verified "ok" online and against the folder; an inference gate told a class is adapter-only disables an
    adapter and serves, where it must refuse (docs/release-manifest.md, design §8). Fix: with a ledger, the groups'
    class sets must be the run's recorded noise groups, and a class is adapter-only only where its (ledger-checked)
    profile is `adapter = NAME` and its adapter is NAME."""
    envelope = released.build()

    def sensitive_adapter_only(statement: dict) -> None:
        p = statement["predicate"]
        index = _shared_group(statement)
        p["groups"][index]["classes"] = [c for c in p["groups"][index]["classes"] if c["data_class"] == "sensitive"]
        p["groups"][index]["adapters"] = ["restricted"]
        for item in p["classes"]:
            if item["data_class"] == "public":
                item["groups"] = [i for i in item["groups"] if i != index]
            if item["data_class"] == "sensitive":
                item["adapter"] = "restricted"

    forged = _resign(envelope, sensitive_adapter_only, released.release_key)
    with pytest.raises(GovtrainError) as caught:
        report = released.verify(forged, ledger=released.url, adapter=released.adapter)
        assert not report.classes["sensitive"].adapter_only  # what is true; today the report says True
    assert caught.value.code in {Code.PREDICATE_MISMATCH, Code.BAD_STATEMENT}, caught.value.line()


def test_a_key_holder_hides_a_class_from_a_group_it_reached(released: Released):
    """Attack: the release key's holder re-signs the manifest with `sensitive` removed from the layers it shares
    with `public` (the two groups of public merged, sensitive left reaching no group), though the run charged it
    (contributions 1, its ε stated and checked). Adversary: a key-holding operator. Impact: `govtrain release verify
    --ledger` says "ok"; the report says sensitive reached no parameter, so a gate asked to serve without sensitive
    serves the layers it trained. Fix: with a ledger, compare the groups' class sets with the spend entries' noise
    groups (`LedgerFacts.noise_signatures`); offline, a class with contributions must reach a group."""
    envelope = released.build()

    def hide_sensitive(statement: dict) -> None:
        p = statement["predicate"]
        index = _shared_group(statement)
        public_only = next(i for i, g in enumerate(p["groups"])
                           if [c["data_class"] for c in g["classes"]] == ["public"])
        merged, shared = p["groups"][public_only], p["groups"][index]
        merged["layers"] = sorted(set(merged["layers"]) | set(shared["layers"]))
        merged["tensors"] += shared["tensors"]
        merged["scalars"] += shared["scalars"]
        del p["groups"][index]
        for item in p["classes"]:
            reached = [i for i, g in enumerate(p["groups"])
                       if item["data_class"] in [c["data_class"] for c in g["classes"]]]
            item["groups"] = reached

    forged = _resign(envelope, hide_sensitive, released.release_key)
    with pytest.raises(GovtrainError) as caught:
        report = released.verify(forged, ledger=released.url, adapter=released.adapter)
        assert report.classes["sensitive"].groups  # what is true; today it is ()
    assert caught.value.code in {Code.PREDICATE_MISMATCH, Code.BAD_STATEMENT}, caught.value.line()


def test_a_class_adapter_that_the_release_does_not_hold_is_refused_offline(released: Released):
    """Attack: the release key's holder states that `sensitive` reached only its own LoRA adapter `sensitive`,
    which the release does not hold: no `predicate.adapter.adapters` entry, no `sensitive/...` subject. The
    relations (`predicate._relations`) never compare a group's adapters with the release's adapters or files.
    Adversary: a key-holding operator. Impact: offline "ok" with `adapter_only` True and an adapter name that an
    inference gate cannot disable (there is none), for a class that trained shared layers. Fix: a group's adapters
    are among `predicate.adapter.adapters`, and each adapter but default has its files among the subjects
    (`NAME/adapter_config.json`, `NAME/adapter_model.safetensors`), else `bad_statement`."""
    envelope = released.build()

    def own_adapter(statement: dict) -> None:
        p = statement["predicate"]
        index = _shared_group(statement)
        p["groups"][index]["classes"] = [c for c in p["groups"][index]["classes"] if c["data_class"] == "sensitive"]
        p["groups"][index]["adapters"] = ["sensitive"]
        for item in p["classes"]:
            if item["data_class"] == "public":
                item["groups"] = [i for i in item["groups"] if i != index]
            if item["data_class"] == "sensitive":
                item["adapter"] = "sensitive"

    forged = _resign(envelope, own_adapter, released.release_key)
    assert "sensitive" not in _statement(forged)["predicate"]["adapter"]["adapters"]
    assert not any(s["name"].startswith("sensitive/") for s in _statement(forged)["subject"])
    with pytest.raises(IntegrityError) as caught:
        released.verify(forged, adapter=released.adapter)
    assert caught.value.code == Code.BAD_STATEMENT, caught.value.line()


# -- 3. a release key holder misstates the tune -----------------------------------------------------------------


def _tuned_release(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A ledger (release key in its policy) where three trial runs of tune "t" were charged and recorded, each run
    entry's adapter hash that of a one-file folder; and the release manifest of the selected trial, built from the
    ledger's own facts as `build_release` does (the adapter is a placeholder file, so its groups are the noise groups
    the spend entries recorded, placed in the default adapter: what a verifier can check them against)."""
    from govtrain.accounting.spend import spend_epsilon_u
    from govtrain.attest.keys import generate_key_pair, load_private_key, load_public_key
    from govtrain.gate.admission import admit
    from govtrain.release.artifact import adapter_digest
    from govtrain.release.facts import current_checkpoint, ledger_facts
    from govtrain.release.groups import TrainedGroup
    from govtrain.release.manifest import _predicate
    from govtrain.release.predicate import PREDICATE_TYPE, STATEMENT_TYPE, Digest, Statement, Subject, statement_bytes
    from tests.conftest import TEST_POLICY, lease, make_corpus, record_spend
    from tests.release_setup import release_policy

    keys = tmp_path / "keys"
    keys.mkdir()
    generate_key_pair(keys, "release")
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    corpus = make_corpus(tmp_path, url, release_policy(TEST_POLICY))

    def files(run_id: str) -> dict[str, bytes]:
        return {"adapter_model.safetensors": hashlib.sha256(run_id.encode()).digest()}

    histories: dict[str, list] = {}
    with corpus.open() as ledger:
        for name, cls, clip in (("a", "public", 1_000_000), ("b", "sensitive", 500_000)):
            data = corpus.data(f"{name}.jsonl", 5)
            admit(ledger, corpus.attestation(data, contribution_id=name, data_class=cls, clip_norm_u=clip,
                                             eps_budget_u=3_000_000), data, now=corpus.now)
        trials = []
        for index in range(3):
            run_id = f"t-trial-{index}"
            spends = []
            for name in ("a", "b"):
                histories.setdefault(name, []).append((10_000, 1_000_000, 5))
                spends.append((name, 5, 1_000_000, spend_epsilon_u("prv", ledger.policy.delta_p, histories[name])))
            record_spend(ledger, ledger.epoch(), 10_000, spends, run_id=run_id, epoch_steps=5, now=corpus.now)
            config = hashlib.sha256(run_id.encode()).digest()
            ledger.record_run(run_id, "dpsgd", config, bytes(32), adapter_digest(files(run_id)), now=corpus.now,
                              run_nonce=lease(run_id))
            ledger.close_epoch(now=corpus.now)
            trials.append((run_id, config))
        ledger.record_tune(tune_id="t", config_sha256=bytes(32), grid_sha256=bytes(32), trials=trials,
                           selection_sha256=bytes(32), metric="accuracy", selected_run_id="t-trial-2", now=corpus.now)
        facts = ledger_facts(ledger, "t-trial-2", current_checkpoint(ledger))
    record = SimpleNamespace(base_model=SimpleNamespace(name="base", revision=None), task="sequence-classification",
                             adapters=["default"])
    subjects = [Subject(name=n, digest=Digest(sha256=d.hex())) for n, d in files("t-trial-2").items()]
    groups = tuple(TrainedGroup(classes=tuple(sorted(s)), adapters=("default",), layers=(0,), heads=(), experts=(),
                                outside=(), tensors=1, scalars=1) for s in sorted(facts.noise_signatures, key=sorted))
    statement = Statement(**{"_type": STATEMENT_TYPE}, subject=subjects,
                          predicateType=PREDICATE_TYPE, predicate=_predicate(facts, record, groups, corpus.now))
    key = load_private_key(keys / "release.key")
    pinned = dict(release_key=load_public_key(keys / "release.pub"), ledger_keys=[load_public_key(keys / "ledger.pub")])
    return dsse.sign(statement_bytes(statement), key).to_json(), key, pinned, url


def test_a_key_holder_misstates_the_tunes_trials_and_the_ledger_does_not_notice(tmp_path: Path):
    """Attack: the release of a tune's selected trial states `tune.trials` = the selected run alone (the tune ran
    three), another `selected_run_id` story, and a made-up `tune.leaf_hash`. `_against_ledger` compares only
    (tune_id, seq); offline nothing binds them. Adversary: a key-holding operator. Impact: `verify --ledger` says
    "ok" to a release whose tune fields the ledger contradicts (docs/release-manifest.md says the tune is checked):
    a reader is told the ε covers one trial and the tune entry's hash is not the ledger's. Fix: compare the whole
    `tune` (leaf hash, trials, selected run) with `LedgerFacts.tune`, and check `tune.leaf_hash` against the stored
    tune entry."""
    from govtrain.release.verification import verify_release

    envelope, key, pinned, url = _tuned_release(tmp_path)
    assert verify_release(envelope, **pinned, ledger=url).statement.predicate.tune.trials == \
        ["t-trial-0", "t-trial-1", "t-trial-2"]
    forged = _resign(envelope, lambda s: s["predicate"]["tune"].update(trials=["t-trial-2"], leaf_hash="0" * 64),
                     key)
    with pytest.raises(IntegrityError) as caught:
        verify_release(forged, **pinned, ledger=url)
    assert caught.value.code == Code.PREDICATE_MISMATCH, caught.value.line()


# -- 4. a database writer makes a good release fail, blaming the release ---------------------------------------


@pytest.mark.parametrize("row", ["a spend entry", "the run entry"])
def test_a_database_writer_makes_a_good_release_fail_blaming_the_release(released: Released, row: str):
    """Attack: a database writer relabels one row's `kind` column to 'epoch' (the run's spend entry for `restricted`,
    or the run entry itself); bodies, leaves and checkpoints untouched. `ledger_facts` selects entries by that column,
    so it computes ε 0 for restricted, or finds no run entry. Adversary: a database writer without keys. Impact: an
    honest release fails with `predicate_mismatch` ("the predicate states ... the ledger ...": the release signer is
    accused of lying) or `unknown_run` (exit 3, the release named a run that does not exist), where the database was
    edited; the auditor blames the wrong party. Fix: read entries by their decoded body's kind and check each
    against its signed leaf; a contradiction is the ledger's (`leaf_hash_mismatch`/`bad_entry`, run govtrain-verify)."""
    envelope = released.build()
    released.verify(envelope, ledger=released.url)
    with released.open() as ledger:
        if row == "a spend entry":
            from govtrain.ledger.entries import decode_stored

            seq = next(s.seq for s in ledger.store.entries(kinds=("spend",))
                       if decode_stored(s)["contribution_id"] == "restr")
        else:
            seq = next(s.seq for s in ledger.store.entries(kinds=("run",)))
    _sql(released, f"UPDATE entries SET kind = 'epoch' WHERE seq = {seq}", drop_triggers=True)
    with pytest.raises(GovtrainError) as caught:
        released.verify(envelope, ledger=released.url)
    assert caught.value.code not in {Code.PREDICATE_MISMATCH, Code.UNKNOWN_RUN}, caught.value.line()
    assert "govtrain-verify" in caught.value.detail, caught.value.line()


# -- 5. hostile envelope bytes, no key at all ------------------------------------------------------------------


def test_an_envelope_with_a_huge_integer_is_bad_envelope_not_a_crash(released: Released, tmp_path: Path):
    """Attack: an envelope holding a 5000-digit integer literal. Python's json refuses it with a ValueError
    (int_max_str_digits), which `dsse.strict_json` does not catch. Adversary: anyone who hands the auditor a file.
    Impact: `verify_release` raises ValueError, not `IntegrityError` as documented (a gate catching
    GovtrainError crashes); the command prints error[internal] with exit 1 instead of error[bad_envelope], exit 4.
    Fix: catch ValueError in `strict_json` (or parse integers with a bounded `parse_int`)."""
    raw = b'{"payload": "e30=", "payloadType": "application/vnd.in-toto+json", "signatures": [{"sig": ' \
          + b"1" * 5000 + b"}]}"
    with pytest.raises(IntegrityError) as caught:
        released.verify(raw)
    assert caught.value.code == Code.BAD_ENVELOPE
    result = _verify_cli(released, raw, tmp_path)
    assert result.exit_code == 4 and "error[bad_envelope]" in result.output, result.output


def test_hostile_keyids_cannot_write_control_characters_into_the_error_line(released: Released):
    """Attack: an envelope whose signatures verify under no pinned key, with `keyid`s holding terminal controls:
    "\\x1b[2K\\rok: run rel" and "\\b\\bease-run\\x1b[8m". `dsse.verify` echoes the first 16 characters of each keyid
    into the `unknown_key` line, which click passes to a terminal unchanged (stripped only when not a tty). On the
    auditor's terminal the line is erased and reads "ok: run release-run", the rest concealed. Adversary: anyone
    who hands the auditor a file (no key). Impact: a forged release looks verified to a human reading the terminal
    (the exit status is still 4). Fix: show keyids only as printable text (e.g. `ascii()`/hex, or only keyids that
    are hex), never raw input."""
    document = json.loads(released.build())
    payload = bytearray(base64.b64decode(document["payload"]))
    payload[-2] ^= 1  # the signature no longer verifies
    document["payload"] = base64.b64encode(bytes(payload)).decode()
    sig = document["signatures"][0]["sig"]
    document["signatures"] = [{"keyid": "\x1b[2K\rok: run rel", "sig": sig},
                              {"keyid": "\b\bease-run\x1b[8m", "sig": sig}]
    with pytest.raises(IntegrityError) as caught:
        released.verify(json.dumps(document).encode())
    assert caught.value.code == Code.UNKNOWN_KEY
    controls = [c for c in caught.value.line() if unicodedata.category(c) == "Cc"]
    assert not controls, repr(caught.value.line())


# -- 6. the same root cause elsewhere: the kind column and the last checkpoint row ------------------------------


@pytest.mark.parametrize("integrity_only", [False, True], ids=["full", "integrity-only"])
@pytest.mark.parametrize("edit", ["relabel the withdraw row", "insert an old checkpoint row",
                                  "delete the newer checkpoints"])
def test_govtrain_verify_is_not_fooled_by_a_relabelled_row_or_a_rolled_back_checkpoint(released: Released, edit: str,
                                                                                       integrity_only: bool):
    """Attack: the edits above that made a tainted release read clean (a withdraw row relabelled; the release's
    checkpoint made the last row), against `govtrain-verify`. Adversary: a database writer without keys. Impact, had
    the verifier shared the release path's root cause: it passes the edited ledger. It does not: it reads every row
    and checks each body's kind against its row (`bad_entry`), every checkpoint row in order (a smaller one after a
    larger: `bad_checkpoint`), and that the last covers every entry (`unsigned_tail`); this test keeps it so."""
    from govtrain.verify.verifier import inspect_ledger

    envelope = released.build()
    size = _statement(envelope)["predicate"]["ledger"]["checkpoint_size"]
    with released.open() as ledger:
        ledger.withdraw("restr", "the contributor asked")
    assert inspect_ledger(released.url, integrity_only=integrity_only).error is None  # before the edit
    if edit.startswith("relabel"):
        _sql(released, "UPDATE entries SET kind = 'epoch' WHERE kind = 'withdraw'", drop_triggers=True)
        expected = Code.BAD_ENTRY
    elif edit.startswith("insert"):
        _sql(released, f"INSERT INTO checkpoints (size, root, note, time) SELECT size, root, note, time FROM "
                        f"checkpoints WHERE size = {size} ORDER BY id LIMIT 1")
        expected = Code.BAD_CHECKPOINT
    else:
        _sql(released, f"DELETE FROM checkpoints WHERE size > {size}", drop_triggers=True)
        expected = Code.UNSIGNED_TAIL
    report = inspect_ledger(released.url, integrity_only=integrity_only)
    assert report.error is not None and report.error.code == expected, report.error


def _pg_sql(url: str, *statements: str) -> None:
    """Edit a PostgreSQL ledger directly, its guard trigger dropped first: a database writer who holds no key."""
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    with engine.begin() as connection:
        connection.execute(text("DROP TRIGGER IF EXISTS entries_guard ON entries"))
        for statement in statements:
            connection.execute(text(statement))
    engine.dispose()


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_a_database_writer_hides_a_policy_change_by_relabelling_its_kind_column(store: str, request):
    """Attack: a database writer relabels a `policy` entry's kind column to 'epoch'. `policy_chain` selected policy
    entries by that column, so `Ledger.open` (and a release's facts) went on with the policy before the change, e.g.
    a release key or a ledger key the change revoked, a class it removed. Adversary: a database writer without keys.
    Impact: the operator's tools act under a policy the ledger replaced, and `govtrain release` would accept a
    revoked release key. Fix: policy entries are found by their bodies (the database searches every body for a
    policy entry's kind field), each body checked against its leaf, and a kind column that disagrees is refused
    (`bad_entry`, run govtrain-verify); a signed read (`ledger/signed.py`) reads every body."""
    import dataclasses

    from govtrain.ledger.ledger import Ledger

    corpus = request.getfixturevalue("corpus" if store == "sqlite" else "pg_corpus")
    with corpus.open() as ledger:
        longer = ledger.policy.retention_epochs + 5
        changed = ledger.change_policy(dataclasses.replace(ledger.policy, retention_epochs=longer), bytes(32),
                                       "keep longer", now=corpus.now)
    with Ledger.open(corpus.url) as ledger:
        assert ledger.policy.retention_epochs == longer  # before the edit
    relabel = f"UPDATE entries SET kind = 'epoch' WHERE seq = {changed.seq}"
    if store == "sqlite":
        db = sqlite3.connect(corpus.url.removeprefix("sqlite:///"))
        for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall():
            db.execute(f"DROP TRIGGER {name}")
        db.execute(relabel)
        db.commit()
        db.close()
    else:
        _pg_sql(corpus.url, relabel)
    with pytest.raises(IntegrityError) as caught:
        Ledger.open(corpus.url)
    assert caught.value.code == Code.BAD_ENTRY and "govtrain-verify" in caught.value.detail, caught.value.line()


def test_a_withdrawal_past_every_checkpoint_the_auditor_trusts_still_taints(released: Released):
    """Attack: after a withdrawal taints the release, a database writer deletes every checkpoint row: none is left
    to say how far the signed ledger reaches. Adversary: a database writer without keys. Impact, where the verifier
    read withdrawals only up to a checkpoint row: a tainted release reads clean (or the ledger reads as having no
    state). Fix: the release's own checkpoint, verified under the pinned keys, counts as signed, and the entries
    past the largest signed checkpoint are read all the same (each body against its own leaf): the withdrawal
    taints, and the report says how many entries no trusted checkpoint signs."""
    envelope = released.build()
    with released.open() as ledger:
        ledger.withdraw("restr", "the contributor asked")
    _sql(released, "DELETE FROM checkpoints", drop_triggers=True)
    report = released.verify(envelope, ledger=released.url)
    assert report.tainted and [w.contribution_id for w in report.withdrawn_since] == ["restr"], str(report)
    assert report.current_checkpoint.size == report.checkpoint.size and report.unsigned_entries == 1
    assert "run govtrain-verify" in str(report) and report.as_json()["unsigned_entries"] == 1
