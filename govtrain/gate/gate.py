"""The admissibility gate (docs/design.md §1.1, §3, §4): is this signed contribution admissible here?

`Gate.verify` decodes and verifies an attestation and checks it against the policy
(`Gate.verify_many` does the same for a batch, faster); `Gate.check_data` checks the data
file it binds. Neither touches the ledger:
replay checks and the admit entry live in `govtrain.gate.admission`. Both raise
(`AttestationError`, `EncodingError`, `AdmissionError`); neither returns a bool.

Verification is cached per ledger epoch, as the primitive prescribes (seed 004, docs/design.md):
the expensive, time-independent part (decoding, signature, schema) is reused for an
attestation seen before in the same epoch; the cheap checks that depend on the clock
and the policy run every time.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from govtrain.attest.cose import ParsedAttestation, parse_attestation, sig_structure, verify_signature
from govtrain.attest.descriptor import Descriptor
from govtrain.data import DataSummary, inspect_data
from govtrain.errors import AdmissionError, AttestationError, Code, GovtrainError
from govtrain.policy.model import Policy
from govtrain.policy.trust import TrustedKey, TrustStore
from govtrain.units import format_micro


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifiedAttestation:
    """An attestation whose signature, encoding and policy bounds have been checked."""

    raw: bytes
    kid: bytes
    attester: str
    descriptor: Descriptor
    payload: bytes
    descriptor_sha256: bytes
    attestation_sha256: bytes


class AttestationCache:
    """Verified attestations by SHA-256 of their bytes, valid for one ledger epoch."""

    def __init__(self, max_entries: int = 65_536) -> None:
        self.max_entries = max_entries
        self.epoch: int | None = None
        self._items: OrderedDict[bytes, VerifiedAttestation] = OrderedDict()
        self.hits = 0

    def get(self, digest: bytes, epoch: int) -> VerifiedAttestation | None:
        if epoch != self.epoch:
            self._items.clear()
            self.epoch = epoch
            return None
        found = self._items.get(digest)
        if found is not None:
            self._items.move_to_end(digest)
            self.hits += 1
        return found

    def put(self, digest: bytes, epoch: int, verified: VerifiedAttestation) -> None:
        if epoch != self.epoch:
            self._items.clear()
            self.epoch = epoch
        self._items[digest] = verified
        if len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


@dataclass(frozen=True, slots=True, kw_only=True)
class GatePerformance:
    """How fast the gate works. These flags never change a verdict, only how it is reached."""

    # Ed25519 checks of a batch run on this many threads (pyca/cryptography releases the GIL).
    verify_threads: int = field(default_factory=lambda: min(4, os.cpu_count() or 1))
    # Batches smaller than this stay on the calling thread.
    min_parallel_batch: int = 64


class Gate:
    def __init__(self, policy: Policy, *, trust: TrustStore | None = None, clock_skew_s: int | None = None,
                 cache: AttestationCache | None = None, performance: GatePerformance | None = None) -> None:
        self.policy = policy
        self.trust = trust if trust is not None else TrustStore.from_policy(policy)
        self.clock_skew_s = policy.clock_skew_s if clock_skew_s is None else clock_skew_s
        self.cache = cache if cache is not None else AttestationCache()
        self.performance = performance if performance is not None else GatePerformance()

    def verify(self, raw: bytes, *, now: int, epoch: int = 0) -> VerifiedAttestation:
        """Verify `.cose` bytes at time `now` (Unix seconds). Raises on the first failed step."""
        digest = hashlib.sha256(raw).digest()
        verified = self.cache.get(digest, epoch)
        if verified is None:
            parsed, key = self._parse(raw)
            verify_signature(parsed, key.public_key)
            verified = self._interpret(parsed, key, digest)
            self.cache.put(digest, epoch, verified)
        self.check_policy(verified, now)
        return verified

    def verify_many(self, raws: Sequence[bytes], *, now: int,
                    epoch: int = 0) -> list[VerifiedAttestation | GovtrainError]:
        """Verify many attestations; each result is its `VerifiedAttestation` or the error that rejects it.

        The same steps as `verify`, in the same order for each attestation, run as phases over the
        whole batch so that every Ed25519 check runs back to back with OpenSSL's tables in cache.
        """
        results: list[VerifiedAttestation | GovtrainError | None] = [None] * len(raws)
        pending: list[tuple[int, bytes, ParsedAttestation, TrustedKey, bytes]] = []
        for index, raw in enumerate(raws):
            digest = hashlib.sha256(raw).digest()
            cached = self.cache.get(digest, epoch)
            if cached is not None:
                results[index] = cached
                continue
            try:
                parsed, key = self._parse(raw)
            except GovtrainError as error:
                results[index] = error
                continue
            pending.append((index, digest, parsed, key, sig_structure(parsed.protected, parsed.payload)))
        signed = []
        for item, error in zip(pending, self._check_signatures(pending)):
            if error is None:
                signed.append(item)
            else:
                results[item[0]] = error
        for index, digest, parsed, key, _ in signed:
            try:
                verified = self._interpret(parsed, key, digest)
            except GovtrainError as error:
                results[index] = error
                continue
            self.cache.put(digest, epoch, verified)
            results[index] = verified
        for index, result in enumerate(results):
            if isinstance(result, VerifiedAttestation):
                try:
                    self.check_policy(result, now)
                except GovtrainError as error:
                    results[index] = error
        return results  # type: ignore[return-value]

    def _check_signatures(self, pending: list) -> list[GovtrainError | None]:
        """Step 6 for a batch, back to back (OpenSSL's tables stay in cache), on several threads."""

        def check(items: list) -> list[GovtrainError | None]:
            errors: list[GovtrainError | None] = []
            for _, _, parsed, key, message in items:
                try:
                    verify_signature(parsed, key.public_key, message=message)
                    errors.append(None)
                except GovtrainError as error:
                    errors.append(error)
            return errors

        threads = self.performance.verify_threads
        if threads <= 1 or len(pending) < self.performance.min_parallel_batch:
            return check(pending)
        size = -(-len(pending) // threads)
        with ThreadPoolExecutor(max_workers=threads) as pool:
            parts = pool.map(check, [pending[i : i + size] for i in range(0, len(pending), size)])
            return [error for part in parts for error in part]

    def _parse(self, raw: bytes) -> tuple[ParsedAttestation, TrustedKey]:
        # 1-4. Strict CBOR, COSE_Sign1 structure and headers (RFC 9052 §4.2, docs/design.md §2-3).
        parsed = parse_attestation(raw)
        # 5. The kid must name a key in the trust store; keys were screened as they entered it.
        return parsed, self.trust.key(parsed.kid)

    # 6. Ed25519 over Sig_structure (RFC 9052 §4.4), before the payload is interpreted: verify_signature.

    def _interpret(self, parsed: ParsedAttestation, key: TrustedKey, digest: bytes) -> VerifiedAttestation:
        # 7. The payload is a canonical descriptor with exactly the docs/design.md §3 fields.
        descriptor = Descriptor.from_bytes(parsed.payload)
        return VerifiedAttestation(
            raw=parsed.raw,
            kid=parsed.kid,
            attester=key.name,
            descriptor=descriptor,
            payload=parsed.payload,
            descriptor_sha256=hashlib.sha256(parsed.payload).digest(),
            attestation_sha256=digest,
        )

    def check_policy(self, verified: VerifiedAttestation, now: int) -> None:
        d = verified.descriptor
        policy = self.policy
        # 8. The class exists and this attester may attest it (docs/design.md §4).
        cls = policy.classes.get(d.data_class)
        if cls is None:
            raise AdmissionError(Code.UNKNOWN_CLASS, f"class {d.data_class!r} is not in this corpus's policy")
        self.trust.authorize(self.trust.key(verified.kid), d.data_class)

        # 9. Validity window against the injected clock, with the configured skew.
        skew = self.clock_skew_s
        if d.not_after < d.not_before:
            raise AttestationError(Code.BAD_WINDOW, "not_after is before not_before")
        if d.issued_at > d.not_after:
            raise AttestationError(Code.BAD_WINDOW, "issued_at is after not_after")
        if d.issued_at > now + skew:
            raise AdmissionError(Code.ISSUED_IN_FUTURE, f"issued_at is {d.issued_at - now} s in the future")
        if now + skew < d.not_before:
            raise AdmissionError(Code.NOT_YET_VALID, f"attestation is valid only from {d.not_before} (now {now})")
        if now - skew > d.not_after:
            raise AdmissionError(Code.EXPIRED, f"attestation expired at {d.not_after} (now {now})")
        if d.not_after - d.not_before > policy.max_validity_s:
            raise AdmissionError(
                Code.WINDOW_TOO_LONG,
                f"validity window of {d.not_after - d.not_before} s exceeds the policy's {policy.max_validity_s} s",
            )

        # 10. Bounds at least as strict as the corpus floor, then the class (docs/design.md §4):
        #     clip_norm <= class.clip_norm <= floor.max_clip_norm,
        #     noise_multiplier >= class.min_noise_multiplier >= floor.min_noise_multiplier,
        #     eps_budget <= class.max_eps_budget.
        corpus, own = "the corpus floor", f"the bound of class {cls.name!r}"
        bounds = (
            (Code.BELOW_CORPUS_FLOOR, "noise multiplier", d.noise_multiplier_u, ">=",
             policy.floor_min_noise_multiplier_u, corpus),
            (Code.BELOW_CORPUS_FLOOR, "clipping norm", d.clip_norm_u, "<=", policy.floor_max_clip_norm_u, corpus),
            (Code.BELOW_FLOOR, "noise multiplier", d.noise_multiplier_u, ">=", cls.min_noise_multiplier_u, own),
            (Code.BELOW_FLOOR, "clipping norm", d.clip_norm_u, "<=", cls.clip_norm_u, own),
            (Code.BUDGET_ABOVE_MAX, "budget", d.eps_budget_u, "<=", cls.max_eps_budget_u, own),
        )
        for code, what, value, relation, limit, whose in bounds:
            if value < limit if relation == ">=" else value > limit:
                raise AdmissionError(code, f"{what} {format_micro(value)} must be {relation} {format_micro(limit)}, "
                                           f"{whose}")

    def check_data(self, verified: VerifiedAttestation, data: str | Path,
                   summary: DataSummary | None = None) -> DataSummary:
        """11. The data (a file, or a dataset directory by its tree hash) is the one the descriptor binds, every
        record reads, and there are as many as declared. The digest comes first: data that is not the bound
        data is reported as such, whatever it holds."""
        d = verified.descriptor
        summary = inspect_data(data) if summary is None else summary
        if summary.sha256 != d.data_sha256:
            what = "tree hash" if Path(data).is_dir() else "SHA-256"
            raise AdmissionError(
                Code.DIGEST_MISMATCH,
                f"{what} of {data} is {summary.sha256.hex()[:16]}…, the attestation binds "
                f"{d.data_sha256.hex()[:16]}…",
            )
        if summary.problem is not None:
            raise AdmissionError(Code.BAD_DATA, summary.problem)
        if summary.records != d.records:
            raise AdmissionError(
                Code.RECORD_COUNT_MISMATCH, f"{data} holds {summary.records} records, the attestation declares {d.records}"
            )
        return summary
