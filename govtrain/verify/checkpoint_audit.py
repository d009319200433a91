"""Steps 6 to 8 of the verifier (docs/design.md §6): the checkpoints the pass meets and those the auditor trusts.

The full pass (`full_audit.py`) appends each entry's leaf to `tree` and each policy to `policies`; at every
checkpoint's size it asks `check` whether the checkpoint signs that tree under the policy in force, and, for a
policy change, carries the signature of the policy it replaced. At the end, `trusted` holds the auditor's own
checkpoints against the ledger (rollback, fork).
"""

from __future__ import annotations

from typing import Sequence

import ledger_store
from govtrain.errors import Code
from govtrain.ledger.checkpoint import Checkpoint, NoteError, verify_checkpoint
from govtrain.ledger.merkle import CompactRange, root_of
from govtrain.ledger.policy_chain import UnauthorisedPolicy, authorise_policy_change, note_keys
from govtrain.policy.model import Policy
from govtrain.verify.report import VerificationReport, _Failure, fork_detail


class CheckpointAudit:
    def __init__(self, store: ledger_store.LedgerStore, report: VerificationReport) -> None:
        self.store, self.report = store, report
        self.tree = CompactRange()
        self.verified_checkpoints: list[tuple[int, bytes]] = []  # (size, root) that matched
        self.policies: list[tuple[int, Policy]] = []  # (seq, policy) in ledger order: what governs which size
        self.unauthorised: list[tuple[int, Policy]] = []  # policy entries no checkpoint has covered yet

    def check(self, stored: ledger_store.StoredCheckpoint, policy: Policy) -> None:
        """Step 6: `stored` carries the signature of the policy each change before it replaced, is signed by a
        key of `policy` (the one in force) and signs the root of the entries read so far."""
        for seq, before in self.unauthorised:  # 6. a policy change is authorised by the policy it replaces
            try:
                authorise_policy_change(seq, before, dict(self.policies)[seq], stored.note)
            except UnauthorisedPolicy as e:
                raise _Failure(e.code, e.detail, seq=seq, checkpoint=stored.id) from e
        self.unauthorised.clear()
        try:
            checkpoint = verify_checkpoint(stored.note, origin=policy.origin, keys=note_keys(policy))
        except NoteError as e:
            raise _Failure(Code.BAD_CHECKPOINT, f"checkpoint {stored.id} (size {stored.size}): {e.detail}",
                           checkpoint=stored.id, seq=self.last_good_size()) from e
        root = self.tree.root()
        if checkpoint.size != stored.size or checkpoint.root != stored.root or root != checkpoint.root:
            raise _Failure(Code.BAD_CHECKPOINT, f"checkpoint {stored.id}: the root of the first {stored.size} "
                           f"entries is not the signed root; an entry from {self.last_good_size()} on was altered",
                           checkpoint=stored.id, seq=self.last_good_size())
        self.verified_checkpoints.append((stored.size, root))

    def policy_at(self, size: int) -> Policy:
        """The policy in force after the first `size` entries."""
        return [policy for seq, policy in self.policies if seq < max(size, 1)][-1]

    def last_good_size(self) -> int:
        return self.verified_checkpoints[-1][0] if self.verified_checkpoints else 0

    def trusted(self, notes: Sequence[str], total: int) -> None:
        """Step 8: every checkpoint the auditor already trusts is a prefix of this ledger."""
        roots = dict(self.verified_checkpoints)
        agreed = 0
        parsed: list[Checkpoint] = []
        for note in notes:
            parsed.append(self._trusted_note(note, total))
        self.report.trusted_checkpoints = len(parsed)
        for checkpoint in sorted(parsed, key=lambda c: c.size):
            if checkpoint.size > total:
                raise _Failure(Code.ROLLBACK, f"a trusted checkpoint signs {checkpoint.size} entries but this "
                               f"ledger holds {total}: it was rolled back", seq=total)
            root = roots.get(checkpoint.size)
            if root is None:
                root = root_of(self.store.leaf_hashes(0, checkpoint.size))
            if root != checkpoint.root:
                raise _Failure(Code.FORK, fork_detail(checkpoint.size, agreed), seq=agreed)
            agreed = checkpoint.size

    def _trusted_note(self, note: str, total: int) -> Checkpoint:
        """A trusted checkpoint, verified under the ledger keys in force at the size it signs."""
        try:
            size = min(int(note.split("\n")[1]), total)
        except (IndexError, ValueError):
            size = total
        policy = self.policy_at(size)
        try:
            return verify_checkpoint(note, origin=policy.origin, keys=note_keys(policy))
        except NoteError as e:
            raise _Failure(Code.FORK, f"a trusted checkpoint is not signed by a ledger key in force at its size for "
                           f"this ledger's origin ({e.detail}): this is not the ledger it came from") from e
