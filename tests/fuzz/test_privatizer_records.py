"""Fuzzing the charge a privatizer record implies, on the verifier's path (docs/privatizers.md).

A spend or run entry's `privatizer` record is signed by whoever holds the ledger key: untrusted input to the auditor.
Whatever it holds, recomputing its charge (`charges.spend_item`, the rules of `govtrain.privatizers.rules`) and the
ε that charge implies (the verifier's accountant) returns or raises a coded `GovtrainError`: never a traceback.

Two harnesses, hypothesis at the "ci" profile (HYPOTHESIS_PROFILE=fuzz: longer):
- `test_the_charge_path_raises_only_coded_errors`: records of every registered privatizer, valid ones mutated (a
  field dropped, added, or set to an int at an edge, a list of ints, text, or something no CBOR map decodes to in
  a checked entry), through `spend_item` and then the accountant, as `_Audit._charge` calls them;
- `test_the_verifier_flags_a_forged_record_with_a_code`: fewer, through the whole verifier: a key-holding operator
  appends a signed spend carrying the record, and `inspect_ledger` gives a verdict (coded) or verifies.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from govtrain import units
from govtrain.privatizers.charges import spend_item
from govtrain.privatizers.rules import RULES
from govtrain.verify.verifier import inspect_ledger, recorded_accountant
from tests.fuzz.common import check, fuzz_settings

P = units.PICO
Q_U, DELTA_P = 10_000, 10_000_000  # TEST_POLICY: q = 0.01, δ = 1e-5, prv
# The spend's σ: at least a policy's floor (TEST_POLICY's 0.5). A σ far below 0.1 is no record's doing (the PLD
# accountant exhausts memory on one at 10^-6 under the i.i.d. Gaussian alone); a record may not bring the charge
# below 0.1 (`rules.MIN_CHARGED_MULTIPLIER_U`), which these edits reach.
FLOOR_U = 500_000
VALID = {
    "gaussian": {"name": "gaussian"},
    "banded-mf": {"name": "banded-mf", "bands": 2, "horizon": 10, "coefficients_p": [800_000_000_000, 600_000_000_000]},
    "blt": {"name": "blt", "buffers": 2, "horizon": 100, "min_separation": 3, "theta_p": [900_000_000_000, P // 2],
            "omega_p": [300_000_000_000, 200_000_000_000]},
    "laplace": {"name": "laplace", "granularity_bits": 16, "beta_exp": 40, "dimension": 1_000},
    "discrete-gaussian": {"name": "discrete-gaussian", "granularity_bits": 16, "beta_exp": 40, "dimension": 1_000},
    "skellam": {"name": "skellam", "granularity_bits": 8, "beta_exp": 40, "dimension": 1_000},
}
# Seeds: the valid records, and a BLT a hair from θ = 1 (m ≈ 2·10^12: no noise left at small σ).
SEEDS = (*VALID.values(), {"name": "blt", "buffers": 1, "horizon": 100, "min_separation": 1, "theta_p": [P - 1],
                           "omega_p": [P]})
EDGES = (0, 1, 2, 7, 8, 9, 16, 24, 25, 64, 256, 257, 4096, P // 2, P - 3, P - 1, P, P + 1, 2 ** 31, 2 ** 62,
         2 ** 63 - 1)
KEYS = ("name", "bands", "buffers", "horizon", "min_separation", "coefficients_p", "theta_p", "omega_p",
        "granularity_bits", "beta_exp", "dimension", "other")

uint63 = st.one_of(st.sampled_from(EDGES), st.integers(0, 2 ** 63 - 1))
uint_list = st.lists(uint63, max_size=12)
# What a checked entry can hold (uint63, text, a list of uint63) and, for the charge path alone, what it cannot.
value = st.one_of(uint63, uint_list, st.text(max_size=8), st.sampled_from(list(VALID)))
odd = st.one_of(st.integers(-2 ** 70, -1), st.booleans(), st.floats(allow_nan=True), st.none(),
                st.lists(st.lists(uint63, max_size=2), max_size=2), st.dictionaries(st.text(max_size=2), uint63,
                                                                                     max_size=2), st.binary(max_size=4))


@st.composite
def records(draw, *, checked: bool) -> dict:
    """A valid record of a registered privatizer, then 0-3 edits (checked: only values a checked entry holds)."""
    record = dict(draw(st.sampled_from([seed for seed in SEEDS if seed["name"] in RULES])))
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from(KEYS))
        if draw(st.booleans()) and key in record and key != "name":
            del record[key]
        elif key in ("theta_p", "omega_p", "coefficients_p") and draw(st.booleans()):
            same = isinstance(record.get(key), list) and draw(st.booleans())  # keep the length: the values change
            size = len(record[key]) if same else draw(st.integers(0, 8))
            record[key] = draw(st.lists(uint63, min_size=size, max_size=size))
        else:
            record[key] = draw(value if checked or draw(st.booleans()) else odd)
    return record


def _charged(record: dict, q_u: int, sigma_u: int, steps: int, accountant: str = "prv") -> None:
    """What `_Audit._charge` does with a spend's record: its item, then the ε of a history holding it."""
    item = spend_item({"sampling_rate_u": q_u, "noise_multiplier_u": sigma_u, "steps": steps, "privatizer": record})
    recorded_accountant(accountant, DELTA_P, [item])


@fuzz_settings(scale=0.5)  # the accountants cost up to half a second an example
@given(records(checked=False), st.integers(1, units.MICRO), st.one_of(st.integers(FLOOR_U, 10 ** 9), st.sampled_from(
    (FLOOR_U, 1_000_000))), st.integers(0, 100),
       st.sampled_from(("rdp", "pld", "prv")))
def test_the_charge_path_raises_only_coded_errors(record, q_u, sigma_u, steps, accountant):
    error = check(lambda: _charged(record, q_u, sigma_u, steps, accountant))
    if error is not None:
        assert error.code.value in ("privatizer_invalid", "privatizer_unknown"), error


def test_the_edits_reach_every_verdict():
    """The harness is not vacuous: valid records charge, and edits give both refusals."""
    assert all(check(lambda r=r: _charged(r, Q_U, 1_000_000, 10)) is None for r in VALID.values())
    codes = {check(lambda r=r: _charged(r, Q_U, 1_000_000, 10)).code.value for r in (
        {**VALID["blt"], "theta_p": [P, 1]}, {"name": "uniform"}, {**VALID["skellam"], "granularity_bits": 9})}
    assert codes == {"privatizer_invalid", "privatizer_unknown"}


@functools.cache
def _base() -> tuple[Path, int]:
    """A ledger with contribution "a" admitted (σ 1, ε ≤ 10): its database file, kept for the session."""
    from tests.conftest import make_corpus
    from tests.test_signed_ledger import _admit

    root = Path(tempfile.mkdtemp(prefix="govtrain-fuzz-records-"))
    corpus = make_corpus(root, f"sqlite:///{root / 'ledger.db'}")
    _admit(corpus, "a", eps_budget_u=10_000_000)
    return root / "ledger.db", corpus.now


def _forged(record: dict, steps: int, eps_u: int) -> str:
    """A copy of the base ledger with a spend of "a" carrying `record`, signed by the ledger key."""
    from govtrain.ledger.entries import spend_entry
    from govtrain.ledger.ledger import Ledger
    from tests.conftest import lease, noise_groups_for

    db, now = _base()
    copy = Path(tempfile.mkdtemp(prefix="govtrain-fuzz-record-")) / "ledger.db"
    shutil.copyfile(db, copy)
    url = f"sqlite:///{copy}"
    with Ledger.open(url) as ledger:
        leaf = ledger.store.entry(ledger.store.admission("a").seq).leaf_hash
        fields = dict(contribution_id="a", admit_leaf=leaf, run_id="run-a", run_nonce=lease("run-a"),
                      epoch=ledger.epoch(), epoch_steps=10, steps=steps, sampling_rate_u=Q_U,
                      noise_multiplier_u=1_000_000, accountant="prv", delta_p=DELTA_P, privacy_unit="example",
                      eps_u=eps_u, noise_groups=noise_groups_for(ledger, ["a"]), privatizer=record)
        with ledger.append(now) as appender:
            appender.add("spend", now, lambda seq: spend_entry(seq, now, **fields))
    return url


@fuzz_settings(scale=0.2)
@given(records(checked=True), st.integers(1, 10), st.sampled_from([1, 100_000, 1_000_000, 10_000_000]))
def test_the_verifier_flags_a_forged_record_with_a_code(record, steps, eps_u):
    urls: list[str] = []
    if check(lambda: urls.append(_forged(record, steps, eps_u))) is not None:
        return  # the entry's shape check refused the record before signing: coded
    try:
        report = inspect_ledger(urls[0], accountant=recorded_accountant)  # anything uncoded raises out of here
        if report.error is not None:
            def raised() -> None:
                raise report.error

            assert check(raised) is report.error  # a one-line coded error
    finally:
        shutil.rmtree(Path(urls[0].removeprefix("sqlite:///")).parent, ignore_errors=True)
