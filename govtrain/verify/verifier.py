"""The auditor's verifier (docs/design.md §6). It never imports torch and trusts nothing it reads.

One pass over the entries, in the order an auditor would check them:
  1. sequence numbers are dense from 0 (nothing removed or inserted);
  2. every body hashes to its stored leaf hash (RFC 9162 §2.1.1); a body may be missing only
     where a summary redacted it (step 9);
  3. every body is deterministic CBOR with its row's envelope and the exact fields of its kind;
  4. the header is entry 0 and only entry 0; it and every later `policy` entry is well formed,
     with screened keys; each governs the entries after it, and none changes the privacy unit, δ or
     the accountant (the terms every budget was signed under);
  5. per kind: every admit's attestation verifies under the trust store and matches the entry
     (unless `attestations=False`); withdrawals name an admitted, not yet withdrawn contribution
     and its admit leaf; epochs count up from 0; entry times never decrease; spends name an eligible
     contribution, carry the policy's accountant, δ and q (or, where the policy sets an expected batch
     size, a q no lower than it over the live records), σ_eff at least the signed σ, a cumulative ε that
     never falls and never exceeds the signed budget, meet `spend_rules` (a run id is one lease, one
     run per epoch, steps bounded by the epoch, fewer only where the contribution retires, σ_eff no
     larger than the recorded noise schedule implies and s_g no larger than the signed σ·C of what the
     epoch's spend charges), and, given an accountant, at least what the recorded history implies (the seam
     `SpendAccountant`); a spend retention redacted is held to all of this as its summary recorded it;
     a run entry is the only one of its id and carries its spend's lease; a `tune` lists its own
     trials, each with one run entry and spend before it, selects one of them with the adapter its run
     entry recorded, scored on no admitted data, and states exactly the epsilon the trials' spend entries
     charged (`govtrain/ledger/tuning.py`);
  6. the root of every checkpointed prefix equals the checkpoint's root, and every checkpoint is a
     signed note by a ledger key of the policy in force, for the policy's origin; the first one to
     cover a `policy` entry is also signed by a ledger key of the policy before it;
  7. the last checkpoint covers every entry (the ledger signs each state it reaches: an unsigned
     tail is a forgery) and no checkpoint covers entries the ledger lacks (truncation);
  8. every checkpoint the auditor already trusts is signed by a ledger key in force at its size and
     is a prefix of this ledger (else rollback or fork);
  9. retention: every redacted entry belongs to a contribution a summary retired; each summary is
     behind the retention horizon, retires whole contributions that nothing names afterwards, and
     matches the leaf hashes always and the bodies while they are present; no admit replays a
     retired contribution (govtrain/verify/retention.py);
 10. the admissions, withdrawals and summaries indexes say exactly what the entries say, column for
     column (for a redacted entry, what its summary committed to).
"""

from __future__ import annotations

from typing import Sequence

import ledger_store
from govtrain.errors import IntegrityError
from govtrain.ledger import availability
from govtrain.ledger.ledger import store_errors
from govtrain.verify.full_audit import _Audit
from govtrain.verify.integrity import NOT_CHECKED, _integrity
from govtrain.verify.report import SpendAccountant, VerificationReport, _Failure, tampered

__all__ = ["SpendAccountant", "VerificationReport", "inspect_ledger", "recorded_accountant", "verify_ledger"]


def verify_ledger(url: str, **options) -> VerificationReport:
    """Audit the ledger at `url`; raises `IntegrityError` naming the first bad entry or checkpoint."""
    report = inspect_ledger(url, **options)
    if report.error is not None:
        raise report.error
    return report


def recorded_accountant(accountant: str, delta_p: int, history: Sequence[tuple[int, int, int]]) -> int:
    """The default `SpendAccountant`: govtrain's own accountants, cached across contributions."""
    from govtrain.accounting.spend import spend_epsilon_u

    return spend_epsilon_u(accountant, delta_p, history)


def inspect_ledger(url: str, *, trusted_checkpoints: Sequence[str] = (), attestations: bool = True,
                   accountant: SpendAccountant | None = recorded_accountant,
                   integrity_only: bool = False) -> VerificationReport:
    """Audit the ledger at `url` and return a report for display (the error, if any, inside it).

    Every recorded spend is recomputed from its recorded parameters with the recorded accountant
    (`accountant`; pass None to skip that, the one step that costs accountant time).

    `integrity_only` checks steps 1, 2, 6, 7 and 8 (sequence, leaf hashes, roots, checkpoint signatures,
    truncation, unsigned tails, trusted checkpoints) and each body's kind against its row, without decoding
    entries: the structure an auditor can check for millions of entries in seconds. What it leaves to the
    full pass is listed in the report (`integrity.NOT_CHECKED`).
    """
    with store_errors():
        store = ledger_store.LedgerStore.open(url)
    availability.guard(store)  # a database that goes away mid-audit: ledger_unavailable, not a driver traceback
    report = VerificationReport(url=store.url, attestations_verified=attestations and not integrity_only,
                                spend_recomputed=accountant is not None and not integrity_only,
                                not_checked=NOT_CHECKED if integrity_only else ())
    try:
        with store.snapshot():  # one moment of a ledger that writers may be appending to
            if integrity_only:
                _integrity(store, report, trusted_checkpoints)
            else:
                _Audit(store, report, attestations, accountant).run(trusted_checkpoints)
    except _Failure as e:
        report.error, report.bad_seq, report.bad_checkpoint = e, e.seq, e.checkpoint
    except ledger_store.TamperedRow as e:  # a cell of a type no ledger writes (a TEXT body, a TEXT seq)
        failure = tampered(e)
        report.error, report.bad_seq, report.bad_checkpoint = failure, failure.seq, failure.checkpoint
    except IntegrityError as e:
        report.error = e
    finally:
        store.close()
    return report
