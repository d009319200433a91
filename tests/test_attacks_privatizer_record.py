"""The privatizer a spend records is what its charge follows from (docs/privatizers.md): the writer records it on
every spend and run entry, the verifier rebuilds it from the record and recomputes the charge, and flags a record
or an ε that does not hold. Old ledgers, whose entries record none, are the i.i.d. Gaussian's and still verify."""

from __future__ import annotations

import math
from typing import Any, Mapping

import pytest

from govtrain.accounting.spend import spend_epsilon_u
from govtrain.errors import ConfigError, IntegrityError, RejectedError
from govtrain.ledger.entries import decode_entry
from govtrain.ledger.ledger import Ledger
from govtrain.privatizers import REGISTRY, rules
from govtrain.privatizers.rules import RULES
from govtrain.privatizers.base import Charge, Participation
from govtrain.privatizers.gaussian import IIDGaussian
from govtrain.verify.verifier import verify_ledger
from tests.conftest import Corpus, lease, noise_groups_for, record_spend, snapshot
from tests.test_signed_ledger import _admit

Q_U, DELTA_P = 10_000, 10_000_000  # TEST_POLICY: q = 0.01, δ = 1e-5, prv


class CyclicTest(IIDGaussian):
    """A stand-in for an amplified matrix factorization, registered in these tests only: b bands, cyclic
    participation over b parts, and the charge jax_privacy's reduction gives banded MF, DP-SGD over ceil(T / b)
    rounds at rate min(1, b·q)."""

    name = "cyclic-test"
    correlated = True
    parameters = ("bands",)

    def __init__(self, bands: int) -> None:
        self.bands = bands

    def record(self) -> dict[str, Any]:
        return {"name": self.name, "bands": self.bands}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "CyclicTest":
        if set(record) != {"name", "bands"} or type(record["bands"]) is not int or record["bands"] < 1:
            raise ValueError("a cyclic-test record is its name and bands >= 1")
        return cls(record["bands"])

    def participation(self) -> Participation:
        return Participation(scheme="cyclic", cycle=self.bands)

    def charge(self, *, sampling_rate_u: int, noise_multiplier_u: int, steps: int) -> Charge:
        return Charge(family="gaussian", sampling_rate_u=min(1_000_000, self.bands * sampling_rate_u),
                      noise_multiplier_u=noise_multiplier_u, rounds=math.ceil(steps / self.bands))


def cyclic_rule(record: Mapping[str, Any]):  # type: ignore[no-untyped-def]
    """cyclic-test's rule (what the verifier charges through): its class's own check and charge."""
    return CyclicTest.from_record(record).charge


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(REGISTRY, "cyclic-test", f"{__name__}:CyclicTest")
    monkeypatch.setitem(RULES, "cyclic-test", f"{__name__}:cyclic_rule")
    rules.cache_clear()
    yield
    rules.cache_clear()  # no record resolved under these registries outlives them


def _cyclic_eps(bands: int, steps: int = 10, sigma_u: int = 1_000_000) -> int:
    return spend_epsilon_u("prv", DELTA_P, [(min(1_000_000, bands * Q_U), sigma_u, math.ceil(steps / bands))])


def _forged_spend(corpus: Corpus, contribution: str, *, eps_u: int, privatizer: dict | None, run_id: str = "run-a",
                  steps: int = 10) -> None:
    """What an operator holding the ledger key can append: a spend entry of its own making, signed."""
    from govtrain.ledger.entries import spend_entry

    with Ledger.open(corpus.url) as ledger:
        leaf = ledger.store.entry(ledger.store.admission(contribution).seq).leaf_hash
        fields = dict(contribution_id=contribution, admit_leaf=leaf, run_id=run_id, run_nonce=lease(run_id),
                      epoch=ledger.epoch(), epoch_steps=10, steps=steps, sampling_rate_u=Q_U,
                      noise_multiplier_u=1_000_000, accountant="prv", delta_p=DELTA_P, privacy_unit="example",
                      eps_u=eps_u, noise_groups=noise_groups_for(ledger, [contribution]))
        if privatizer is not None:
            fields["privatizer"] = privatizer
        with ledger.append(corpus.now) as appender:
            appender.add("spend", corpus.now, lambda seq: spend_entry(seq, corpus.now, **fields))


def _entries(corpus: Corpus, kind: str) -> list[dict]:
    with corpus.open() as ledger:
        return [decode_entry(e.body, seq=e.seq, kind=e.kind) for e in ledger.store.entries(kinds=(kind,))]


def _flagged(corpus: Corpus, code: str) -> IntegrityError:
    with pytest.raises(IntegrityError) as info:
        verify_ledger(corpus.url)
    assert info.value.code.value == code, info.value
    return info.value


def test_spend_and_run_entries_record_the_privatizer_and_verify(corpus: Corpus):
    _admit(corpus, "a")
    with corpus.open() as ledger:
        record_spend(ledger, 0, Q_U, [("a", 10, 1_000_000, _cyclic_eps(1))], run_id="run-a", epoch_steps=10,
                     now=corpus.now)
        ledger.record_run("run-a", "dpsgd", bytes(32), bytes(32), None, corpus.now, run_nonce=lease("run-a"))
    assert [s["privatizer"] for s in _entries(corpus, "spend")] == [{"name": "gaussian"}]
    assert [r["privatizer"] for r in _entries(corpus, "run")] == [{"name": "gaussian"}]
    report = verify_ledger(corpus.url)
    assert report.spend_recomputed and report.by_kind["spend"] == 1


def test_a_ledger_written_before_privatizers_still_verifies(corpus: Corpus):
    """Spend entries without the field (as govtrain wrote them before) are the i.i.d. Gaussian's: recomputed as
    DP-SGD, and a ledger that starts recording privatizers after them verifies too."""
    _admit(corpus, "old")
    _admit(corpus, "new")
    _forged_spend(corpus, "old", eps_u=_cyclic_eps(1), privatizer=None)  # the old format, honest
    assert "privatizer" not in _entries(corpus, "spend")[0]
    assert verify_ledger(corpus.url).spend_recomputed
    with corpus.open() as ledger:
        ledger.close_epoch(now=corpus.now)
        record_spend(ledger, 1, Q_U, [("new", 10, 1_000_000, _cyclic_eps(1))], run_id="run-b", epoch_steps=10,
                     now=corpus.now)
    assert verify_ledger(corpus.url).spend_recomputed


def test_the_verifier_recomputes_a_cyclic_charge_from_the_record(corpus: Corpus, registered):
    _admit(corpus, "a")
    with corpus.open() as ledger:
        ledger.record_spend(0, Q_U, [("a", 10, 1_000_000, _cyclic_eps(4))], run_id="run-a", run_nonce=lease("run-a"),
                            epoch_steps=10, noise_groups=noise_groups_for(ledger, ["a"]), now=corpus.now,
                            privatizer={"name": "cyclic-test", "bands": 4})
    assert _entries(corpus, "spend")[0]["privatizer"] == {"name": "cyclic-test", "bands": 4}
    assert verify_ledger(corpus.url).spend_recomputed


@pytest.mark.parametrize("charged", [1, 2])
def test_a_spend_whose_recorded_privatizer_does_not_imply_its_epsilon_is_flagged(corpus: Corpus, registered,
                                                                                 charged):
    """A spend recording the 4-band cyclic privatizer, with the ε of DP-SGD (1 band) or of 2 bands: at q = 0.01
    and sigma 1, 4 bands amplified over 3 rounds at 4q imply more, so the record does not imply its ε."""
    _admit(corpus, "a")
    assert _cyclic_eps(charged) < _cyclic_eps(4)
    _forged_spend(corpus, "a", eps_u=_cyclic_eps(charged), privatizer={"name": "cyclic-test", "bands": 4})
    error = _flagged(corpus, "bad_spend")
    assert "privatizer imply" in error.detail


@pytest.mark.parametrize("recorded, code", [
    ({"name": "uniform"}, "bad_privatizer"),  # no such privatizer
    ({"name": "gaussian", "bands": 4}, "bad_privatizer"),  # a parameter the i.i.d. Gaussian does not take
    ({"name": "cyclic-test", "bands": 0}, "bad_privatizer"),  # a parameter it cannot rebuild from
    ({"name": "cyclic-test", "bands": -1}, "bad_entry"),  # not even the record's shape
    ({"bands": 4}, "bad_entry"),
])
def test_a_spend_whose_privatizer_record_cannot_be_rebuilt_fails_with_a_code(corpus: Corpus, registered, recorded,
                                                                             code):
    _admit(corpus, "a")
    _forged_spend(corpus, "a", eps_u=_cyclic_eps(1), privatizer=recorded)
    _flagged(corpus, code)


def test_a_privatizer_known_only_elsewhere_fails_here_with_a_code(corpus: Corpus, registered):
    """A ledger written where cyclic-test exists, verified where it does not: the charge cannot be recomputed."""
    _admit(corpus, "a")
    _forged_spend(corpus, "a", eps_u=_cyclic_eps(4), privatizer={"name": "cyclic-test", "bands": 4})
    verify_ledger(corpus.url)
    del REGISTRY["cyclic-test"]
    del RULES["cyclic-test"]
    rules.cache_clear()
    assert "cyclic-test" in _flagged(corpus, "bad_privatizer").detail


def test_the_writer_refuses_a_record_it_cannot_rebuild_and_writes_nothing(corpus: Corpus):
    _admit(corpus, "a")
    before = snapshot(corpus.url)
    for record, code in (({"name": "uniform"}, "privatizer_unknown"), ({"name": "gaussian", "bands": 2},
                                                                        "privatizer_invalid"),
                         ({"name": "gaussian", "Bad": 1}, "privatizer_invalid")):
        with corpus.open() as ledger, pytest.raises(ConfigError) as info:
            ledger.record_spend(0, Q_U, [("a", 10, 1_000_000, _cyclic_eps(1))], run_id="run-a",
                                run_nonce=lease("run-a"), epoch_steps=10, noise_groups=noise_groups_for(ledger, ["a"]),
                                now=corpus.now, privatizer=record)
        assert info.value.code.value == code
        assert snapshot(corpus.url) == before


def test_a_run_keeps_one_privatizer_across_its_spend_and_its_run_entry(corpus: Corpus, registered):
    """Spend rule 8: a later epoch's spend of the run, or its run entry, under another privatizer is refused by
    the writer (nothing written) and flagged by the verifier."""
    _admit(corpus, "a")
    cyclic = {"name": "cyclic-test", "bands": 4}
    with corpus.open() as ledger:
        ledger.record_spend(0, Q_U, [("a", 10, 1_000_000, _cyclic_eps(4))], run_id="run-a", run_nonce=lease("run-a"),
                            epoch_steps=10, noise_groups=noise_groups_for(ledger, ["a"]), now=corpus.now,
                            privatizer=cyclic)
        ledger.close_epoch(now=corpus.now)
    before = snapshot(corpus.url)
    with corpus.open() as ledger:
        with pytest.raises(ConfigError) as info:
            record_spend(ledger, 1, Q_U, [("a", 10, 1_000_000, 2_500_000)], run_id="run-a", epoch_steps=10,
                         now=corpus.now)
        assert info.value.code.value == "bad_argument" and "one privatizer" in info.value.detail
        with pytest.raises((ConfigError, RejectedError)) as info:
            ledger.record_run("run-a", "dpsgd", bytes(32), bytes(32), None, corpus.now, run_nonce=lease("run-a"))
        assert "one privatizer" in info.value.detail
    assert snapshot(corpus.url) == before
    with corpus.open() as ledger:
        ledger.record_run("run-a", "dpsgd", bytes(32), bytes(32), None, corpus.now, run_nonce=lease("run-a"),
                          privatizer=cyclic)
    assert _entries(corpus, "run")[0]["privatizer"] == cyclic
    verify_ledger(corpus.url)


def test_the_verifier_rebuilds_gaussian_records_without_importing_torch(corpus: Corpus):
    import subprocess
    import sys

    _admit(corpus, "a")
    with corpus.open() as ledger:
        record_spend(ledger, 0, Q_U, [("a", 10, 1_000_000, _cyclic_eps(1))], run_id="run-a", epoch_steps=10,
                     now=corpus.now)
        ledger.record_run("run-a", "dpsgd", bytes(32), bytes(32), None, corpus.now, run_nonce=lease("run-a"))
    code = ("import sys\nfrom govtrain.verify.verifier import verify_ledger\n"
            f"assert verify_ledger({corpus.url!r}).spend_recomputed\n"
            "assert 'torch' not in sys.modules, 'the verifier imported torch'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_scheduler_plans_with_the_privatizers_charge(registered):
    """Planning an epoch under the cyclic privatizer charges ceil(steps / b) rounds at min(1, b·q), and the most
    steps a budget affords is found through the same charge."""
    from govtrain.accounting.spend import SpendCalculator
    from govtrain.resolver.schedule import Member, Scheduler, cohorts_of, disjoint_groups

    member = Member("a", "public", 1_000_000, 1_000_000, 8_000_000)
    cyclic = CyclicTest(4)
    scheduler = Scheduler(SpendCalculator("prv", DELTA_P), disjoint_groups(["public"]), sampling_rate_u=Q_U,
                          steps_per_epoch=10, privatizer=cyclic)
    cohorts = cohorts_of([member])
    plan = scheduler.plan_epoch(cohorts, 0, 0, 10)
    assert cohorts[0].history == ((4 * Q_U, 1_000_000, 3),) and plan.spends[0].eps_u == _cyclic_eps(4)
    tight = cohorts_of([Member("b", "public", 1_000_000, 1_000_000, _cyclic_eps(4, steps=5))])
    plan = scheduler.plan_epoch(tight, 1, 10, 10)
    assert plan.spends[0].steps == 8 and plan.spends[0].eps_u == _cyclic_eps(4, steps=8)  # 2 rounds: 8 steps
    gaussian = Scheduler(SpendCalculator("prv", DELTA_P), disjoint_groups(["public"]), sampling_rate_u=Q_U,
                         steps_per_epoch=10)
    again = cohorts_of([member])
    gaussian.plan_epoch(again, 0, 0, 10)
    assert again[0].history == ((Q_U, 1_000_000, 10),)  # no privatizer: today's bucket


class FamilyTest(CyclicTest):
    """A privatizer of another noise family, for these tests only."""

    name = "family-test"
    correlated = False

    def charge(self, *, sampling_rate_u: int, noise_multiplier_u: int, steps: int) -> Charge:
        return Charge(family="test-family", sampling_rate_u=sampling_rate_u, noise_multiplier_u=noise_multiplier_u,
                      rounds=steps, params=(self.bands,))


def family_rule(record: Mapping[str, Any]):  # type: ignore[no-untyped-def]
    return FamilyTest.from_record(record).charge


def test_a_history_with_another_family_goes_to_the_families_accountant(monkeypatch):
    import sys
    import types

    import govtrain.accounting as accounting
    from govtrain.privatizers import charges
    from govtrain.accounting.spend import SpendCalculator

    monkeypatch.setitem(REGISTRY, "family-test", f"{__name__}:FamilyTest")
    monkeypatch.setitem(RULES, "family-test", f"{__name__}:family_rule")
    rules.cache_clear()
    seen = []
    fake = types.ModuleType("govtrain.accounting.families")
    fake.epsilon_u = lambda accountant, delta_p, history: seen.append((accountant, delta_p, history)) or 123
    monkeypatch.setitem(sys.modules, "govtrain.accounting.families", fake)
    monkeypatch.setattr(accounting, "families", fake, raising=False)
    history = (charges.spend_item({"sampling_rate_u": Q_U, "noise_multiplier_u": 2_000_000, "steps": 10}),
               charges.spend_item({"sampling_rate_u": Q_U, "noise_multiplier_u": 3_000_000, "steps": 5,
                                   "privatizer": {"name": "family-test", "bands": 2}}))
    assert history[0] == (Q_U, 2_000_000, 10)  # a spend before privatizers: today's bucket
    calculator = SpendCalculator("prv", DELTA_P)
    assert calculator.epsilon_u(history) == 123
    assert seen == [("prv", DELTA_P, (Charge(family="gaussian", sampling_rate_u=Q_U, noise_multiplier_u=2_000_000,
                                             rounds=10),
                                      Charge(family="test-family", sampling_rate_u=Q_U, noise_multiplier_u=3_000_000,
                                             rounds=5, params=(2,))))]
    assert calculator.epsilon_u(history) == 123 and len(seen) == 1  # cached by its charges
    monkeypatch.setitem(sys.modules, "govtrain.accounting.families", None)  # an installation without them
    monkeypatch.delattr(accounting, "families")
    with pytest.raises(ConfigError) as info:
        SpendCalculator("prv", DELTA_P).epsilon_u(history)
    assert info.value.code.value == "privatizer_unknown" and "test-family" in info.value.detail
    rules.cache_clear()
