"""Policy changes (docs/design.md §4, §6): a `policy` entry governs every entry after it, once the policy before it
authorises it. `Ledger.open`, `Ledger.change_policy` and the verifier apply these same checks.

What a change may not alter: the origin (the ledger's name in every checkpoint), and the terms every
contribution signed its budget under, which every spend is accounted at: the privacy unit, δ and the
accountant (`fixed_terms_changed`). Everything else (keys, attesters, classes, q, epochs, retention, floors)
is either recorded in the spend it affects or only governs what is admitted next.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import ledger_store
from govtrain.encoding import cbor
from govtrain.errors import Code, IntegrityError
from govtrain.ledger.checkpoint import NoteError, NoteKey, verify_checkpoint
from govtrain.ledger.entries import decode_entry
from govtrain.policy.model import Policy


def note_keys(policy: Policy) -> list[NoteKey]:
    """The policy's ledger keys as checkpoint verifier keys."""
    return [NoteKey(k.name, k.public_key) for k in policy.ledger_keys]


class UnauthorisedPolicy(IntegrityError):
    """A `policy` entry that the policy before it did not sign for, renames the ledger, or cannot be read."""

    def __init__(self, seq: int, detail: str, code: Code = Code.POLICY_UNAUTHORISED) -> None:
        super().__init__(code, f"entry {seq}: {detail}")
        self.seq = seq


def authorise_policy_change(seq: int, before: Policy, after: Policy, covering_note: str | None) -> None:
    """Raise unless the `policy` entry `seq` may replace `before` with `after`: same origin, and the first
    checkpoint that covers it is signed by a ledger key of `after` *and* one of `before`. Without the
    second signature, whoever can write the database could list their own keys and sign for them."""
    if after.origin != before.origin:
        raise UnauthorisedPolicy(seq, f"a policy change may not rename the ledger ({before.origin!r} to "
                                      f"{after.origin!r})")
    fixed = fixed_terms_changed(before, after)
    if fixed is not None:
        raise UnauthorisedPolicy(seq, f"a policy change may not change {fixed}")
    if covering_note is None:
        raise UnauthorisedPolicy(seq, "no checkpoint covers this policy change")
    try:
        verify_checkpoint(covering_note, origin=after.origin, keys=note_keys(after),
                          also_signed_by=[note_keys(before)])
    except NoteError as e:
        raise UnauthorisedPolicy(seq, f"the checkpoint that first covers this policy change is not signed by a "
                                      f"ledger key of the policy before it and one of the new policy ({e.detail})") from e


def fixed_terms_changed(before: Policy, after: Policy) -> str | None:
    """What a policy change may not alter, named, or None. The privacy unit, delta and accountant are the
    terms every contribution signed its budget under: each spend is accounted at the ledger's one delta with
    its one accountant, so raising delta (or moving to an accountant that reads the same history as cheaper)
    would let a contribution take steps its signed budget forbade under the rules it was admitted under.
    Start a new ledger for other terms."""
    if after.unit != before.unit:
        return (f"the privacy unit ({before.unit} to {after.unit}): every ε in the ledger is about one "
                "unit")
    if after.delta_p != before.delta_p:
        return (f"delta ({before.delta_p / 1e12:g} to {after.delta_p / 1e12:g}): every budget was signed, and "
                "every spend is accounted, at the ledger's delta")
    if after.accountant != before.accountant:
        return (f"the accountant ({before.accountant} to {after.accountant}): every budget was signed, and every "
                "spend is accounted, under the ledger's accountant")
    return None


def policy_chain(store: ledger_store.LedgerStore, header: dict, *,
                 signed: Iterable[tuple[int, dict]] | None = None,
                 covering: Callable[[int], str | None] | None = None) -> list[tuple[int, Policy]]:
    """(seq, policy) for the header and every `policy` entry, each change authorised by the policy before it.

    A policy entry is found by its body, never by the kind column alone: a database writer without keys can
    relabel a row, and a change it hid would leave the policy before it in force. `signed` gives the (seq, body)
    of the policy entries of a signed read (`ledger/signed.py`); by default they are the rows whose kind column
    or body names a policy entry (`_policy_entries`). `covering(seq)` is the note of the checkpoint that first
    covers entry `seq` (default: the store's first checkpoint row past it)."""
    if covering is None:
        def covering(seq: int) -> str | None:
            found = store.checkpoint_covering(seq)
            return found.note if found is not None else None

    chain = [(0, Policy.from_record(header["policy"]))]
    for seq, entry in (_policy_entries(store) if signed is None else signed):
        try:
            policy = Policy.from_record(entry["policy"])
        except IntegrityError as e:
            raise UnauthorisedPolicy(seq, e.detail, e.code) from e
        authorise_policy_change(seq, chain[-1][1], policy, covering(seq))
        chain.append((seq, policy))
    return chain


# A policy entry's body holds its kind as deterministic CBOR: the text "kind", then the text "policy".
_POLICY_KIND = cbor.encode("kind") + cbor.encode("policy")


def _policy_entries(store: ledger_store.LedgerStore) -> Iterator[tuple[int, dict]]:
    """(seq, body) of every policy entry, found by its body (the database searches every body for a policy
    entry's kind field) as well as by the kind column; each body checked against its signed leaf, and a kind
    column that disagrees with its body refused: the database was edited."""
    for stored in store.entries_holding(_POLICY_KIND, kinds=("policy",)):
        if stored.body is None:
            raise UnauthorisedPolicy(stored.seq, "a policy entry has no body; only admit, spend and withdraw "
                                                 "entries may be redacted", Code.BAD_ENTRY)
        if ledger_store.leaf_hash(stored.body) != stored.leaf_hash:  # what the checkpoints signed, not an edit
            raise UnauthorisedPolicy(stored.seq, f"the {stored.kind} entry's body does not hash to its signed leaf: "
                                                 "the database was edited; run govtrain-verify",
                                     Code.LEAF_HASH_MISMATCH)
        try:
            entry = decode_entry(stored.body, seq=stored.seq, kind=None)
        except IntegrityError as e:
            raise UnauthorisedPolicy(stored.seq, f"{e.detail}; run govtrain-verify", e.code) from e
        if (entry["kind"] == "policy") != (stored.kind == "policy"):
            raise UnauthorisedPolicy(stored.seq, f"its kind column says {stored.kind!r}, its body is a "
                                                 f"{entry['kind']!r} entry: the database was edited; run "
                                                 "govtrain-verify", Code.BAD_ENTRY)
        if entry["kind"] == "policy":
            yield stored.seq, entry
