"""Issue 20, items 1, 4, 7 and 8: what an operator holding the ledger key could once make `govtrain-verify` pass.

The adversary holds the ledger key (it signs whatever it appends) and may run modified code; the auditor
verifies the ledger and holds nothing else. Each attack is shown first as the writer's refusal (nothing
written: size, head and admissions unchanged) and then as an entry appended and signed past the writer's
checks, which the verifier must name:

- item 8: a spend whose sigma_eff no noise schedule implies (sigma_eff 100 where the live contributions'
  signed sigma*C allow 1), or whose schedule claims more noise than any live contribution signed for;
- item 7: a policy change that raises delta (or changes the accountant), which re-prices every past spend;
- item 4: a `tune` recorded after retention dropped its trials' spend bodies, stating epsilon 0;
- item 1: two run entries with one id, or one id's spend under two leases.
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from govtrain.accounting.spend import spend_epsilon_u
from govtrain.errors import Code, ConfigError, GovtrainError, IntegrityError
from govtrain.ledger.entries import decode_entry, run_entry, spend_entry, tune_entry
from govtrain.ledger.ledger import Ledger
from govtrain.ledger.spend_rules import noise_groups_record
from govtrain.verify.verifier import inspect_ledger, verify_ledger
from tests.conftest import Corpus, lease, record_spend, snapshot
from tests.test_signed_ledger import _admit, _db, _sql

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    from tests.test_train import save_tiny_bert

    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))

Q = 10_000  # TEST_POLICY's sampling rate
DELTA = 10_000_000  # and its delta (pico)


def _eps(*history: tuple[int, int, int], delta_p: int = DELTA) -> int:
    return spend_epsilon_u("prv", delta_p, list(history))


def _forge_spend(corpus: Corpus, contribution: str, *, sigma_u: int, eps_u: int, groups: list[dict],
                 run_id: str = "r", nonce: bytes | None = None, steps: int = 10) -> int:
    """A spend entry appended and signed with the ledger key, past `record_spend`'s checks. Returns its seq."""
    with corpus.open() as ledger:
        leaf = ledger.store.entry(ledger.store.admission(contribution).seq).leaf_hash
        epoch = ledger.epoch()
        with ledger.append(corpus.now) as appender:
            stored = appender.add("spend", corpus.now, lambda seq: spend_entry(
                seq, corpus.now, contribution_id=contribution, admit_leaf=leaf, run_id=run_id,
                run_nonce=nonce or lease(run_id), epoch=epoch, epoch_steps=10, steps=steps, sampling_rate_u=Q,
                noise_multiplier_u=sigma_u, accountant="prv", delta_p=DELTA, privacy_unit="example", eps_u=eps_u,
                noise_groups=groups))
    return stored.seq


def _failure(corpus: Corpus) -> tuple[Code, int | None, str]:
    report = inspect_ledger(corpus.url)
    assert not report.ok
    return report.error.code, report.bad_seq, report.error.detail


# -- item 8: sigma_eff has an upper bound ----------------------------------------------------------------


PUBLIC = [{"classes": ["public"], "s_pu": 1_000_000 * 1_000_000}]  # s_g = sigma 1 x C 1, the honest schedule


def test_8_the_review_attack_sigma_eff_100_is_refused_by_the_writer_and_flagged_by_the_verifier(corpus: Corpus):
    """c1 signed sigma 1, C 1 and budget 1.0: at sigma_eff 100 a whole epoch costs next to nothing, where its own
    sigma costs ten times more. The schedule implies sigma_eff <= 1 (it is the only live contribution)."""
    _admit(corpus, "c1", eps_budget_u=1_000_000)
    forged, honest = _eps((Q, 100_000_000, 10)), _eps((Q, 1_000_000, 10))
    assert forged * 10 < honest  # what the attack would save
    before = snapshot(corpus.url)
    for groups in (PUBLIC, [{"classes": ["public"], "s_pu": 100 * 10**12}]):  # honest s_g; s_g inflated to match
        with corpus.open() as ledger, pytest.raises(ConfigError) as refused:
            record_spend(ledger, 0, Q, [("c1", 10, 100_000_000, forged)], epoch_steps=10, now=corpus.now,
                         noise_groups=groups)
        assert refused.value.code is Code.BAD_ARGUMENT and "exceeds" in refused.value.detail
        assert snapshot(corpus.url) == before
    seq = _forge_spend(corpus, "c1", sigma_u=100_000_000, eps_u=forged, groups=PUBLIC)
    code, bad, detail = _failure(corpus)
    assert (code, bad) == (Code.BAD_SPEND, seq) and "sigma_eff 100000000" in detail


def test_8_a_schedule_claiming_more_noise_than_any_live_contribution_signed_fails(corpus: Corpus):
    _admit(corpus, "c1", eps_budget_u=1_000_000)
    seq = _forge_spend(corpus, "c1", sigma_u=100_000_000, eps_u=_eps((Q, 100_000_000, 10)),
                       groups=[{"classes": ["public"], "s_pu": 100 * 10**12}])
    code, bad, detail = _failure(corpus)
    assert (code, bad) == (Code.BAD_SPEND, seq) and "largest signed sigma*C" in detail


def test_8_a_group_shared_with_a_noisier_class_is_justified_only_by_a_contribution_it_charges(corpus: Corpus):
    """The schedule may cover c1 with another class's larger sigma*C only in an epoch whose spend charges a
    contribution of that class: once it withdrew, the same claim is refused, by the writer and the verifier."""
    _admit(corpus, "c1", eps_budget_u=1_000_000)
    _admit(corpus, "noisy", data_class="sensitive", clip_norm_u=500_000, noise_multiplier_u=4_000_000,
           eps_budget_u=3_000_000)  # sigma*C = 2, in pico 2e12
    shared = [{"classes": ["public", "sensitive"], "s_pu": 2 * 10**12}]
    with corpus.open() as ledger:
        record_spend(ledger, 0, Q, [("c1", 10, 2_000_000, _eps((Q, 2_000_000, 10))),
                                    ("noisy", 10, 4_000_000, _eps((Q, 4_000_000, 10)))],
                     epoch_steps=10, now=corpus.now, noise_groups=shared)
        ledger.close_epoch(now=corpus.now)
        ledger.withdraw("noisy", "leaves after epoch 0", now=corpus.now)
        before = snapshot(corpus.url)
        with pytest.raises(ConfigError) as refused:
            record_spend(ledger, 1, Q, [("c1", 10, 2_000_000, _eps((Q, 2_000_000, 10), (Q, 2_000_000, 10)))],
                         epoch_steps=10, now=corpus.now, noise_groups=shared)
    assert "largest signed sigma*C" in refused.value.detail and snapshot(corpus.url) == before
    verify_ledger(corpus.url)
    seq = _forge_spend(corpus, "c1", sigma_u=2_000_000, eps_u=_eps((Q, 2_000_000, 10), (Q, 2_000_000, 10)),
                       groups=shared)
    assert _failure(corpus)[:2] == (Code.BAD_SPEND, seq)


def _h_retires_in_epoch_0(corpus: Corpus) -> int:
    """H (sigma 50, budget: 5 steps) is charged 5 of epoch 0's 10 steps and retires; L (sigma 1) is charged at
    H's noise that epoch, as the schedule allows while H takes part."""
    h5 = _eps((Q, 50_000_000, 5))
    _admit(corpus, "H", noise_multiplier_u=50_000_000, eps_budget_u=h5)
    _admit(corpus, "L", eps_budget_u=5_000_000)
    with corpus.open() as ledger:
        record_spend(ledger, 0, Q, [("H", 5, 50_000_000, h5), ("L", 10, 50_000_000, _eps((Q, 50_000_000, 10)))],
                     epoch_steps=10, now=corpus.now, noise_groups=H_NOISE)
        ledger.close_epoch(now=corpus.now)
    return h5


H_NOISE = [{"classes": ["public"], "s_pu": 50 * 10**12}]


def test_8_review_f2_a_contribution_retired_by_its_budget_justifies_nothing_even_after_compaction(corpus: Corpus):
    """Review finding F2: retention used to forget that H retired by its budget, so after `ledger compact` its
    sigma*C justified an inflated s_g again, for a forged spend (verifier) and for `record_spend` itself."""
    _h_retires_in_epoch_0(corpus)
    history = [(Q, 50_000_000, 10), (Q, 50_000_000, 10)]
    seq = _forge_spend(corpus, "L", sigma_u=50_000_000, eps_u=_eps(*history), groups=H_NOISE)
    assert _failure(corpus)[:2] == (Code.BAD_SPEND, seq)
    with corpus.open() as ledger:
        ledger.close_epoch(now=corpus.now)
        assert [e.kind for e in ledger.compact(ledger.epoch() - 1, now=corpus.now)] == ["admit", "spend"]  # H's
    assert _failure(corpus)[:2] == (Code.BAD_SPEND, seq)  # still flagged after the compaction
    before = snapshot(corpus.url)
    with corpus.open() as ledger, pytest.raises(ConfigError):
        record_spend(ledger, 2, Q, [("L", 10, 50_000_000, _eps(*history, (Q, 50_000_000, 10)))], epoch_steps=10,
                     now=corpus.now, noise_groups=H_NOISE)
    assert snapshot(corpus.url) == before


def test_8_review_f1_a_contribution_that_affords_no_step_adds_no_noise_and_justifies_none(corpus: Corpus):
    """Review finding F1: Z (sigma 40) signed a budget below one step's cost, and H spent its budget exactly at
    an epoch's end. Neither is ever charged again, so neither may justify s_g; the scheduler no longer adds
    noise for a cohort that takes no step (it used to, and a fresh run's honest schedule then looked like
    cover for L)."""
    from govtrain.accounting.spend import SpendCalculator
    from govtrain.resolver.schedule import Member, Scheduler, cohorts_of, disjoint_groups

    one_step = _eps((Q, 40_000_000, 1))
    _admit(corpus, "Z", noise_multiplier_u=40_000_000, eps_budget_u=one_step - 1)
    _admit(corpus, "L", eps_budget_u=5_000_000)
    cohorts = cohorts_of([Member("Z", "public", 1_000_000, 40_000_000, one_step - 1),
                          Member("L", "public", 1_000_000, 1_000_000, 5_000_000)])
    plan = Scheduler(SpendCalculator("prv", DELTA), disjoint_groups(["public"]), sampling_rate_u=Q,
                     steps_per_epoch=10).plan_epoch(cohorts, 0, 0)
    assert noise_groups_record(plan.group_noise_pu) == PUBLIC  # L's own sigma*C: Z takes no step and adds nothing
    assert [r[0] for r in plan.spend_records()] == ["L"] and plan.spends[-1].retires_at == 0
    before = snapshot(corpus.url)
    with corpus.open() as ledger, pytest.raises(ConfigError):
        record_spend(ledger, 0, Q, [("L", 10, 40_000_000, _eps((Q, 40_000_000, 10)))], epoch_steps=10,
                     now=corpus.now, noise_groups=[{"classes": ["public"], "s_pu": 40 * 10**12}])
    assert snapshot(corpus.url) == before
    with corpus.open() as ledger:
        record_spend(ledger, 0, Q, plan.spend_records(), epoch_steps=10, now=corpus.now,
                     noise_groups=noise_groups_record(plan.group_noise_pu))
    verify_ledger(corpus.url)


def test_8_a_withdrawal_between_plan_and_write_ahead_plans_the_epoch_again(corpus: Corpus, tiny_bert):
    """The run planned with `noisy`, whose sigma*C set the shared noise; it withdraws before the write-ahead.
    The run plans the epoch again without it (its sigma*C no longer justifies anything) and verifies."""
    from govtrain.train.config import load_run_config
    from govtrain.train.run import Run
    from tests.test_train import _admit as admit_data, _config

    admit_data(corpus, "pub")
    admit_data(corpus, "noisy", noise_multiplier_u=3_000_000)
    lines: list[str] = []
    with corpus.open() as ledger:
        run = Run(load_run_config(_config(corpus, tiny_bert, 10)), ledger, insecure_seed=1, log=lines.append)
        run.prepare()
        assert run.plan_epoch() and run.pending["noise_groups"][0]["s_pu"] == 3 * 10**12
        ledger.withdraw("noisy", "leaves before the write-ahead", now=corpus.now)
        assert not run.write_ahead() and run.pending is None
        assert run.plan_epoch() and run.write_ahead()
        assert run.pending["noise_groups"][0]["s_pu"] == 10**12 and [r[0] for r in run.pending["spend"]] == ["pub"]
        run.release()
    assert any("planning the epoch again" in line for line in lines)
    verify_ledger(corpus.url)


@pytest.mark.parametrize("case", ["two_schedules", "class_reaches_no_group", "unknown_class", "unsorted"])
def test_8_a_malformed_or_inconsistent_schedule_fails_verification(corpus: Corpus, case: str):
    _admit(corpus, "c1")
    _admit(corpus, "c2")
    groups = {"two_schedules": [{"classes": ["public"], "s_pu": 10**12 - 1}],
              "class_reaches_no_group": [{"classes": ["sensitive"], "s_pu": 10**12}],
              "unknown_class": [{"classes": ["nobody", "public"], "s_pu": 10**12}],
              "unsorted": [{"classes": ["sensitive", "public"], "s_pu": 10**12}]}[case]
    with corpus.open() as ledger:
        record_spend(ledger, 0, Q, [("c1", 10, 1_000_000, _eps((Q, 1_000_000, 10)))], epoch_steps=10, now=corpus.now,
                     noise_groups=PUBLIC)
    seq = _forge_spend(corpus, "c2", sigma_u=1_000_000, eps_u=_eps((Q, 1_000_000, 10)), groups=groups)
    assert _failure(corpus)[:2] == (Code.BAD_SPEND, seq)


def test_8_a_real_run_records_its_schedule_and_the_verifier_recomputes_the_bound(corpus: Corpus):
    """The honest path: the scheduler's s_g, recorded as the spend's noise_groups, is the largest sigma*C of the
    eligible contributions reaching each group, and sigma_eff is min s_g / C bucketed down."""
    from govtrain.accounting.spend import SpendCalculator
    from govtrain.resolver.schedule import Member, Scheduler, cohorts_of

    _admit(corpus, "p")
    _admit(corpus, "s", data_class="sensitive", clip_norm_u=500_000, noise_multiplier_u=1_300_000,
           eps_budget_u=3_000_000)
    groups = {"public": [frozenset({"public"}), frozenset({"public", "sensitive"})],
              "sensitive": [frozenset({"public", "sensitive"})]}
    cohorts = cohorts_of([Member("p", "public", 1_000_000, 1_000_000, 5_000_000),
                          Member("s", "sensitive", 500_000, 1_300_000, 3_000_000)])
    plan = Scheduler(SpendCalculator("prv", DELTA), groups, sampling_rate_u=Q, steps_per_epoch=10).plan_epoch(
        cohorts, 0, 0)
    recorded = noise_groups_record(plan.group_noise_pu)
    assert recorded == [{"classes": ["public"], "s_pu": 10**12},
                        {"classes": ["public", "sensitive"], "s_pu": 10**12}]  # 1 x 1 > 1.3 x 0.5
    with corpus.open() as ledger:
        record_spend(ledger, 0, Q, plan.spend_records(), epoch_steps=10, now=corpus.now, noise_groups=recorded)
    spends = {s["contribution_id"]: s for s in (decode_entry(e.body, seq=e.seq, kind="spend")
                                               for e in Ledger.open(corpus.url).store.entries(kinds=("spend",)))}
    assert spends["s"]["noise_multiplier_u"] == 2_000_000 and spends["s"]["noise_groups"] == recorded
    verify_ledger(corpus.url)


# -- item 7: delta and the accountant are fixed for the ledger's life ------------------------------------


@pytest.mark.parametrize("change", [{"delta_p": 50_000_000_000}, {"delta_p": 1_000_000}, {"accountant": "rdp"},
                                    {"accountant": "pld"}])
def test_7_change_policy_refuses_another_delta_or_accountant_and_writes_nothing(corpus: Corpus, change: dict):
    before = snapshot(corpus.url)
    with corpus.open() as ledger:
        with pytest.raises(ConfigError) as refused:
            ledger.change_policy(dataclasses.replace(ledger.policy, **change), bytes(32), "cheaper epsilon",
                                 now=corpus.now)
        assert ledger.policy.delta_p == DELTA and ledger.policy.accountant == "prv"  # the open ledger kept its policy
    assert refused.value.code is Code.POLICY_INVALID and snapshot(corpus.url) == before


def test_7_the_review_attack_a_forged_delta_change_is_refused_by_open_and_the_verifier(corpus: Corpus, monkeypatch):
    """The review's case: c1 signed sigma 2 and budget 1.5 at delta 1e-5. Its history after a delta of 0.05 looks
    affordable, but at the delta it signed it costs several times its budget. An operator holding the key
    writes the delta change past `change_policy` (both signatures on its checkpoint, as a genuine change has)."""
    import govtrain.ledger.ledger as ledger_module

    _admit(corpus, "c1", noise_multiplier_u=2_000_000, eps_budget_u=1_500_000)
    loose = 50_000_000_000
    history = [(200_000, 2_000_000, 82)]  # the review's q 0.2, and about its 83 steps
    assert _eps(*history, delta_p=loose) <= 1_500_000 and _eps(*history) > 2.9 * 1_500_000  # the attack would pay
    monkeypatch.setattr(ledger_module, "fixed_terms_changed", lambda before, after: None)
    with corpus.open() as ledger:
        ledger.change_policy(dataclasses.replace(ledger.policy, delta_p=loose), bytes(32), "cheaper epsilon",
                             now=corpus.now)
        seq = ledger.size() - 1
    monkeypatch.undo()
    with pytest.raises(IntegrityError) as refused:
        Ledger.open(corpus.url)
    assert refused.value.code is Code.POLICY_UNAUTHORISED and "delta" in refused.value.detail
    code, bad, detail = _failure(corpus)
    assert (code, bad) == (Code.POLICY_UNAUTHORISED, seq) and "delta" in detail


def test_7_a_forged_accountant_change_fails_verification(corpus: Corpus, monkeypatch):
    import govtrain.ledger.ledger as ledger_module

    monkeypatch.setattr(ledger_module, "fixed_terms_changed", lambda before, after: None)
    with corpus.open() as ledger:
        ledger.change_policy(dataclasses.replace(ledger.policy, accountant="pld"), bytes(32), "tighter", now=corpus.now)
        seq = ledger.size() - 1
    monkeypatch.undo()
    code, bad, detail = _failure(corpus)
    assert (code, bad) == (Code.POLICY_UNAUTHORISED, seq) and "accountant" in detail


def test_7_a_policy_change_that_keeps_the_terms_still_verifies(corpus: Corpus):
    with corpus.open() as ledger:
        ledger.change_policy(dataclasses.replace(ledger.policy, retention_epochs=3), bytes(32), "keep longer",
                             now=corpus.now)
    verify_ledger(corpus.url)


# -- item 4: a tune after retention states what its trials charged ----------------------------------------


def _trials_then_compaction(corpus: Corpus) -> tuple[list[tuple[str, bytes]], dict]:
    """Two trials of tune "t" (their spend and run entries, one epoch each), the search killed before its tune
    entry, then ledger epochs closed and `ledger compact`, which drops every trial spend's body. Returns the
    trials and the totals a tune entry recorded before the compaction would have stated."""
    from tests.test_tune import _charged_runs

    trials = _charged_runs(corpus, "t", 2)
    with corpus.open() as ledger:
        before = ledger.tune_book().totals([run for run, _ in trials])
        for _ in range(2):
            ledger.close_epoch(now=corpus.now)
        redacted = ledger.compact(ledger.epoch() - 1, now=corpus.now)
    assert {e.kind for e in redacted} == {"admit", "spend"}  # every trial's spend body is gone
    assert before[0] > 0
    return trials, {"eps_u": before[0], "eps_by_class": before[1]}


def test_4_a_tune_recorded_after_compaction_states_what_its_trials_charged(corpus: Corpus):
    trials, stated = _trials_then_compaction(corpus)
    with corpus.open() as ledger:
        _, fields = ledger.record_tune(tune_id="t", config_sha256=bytes(32), grid_sha256=bytes(32), trials=trials,
                                       selection_sha256=hashlib.sha256(b"held out").digest(), metric="accuracy",
                                       selected_run_id=trials[-1][0], now=corpus.now)
    assert {"eps_u": fields["eps_u"], "eps_by_class": fields["eps_by_class"]} == stated
    assert verify_ledger(corpus.url).by_kind["tune"] == 1


@pytest.mark.parametrize("stated", [0, "one_less"])
def test_4_the_review_attack_a_tune_stating_less_after_compaction_fails_verification(corpus: Corpus, stated):
    trials, honest = _trials_then_compaction(corpus)
    by_class = [{**item, "eps_u": 0 if stated == 0 else item["eps_u"] - 1} for item in honest["eps_by_class"]]
    fields = dict(tune_id="t", config_sha256=bytes(32), grid_sha256=bytes(32),
                  trials=[{"run_id": r, "config_sha256": c} for r, c in trials],
                  selection_sha256=hashlib.sha256(b"held out").digest(), metric="accuracy", selected_run_id=None,
                  adapter_sha256=None, accounting="composition", eps_u=max(i["eps_u"] for i in by_class),
                  eps_by_class=by_class)
    with corpus.open() as ledger:
        with ledger.append(corpus.now) as appender:
            stored = appender.add("tune", corpus.now, lambda seq: tune_entry(seq, corpus.now, **fields))
    code, bad, detail = _failure(corpus)
    assert (code, bad) == (Code.BAD_TUNE, stored.seq) and "imply" in detail


def test_4_a_summary_that_understates_a_retired_spend_fails_while_the_bodies_are_there(corpus: Corpus):
    """The summary's record of each spend is checked against the spend bodies before they are dropped."""
    from tests.test_attacks_retention import _operator_summary, _retired

    from tests.test_tune import _charged_runs

    _charged_runs(corpus, "t", 1)
    with corpus.open() as ledger:
        for _ in range(2):
            ledger.close_epoch(now=corpus.now)
        seqs = {row.contribution_id: row.seq for row in ledger.store.admissions()}
        named = {cid: [e.seq for e in ledger.store.entries(kinds=("admit", "spend"))
                       if decode_entry(e.body, seq=e.seq, kind=e.kind)["contribution_id"] == cid] for cid in seqs}
    retired = _retired(corpus, seqs["a"], named["a"])
    retired = {**retired, "eps_u": 0, "spends": [{**s, "eps_u": 0} for s in retired["spends"]]}
    seq = _operator_summary(corpus, data_class="public", before_epoch=1, retired=[retired], redact=False)
    code, bad, detail = _failure(corpus)
    assert (code, bad) == (Code.BAD_SUMMARY, seq)


def test_4_record_tune_refuses_over_a_redacted_spend_that_no_summary_records(corpus: Corpus):
    """A database writer without keys drops a trial's spend body outside any summary: the tune's total can no
    longer be stated, so nothing is recorded (the verifier flags the redaction itself)."""
    from tests.test_tune import _charged_runs

    trials = _charged_runs(corpus, "t", 2)
    with corpus.open() as ledger:
        seq = next(iter(ledger.store.entries(kinds=("spend",)))).seq
    _sql(_db(corpus.url), f"UPDATE entries SET body = NULL WHERE seq = {seq}")
    before = snapshot(corpus.url)
    with corpus.open() as ledger, pytest.raises(GovtrainError) as refused:
        ledger.record_tune(tune_id="t", config_sha256=bytes(32), grid_sha256=bytes(32), trials=trials,
                           selection_sha256=hashlib.sha256(b"held out").digest(), metric="accuracy",
                           selected_run_id=None, now=corpus.now)
    assert refused.value.code is Code.BAD_SUMMARY and snapshot(corpus.url) == before


# -- item 1 (the verifier's side): one run id, one lease ---------------------------------------------------


def _run_entry(corpus: Corpus, run_id: str, nonce: bytes) -> int:
    with corpus.open() as ledger:
        with ledger.append(corpus.now) as appender:
            stored = appender.add("run", corpus.now, lambda seq: run_entry(
                seq, corpus.now, run_id=run_id, run_nonce=nonce, mechanism="dpsgd", device="cpu", precision="fp32",
                config_sha256=bytes(32), base_model_sha256=bytes(32), adapter_sha256=None))
    return stored.seq


def _one_epoch(corpus: Corpus, run_id: str = "r", nonce: bytes | None = None) -> None:
    with corpus.open() as ledger:
        record_spend(ledger, ledger.epoch(), Q, [("c1", 10, 1_000_000, _eps(*[(Q, 1_000_000, 10)] * (ledger.epoch() + 1)))],
                     run_id=run_id, run_nonce=nonce, epoch_steps=10, now=corpus.now)
        ledger.close_epoch(now=corpus.now)


def test_1_the_writer_refuses_a_second_lease_and_a_second_run_entry_for_one_id(corpus: Corpus):
    _admit(corpus, "c1")
    _one_epoch(corpus)
    before = snapshot(corpus.url)
    with corpus.open() as ledger:
        for write in (lambda: record_spend(ledger, 1, Q, [("c1", 10, 1_000_000, _eps(*[(Q, 1_000_000, 10)] * 2))],
                                           run_nonce=bytes(16), epoch_steps=10, now=corpus.now),
                      lambda: ledger.record_run("r", "dpsgd", bytes(32), bytes(32), None, now=corpus.now,
                                                run_nonce=bytes(16))):
            with pytest.raises(GovtrainError) as refused:
                write()
            assert refused.value.code is Code.RUN_ID_TAKEN and refused.value.exit_code == 3
    assert snapshot(corpus.url) == before
    with corpus.open() as ledger:
        ledger.record_run("r", "dpsgd", bytes(32), bytes(32), None, now=corpus.now, run_nonce=lease("r"))
        with pytest.raises(GovtrainError) as refused:  # the lease ended with its run entry
            ledger.record_run("r", "dpsgd", bytes(32), bytes(32), None, now=corpus.now, run_nonce=lease("r"))
        assert refused.value.code is Code.RUN_ID_TAKEN
        with pytest.raises(GovtrainError) as refused:
            record_spend(ledger, 1, Q, [("c1", 10, 1_000_000, _eps(*[(Q, 1_000_000, 10)] * 2))], epoch_steps=10,
                         now=corpus.now)
        assert refused.value.code is Code.RUN_ID_TAKEN
    verify_ledger(corpus.url)


@pytest.mark.parametrize("case", ["second_run_entry", "run_entry_of_another_lease", "spend_under_a_second_lease",
                                  "spend_after_the_run_entry"])
def test_1_the_verifier_names_a_second_run_under_one_id(corpus: Corpus, case: str):
    _admit(corpus, "c1")
    _one_epoch(corpus)
    if case == "second_run_entry":
        _run_entry(corpus, "r", lease("r"))
        seq, code = _run_entry(corpus, "r", lease("r")), Code.BAD_RUN
    elif case == "run_entry_of_another_lease":
        seq, code = _run_entry(corpus, "r", bytes(16)), Code.BAD_RUN
    elif case == "spend_under_a_second_lease":
        seq, code = _forge_spend(corpus, "c1", sigma_u=1_000_000, eps_u=_eps(*[(Q, 1_000_000, 10)] * 2),
                                 groups=PUBLIC, nonce=bytes(16)), Code.BAD_SPEND
    else:
        _run_entry(corpus, "r", lease("r"))
        seq, code = _forge_spend(corpus, "c1", sigma_u=1_000_000, eps_u=_eps(*[(Q, 1_000_000, 10)] * 2),
                                 groups=PUBLIC), Code.BAD_SPEND
    assert _failure(corpus)[:2] == (code, seq)


def test_1_a_lease_survives_retention(corpus: Corpus):
    """Once retention drops a run's spend bodies, its lease is still read from the summaries: a later spend of
    that id under another nonce still fails."""
    _admit(corpus, "c1")
    _one_epoch(corpus)
    with corpus.open() as ledger:
        for _ in range(2):
            ledger.close_epoch(now=corpus.now)
    _admit(corpus, "c2")  # after the compaction's boundary: it stays
    with corpus.open() as ledger:
        assert {e.kind for e in ledger.compact(ledger.epoch() - 1, now=corpus.now)} == {"admit", "spend"}
    verify_ledger(corpus.url)
    with corpus.open() as ledger, pytest.raises(GovtrainError) as refused:
        record_spend(ledger, ledger.epoch(), Q, [("c2", 10, 1_000_000, _eps((Q, 1_000_000, 10)))],
                     run_nonce=bytes(16), epoch_steps=10, now=corpus.now)
    assert refused.value.code is Code.RUN_ID_TAKEN
    seq = _forge_spend(corpus, "c2", sigma_u=1_000_000, eps_u=_eps((Q, 1_000_000, 10)), groups=PUBLIC,
                       nonce=bytes(16))
    assert _failure(corpus)[:2] == (Code.BAD_SPEND, seq)


def test_4_the_documented_resume_path_after_compaction_states_the_trials_epsilon(corpus: Corpus, monkeypatch,
                                                                                  tmp_path_factory):
    """The review's path through `govtrain tune` itself: the trials finish, the search is killed before its tune
    entry, `ledger compact` drops the trials' spend bodies, and `tune --id` runs again. It used to state
    epsilon 0; it states what the trials charged, and the verifier agrees."""
    pytest.importorskip("transformers")
    import govtrain.ledger.ledger as ledger_module
    from govtrain.train.config import load_run_config
    from govtrain.train.tune import load_grid, tune
    from tests.test_train import _admit as admit_data, _config, save_tiny_bert
    from tests.test_tune import _grid, _valid

    admit_data(corpus, "pub")
    _valid(corpus)
    config_path = _config(corpus, save_tiny_bert(tmp_path_factory.mktemp("tiny-bert")), 5)
    grid = load_grid(_grid(corpus, '"optimizer.lr" = [0.01, 0.05]'))
    options = dict(tune_id="again", insecure_seed=3, log=lambda line: None, now=lambda: corpus.now)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ledger_module.Ledger, "record_tune", killed)
    with pytest.raises(KeyboardInterrupt):
        tune(load_run_config(config_path), config_path, grid, corpus.url, **options)
    monkeypatch.undo()
    with corpus.open() as ledger:
        charged = ledger.tune_book().totals(["again-trial-0", "again-trial-1"])
        for _ in range(2):
            ledger.close_epoch(now=corpus.now)
        assert {e.kind for e in ledger.compact(ledger.epoch() - 1, now=corpus.now)} == {"admit", "spend"}
    result = tune(load_run_config(config_path), config_path, grid, corpus.url, **options)
    assert charged[0] > 0 and (result.eps_u, result.eps_by_class) == (charged[0], {i["data_class"]: i["eps_u"]
                                                                                    for i in charged[1]})
    assert verify_ledger(corpus.url).by_kind["tune"] == 1


# -- review finding F3: what a summary records about a redacted spend still meets the rules -----------------


def test_1_review_f3_a_second_lease_stays_flagged_after_an_honest_compaction(corpus: Corpus):
    """A forged spend under a second nonce for run "r" fails; an honest `ledger compact` that redacts it (its
    summary true to the bodies) used to make it pass, although the summary itself records both nonces."""
    for name in ("c1", "c2", "c3"):
        _admit(corpus, name)
    with corpus.open() as ledger:
        record_spend(ledger, 0, Q, [("c1", 10, 1_000_000, _eps((Q, 1_000_000, 10))),
                                    ("c2", 10, 1_000_000, _eps((Q, 1_000_000, 10)))], epoch_steps=10, now=corpus.now,
                     noise_groups=PUBLIC)
    seq = _forge_spend(corpus, "c3", sigma_u=1_000_000, eps_u=_eps((Q, 1_000_000, 10)), groups=PUBLIC,
                       nonce=b"\x02" * 16)
    assert _failure(corpus)[:2] == (Code.BAD_SPEND, seq)
    with corpus.open() as ledger:
        ledger.close_epoch(now=corpus.now)
        record_spend(ledger, 1, Q, [("c2", 10, 1_000_000, _eps((Q, 1_000_000, 10), (Q, 1_000_000, 10)))],
                     epoch_steps=10, now=corpus.now, noise_groups=PUBLIC)
        for _ in range(2):
            ledger.close_epoch(now=corpus.now)
        assert seq in {e.seq for e in ledger.compact(1, now=corpus.now)}
    code, bad, detail = _failure(corpus)
    assert (code, bad) == (Code.BAD_SPEND, seq) and "redacted" in detail


def test_4_review_f3_a_trials_spend_after_its_tune_stays_flagged_after_compaction(corpus: Corpus):
    from tests.test_tune import _charged_runs

    trials = _charged_runs(corpus, "t", 2)
    _admit(corpus, "x")
    with corpus.open() as ledger:
        ledger.record_tune(tune_id="t", config_sha256=bytes(32), grid_sha256=bytes(32), trials=trials,
                           selection_sha256=hashlib.sha256(b"held out").digest(), metric="accuracy",
                           selected_run_id=trials[0][0], now=corpus.now)
    seq = _forge_spend(corpus, "x", sigma_u=1_000_000, eps_u=_eps((Q, 1_000_000, 10)), groups=PUBLIC,
                       run_id="t-trial-0")  # charged by a trial after its run entry and its tune
    assert _failure(corpus)[:2] == (Code.BAD_SPEND, seq)
    with corpus.open() as ledger:
        for _ in range(2):
            ledger.close_epoch(now=corpus.now)
        assert seq in {e.seq for e in ledger.compact(ledger.epoch() - 1, now=corpus.now)}
    assert _failure(corpus)[:2] == (Code.BAD_SPEND, seq)


# -- second review round: a redacted spend is held to every rule its body met ----------------------------------


def _compact_keeping(corpus: Corpus, alive: str, history: list) -> None:
    """Close the epoch, charge `alive` (so that it is not retired) in the next, close it, and compact."""
    with corpus.open() as ledger:
        ledger.close_epoch(now=corpus.now)
        record_spend(ledger, ledger.epoch(), Q, [(alive, 10, 1_000_000, _eps(*history, (Q, 1_000_000, 10)))],
                     epoch_steps=10, now=corpus.now, noise_groups=PUBLIC)
        ledger.close_epoch(now=corpus.now)
        ledger.compact(ledger.epoch() - 1, now=corpus.now)


@pytest.mark.parametrize("case", ["spend_after_retiring", "over_budget", "understated"])
def test_8_review_h2_an_honest_compaction_does_not_launder_a_forged_spend(corpus: Corpus, case: str):
    """Second review, H2: the first fix checked only what a summary then recorded of a redacted spend (lease,
    hold, rising epsilon), so a forged spend compacted honestly verified: one charging H after its budget
    retired it (and so justifying 50x noise for L), one above its signed budget, one far below what its own q,
    sigma and steps imply. Summaries now keep every field the rules read, and a redacted spend meets them all."""
    _admit(corpus, "L", eps_budget_u=5_000_000)
    if case == "spend_after_retiring":
        h5 = _eps((Q, 50_000_000, 5))
        _admit(corpus, "H", noise_multiplier_u=50_000_000, eps_budget_u=h5)
        with corpus.open() as ledger:
            record_spend(ledger, 0, Q, [("H", 5, 50_000_000, h5), ("L", 10, 50_000_000, _eps((Q, 50_000_000, 10)))],
                         epoch_steps=10, now=corpus.now, noise_groups=H_NOISE)
            ledger.close_epoch(now=corpus.now)
        seq = _forge_spend(corpus, "H", sigma_u=50_000_000, eps_u=h5, groups=H_NOISE)
        history = [(Q, 50_000_000, 10)]
    else:
        _admit(corpus, "X", eps_budget_u=1_000_000)
        with corpus.open() as ledger:
            record_spend(ledger, 0, Q, [("L", 10, 1_000_000, _eps((Q, 1_000_000, 10)))], epoch_steps=10,
                         now=corpus.now, noise_groups=PUBLIC)
        seq = _forge_spend(corpus, "X", sigma_u=1_000_000, groups=PUBLIC,
                           eps_u=3_000_000 if case == "over_budget" else 1)
        history = [(Q, 1_000_000, 10)]
    before = _failure(corpus)
    assert before[:2] == (Code.BAD_SPEND, seq)
    _compact_keeping(corpus, "L", history)
    with corpus.open() as ledger:
        assert ledger.store.entry(seq).body is None  # the forged spend's body is gone
    code, bad, detail = _failure(corpus)
    assert (code, bad) == (Code.BAD_SPEND, seq) and "redacted" in detail


def test_1_review_l3_the_writer_refuses_a_run_named_as_a_recorded_tunes_trial(corpus: Corpus):
    """Second review, L3: a fresh run that happened to be called `sweep-trial-9` after tune `sweep` was
    recorded got its spend signed, and the ledger then failed verification for good."""
    from tests.test_tune import _charged_runs

    trials = _charged_runs(corpus, "sweep", 2)
    _admit(corpus, "x")
    with corpus.open() as ledger:
        ledger.record_tune(tune_id="sweep", config_sha256=bytes(32), grid_sha256=bytes(32), trials=trials,
                           selection_sha256=hashlib.sha256(b"held out").digest(), metric="accuracy",
                           selected_run_id=None, now=corpus.now)
    before = snapshot(corpus.url)
    with corpus.open() as ledger, pytest.raises(GovtrainError) as refused:
        record_spend(ledger, ledger.epoch(), Q, [("x", 10, 1_000_000, _eps((Q, 1_000_000, 10)))],
                     run_id="sweep-trial-9", epoch_steps=10, now=corpus.now)
    assert refused.value.code is Code.RUN_ID_TAKEN and snapshot(corpus.url) == before
    verify_ledger(corpus.url)


def test_8_review_l2_a_compaction_between_plan_and_write_ahead_plans_the_epoch_again(corpus: Corpus, tiny_bert):
    """Second review, L2: `ledger compact` retired an idle contribution the run had planned with, and the run
    stopped with `redacted`; like a withdrawal in that window, it now plans the epoch again."""
    from govtrain.train.config import load_run_config
    from govtrain.train.run import Run
    from tests.test_train import _admit as admit_data, _config

    admit_data(corpus, "pub")
    admit_data(corpus, "idle")
    with corpus.open() as ledger:
        ledger.close_epoch(now=corpus.now)
        record_spend(ledger, 1, Q, [("pub", 10, 1_000_000, _eps((Q, 1_000_000, 10)))], run_id="other",
                     epoch_steps=10, now=corpus.now)
        ledger.close_epoch(now=corpus.now)
        run = Run(load_run_config(_config(corpus, tiny_bert, 10)), ledger, insecure_seed=1, log=lambda line: None,
                  confirm=True)  # "other" charged pub
        run.prepare()
        assert run.plan_epoch() and [r[0] for r in run.pending["spend"]] == ["idle", "pub"]
        assert [e.kind for e in ledger.compact(1, now=corpus.now)] == ["admit"]  # idle, named by nothing since
        assert not run.write_ahead() and run.pending is None
        assert run.plan_epoch() and run.write_ahead() and [r[0] for r in run.pending["spend"]] == ["pub"]
        run.release()
    verify_ledger(corpus.url)
