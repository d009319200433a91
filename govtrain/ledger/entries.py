"""Ledger entries: canonical CBOR maps ``{"v": 1, "seq": n, "kind": k, "time": t, …}`` (DESIGN §6).

Each kind has one builder here and one exact field list (`SPECS`, mirrored by
`schemas/ledger.cddl`). `decode_entry` reads an entry back without trusting it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from govtrain.encoding import cbor
from govtrain.encoding.fields import check_shape
from govtrain.errors import Code, GovtrainError, IntegrityError

if TYPE_CHECKING:
    from govtrain.gate.gate import VerifiedAttestation
    from govtrain.policy.model import Policy

ENTRY_VERSION = 1
KINDS = ("header", "admit", "spend", "withdraw", "epoch", "summary", "run", "policy")

_COMMON = {"v": int, "seq": int, "kind": str, "time": int}
SPECS: dict[str, dict[str, type]] = {
    "header": {**_COMMON, "policy": dict, "policy_source_sha256": bytes},
    "admit": {
        **_COMMON,
        "contribution_id": str,
        "contributor": str,
        "data_class": str,
        "kid": bytes,
        "descriptor_sha256": bytes,
        "attestation_sha256": bytes,
        "data_sha256": bytes,
        "records": int,
        "clip_norm_u": int,
        "noise_multiplier_u": int,
        "eps_budget_u": int,
        "not_before": int,
        "not_after": int,
        # The attestation as received, so that an auditor can re-verify the attester's signature.
        "attestation": bytes,
    },
}


def _entry(seq: int, kind: str, time: int, **fields: Any) -> bytes:
    return cbor.encode({"v": ENTRY_VERSION, "seq": seq, "kind": kind, "time": time, **fields})


def header_entry(seq: int, time: int, policy: "Policy", policy_source_sha256: bytes) -> bytes:
    return _entry(seq, "header", time, policy=policy.to_record(), policy_source_sha256=policy_source_sha256)


def admit_entry(seq: int, time: int, verified: "VerifiedAttestation") -> bytes:
    d = verified.descriptor
    return _entry(
        seq,
        "admit",
        time,
        contribution_id=d.contribution_id,
        contributor=d.contributor,
        data_class=d.data_class,
        kid=verified.kid,
        descriptor_sha256=verified.descriptor_sha256,
        attestation_sha256=verified.attestation_sha256,
        data_sha256=d.data_sha256,
        records=d.records,
        clip_norm_u=d.clip_norm_u,
        noise_multiplier_u=d.noise_multiplier_u,
        eps_budget_u=d.eps_budget_u,
        not_before=d.not_before,
        not_after=d.not_after,
        attestation=verified.raw,
    )


def decode_entry(body: bytes, *, seq: int, kind: str) -> dict:
    """Strictly decode a stored entry and check its envelope against the row it came from."""
    try:
        entry = cbor.decode(body, max_size=max(cbor.MAX_INPUT_BYTES, len(body)))
    except GovtrainError as e:
        raise IntegrityError(Code.BAD_ENTRY, f"entry {seq} is not deterministic CBOR: {e.detail}") from e
    if type(entry) is not dict:
        raise IntegrityError(Code.BAD_ENTRY, f"entry {seq} is not a map")
    if entry.get("kind") != kind or entry.get("seq") != seq:
        raise IntegrityError(Code.BAD_ENTRY, f"entry {seq} claims seq {entry.get('seq')!r}, kind {entry.get('kind')!r}")
    if entry.get("v") != ENTRY_VERSION:
        raise IntegrityError(Code.BAD_ENTRY, f"entry {seq} has unsupported version {entry.get('v')!r}")
    spec = SPECS.get(kind)
    if spec is None:
        raise IntegrityError(Code.BAD_ENTRY, f"entry {seq} has a kind this verifier does not know: {kind!r}")
    try:
        check_shape(entry, spec, what=f"entry {seq} ({kind})", error=IntegrityError)
    except GovtrainError as e:
        raise IntegrityError(Code.BAD_ENTRY, e.detail) from e
    return entry
