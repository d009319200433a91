"""Poisson sampling (docs/design.md §5): every eligible unit (an example, or under privacy_unit = "contribution"
a whole contribution) joins a step's batch independently with probability q, so batches vary in size and may be empty
(the step then releases noise alone). A sampled contribution then uses at most a public number of its
examples, drawn uniformly without replacement (`take`).

Eligibility is decided by the caller from the ledger (admitted, not withdrawn, not retired) and
passed in per step: an example of a contribution withdrawn or retired before the step cannot be
drawn. The generator is seeded from the operating system's entropy; `insecure_seed` makes it
repeatable for tests and nothing else.

**A step's draw is a function of the run's secret key, the step and each unit's stable identity** (`key`,
`at_step`, `identities`): a unit is named by its identity (`unit_identities`: a contribution's id, or for the
example unit its contribution's id and its row's index there), never by its position in the run's corpus. Each
unit's uniform for a step is AES-256 of its identity digest under a key derived from HMAC-SHA-256(key, step), and it
joins if that is below q. So:

- a step that is run again (after a kill, after leaving the run's `with` block mid-step, from a copy of the run
  state) draws exactly the same batch, so no process can re-draw a step until it likes the draw: rejection
  sampling the sampler would void the amplification the accountant charges for;
- a withdrawal, a retirement, an admission or another order of the data files between two steps (or between a kill
  and the resume, which rebuilds the corpus) changes no other unit's uniform, part (`cyclic_parts`) or taken
  examples (`take`): each unit's participation is what it would have been in the uninterrupted run.

The key is as secret as the draws it decides (knowing which units a step drew voids amplification too): it lives only
in the run state (0600), never in a log, and goes with the state when the run ends. AES under a 256-bit key derived
per step is a pseudorandom function of the identity: no one without the key can predict or correlate two units'
uniforms (a 64-bit mixer or a 32-bit seed would not do for a secret draw: privatizers/entropy.py).
"""

from __future__ import annotations

import hashlib
import hmac
from fractions import Fraction
from typing import Iterable, Sequence

import numpy as np

IDENTITY_LABEL = b"govtrain-unit\0"
IDENTITY_BYTES = 16  # 128 bits: two units' identity digests coincide with probability ~n²/2¹²⁹, never in practice


def unit_identities(names: Iterable[str]) -> np.ndarray:
    """Each unit's identity digest, [n, 2] uint64: the first 16 bytes of SHA-256("govtrain-unit" ‖ 0x00 ‖ name) of
    its stable name, computed once per run.

    The name is the unit's own, never its place in a list: a contribution's id under privacy_unit = "contribution";
    for the example unit `routing.microbatch.example_id(contribution id, index)`, the row's index within its
    contribution. A contribution's bytes are fixed by the digest its signed attestation names, so that index always
    names the same row, and two equal rows of one contribution get two identities (a row digest would give them one:
    they would always join together, and the unit's sensitivity would double). The corpus the run started from is
    recorded in its state, and a resume whose rows moved is refused (`train/corpus.py`)."""
    digests = b"".join(hashlib.sha256(IDENTITY_LABEL + name.encode("utf-8")).digest()[:IDENTITY_BYTES]
                       for name in names)
    return np.frombuffer(digests, dtype="<u8").reshape(-1, 2).astype(np.uint64)


def _identity_bytes(identities: np.ndarray) -> bytes:
    identities = np.asarray(identities, dtype=np.uint64)
    if identities.ndim != 2 or identities.shape[1] != 2:
        raise ValueError("identities are unit_identities' [n, 2] uint64 digests")
    return identities.astype("<u8").tobytes()


class PoissonSampler:
    def __init__(self, sampling_rate: float, *, insecure_seed: int | None = None) -> None:
        if not 0 < sampling_rate <= 1:
            raise ValueError("the sampling rate must be in (0, 1]")
        self.sampling_rate = sampling_rate
        # SeedSequence() with no entropy argument draws 128 bits from the OS (secrets/urandom).
        seed = np.random.SeedSequence() if insecure_seed is None else np.random.SeedSequence(insecure_seed)
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self.key: bytes | None = None  # the run's secret: with it, each step's draw is fixed by the step
        self._step_seed: int | None = None
        self._step_bytes: bytes | None = None

    def at_step(self, step: int) -> None:
        """Draw step `step`'s batch next: with a `key`, the same step draws the same batch in any process."""
        if self.key is None:
            return
        self._step_bytes = step.to_bytes(8, "big")
        digest = hmac.new(self.key, b"govtrain-poisson-step\0" + self._step_bytes, hashlib.sha256).digest()
        self._step_seed = int.from_bytes(digest, "big")
        self._rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(self._step_seed)))

    def uniforms(self, identities: np.ndarray) -> np.ndarray:
        """The step's uniform in [0, 1) of each unit (`unit_identities` rows), in their order: the first 8 bytes of
        AES-256_k(identity digest), k = HMAC-SHA-256(key, "govtrain-poisson-unit" ‖ 0x00 ‖ step), to 53 bits. A
        function of the key, the step and the unit alone: which other units exist, and in what order, changes
        nothing. Distinct identities are distinct AES blocks, so their uniforms are independent as far as anyone
        without the key can tell."""
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        if self.key is None or self._step_bytes is None:
            raise RuntimeError("a unit's uniform needs the run's key and the step (at_step)")
        blocks = _identity_bytes(identities)
        if not blocks:
            return np.zeros(0, dtype=np.float64)
        key = hmac.new(self.key, b"govtrain-poisson-unit\0" + self._step_bytes, hashlib.sha256).digest()
        encryptor = Cipher(algorithms.AES(key), modes.ECB()).encryptor()  # one block per unit: a keyed PRP per block
        out = np.frombuffer(encryptor.update(blocks) + encryptor.finalize(), dtype="<u8")[::2]
        return (out >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))

    def _uniforms(self, eligible: np.ndarray, identities: np.ndarray | None) -> np.ndarray:
        """Each eligible unit's uniform: by its identity under the key, or (no key: tests and benchmarks only) the
        seeded generator's next draws, one per eligible unit in order."""
        if self.key is None:
            return self._rng.random(eligible.shape[0])
        if identities is None:
            raise ValueError("a keyed draw needs each unit's identity (unit_identities), never its position")
        return self.uniforms(np.asarray(identities, dtype=np.uint64)[eligible])

    def sample(self, eligible: Sequence[int] | np.ndarray, *, identities: np.ndarray | None = None) -> np.ndarray:
        """The indices (a subset of `eligible`, in its order) drawn for one step. `eligible` indexes `identities`
        (the corpus's units' `unit_identities`): each unit's uniform is its own (`uniforms`), so whether it joins
        depends on no other unit (a withdrawal, an admission or a resume that rebuilds the corpus moves no one
        else)."""
        eligible = np.asarray(eligible, dtype=np.int64)
        return eligible[self._uniforms(eligible, identities) < self.sampling_rate]

    def take(self, members: Sequence[int] | np.ndarray, most: int, *,
             identity: np.ndarray | None = None) -> np.ndarray:
        """`most` of `members` (all of them if fewer), uniformly without replacement, in their order. `members` are
        a contribution's examples in the order of its rows; with a key and `identity` (the contribution's
        `unit_identities` row) the choice of rows is fixed by the key, the step and the contribution alone, from a
        generator seeded with HMAC-SHA-256(key, "govtrain-poisson-take" ‖ 0x00 ‖ step ‖ identity)."""
        members = np.asarray(members, dtype=np.int64)
        if members.shape[0] <= most:
            return members
        rng = self._rng
        if self.key is not None and self._step_bytes is not None:
            if identity is None:
                raise ValueError("a keyed take needs the contribution's identity (unit_identities), never its position")
            digest = hmac.new(self.key, b"govtrain-poisson-take\0" + self._step_bytes
                              + _identity_bytes(np.asarray(identity).reshape(1, 2)), hashlib.sha256).digest()
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(int.from_bytes(digest, "big"))))
        return np.sort(members[rng.choice(members.shape[0], size=most, replace=False)])


_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def cyclic_parts(identities: np.ndarray, cycle: int, partition_key: bytes) -> np.ndarray:
    """Each unit's part, in [0, cycle): a public keyed hash of the unit's identity digest alone (`unit_identities`:
    SplitMix64's finaliser on its first 64 bits plus a seed from SHA-256 of `partition_key`), so it is fixed for the
    run, the same in every process and on every resume, and unchanged by any other unit's withdrawal, admission or
    order. Only the Poisson draw inside a part is secret; which part a unit is in may be public, as the partition
    is independent of the data."""
    identities = np.asarray(identities, dtype=np.uint64)
    if identities.ndim != 2 or identities.shape[1] != 2:
        raise ValueError("cyclic parts are of unit_identities' [n, 2] uint64 digests, never of positions")
    seed = np.uint64(int.from_bytes(hashlib.sha256(b"govtrain-cyclic-part\0" + partition_key).digest()[:8], "big"))
    with np.errstate(over="ignore"):
        x = identities[:, 0] * _MIX[0] + seed
        x = (x ^ (x >> np.uint64(30))) * _MIX[1]
        x = (x ^ (x >> np.uint64(27))) * _MIX[2]
        x = x ^ (x >> np.uint64(31))
    return (x % np.uint64(cycle)).astype(np.int64)


class CyclicPoissonSampler(PoissonSampler):
    """Cyclic Poisson sampling (b-min-separation), the participation banded MF's amplified accounting and BLT's
    multi-participation bound assume (`Participation(scheme="cyclic", cycle=b)`).

    Units are split into `cycle` parts by `cyclic_parts`, a public rule fixed for the run: a keyed hash of the unit's
    stable identity (`unit_identities`: its contribution's id, and for the example unit its row's index there) and
    the run's public `partition_key` (its run id). Step t draws only from part t mod cycle, each eligible unit of it
    independently at rate min(1, cycle·q), so the expected batch is unchanged and a unit takes part at most once in
    any `cycle` consecutive steps.

    The part must not depend on who else is eligible or on where the unit sits in the corpus. If it did (say, a
    unit's rank among the eligible, or its position in the run's sorted corpus, mod cycle), a withdrawal, an
    admission or a resume that rebuilds the corpus without the withdrawn would move other units to other parts, and
    a unit moved from part j to part j+1 could be drawn at steps j and j+1: two participations one step apart, which
    the accounting (disjoint bands, or separation ≥ b) does not cover. It would also make one person's presence
    change everyone else's participation pattern, so neighbouring datasets would no longer differ in one unit's
    rows alone.

    The step must be set (`at_step`) before each `sample`: the step decides the part, and, with the run's secret
    `key`, the draw (as for `PoissonSampler`, a re-run of a step draws the same batch).

    cycle·q > 1 is refused unless `allow_rate_cap=True`: the part rate is then capped at 1, so the expected batch
    falls to N/cycle, below q·N. Privacy is not at stake (the banded charge composes at min(1, cycle·q), the rate
    drawn), but the run would train on smaller batches than its configuration says."""

    def __init__(self, sampling_rate: float, *, cycle: int, partition_key: bytes | None,
                 insecure_seed: int | None = None, allow_rate_cap: bool = False) -> None:
        """`partition_key` None: set it (`partition_key = ...`) before the first `sample`, as a run does once its
        run id is known (a resumed run sets the same id, so its units stay in their parts)."""
        super().__init__(sampling_rate, insecure_seed=insecure_seed)
        if type(cycle) is not int or cycle < 1:
            raise ValueError("the cycle must be a positive int")
        if cycle * Fraction(sampling_rate) > 1 and not allow_rate_cap:
            raise ValueError(f"cycle·q = {cycle}·{sampling_rate} > 1: each part would be drawn whole and the expected "
                             f"batch would drop from q·N to N/{cycle}; lower q or the cycle (bands), or pass "
                             "allow_rate_cap=True")
        self.cycle = cycle
        self.partition_key = None if partition_key is None else bytes(partition_key)
        self._step: int | None = None

    @property
    def part_rate(self) -> float:
        """Each part member's rate, min(1, cycle·q), at the rate the sampler draws at now (a run sets q per epoch)."""
        return min(1.0, self.cycle * self.sampling_rate)

    def at_step(self, step: int) -> None:
        self._step = step
        super().at_step(step)

    def sample(self, eligible: Sequence[int] | np.ndarray, *, identities: np.ndarray | None = None) -> np.ndarray:
        """The eligible units of part (step mod cycle) drawn at rate min(1, cycle·q), in `eligible`'s order.
        `eligible` indexes `identities` (`unit_identities` of the corpus's units), which decide each unit's part
        and, with the key, its uniform."""
        if self._step is None:
            raise RuntimeError("call at_step(step) before sample: the step decides which part is drawn")
        if self.partition_key is None:
            raise RuntimeError("set the partition key (the run's id) before sample: it decides each unit's part")
        if identities is None:
            raise ValueError("a cyclic draw needs each unit's identity (unit_identities): it decides the unit's part")
        eligible = np.asarray(eligible, dtype=np.int64)
        uniforms = self._uniforms(eligible, identities)
        in_part = cyclic_parts(np.asarray(identities, dtype=np.uint64)[eligible], self.cycle,
                               self.partition_key) == self._step % self.cycle
        return eligible[in_part & (uniforms < self.part_rate)]
