"""Ledger entries: canonical CBOR maps ``{"v": 1, "seq": n, "kind": k, "time": t, …}`` (docs/design.md §6).

Each kind has one builder here and one exact field list (`SPECS`, mirrored by
`schemas/ledger.cddl`). `decode_entry` reads an entry back without trusting it.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Protocol

import ledger_store
from govtrain.encoding import cbor
from govtrain.encoding.fields import INT63_MAX, check_shape
from govtrain.errors import Code, GovtrainError, IntegrityError

if TYPE_CHECKING:
    from govtrain.attest.descriptor import Descriptor
    from govtrain.policy.model import Policy

ENTRY_VERSION = 1
# A run entry's mechanism (the training mechanisms, `govtrain.mechanisms`, name theirs from this list: the
# ledger records and the verifier checks a name, and sits below the mechanisms that implement them).
MECHANISMS = ("dpsgd", "prism", "dp-muon")
PRECISIONS = ("fp32", "bf16")
DEVICE = re.compile(r"cpu|cuda:[0-9]{1,2}")
KINDS = ("header", "admit", "spend", "withdraw", "epoch", "summary", "run", "policy", "tune")

_COMMON = {"v": int, "seq": int, "kind": str, "time": int}
SPECS: dict[str, dict[str, type | tuple[type, ...]]] = {
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
    # A contribution's privacy spend, written ahead for one ledger epoch (docs/design.md §5-6).
    "spend": {
        **_COMMON,
        "contribution_id": str,
        "admit_leaf": bytes,
        "run_id": str,                  # the run that wrote this epoch's spend ahead (it alone trains the epoch)
        "run_nonce": bytes,             # 16 random bytes: the run's lease on its id (every spend and its run entry)
        "epoch": int,
        "epoch_steps": int,             # the steps that run takes in this ledger epoch
        "steps": int,                   # steps of this epoch in which the contribution is eligible
        "sampling_rate_u": int,         # q, micro-units
        "noise_multiplier_u": int,      # sigma_eff, micro-units, rounded down (more conservative)
        "accountant": str,
        "delta_p": int,
        "privacy_unit": str,            # the header's: what q samples and eps protects (example, contribution)
        "eps_u": int,                   # cumulative epsilon after this epoch, micro-units, rounded up
        "noise_groups": list,           # the epoch's noise schedule: NOISE_GROUP maps, sorted by classes
        "privatizer": dict,             # the privatizer's record (PRIVATIZER): what the charge follows from
    },
    "withdraw": {**_COMMON, "contribution_id": str, "admit_leaf": bytes, "reason": str},
    "epoch": {**_COMMON, "epoch": int},   # closes ledger epoch `epoch` (numbered from 0)
    "summary": {
        **_COMMON,
        "data_class": str,
        "before_epoch": int,
        "first_seq": int,               # the summarized range [first_seq, last_seq]
        "last_seq": int,
        "entries": int,                 # entries of this class summarized
        "admitted": int,
        "withdrawn": int,
        "spend_u": int,                 # sum over contributions of their latest cumulative eps_u
        "entries_sha256": bytes,        # SHA-256 over this class's summarized entries' leaf hashes, in order
        "range_sha256": bytes,          # SHA-256 over the leaf hashes of every entry this compaction redacts
        "retired": list,                # RETIRED maps, one per contribution of this class, by admit_seq
    },
    "run": {**_COMMON, "run_id": str,
            "run_nonce": bytes,             # the lease its spend entries carry
            "mechanism": str, "config_sha256": bytes, "base_model_sha256": bytes,
            "adapter_sha256": (bytes, type(None)),
            "device": str,                  # what computed it: cpu or cuda:N (never what it released)
            "precision": str,               # fp32, or bf16 autocast (norms, clipping, sums and noise in fp32)
            "privatizer": dict},            # the privatizer's record (PRIVATIZER), as its spend entries record it
    "policy": {**_COMMON, "policy": dict, "policy_source_sha256": bytes, "reason": str},
    # A hyperparameter search (`govtrain tune`): its trials, each a governed run whose spend entries already
    # charged it, bound together, the one selected, and the total epsilon the search charged (ledger/tuning.py).
    "tune": {**_COMMON,
             "tune_id": str,
             "config_sha256": bytes,        # the base RUN.toml, as read
             "grid_sha256": bytes,          # the grid file, as read
             "trials": list,                # TRIAL maps, in the order they ran: run ids <tune_id>-trial-<k>
             "selection_sha256": bytes,     # the held-out file the trials were scored on (never admitted data)
             "metric": str,                 # accuracy (higher is better) or loss (lower is better)
             "selected_run_id": (str, type(None)),   # null: the search stopped before it could select
             "adapter_sha256": (bytes, type(None)),  # the selected run's, as its run entry recorded it
             "accounting": str,             # composition
             "eps_u": int,                  # the largest of eps_by_class
             "eps_by_class": list},         # CLASS_EPS maps, by class name
}

# One parameter group of an epoch's noise schedule (docs/design.md §5): the classes that reach it and s_g, the largest
# signed sigma_i * C_i of an eligible contribution reaching it, in pico-units (micro * micro).
NOISE_GROUP: dict[str, type | tuple[type, ...]] = {"classes": list, "s_pu": int}
# A tuning trial: the run's id and the SHA-256 of its derived config (the run entry records the same).
TRIAL: dict[str, type | tuple[type, ...]] = {"run_id": str, "config_sha256": bytes}
# Per class, the largest cumulative eps_u, after the tune's last trial, of a contribution any trial charged.
CLASS_EPS: dict[str, type | tuple[type, ...]] = {"data_class": str, "eps_u": int}

# One contribution a summary retires: what its admit entry committed to (so that its index rows, and any
# later admit that replays it, can be checked after the body is gone) and every entry of it summarized.
RETIRED: dict[str, type | tuple[type, ...]] = {
    "contribution_id": str,
    "data_class": str,
    "admit_seq": int,
    "descriptor_sha256": bytes,
    "attestation_sha256": bytes,
    "data_sha256": bytes,
    "records": int,
    "clip_norm_u": int,                 # its signed bounds, which the spend rules still read
    "noise_multiplier_u": int,
    "eps_budget_u": int,
    "withdraw_seq": (int, type(None)),
    "entry_seqs": list,                 # ascending, admit_seq first
    "spends": list,                     # SPENT maps, one per spend entry of it, in order
    "eps_u": int,                       # its final cumulative epsilon: the last spend's, or 0
}
# A spend entry a summary retires: every field of its body the rules read (all but its admit leaf, time and the
# ledger's fixed accountant, delta and privacy unit), so that a redacted spend is checked as its body was.
SPENT: dict[str, type | tuple[type, ...]] = {
    "seq": int, "run_id": str, "run_nonce": bytes, "epoch": int, "epoch_steps": int, "steps": int,
    "sampling_rate_u": int, "noise_multiplier_u": int, "eps_u": int, "noise_groups": list, "privatizer": dict}
_DIGESTS = ("descriptor_sha256", "attestation_sha256", "data_sha256")
# Fields every entry written now has and entries written before them lack: a `spend` or `run` entry without
# `privatizer` (and a SPENT map without it) was the i.i.d. Gaussian's, which is all govtrain had then.
LATER = {"spend": frozenset({"privatizer"}), "run": frozenset({"privatizer"})}
SPENT_LATER = frozenset({"privatizer"})
# A privatizer's record (`Privatizer.record`): "name" and its public parameters, text keys to ints, text, or lists
# of signed 63-bit ints (a matrix factorization's coefficients, θ and ω) of at most PRIVATIZER_LIST_MAX.
PRIVATIZER_KEYS = re.compile(r"[a-z][a-z0-9_]{0,31}")
PRIVATIZER_LIST_MAX = 4096

_TEMPLATES = {kind: cbor.MapTemplate(spec) for kind, spec in SPECS.items()}
# An entry as written before the LATER fields existed: what old ledgers hold (the `Ledger` writes every field).
_EARLIER = {kind: cbor.MapTemplate(set(SPECS[kind]) - later) for kind, later in LATER.items()}


def _entry(seq: int, kind: str, time: int, **fields: Any) -> bytes:
    fields.update(v=ENTRY_VERSION, seq=seq, kind=kind, time=time)  # kwargs is already a fresh dict
    if kind in LATER and not LATER[kind] & fields.keys():
        return _EARLIER[kind].encode(fields)
    return _TEMPLATES[kind].encode(fields)


def header_entry(seq: int, time: int, policy: "Policy", policy_source_sha256: bytes) -> bytes:
    return _entry(seq, "header", time, policy=policy.to_record(), policy_source_sha256=policy_source_sha256)


class AdmittedAttestation(Protocol):
    """What an admit entry records of a verified attestation (the gate's `VerifiedAttestation`, which sits above
    the ledger and passes itself in)."""

    raw: bytes
    kid: bytes
    descriptor: "Descriptor"
    descriptor_sha256: bytes
    attestation_sha256: bytes


def admit_entry(seq: int, time: int, verified: AdmittedAttestation) -> bytes:
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


def withdraw_entry(seq: int, time: int, contribution_id: str, admit_leaf: bytes, reason: str) -> bytes:
    return _entry(seq, "withdraw", time, contribution_id=contribution_id, admit_leaf=admit_leaf, reason=reason)


def epoch_entry(seq: int, time: int, epoch: int) -> bytes:
    return _entry(seq, "epoch", time, epoch=epoch)


def summary_entry(seq: int, time: int, **fields: Any) -> bytes:
    return _entry(seq, "summary", time, **fields)


def spend_entry(seq: int, time: int, **fields: Any) -> bytes:
    return _entry(seq, "spend", time, **fields)


def run_entry(seq: int, time: int, **fields: Any) -> bytes:
    return _entry(seq, "run", time, **fields)


def tune_entry(seq: int, time: int, **fields: Any) -> bytes:
    return _entry(seq, "tune", time, **fields)


def policy_entry(seq: int, time: int, policy: "Policy", policy_source_sha256: bytes, reason: str) -> bytes:
    return _entry(seq, "policy", time, policy=policy.to_record(), policy_source_sha256=policy_source_sha256,
                  reason=reason)


def decode_entry(body: bytes, *, seq: int, kind: str | None) -> dict:
    """Strictly decode a stored entry and check its envelope against the row it came from. `kind` None: the kind
    the body states (`ledger/signed.py`: a reader that must not trust the row's kind column), checked the same."""
    try:
        entry = cbor.decode(body, max_size=max(cbor.MAX_INPUT_BYTES, len(body)))
    except GovtrainError as e:
        raise IntegrityError(Code.BAD_ENTRY, f"entry {seq} is not deterministic CBOR: {e.detail}") from e
    if type(entry) is not dict:
        raise IntegrityError(Code.BAD_ENTRY, f"entry {seq} is not a map")
    if kind is None and type(entry.get("kind")) is str:
        kind = entry["kind"]
    if entry.get("kind") != kind or entry.get("seq") != seq:
        raise IntegrityError(Code.BAD_ENTRY, f"entry {seq} claims seq {entry.get('seq')!r}, kind {entry.get('kind')!r}")
    if entry.get("v") != ENTRY_VERSION:
        raise IntegrityError(Code.BAD_ENTRY, f"entry {seq} has unsupported version {entry.get('v')!r}")
    spec = SPECS.get(kind)
    if spec is None:
        raise IntegrityError(Code.BAD_ENTRY, f"entry {seq} has a kind this verifier does not know: {kind!r}")
    try:
        check_shape(entry, spec, what=f"entry {seq} ({kind})", error=IntegrityError,
                    optional=LATER.get(kind, frozenset()))
        if "privatizer" in entry and kind in LATER:
            check_privatizer_record(entry["privatizer"], what=f"entry {seq} ({kind}).privatizer")
        if kind == "summary":
            _check_retired(entry["retired"], what=f"entry {seq} (summary).retired")
        if kind == "spend":
            _check_noise_groups(entry["noise_groups"], what=f"entry {seq} (spend).noise_groups")
        if kind == "tune":
            for name, spec in (("trials", TRIAL), ("eps_by_class", CLASS_EPS)):
                for index, item in enumerate(entry[name]):
                    check_shape(item, spec, what=f"entry {seq} (tune).{name}[{index}]", error=IntegrityError)
    except GovtrainError as e:
        raise IntegrityError(Code.BAD_ENTRY, e.detail) from e
    return entry


def decode_stored(stored: "ledger_store.StoredEntry") -> dict:
    """`decode_entry` of a stored row whose body hashes to its stored leaf: what the checkpoints signed. A
    reader that acts on entries (the writer's rules, the planner, retention) reads only those: a database
    writer without keys can edit a body in place, but not the tree its leaf is part of."""
    if ledger_store.leaf_hash(stored.body) != stored.leaf_hash:
        raise IntegrityError(Code.LEAF_HASH_MISMATCH, f"entry {stored.seq} ({stored.kind}) does not hash to its signed "
                                                      "leaf: the database was edited; run govtrain-verify")
    return decode_entry(stored.body, seq=stored.seq, kind=stored.kind)


def check_privatizer_record(record: dict, *, what: str) -> None:
    """A privatizer record's shape: a text "name" and at most 16 parameters, each a lower-case key to an unsigned
    integer, text, or a list of at most `PRIVATIZER_LIST_MAX` 63-bit integers, signed (a matrix factorization's
    strategy; nothing nested). Whether its privatizer takes them is the verifier's question
    (`privatizers.rules.check_record`)."""
    if type(record.get("name")) is not str or not record["name"]:
        raise IntegrityError(Code.MISSING_FIELD, f"{what} must name its privatizer (a text \"name\")")
    if len(record) > 17:
        raise IntegrityError(Code.BAD_VALUE, f"{what} has more than 16 parameters")
    for key, value in record.items():
        if type(key) is not str or not PRIVATIZER_KEYS.fullmatch(key):
            raise IntegrityError(Code.BAD_VALUE, f"{what} has a key that is no parameter name: {key!r}")
        if type(value) is str:
            if len(value) > 64:
                raise IntegrityError(Code.BAD_VALUE, f"{what}.{key} is longer than 64 characters")
        elif type(value) is list:
            if len(value) > PRIVATIZER_LIST_MAX:
                raise IntegrityError(Code.BAD_VALUE, f"{what}.{key} holds more than {PRIVATIZER_LIST_MAX} values")
            if not all(type(v) is int and -INT63_MAX <= v <= INT63_MAX for v in value):
                raise IntegrityError(Code.WRONG_TYPE, f"{what}.{key} must be a list of 63-bit integers")
        elif type(value) is not int or not 0 <= value <= INT63_MAX:
            raise IntegrityError(Code.WRONG_TYPE, f"{what}.{key} must be an unsigned integer, text or a list of "
                                                  "63-bit integers")


def _check_noise_groups(groups: list, *, what: str) -> None:
    for index, item in enumerate(groups):
        check_shape(item, NOISE_GROUP, what=f"{what}[{index}]", error=IntegrityError)
        if any(type(name) is not str for name in item["classes"]):
            raise IntegrityError(Code.WRONG_TYPE, f"{what}[{index}].classes must be class names")


def _check_retired(retired: list, *, what: str) -> None:
    for index, item in enumerate(retired):
        where = f"{what}[{index}]"
        check_shape(item, RETIRED, what=where, error=IntegrityError)
        for name in _DIGESTS:
            if len(item[name]) != 32:
                raise IntegrityError(Code.BAD_VALUE, f"{where}.{name} must be 32 bytes")
        for position, value in enumerate(item["entry_seqs"]):
            if type(value) is not int or not 0 <= value <= INT63_MAX:
                raise IntegrityError(Code.WRONG_TYPE, f"{where}.entry_seqs[{position}] must be an unsigned integer")
        for position, spent in enumerate(item["spends"]):
            check_shape(spent, SPENT, what=f"{where}.spends[{position}]", error=IntegrityError, optional=SPENT_LATER)
            _check_noise_groups(spent["noise_groups"], what=f"{where}.spends[{position}].noise_groups")
            if "privatizer" in spent:
                check_privatizer_record(spent["privatizer"], what=f"{where}.spends[{position}].privatizer")
