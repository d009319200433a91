"""Release manifests (`govtrain/release/`, docs/release-manifest.md): a run's adapter folder signed as an in-toto
Statement v1 in a DSSE envelope, its predicate checked against its JSON Schema by an independent validator, its
envelope by an independent DSSE implementation (securesystemslib), the same files signed as an OpenSSF model-signing
bundle that model_signing's own verifier accepts; ε per class against the ledger's spend entries; the policy's
release keys absent from every policy that names none."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from click.testing import CliRunner  # noqa: E402

from govtrain.cli.main import cli  # noqa: E402
from govtrain.encoding import cbor  # noqa: E402
from govtrain.errors import Code, GovtrainError, IntegrityError, RejectedError  # noqa: E402
from govtrain.ledger.entries import decode_entry  # noqa: E402
from govtrain.policy.model import Policy  # noqa: E402
from govtrain.release import dsse  # noqa: E402
from govtrain.release.artifact import CARD, adapter_digest, adapter_sha256, folder_files  # noqa: E402
from govtrain.release.predicate import PREDICATE_TYPE, json_schema  # noqa: E402
from tests.conftest import REPO, TEST_POLICY, make_corpus, snapshot  # noqa: E402
from tests.release_setup import ORIGIN, RUN_ID, Released, release_policy, trained_release  # noqa: E402

SCHEMA = REPO / "schemas" / "release.schema.json"


@pytest.fixture
def released(tmp_path_factory, tmp_path: Path) -> Released:
    return trained_release(tmp_path_factory).copy(tmp_path / "copy")


def _statement(envelope: bytes) -> dict:
    return json.loads(base64.b64decode(json.loads(envelope)["payload"]))


# -- the policy's release keys --------------------------------------------------------------------------------


def test_release_keys_are_recorded_only_where_a_policy_names_them(tmp_path: Path):
    plain = make_corpus(tmp_path / "plain", f"sqlite:///{tmp_path / 'plain.db'}")
    with plain.open() as ledger:
        record = ledger.header["policy"]
        assert "release_keys" not in record and ledger.policy.release_keys == ()
        assert Policy.from_record(record).to_record() == record
    with pytest.raises(IntegrityError) as caught:  # an empty list is not the canonical form of "none"
        Policy.from_record({**record, "release_keys": []})
    assert caught.value.code == Code.BAD_LEDGER_HEADER

    keys = tmp_path / "named" / "keys"
    keys.mkdir(parents=True)
    from govtrain.attest.keys import generate_key_pair, load_public_key

    generate_key_pair(keys, "release")
    named = make_corpus(tmp_path / "named", f"sqlite:///{tmp_path / 'named.db'}", release_policy(TEST_POLICY))
    with named.open() as ledger:
        record = ledger.header["policy"]
        assert record["release_keys"] == [{"name": "release", "public_key": load_public_key(keys / "release.pub")}]
        assert Policy.from_record(record).release_keys == ledger.policy.release_keys
        stored = ledger.store.entry(0)
    import pycddl

    pycddl.Schema((REPO / "schemas" / "ledger.cddl").read_text()).validate_cbor(stored.body)
    entry = decode_entry(stored.body, seq=0, kind="header")
    assert cbor.encode(entry) == stored.body


def test_the_subjects_hash_to_the_adapter_hash_as_the_folder_does(tmp_path: Path):
    """`adapter_digest` over a manifest's subjects is the run entry's adapter hash of the folder they list: the
    hash as runs have always recorded it (sorted paths, the top card and run state left out), names sorting
    component by component ("a/b" before "a-b", unlike their strings)."""
    import hashlib

    folder = tmp_path / "adapter"
    for name in ("a-b", "a/b", "a.b", "A", "README.md", "sub/README.md", "run-state.pt", "x/run-state.lock",
                 "run-state.safetensors", "y/run-state.safetensors.tmp", "z"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(name)
    oracle = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in (
            "run-state.safetensors", "run-state.safetensors.tmp", "run-state.pt", "run-state.pt.tmp", "run-state.lock")
            and p.relative_to(folder) != Path("README.md")):
        oracle.update(str(path.relative_to(folder)).encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    files = folder_files(folder)
    assert "README.md" in files and "run-state.pt" in files and "run-state.safetensors" in files  # every file
    assert adapter_digest(files) == adapter_sha256(folder) == oracle.digest()
    (folder / "link").symlink_to(folder / "z")
    with pytest.raises(GovtrainError) as caught:
        folder_files(folder)
    assert caught.value.code == Code.ARTIFACT_UNREADABLE


# -- round trip --------------------------------------------------------------------------------------------


def test_a_release_verifies_offline_and_states_what_the_ledger_records(released: Released):
    from govtrain.release.card import run_facts

    envelope = released.build(now=1_700_000_000)
    report = released.verify(envelope)
    statement = _statement(envelope)
    assert statement["_type"] == "https://in-toto.io/Statement/v1" and statement["predicateType"] == PREDICATE_TYPE
    assert json.loads(envelope)["payloadType"] == "application/vnd.in-toto+json"
    # Every file, the card too; the run entry's adapter hash covers all but the card.
    files = folder_files(released.adapter)
    assert report.subjects == {name: digest.hex() for name, digest in files.items()} and CARD in report.subjects
    assert {"adapter_model.safetensors", "restricted/adapter_model.safetensors", "govtrain.json"} <= set(files)
    assert adapter_digest(files) == adapter_sha256(released.adapter)
    with released.open() as ledger:
        facts = run_facts(ledger, RUN_ID)
        spend = [decode_entry(s.body, seq=s.seq, kind="spend") for s in ledger.store.entries(kinds=("spend",))]
    assert (report.run_id, report.origin, report.run_seq) == (RUN_ID, ORIGIN, facts.seq)
    assert report.statement.predicate.run.leaf_hash == facts.leaf_hash.hex()
    assert report.statement.predicate.released_at == 1_700_000_000
    # ε per class: the card's figures, and the largest cumulative ε the spend entries record per class.
    classes = {"pub": "public", "sens": "sensitive", "restr": "restricted"}
    largest: dict[str, int] = {}
    for entry in spend:
        data_class = classes[entry["contribution_id"]]
        largest[data_class] = max(largest.get(data_class, 0), entry["eps_u"])
    assert {n: c.eps_u for n, c in report.classes.items()} == largest == facts.eps_by_class
    assert all(c.contributions == 1 for c in report.classes.values())
    privacy = report.statement.predicate.privacy
    assert (privacy.unit, privacy.accountant, privacy.delta_p, privacy.mechanism) == ("example", "prv", 10_000_000,
                                                                                      "dpsgd")
    assert report.withdrawn_at_release == () and report.withdrawn_since is None and not report.tainted


def test_the_groups_are_the_trained_layers_heads_and_adapters_and_say_which_class_reached_only_its_own(
        released: Released):
    from safetensors import safe_open

    report = released.verify(released.build())
    by_classes = {g.classes: g for g in report.groups}
    assert set(by_classes) == {("public",), ("public", "sensitive"), ("restricted",)}
    public, shared = by_classes[("public",)], by_classes[("public", "sensitive")]
    restricted = by_classes[("restricted",)]
    # fraction [0.5, 1] of 6 layers is 3-5, with the head; band [4, 5] inside it; the restricted class's adapter
    # has LoRA factors in every layer and nothing else.
    assert (public.layers, public.outside, public.adapters) == ((3,), ("classifier",), ("default",))
    assert (shared.layers, shared.outside, shared.adapters) == ((4, 5), (), ("default",))
    assert (restricted.layers, restricted.outside, restricted.adapters) == (tuple(range(6)), (), ("restricted",))
    # Their sizes, read independently from the saved tensors (safetensors), by layer.
    # The default adapter's LoRA factors in layers 0-2, which no class reaches, are frozen: in no group.
    sizes: dict[str, int] = {"public": 0, "shared": 0, "restricted": 0, "frozen": 0}
    for file, owner in (("adapter_model.safetensors", None), ("restricted/adapter_model.safetensors", "restricted")):
        with safe_open(str(released.adapter / file), "pt") as tensors:
            for name in tensors.keys():
                numel = tensors.get_tensor(name).numel()
                layer = next((int(p) for a, p in zip(name.split("."), name.split(".")[1:]) if a == "layer"), None)
                sizes[owner or ("shared" if layer in (4, 5) else "public" if layer in (3, None) else "frozen")] += numel
    assert (public.scalars, shared.scalars, restricted.scalars) == (sizes["public"], sizes["shared"],
                                                                   sizes["restricted"])
    assert sizes["frozen"] > 0
    # What an inference gate reads: a class it may not serve is dropped by disabling its adapter, or refused.
    assert report.classes["restricted"].adapter == "restricted" and report.classes["restricted"].adapter_only
    assert not report.classes["public"].adapter_only and not report.classes["sensitive"].adapter_only
    assert [report.groups[i].classes for i in report.classes["sensitive"].groups] == [("public", "sensitive")]
    assert all(g.eps_u[c] == report.classes[c].eps_u for g in report.groups for c in g.classes)


def test_against_the_live_ledger_a_release_is_current_or_tainted_and_verifying_changes_nothing(
        released: Released):
    envelope = released.build()
    report = released.verify(envelope, adapter=released.adapter, ledger=released.url)
    assert not report.tainted and report.withdrawn_since == ()
    assert report.current_checkpoint.size == report.checkpoint.size
    with released.open() as ledger:
        ledger.withdraw("sens", "the contributor asked", now=ledger.store.head().time)
    before = snapshot(released.url)
    report = released.verify(envelope, adapter=released.adapter, ledger=released.url)
    assert report.tainted and [w.contribution_id for w in report.withdrawn_since] == ["sens"]
    assert report.withdrawn_since[0].data_class == "sensitive"
    assert report.current_checkpoint.size == report.checkpoint.size + 1
    assert report.as_json()["status"] == "tainted" and snapshot(released.url) == before
    # Signed afresh (confirmed), the withdrawal is stated as withdrawn at release, not since; an inference gate
    # still refuses it as tainted (tests/test_attacks_rerelease.py)
    again = released.verify(released.build(confirm=True), ledger=released.url)
    assert [w.contribution_id for w in again.withdrawn_at_release] == ["sens"] and not again.withdrawn_since
    assert "withdrawn before this release" in str(again)


def test_a_trial_of_a_tune_states_the_tunes_epsilon_and_waits_for_the_tune(corpus):
    from govtrain.ledger.tuning import TuneBook
    from govtrain.release.facts import current_checkpoint, ledger_facts
    from tests.test_tune import _charged_runs, _honest

    trials = _charged_runs(corpus, "t", 3)
    with corpus.open() as ledger:
        with pytest.raises(RejectedError) as caught:
            ledger_facts(ledger, "t-trial-0", current_checkpoint(ledger))
        assert caught.value.code == Code.TUNE_UNRECORDED
    fields = _honest(corpus, trials)
    with corpus.open() as ledger:
        facts = ledger_facts(ledger, "t-trial-0", current_checkpoint(ledger))
        run_seq = facts.proof.index
        _, alone = TuneBook.read(ledger.store, until=run_seq).totals(["t-trial-0"])
    assert facts.tune.tune_id == "t" and facts.tune.trials == tuple(r for r, _ in trials)
    assert facts.eps_by_class == {item["data_class"]: item["eps_u"] for item in fields["eps_by_class"]}
    assert all(facts.eps_by_class[item["data_class"]] > item["eps_u"] for item in alone)  # the later trials count


# -- independent implementations --------------------------------------------------------------------------


def test_the_statement_matches_its_json_schema_by_an_independent_validator(released: Released):
    import jsonschema

    schema = json.loads(SCHEMA.read_text())
    assert schema == json_schema()  # the file is what the code generates (`make schemas`)
    validator = jsonschema.Draft202012Validator(schema)
    statement = _statement(released.build())
    validator.validate(statement)
    broken = [
        {**statement, "predicate": {**statement["predicate"], "released_at": 1.5}},  # no floats
        {**statement, "predicate": {**statement["predicate"], "surplus": 1}},
        {**statement, "subject": [{"name": "../escape", "digest": {"sha256": "0" * 64}}]},
        {**statement, "predicateType": "https://example.org/other"},
        {k: v for k, v in statement.items() if k != "subject"},
    ]
    from govtrain.release.predicate import read_statement

    for document in broken:
        assert list(validator.iter_errors(document))
        with pytest.raises(IntegrityError) as caught:
            read_statement(document)
        assert caught.value.code == Code.BAD_STATEMENT


def test_the_envelope_verifies_with_securesystemslib_and_pae_is_the_dsse_specs(released: Released):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    from securesystemslib.dsse import Envelope
    from securesystemslib.signer import SSlibKey

    # DSSE protocol.md's example.
    assert dsse.pae("http://example.com/HelloWorld", b"hello world") == \
        b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
    envelope = released.build()
    public = Ed25519PublicKey.from_public_bytes(released.release_pub)
    key = SSlibKey.from_crypto(public, keyid=dsse.keyid(public))
    theirs = Envelope.from_dict(json.loads(envelope))
    assert theirs.pae() == dsse.pae(theirs.payload_type, theirs.payload)
    assert set(theirs.verify([key], 1)) == {dsse.keyid(public)}
    document = json.loads(envelope)
    body = bytearray(base64.b64decode(document["payload"]))
    body[body.index(b'"eps_u":') + 8] ^= 1  # one digit of an ε
    document["payload"] = base64.b64encode(bytes(body)).decode()
    with pytest.raises(Exception):
        Envelope.from_dict(document).verify([key], 1)


def test_model_signings_own_verifier_accepts_the_bundle_and_refuses_it_after_one_byte_changes(released: Released,
                                                                                               tmp_path: Path):
    import model_signing
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "ms.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                        serialization.PrivateFormat.PKCS8,
                                                        serialization.NoEncryption()))
    (tmp_path / "ms.key").chmod(0o600)
    (tmp_path / "ms.pub").write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    result = CliRunner().invoke(cli, ["release", "--run", RUN_ID, "--adapter", str(released.adapter), "--out",
                                      str(tmp_path / "r.dsse"), "--ledger", released.url, "--key",
                                      str(released.release_key_path), "--base", str(released.base),
                                      "--model-signing", str(tmp_path / "adapter.sig"), "--ms-key",
                                      str(tmp_path / "ms.key")])
    assert result.exit_code == 0, result.output
    verifier = model_signing.verifying.Config().use_elliptic_key_verifier(public_key=tmp_path / "ms.pub")
    verifier.verify(released.adapter, tmp_path / "adapter.sig")
    bundle = json.loads((tmp_path / "adapter.sig").read_text())
    payload = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    ours = _statement((tmp_path / "r.dsse").read_bytes())
    assert payload["predicate"]["govtrain_release"] == ours["predicate"]  # the govtrain fields travel with it
    assert sorted(r["name"] for r in payload["predicate"]["resources"]) == sorted(s["name"] for s in ours["subject"])
    for name in ("restricted/adapter_model.safetensors", CARD):  # the weights, and the card
        path = released.adapter / name
        original = path.read_bytes()
        path.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        with pytest.raises(ValueError, match="Signature mismatch"):
            verifier.verify(released.adapter, tmp_path / "adapter.sig")
        path.write_bytes(original)
    verifier.verify(released.adapter, tmp_path / "adapter.sig")


# -- the command line --------------------------------------------------------------------------------------


def _release_args(released: Released, out: Path, key: Path | None = None) -> list[str]:
    return ["release", "--run", RUN_ID, "--adapter", str(released.adapter), "--out", str(out), "--ledger", released.url,
            "--key", str(key or released.release_key_path), "--base", str(released.base)]


def _verify_args(released: Released, path: Path, *extra: str) -> list[str]:
    return ["release", "verify", str(path), "--key", str(released.keys / "release.pub"), "--ledger-key",
            str(released.keys / "ledger.pub"), *extra]


def test_the_command_line_releases_verifies_and_exits_6_when_tainted(released: Released, tmp_path: Path):
    runner = CliRunner()
    out = tmp_path / "release.dsse"
    result = runner.invoke(cli, _release_args(released, out))
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.output and "restricted ε" in result.output
    again = runner.invoke(cli, _release_args(released, out))  # never overwrites
    assert again.exit_code == 2 and "error[bad_argument]" in again.output
    ok = runner.invoke(cli, _verify_args(released, out, "--adapter", str(released.adapter), "--ledger", released.url))
    assert ok.exit_code == 0 and ok.output.startswith("ok: run release-run's release"), ok.output
    as_json = runner.invoke(cli, _verify_args(released, out, "--json"))
    document = json.loads(as_json.stdout)
    assert as_json.exit_code == 0 and document["status"] == "ok" and document["ledger_checked"] is False
    assert document["classes"]["restricted"]["adapter"] == "restricted"
    with released.open() as ledger:
        ledger.withdraw("pub", "withdrawn", now=ledger.store.head().time)
    tainted = runner.invoke(cli, _verify_args(released, out, "--ledger", released.url))
    assert tainted.exit_code == 6 and "TAINTED" in tainted.output and "pub (entry" in tainted.output
    vkey = tmp_path / "ledger.vkey"  # a note verifier key pins the ledger key too
    vkey.write_text(released.ledger_note_key.vkey() + "\n")
    pinned = runner.invoke(cli, ["release", "verify", str(out), "--key", str(released.keys / "release.pub"),
                                 "--ledger-key", str(vkey)])
    assert pinned.exit_code == 0, pinned.output


@pytest.mark.parametrize("args, says", [
    (["release"], "needs --run"),
    (["release", "--run", "r", "verify", "x.dsse"], "belong to govtrain release itself"),
    (["release", "verify", "x.dsse", "--key", "k"], "--ledger-key"),
])
def test_usage_errors_exit_2(args: list[str], says: str):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and says in result.output and "error[usage]" in result.output


def test_model_signing_needs_its_key_and_a_path_outside_the_folder(released: Released, tmp_path: Path):
    runner = CliRunner()
    alone = runner.invoke(cli, [*_release_args(released, tmp_path / "a.dsse"), "--model-signing", "x.sig"])
    assert alone.exit_code == 2 and "go together" in alone.output and not (tmp_path / "a.dsse").exists()
    inside = runner.invoke(cli, _release_args(released, released.adapter / "release.dsse"))
    assert inside.exit_code == 2 and "inside the adapter folder" in inside.output
    assert not (released.adapter / "release.dsse").exists()
    (tmp_path / "taken.sig").write_text("someone else's")  # checked before the manifest is written
    (tmp_path / "ms.key").write_text("not read")
    taken = runner.invoke(cli, [*_release_args(released, tmp_path / "b.dsse"), "--model-signing",
                                str(tmp_path / "taken.sig"), "--ms-key", str(tmp_path / "ms.key")])
    assert taken.exit_code == 2 and "already exists" in taken.output and not (tmp_path / "b.dsse").exists()
    assert (tmp_path / "taken.sig").read_text() == "someone else's"


def test_verification_never_imports_torch(released: Released, tmp_path: Path):
    path = tmp_path / "release.dsse"
    path.write_bytes(released.build())
    args = _verify_args(released, path, "--adapter", str(released.adapter), "--ledger", released.url)
    code = (f"import sys; from govtrain.cli.main import cli; from click.testing import CliRunner; "
            f"r = CliRunner().invoke(cli, {args!r}); "
            "assert r.exit_code == 0, r.output; assert 'torch' not in sys.modules, 'torch was imported'")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_verify_release_raises_a_govtrain_error_for_bytes_that_are_no_envelope(released: Released):
    for raw in (b"", b"not json", b'{"payload": "", "payloadType": "x"}', b'{"a": 1, "a": 2}'):
        with pytest.raises(GovtrainError) as caught:
            released.verify(raw)
        assert caught.value.code == Code.BAD_ENVELOPE


# -- groups in the policy's terms: heads, grouped-query heads, experts (no training) ----------------------------


def _groups(classes: dict, net) -> dict:
    from govtrain.release.groups import trained_groups
    from govtrain.resolver.model import describe

    return {g.classes: g for g in trained_groups(classes, describe(net))}


def test_a_heads_profile_names_its_heads_and_the_rest_of_the_layer_stays_with_the_others():
    from tests.test_resolver import cls, peft_bert

    classes = {"public": cls("public", fraction_u=(500_000, 1_000_000), head=True),
               "sensitive": cls("sensitive", band=(4, 5), heads=((5, (0, 1)),))}
    groups = _groups(classes, peft_bert())
    shared, public = groups[("public", "sensitive")], groups[("public",)]
    assert shared.layers == (4, 5) and shared.heads == ((5, (0, 1)),) and shared.outside == ()
    # Layer 5's other heads (rows of q/v lora_B, columns of the output projection's lora_A) and the factors that
    # mix every head stay public's; so do layer 3 and the head.
    assert public.layers == (3, 5) and public.heads == ((5, (2, 3)),) and public.outside == ("classifier",)
    assert set(groups) == {("public",), ("public", "sensitive")}


def test_a_key_value_head_shared_by_grouped_query_heads_is_named_by_the_query_heads_it_serves():
    import transformers

    from tests.test_resolver import cls

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    groups = _groups({"c": cls("c", band=(3, 3), heads=((3, (0, 1)),))}, transformers.LlamaForCausalLM(config))
    assert groups[("c",)].heads == ((3, (0, 1)),) and groups[("c",)].layers == (3,)


def test_an_experts_profile_names_its_experts_on_fused_parameters_and_their_lora_factors():
    from tests.test_moe import CLASSES, fused_lora, mixtral
    from tests.test_resolver import cls

    groups = _groups(CLASSES, mixtral())
    assert groups[("depth", "experts")].experts == ((0, (1,)),)
    assert groups[("experts", "routed")].experts == ((1, (1, 2)),) and groups[("experts", "routed")].layers == (1,)
    lora = _groups({"one": cls("one", band=(0, 1), experts=((0, (1,)), (1, (2, 3))))}, fused_lora())
    assert lora[("one",)].experts == ((0, (1,)), (1, (2, 3))) and lora[("one",)].tensors == 8
