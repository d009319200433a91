"""What a verification reports, and the failure that names where a ledger first goes wrong.

Shared by the full pass (`verifier.py`, `full_audit.py`), the bulk structural pass (`integrity.py`) and the
retention steps (`retention.py`), so that none of them imports another for its types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import ledger_store
from govtrain.errors import Code, GovtrainError, IntegrityError

# (accountant name, delta_p, [(sampling_rate_u, noise_multiplier_u, steps), ...]) -> epsilon in
# micro-units, rounded up. Issue 4's accountants plug in here.
SpendAccountant = Callable[[str, int, Sequence[tuple[int, int, int]]], int]


@dataclass
class VerificationReport:
    url: str
    entries: int = 0
    admissions: int = 0
    withdrawals: int = 0
    checkpoints: int = 0
    epochs: int = 0
    redacted: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    attestations_verified: bool = True
    spend_recomputed: bool = False
    trusted_checkpoints: int = 0
    error: GovtrainError | None = None
    bad_seq: int | None = None
    bad_checkpoint: int | None = None
    not_checked: tuple[str, ...] = ()  # what an integrity-only pass leaves to the full pass

    @property
    def ok(self) -> bool:
        return self.error is None

    def as_json(self) -> dict:
        report = {
            "ok": self.ok, "ledger": self.url, "entries": self.entries, "admissions": self.admissions,
            "withdrawals": self.withdrawals, "checkpoints": self.checkpoints, "epochs": self.epochs,
            "redacted": self.redacted, "by_kind": dict(sorted(self.by_kind.items())),
            "attestations_verified": self.attestations_verified, "spend_recomputed": self.spend_recomputed,
            "trusted_checkpoints": self.trusted_checkpoints,
        }
        if self.not_checked:
            report["not_checked"] = list(self.not_checked)
        if self.error is not None:
            report.update(code=self.error.code.value, detail=self.error.detail, first_bad_entry=self.bad_seq,
                          bad_checkpoint=self.bad_checkpoint)
        return report


class _Failure(IntegrityError):
    def __init__(self, code: Code, detail: str, *, seq: int | None = None, checkpoint: int | None = None) -> None:
        super().__init__(code, detail)
        self.seq = seq
        self.checkpoint = checkpoint


# A cell of the wrong type (ledger_store.TamperedRow) is a row no ledger wrote: reported as that table's tampering.
TAMPERED_CODES = {"entries": Code.BAD_ENTRY, "checkpoints": Code.BAD_CHECKPOINT, "admissions": Code.INDEX_MISMATCH,
                  "withdrawals": Code.INDEX_MISMATCH, "summaries": Code.INDEX_MISMATCH}


def tampered(error: ledger_store.TamperedRow) -> _Failure:
    """The verdict on a cell of the wrong type: the table's code (`integrity` for the tree cache and settings)."""
    key = error.key if type(error.key) is int else None
    return _Failure(TAMPERED_CODES.get(error.table, Code.INTEGRITY),
                    f"{error}: no ledger writes that, so the database was altered",
                    seq=key if error.table == "entries" else None,
                    checkpoint=key if error.table == "checkpoints" else None)


def fork_detail(size: int, agreed: int) -> str:
    """What a trusted checkpoint that this ledger contradicts says about where the two differ."""
    where = (f"entries 0..{size - 1}" if agreed == 0 else
             f"entries {agreed}..{size - 1} (the first {agreed} agree with an earlier trusted checkpoint)")
    return (f"the first {size} entries are not the ones the trusted checkpoint signed: the ledger forked; the first "
            f"differing entry is among {where}")
