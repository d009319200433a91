"""Ed25519 keys: RFC 8032 vectors, key files, key ids, and the small-order screen."""

from __future__ import annotations

import hashlib
import stat

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from govtrain.attest.keys import (
    check_public_key,
    generate_key_pair,
    key_id,
    load_private_key,
    load_public_key,
    parse_public_key,
    raw_public_key,
)
from govtrain.errors import Code, ConfigError
from govtrain.policy.trust import TrustStore

# RFC 8032 §7.1, TEST 1 and TEST 2.
RFC8032 = [
    ("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60",
     "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a", "",
     "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b"),
    ("4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb",
     "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c", "72",
     "92a009a9f0d4cab8720e820b5f642540a2b27b5416503f8fb3762223ebdb69da085ac1e43e15996e458f3613d0f11d8c387b2eaeb4302aeeb00d291612bb0c00"),
]

# The eight small-order points, plus non-canonical encodings of some of them.
SMALL_ORDER = [
    "0100000000000000000000000000000000000000000000000000000000000000",  # identity
    "ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",  # order 2
    "0000000000000000000000000000000000000000000000000000000000000000",  # order 4
    "0000000000000000000000000000000000000000000000000000000000000080",  # order 4
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a",  # order 8
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac03fa",  # order 8
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05",  # order 8
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc85",  # order 8
    "eeffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",  # y = p + 1 (non-canonical identity)
    "0100000000000000000000000000000000000000000000000000000000000080",  # x = 0 with sign bit set
]


@pytest.mark.parametrize("secret,public,message,signature", RFC8032)
def test_rfc8032_vectors(secret, public, message, signature):
    key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(secret))
    assert raw_public_key(key.public_key()).hex() == public
    assert key.sign(bytes.fromhex(message)).hex() == signature
    check_public_key(bytes.fromhex(public))
    assert key_id(bytes.fromhex(public)) == hashlib.sha256(bytes.fromhex(public)).digest()


@pytest.mark.parametrize("encoded", SMALL_ORDER)
def test_small_order_and_non_canonical_keys_are_refused(encoded):
    with pytest.raises(ConfigError) as info:
        check_public_key(bytes.fromhex(encoded))
    assert info.value.code == Code.BAD_PUBLIC_KEY
    with pytest.raises(ConfigError):
        TrustStore([("evil", bytes.fromhex(encoded), ["public"])])


def test_not_on_curve_and_mixed_order_keys_are_refused():
    with pytest.raises(ConfigError):
        check_public_key(bytes.fromhex("02" + "00" * 31))  # y = 2: x^2 is not a square
    # A valid key plus the order-2 point has a torsion component: mixed order.
    from govtrain.attest import keys as k

    good = raw_public_key(Ed25519PrivateKey.generate().public_key())
    x, y = k._decompress(good)
    tx, ty = k._decompress(bytes.fromhex(SMALL_ORDER[1]))
    X, Y, Z, _ = k._add((x, y, 1, x * y % k._P), (tx, ty, 1, tx * ty % k._P))
    zi = pow(Z, k._P - 2, k._P)
    ax, ay = X * zi % k._P, Y * zi % k._P
    with pytest.raises(ConfigError):
        check_public_key((ay | ((ax & 1) << 255)).to_bytes(32, "little"))


def test_openssl_accepts_a_forgery_under_the_identity_key_which_is_why_we_screen():
    identity = bytes.fromhex(SMALL_ORDER[0])
    forged = identity + bytes(32)  # R = identity, S = 0
    Ed25519PublicKey.from_public_bytes(identity).verify(forged, b"any message at all")  # no exception
    with pytest.raises(ConfigError):
        TrustStore([("identity", identity, ["public"])])


def test_random_keys_pass_the_screen():
    for _ in range(20):
        check_public_key(raw_public_key(Ed25519PrivateKey.generate().public_key()))


def test_generate_writes_0600_private_and_refuses_to_overwrite(tmp_path):
    private, public = generate_key_pair(tmp_path, "alice")
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    assert private.read_text().startswith("-----BEGIN PRIVATE KEY-----")
    assert public.read_text().startswith("-----BEGIN PUBLIC KEY-----")
    key = load_private_key(private)
    assert load_public_key(public) == raw_public_key(key.public_key())
    before = private.read_bytes()
    with pytest.raises(ConfigError) as info:
        generate_key_pair(tmp_path, "alice")
    assert info.value.code == Code.KEY_EXISTS and private.read_bytes() == before


def test_generate_ignores_a_permissive_umask(tmp_path):
    import os

    old = os.umask(0)
    try:
        private, _ = generate_key_pair(tmp_path, "umask")
    finally:
        os.umask(old)
    assert stat.S_IMODE(private.stat().st_mode) == 0o600


def test_private_key_readable_by_others_is_refused(tmp_path):
    private, _ = generate_key_pair(tmp_path, "loose")
    private.chmod(0o644)
    with pytest.raises(ConfigError) as info:
        load_private_key(private)
    assert info.value.code == Code.KEY_PERMISSIONS and "chmod 600" in info.value.detail
    assert private.read_text() not in info.value.detail


def test_unreadable_and_wrong_key_files(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_private_key(tmp_path / "missing.key")
    assert info.value.code == Code.KEY_UNREADABLE
    junk = tmp_path / "junk.key"
    junk.write_text("not a key")
    junk.chmod(0o600)
    with pytest.raises(ConfigError) as info:
        load_private_key(junk)
    assert info.value.code == Code.KEY_UNREADABLE


def test_public_key_forms(tmp_path):
    import base64

    raw = raw_public_key(Ed25519PrivateKey.generate().public_key())
    assert parse_public_key(base64.b64encode(raw).decode()) == raw
    with pytest.raises(ConfigError):
        parse_public_key(base64.b64encode(raw[:31]).decode())
    with pytest.raises(ConfigError):
        parse_public_key("!!!")


def test_save_round_trips_a_given_key(tmp_path):
    from govtrain.attest.keys import save_key_pair

    key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(RFC8032[0][0]))
    private, public = save_key_pair(key, tmp_path, "rfc")
    assert raw_public_key(load_private_key(private).public_key()).hex() == RFC8032[0][1]
    assert load_public_key(public).hex() == RFC8032[0][1]
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    (tmp_path / "other.pub").write_text("x")
    with pytest.raises(ConfigError):
        save_key_pair(key, tmp_path, "other")
    assert not (tmp_path / "other.key").exists()
