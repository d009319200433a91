"""C2SP signed notes and tlog checkpoints: the spec's own example, round trips and every malformation."""

from __future__ import annotations

import base64

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from govtrain.attest.keys import raw_public_key
from govtrain.ledger.checkpoint import (
    NoteError,
    NoteKey,
    note_key_id,
    parse_note,
    sign_checkpoint,
    sign_note,
    verify_checkpoint,
    verify_note,
)
from govtrain.ledger.merkle import leaf_hash, root_of

# The example in c2sp.org/signed-note ("Verifier keys / Example"): a public spec vector.
SPEC_VKEY = "example.com/foo+530d903a+AekyeRrm56hApGFkyQR4ZCbV54Id2LKaANYcrnKv3U2k"
SPEC_NOTE = ("This is an example message.\n\n"
             "\u2014 example.com/foo Uw2QOkn8srV1yJGh2VYRlL1Tnagv1YEq6TfXppzi2ONncAlTgK7Ztg1ERYNZXsYjOBH3mFXmRKuwHj"
             "G1Yu72IneyaQM=\n")
KEY = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(
    "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60"))  # RFC 8032 TEST 1
ORIGIN = "test.invalid/log"


def test_spec_example_verifies():
    key = NoteKey.from_vkey(SPEC_VKEY)
    assert key.vkey() == SPEC_VKEY and key.key_id.hex() == "530d903a"
    text, verified = verify_note(SPEC_NOTE, [key])
    assert text == "This is an example message.\n" and verified == [key]
    with pytest.raises(NoteError):
        verify_note(SPEC_NOTE.replace("example message", "exemplary message"), [key])


def test_key_id_follows_the_spec():
    import hashlib

    public = raw_public_key(KEY.public_key())
    assert note_key_id(ORIGIN, public) == hashlib.sha256(ORIGIN.encode() + b"\n\x01" + public).digest()[:4]


def _checkpoint(size: int = 5):
    root = root_of([leaf_hash(bytes([i])) for i in range(size)])
    return root, sign_checkpoint(ORIGIN, size, root, KEY)


def test_checkpoint_round_trip():
    root, checkpoint = _checkpoint()
    lines = checkpoint.note.split("\n")
    assert lines[:4] == [ORIGIN, "5", base64.b64encode(root).decode(), ""]
    assert lines[4].startswith("\u2014 " + ORIGIN + " ")
    key = NoteKey(ORIGIN, raw_public_key(KEY.public_key()))
    parsed = verify_checkpoint(checkpoint.note, origin=ORIGIN, keys=[key])
    assert (parsed.size, parsed.root, parsed.note) == (5, root, checkpoint.note)


def test_unknown_signatures_are_ignored_and_known_failures_reject():
    _, checkpoint = _checkpoint()
    key = NoteKey(ORIGIN, raw_public_key(KEY.public_key()))
    other = Ed25519PrivateKey.generate()
    cosigned = checkpoint.note + sign_note(checkpoint.note.split("\n\n")[0] + "\n", other, "witness.example").split("\n\n")[1]
    assert verify_checkpoint(cosigned, origin=ORIGIN, keys=[key]).size == 5
    # The right name and key ID but a different key: a known key's signature that fails.
    imposter = NoteKey(ORIGIN, raw_public_key(other.public_key()))
    with pytest.raises(NoteError):
        verify_checkpoint(checkpoint.note, origin=ORIGIN, keys=[imposter])  # unknown -> nothing verified
    forged = sign_checkpoint(ORIGIN, 5, b"\x00" * 32, other)
    text = forged.note.split("\n\n")[0]
    good_sig_line = checkpoint.note.split("\n\n")[1]
    with pytest.raises(NoteError):
        verify_checkpoint(text + "\n\n" + good_sig_line, origin=ORIGIN, keys=[key])  # root replaced


@pytest.mark.parametrize("mutate", [
    lambda n: n.replace(ORIGIN, "other.invalid/log", 1),
    lambda n: n.replace("\n5\n", "\n05\n", 1),
    lambda n: n.replace("\n5\n", "\n6\n", 1),
    lambda n: n.replace("\n\n", "\n", 1),
    lambda n: n[:-1],
    lambda n: n.replace("\u2014", "-"),
    lambda n: n.replace("\n", "\r\n"),
    lambda n: "x" * 70_000 + n,
    lambda n: n.split("\n\n")[0] + "\n\n",
])
def test_malformed_checkpoints_are_rejected(mutate):
    _, checkpoint = _checkpoint()
    key = NoteKey(ORIGIN, raw_public_key(KEY.public_key()))
    with pytest.raises(NoteError):
        verify_checkpoint(mutate(checkpoint.note), origin=ORIGIN, keys=[key])


def test_small_order_note_keys_are_refused():
    from govtrain.errors import ConfigError

    with pytest.raises(ConfigError):
        NoteKey(ORIGIN, bytes.fromhex("01" + "00" * 31))


def test_parse_note_needs_signatures():
    with pytest.raises(NoteError):
        parse_note("text\n\n")
    text, signatures = parse_note(SPEC_NOTE)
    assert len(signatures) == 1 and signatures[0].name == "example.com/foo"
