"""The same release as an OpenSSF model-signing 1.x bundle (github.com/sigstore/model-transparency), signed with a
P-256 key, for tools that verify models that way (docs/release-manifest.md). Never imports torch.

    model_signing.verifying.Config().use_elliptic_key_verifier(public_key="ms.pub").verify("adapter", "adapter.sig")

A Sigstore bundle (media type application/vnd.dev.sigstore.bundle.v0.3+json) with no transparency-log entry, whose
verification material is the public key's hint (SHA-256 hex of its PEM SubjectPublicKeyInfo), around a DSSE
envelope (`dsse.pae`) of an in-toto Statement v1 of predicate type https://model_signing/signature/v1.0:

    subject     [{"name": the folder's name, "digest": {"sha256": SHA-256 over the resources' digests, in order}}]
    predicate   {"serialization": {"method": "files", "hash_type": "sha256", "allow_symlinks": false},
                 "resources": [{"name": path, "algorithm": "sha256", "digest": hex}, ...]   every file, path order
                 "govtrain_release": the govtrain predicate (predicate.py), as the release manifest states it}

model-signing's verifiers ignore predicate fields they do not know (its v1.0 predicate), so `govtrain_release`
travels with the signature; the same files are covered, card included. The signature is ECDSA P-256 with SHA-256,
DER-encoded, over the PAE of the payload, which is the one function `statement_bytes` gives.
"""

from __future__ import annotations

import base64
import hashlib
import json
import stat
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from govtrain.errors import Code, ConfigError
from govtrain.release import dsse
from govtrain.release.predicate import Statement

BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
PREDICATE_TYPE = "https://model_signing/signature/v1.0"
GOVTRAIN_FIELD = "govtrain_release"
# What model-signing's verifier leaves out of a folder whatever the signature says: a folder holding one of them
# could not verify there, so it is refused here.
IGNORED_BY_MODEL_SIGNING = (".git", ".gitattributes", ".github", ".gitignore")


def load_p256_key(path: str | Path) -> ec.EllipticCurvePrivateKey:
    """A PEM P-256 private key (PKCS#8 or SEC1), refusing a file others can read."""
    path = Path(path)
    try:
        mode, data = path.stat().st_mode, path.read_bytes()
    except OSError as e:
        raise ConfigError(Code.KEY_UNREADABLE, f"cannot read private key {path}: {e.strerror}") from e
    if stat.S_IMODE(mode) & 0o077:
        raise ConfigError(Code.KEY_PERMISSIONS, f"private key {path} is readable by others (mode "
                                                f"{stat.S_IMODE(mode):04o}); run: chmod 600 {path}")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:
        raise ConfigError(Code.KEY_UNREADABLE, f"{path} is not an unencrypted PEM private key") from e
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name != "secp256r1":
        raise ConfigError(Code.KEY_UNREADABLE, f"{path} is not a P-256 (secp256r1) key, which model-signing's "
                                               "elliptic-key verifier takes")
    return key


def model_signing_statement(statement: Statement, folder_name: str) -> bytes:
    """The model-signing payload over the release's subjects, carrying its govtrain predicate."""
    names = [s.name for s in statement.subject]
    ignored = sorted(n for n in names if n.split("/")[0] in IGNORED_BY_MODEL_SIGNING)
    if ignored:
        raise ConfigError(Code.BAD_ARGUMENT, f"the folder holds {ignored[0]}, which model-signing's verifier never "
                                             "hashes: move it out of the adapter folder to sign it that way")
    resources = [{"name": s.name, "algorithm": "sha256", "digest": s.digest.sha256}
                 for s in sorted(statement.subject, key=lambda s: s.name.split("/"))]
    root = hashlib.sha256(b"".join(bytes.fromhex(r["digest"]) for r in resources)).hexdigest()
    document = {
        "_type": "https://in-toto.io/Statement/v1",
        "subject": [{"name": folder_name, "digest": {"sha256": root}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "serialization": {"method": "files", "hash_type": "sha256", "allow_symlinks": False},
            "resources": resources,
            GOVTRAIN_FIELD: statement.predicate.model_dump(mode="json"),
        },
    }
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def model_signing_bundle(statement: Statement, folder_name: str, key: ec.EllipticCurvePrivateKey) -> bytes:
    """The bundle's JSON bytes: `model_signing_statement` in a DSSE envelope signed by the P-256 `key`."""
    payload = model_signing_statement(statement, folder_name)
    signature = key.sign(dsse.pae(dsse.PAYLOAD_TYPE, payload), ec.ECDSA(hashes.SHA256()))
    public_pem = key.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)
    bundle = {
        "mediaType": BUNDLE_MEDIA_TYPE,
        "verificationMaterial": {"publicKey": {"hint": hashlib.sha256(public_pem).hexdigest()}, "tlogEntries": []},
        "dsseEnvelope": {"payload": base64.b64encode(payload).decode(), "payloadType": dsse.PAYLOAD_TYPE,
                         "signatures": [{"sig": base64.b64encode(signature).decode(), "keyid": ""}]},
    }
    return (json.dumps(bundle, indent=2) + "\n").encode()
