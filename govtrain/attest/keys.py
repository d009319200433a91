"""Ed25519 keys: files, key ids and the prime-order screen.

Private keys are PKCS#8 PEM files created with mode 0600 (never overwritten, never
logged); public keys are SubjectPublicKeyInfo PEM. The key id of a public key is the
SHA-256 of its raw 32 bytes (docs/design.md §3).

OpenSSL, like RFC 8032's cofactorless equation, accepts forged signatures under
small-order public keys (with A = identity, R = identity and S = 0 verify any
message). `check_public_key` therefore rejects every encoding that is not a
canonical encoding of a point of prime order L; trust stores call it when a key
enters them, so no such key can ever be asked to verify anything.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import stat
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from govtrain.errors import Code, ConfigError

PUBLIC_KEY_BYTES = 32

# edwards25519 (RFC 8032 §5.1)
_P = 2**255 - 19
_D = (-121665 * pow(121666, _P - 2, _P)) % _P
_L = 2**252 + 27742317777372353535851937790883648493
_SQRT_M1 = pow(2, (_P - 1) // 4, _P)


def key_id(public_key: bytes | Ed25519PublicKey) -> bytes:
    """SHA-256 of the raw 32-byte public key."""
    return hashlib.sha256(raw_public_key(public_key)).digest()


def raw_public_key(public_key: bytes | Ed25519PublicKey) -> bytes:
    if isinstance(public_key, Ed25519PublicKey):
        return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    if isinstance(public_key, (bytes, bytearray)) and len(public_key) == PUBLIC_KEY_BYTES:
        return bytes(public_key)
    raise TypeError("expected an Ed25519PublicKey or 32 raw bytes")


# ---------------------------------------------------------------------------------------
# Prime-order screen
# ---------------------------------------------------------------------------------------


def _decompress(encoded: bytes) -> tuple[int, int] | None:
    """RFC 8032 §5.1.3 point decoding; None where the encoding is not canonical or not on the curve."""
    y = int.from_bytes(encoded, "little") & ((1 << 255) - 1)
    sign = encoded[31] >> 7
    if y >= _P:
        return None
    u = (y * y - 1) % _P
    v = (_D * y * y + 1) % _P
    x = (u * pow(v, 3, _P) * pow(u * pow(v, 7, _P), (_P - 5) // 8, _P)) % _P
    check = (v * x * x) % _P
    if check == (-u) % _P:
        x = (x * _SQRT_M1) % _P
    elif check != u:
        return None
    if x == 0 and sign == 1:
        return None
    if x & 1 != sign:
        x = _P - x
    return x, y


def _add(p1: tuple, p2: tuple) -> tuple:
    # Extended twisted-Edwards coordinates, a = -1 (RFC 8032 §5.1.4).
    x1, y1, z1, t1 = p1
    x2, y2, z2, t2 = p2
    a = (y1 - x1) * (y2 - x2) % _P
    b = (y1 + x1) * (y2 + x2) % _P
    c = 2 * t1 * t2 * _D % _P
    d = 2 * z1 * z2 % _P
    e, f, g, h = b - a, d - c, d + c, b + a
    return e * f % _P, g * h % _P, f * g % _P, e * h % _P


def _multiply(scalar: int, point: tuple) -> tuple:
    result = (0, 1, 1, 0)
    while scalar:
        if scalar & 1:
            result = _add(result, point)
        point = _add(point, point)
        scalar >>= 1
    return result


def _is_identity(point: tuple) -> bool:
    x, y, z, _ = point
    return x % _P == 0 and (y - z) % _P == 0


_SCREENED: set[bytes] = set()  # keys found of prime order: the verifier screens a policy's keys at every checkpoint
_SCREENED_MAX = 1024


def check_public_key(raw: bytes) -> None:
    """Raise `ConfigError(bad_public_key)` unless `raw` canonically encodes a point of prime order L."""
    if not isinstance(raw, (bytes, bytearray)) or len(raw) != PUBLIC_KEY_BYTES:
        raise ConfigError(Code.BAD_PUBLIC_KEY, "an Ed25519 public key is exactly 32 bytes")
    if bytes(raw) in _SCREENED:  # the answer is a function of the 32 bytes alone; only passes are remembered
        return
    affine = _decompress(bytes(raw))
    if affine is None:
        raise ConfigError(Code.BAD_PUBLIC_KEY, "public key is not a canonical encoding of a curve point")
    x, y = affine
    point = (x, y, 1, x * y % _P)
    if _is_identity(point):
        raise ConfigError(Code.BAD_PUBLIC_KEY, "public key is the identity point (small order)")
    if not _is_identity(_multiply(_L, point)):
        raise ConfigError(
            Code.BAD_PUBLIC_KEY, "public key has a small-order component; signatures under it can be forged"
        )
    if len(_SCREENED) < _SCREENED_MAX:
        _SCREENED.add(bytes(raw))


# ---------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------


def generate_key_pair(out_dir: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """Write a new key pair as ``NAME.key`` (PKCS#8 PEM, 0600) and ``NAME.pub`` (PEM); never overwrite."""
    return save_key_pair(Ed25519PrivateKey.generate(), out_dir, name)


def save_key_pair(private_key: Ed25519PrivateKey, out_dir: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """Save `private_key` as ``NAME.key`` (PKCS#8 PEM, mode 0600) and its public key as ``NAME.pub``.

    Refuses to overwrite either file, and writes neither if either exists.
    """
    if not name or "/" in name or name.startswith("."):
        raise ConfigError(Code.BAD_ARGUMENT, f"key name {name!r} must be a plain file name")
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    private_path = directory / f"{name}.key"
    public_path = directory / f"{name}.pub"
    for path in (private_path, public_path):
        if path.exists():
            raise ConfigError(Code.KEY_EXISTS, f"{path} already exists; choose another --name or --out")
    _write_new(
        private_path,
        private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
        0o600,
    )
    _write_new(public_path, public_key_pem(private_key.public_key()), 0o644)
    return private_path, public_path


def _write_new(path: Path, content: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)  # the umask must not widen or narrow what we asked for
        os.write(fd, content)
    finally:
        os.close(fd)


def public_key_pem(public_key: Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def load_private_key(path: str | os.PathLike) -> Ed25519PrivateKey:
    """Load a PKCS#8 PEM Ed25519 private key, refusing files others can read."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(Code.KEY_UNREADABLE, f"cannot read private key {path}: {e.strerror}") from e
    if data.lstrip().startswith(b"-----BEGIN PUBLIC KEY-----"):  # before the mode: a .pub is meant to be 0644
        pair = path.with_suffix(".key")
        which = (str(pair) if path.suffix == ".pub" and pair.is_file()
                 else "the NAME.key file `govtrain keys generate` wrote beside NAME.pub")
        raise ConfigError(Code.KEY_IS_PUBLIC, f"{path} is a public key, and signing needs the private key: give {which}")
    if stat.S_IMODE(mode) & 0o077:
        raise ConfigError(
            Code.KEY_PERMISSIONS,
            f"private key {path} is readable by others (mode {stat.S_IMODE(mode):04o}); run: chmod 600 {path}",
        )
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:
        raise ConfigError(Code.KEY_UNREADABLE, f"{path} is not an unencrypted PKCS#8 PEM private key") from e
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(Code.KEY_UNREADABLE, f"{path} holds a {type(key).__name__}, not an Ed25519 key")
    return key


def parse_public_key(text: str | bytes, *, source: str = "public key") -> bytes:
    """Raw 32 bytes from a PEM public key or the base64 of the raw key; screened by `check_public_key`."""
    if isinstance(text, bytes):
        text = text.decode("ascii", errors="replace")
    stripped = text.strip()
    if stripped.startswith("-----BEGIN"):
        try:
            key = serialization.load_pem_public_key(stripped.encode("ascii"))
        except (ValueError, UnsupportedAlgorithm) as e:
            raise ConfigError(Code.BAD_PUBLIC_KEY, f"{source} is not a PEM public key") from e
        if not isinstance(key, Ed25519PublicKey):
            raise ConfigError(Code.BAD_PUBLIC_KEY, f"{source} is a {type(key).__name__}, not Ed25519")
        raw = raw_public_key(key)
    else:
        try:
            raw = base64.b64decode(stripped, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ConfigError(Code.BAD_PUBLIC_KEY, f"{source} is neither PEM nor base64") from e
        if len(raw) != PUBLIC_KEY_BYTES:
            raise ConfigError(Code.BAD_PUBLIC_KEY, f"{source} decodes to {len(raw)} bytes, not 32")
    try:
        check_public_key(raw)
    except ConfigError as e:
        raise ConfigError(Code.BAD_PUBLIC_KEY, f"{source}: {e.detail}") from e
    return raw


def load_public_key(path: str | os.PathLike) -> bytes:
    """Raw bytes of the screened public key in a PEM (or base64) file."""
    path = Path(path)
    try:
        text = path.read_text("ascii")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(Code.KEY_UNREADABLE, f"cannot read public key {path}") from e
    return parse_public_key(text, source=str(path))
