"""Spend at scale, the noise schedule (s_g, sigma_eff, retirement) and calibration."""

from __future__ import annotations

import math

import pytest

from govtrain.accounting import Bucket, PLDAccountant, RDPAccountant, get_accountant
from govtrain.accounting.calibrate import (
    analytic_gaussian_sigma,
    classical_gaussian_sigma,
    gaussian_delta,
    noise_multiplier_for,
)
from govtrain.accounting.spend import SpendCalculator, bucket_sigma_u, canonical
from tests.conftest import record_spend
from govtrain.resolver.schedule import (
    Member,
    Scheduler,
    cohorts_of,
    disjoint_groups,
    group_noise,
    sigma_eff_u,
)

DELTA_P = 10_000_000
Q = 10_000  # 0.01


# -- sigma_eff bucketing and canonical histories ------------------------------------------------


@pytest.mark.parametrize("exact, signed, expected", [
    (1_234_567, 1_000_000, 1_230_000),  # 3 significant digits, down
    (999_999, 600_000, 999_000),
    (12_345_678, 1_000_000, 12_300_000),
    (612_345, 612_345, 612_345),  # never below the signed multiplier: that would make the record inadmissible
    (612_399, 612_345, 612_345),
    (800_000, 800_000, 800_000),
])
def test_sigma_eff_rounds_down_never_below_the_signed_value(exact, signed, expected):
    assert bucket_sigma_u(exact, signed) == expected <= exact


def test_sigma_eff_below_the_signed_value_is_a_bug():
    with pytest.raises(ValueError):
        bucket_sigma_u(599_999, 600_000)


def test_canonical_keys():
    history = [(Q, 1_000_000, 100), (0, 1_000_000, 50), (Q, 2_000_000, 0), (Q, 1_000_000, 100)]
    assert canonical(history, ordered=True) == ((Q, 1_000_000, 100), (Q, 1_000_000, 100))
    assert canonical(history) == ((Q, 1_000_000, 200),)
    with pytest.raises(ValueError):
        canonical([(Q, 0, 10)])


# -- the calculator -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["pld", "rdp"])
def test_calculator_caches_by_history_and_matches_the_accountant(name):
    history = ((Q, 1_000_000, 100), (Q, 1_500_000, 100))
    calculator = SpendCalculator(name, DELTA_P)
    values = calculator.epsilon_many([history] * 50 + [history[:1]] * 50)
    assert calculator.calls == 2 and calculator.lookups == 100
    direct = get_accountant(name)
    assert values[0] == direct.epsilon([Bucket.from_micro(*b) for b in history], 1e-5).epsilon_u
    assert values[-1] == direct.epsilon([Bucket.from_micro(*history[0])], 1e-5).epsilon_u
    assert calculator.epsilon_u(history) == values[0] and calculator.calls == 2


def test_worker_processes_give_the_same_numbers():
    histories = [((Q, s, 100),) * k for s in (900_000, 1_300_000, 2_000_000) for k in (1, 2, 3)]
    with SpendCalculator("pld", DELTA_P, workers=2) as parallel:
        assert parallel.epsilon_many(histories) == SpendCalculator("pld", DELTA_P).epsilon_many(histories)


def test_pld_prefix_cache_gives_the_uncached_answer():
    history = [Bucket(0.01, 1.0, 100), Bucket(0.01, 1.3, 100), Bucket(0.01, 1.0, 100)]
    warm = PLDAccountant()
    warm.epsilon(history[:1], 1e-5)
    warm.epsilon(history[:2], 1e-5)
    assert warm.epsilon(history, 1e-5) == PLDAccountant().epsilon(history, 1e-5)


@pytest.mark.parametrize("budget_u", [730_000, 800_000, 900_000])
def test_max_steps_is_the_largest_k_within_budget(budget_u):
    calculator = SpendCalculator("pld", DELTA_P)
    prior = ((Q, 1_000_000, 100),)
    k, eps_u = calculator.max_steps(prior, Q, 1_000_000, 100, budget_u)
    assert 0 <= k < 100
    assert eps_u == calculator.epsilon_u(prior + ((Q, 1_000_000, k),)) <= budget_u
    assert calculator.epsilon_u(prior + ((Q, 1_000_000, k + 1),)) > budget_u


def test_max_steps_when_the_whole_epoch_fits_or_nothing_does():
    calculator = SpendCalculator("rdp", DELTA_P)
    assert calculator.max_steps((), Q, 1_000_000, 100, 10_000_000) == (100, calculator.epsilon_u(((Q, 1_000_000, 100),)))
    spent = calculator.epsilon_u(((Q, 1_000_000, 100),))
    assert calculator.max_steps(((Q, 1_000_000, 100),), Q, 1_000_000, 100, spent - 1)[0] == 0


# -- the noise schedule -------------------------------------------------------------------------


def members() -> list[Member]:
    return [
        Member("p1", "public", 1_000_000, 600_000, 8_000_000),
        Member("p2", "public", 1_000_000, 900_000, 8_000_000),   # the strictest public signer sets s_public
        Member("p3", "public", 500_000, 600_000, 8_000_000),     # a smaller C: the same noise is more, relative to it
        Member("s1", "sensitive", 500_000, 1_000_000, 3_000_000),
        Member("r1", "restricted", 500_000, 1_500_000, 1_000_000),
    ]


def test_group_noise_and_sigma_eff_follow_design_section_5():
    cohorts = cohorts_of(members())
    groups = {"public": [frozenset({"public"}), frozenset({"public", "sensitive"})],
              "sensitive": [frozenset({"public", "sensitive"})],
              "restricted": [frozenset({"restricted"})]}
    noise = group_noise(groups, cohorts)
    # s_g = max sigma_i C_i over eligible contributions reaching g (pico-units)
    assert noise[frozenset({"public"})] == 900_000 * 1_000_000
    assert noise[frozenset({"public", "sensitive"})] == 900_000 * 1_000_000  # max(0.9, 1.0 * 0.5)
    assert noise[frozenset({"restricted"})] == 1_500_000 * 500_000
    by_id = {next(iter(c.members)): c for c in cohorts}
    assert sigma_eff_u(by_id["p1"], groups, noise) == 900_000       # min over its groups of s_g / C
    assert sigma_eff_u(by_id["p3"], groups, noise) == 1_800_000
    assert sigma_eff_u(by_id["s1"], groups, noise) == 1_800_000     # 0.9 / 0.5: it shares noise with public
    assert sigma_eff_u(by_id["r1"], groups, noise) == 1_500_000
    for cohort in cohorts:  # no one is charged for less noise than they signed for
        assert sigma_eff_u(cohort, groups, noise) >= cohort.noise_multiplier_u
    # Disjoint groups (no model): sigma_eff can only be smaller, i.e. conservative.
    disjoint = disjoint_groups(groups)
    lone = group_noise(disjoint, cohorts)
    assert sigma_eff_u(by_id["s1"], disjoint, lone) == 1_000_000 <= sigma_eff_u(by_id["s1"], groups, noise)


def test_withdrawn_or_retired_contributions_stop_setting_the_noise():
    cohorts = cohorts_of(members())
    groups = disjoint_groups(["public", "sensitive", "restricted"])
    strict = next(c for c in cohorts if "p2" in c.members)
    strict.members.discard("p2")  # withdrawn
    assert group_noise(groups, cohorts)[frozenset({"public"})] == 600_000 * 1_000_000


def test_schedule_charges_each_contribution_its_own_history():
    calculator = SpendCalculator("pld", DELTA_P)
    cohorts = cohorts_of(members())
    scheduler = Scheduler(calculator, disjoint_groups(["public", "sensitive", "restricted"]), sampling_rate_u=Q,
                          steps_per_epoch=50)
    plans = scheduler.project(cohorts, first_epoch=0, total_steps=120)
    assert [p.steps for p in plans] == [50, 50, 20] and [p.first_step for p in plans] == [0, 50, 100]
    direct = PLDAccountant()
    for cohort in cohorts:
        expected = direct.epsilon([Bucket.from_micro(*b) for b in cohort.history], 1e-5).epsilon_u
        assert cohort.eps_u == expected <= cohort.eps_budget_u
        assert sum(b[2] for b in cohort.history) == (120 if cohort.retired_at is None else cohort.retired_at)


def test_retirement_a_budget_of_k_steps_allows_exactly_k():
    calculator = SpendCalculator("pld", DELTA_P)
    k = 37
    budget = calculator.epsilon_u(((Q, 2_000_000, k),))
    member = Member("only", "c", 1_000_000, 2_000_000, budget)
    cohorts = cohorts_of([member])
    scheduler = Scheduler(calculator, disjoint_groups(["c"]), sampling_rate_u=Q, steps_per_epoch=25)
    plans = scheduler.project(cohorts, first_epoch=3, total_steps=100)
    (cohort,) = cohorts
    assert cohort.retired_at == k and sum(s for _, _, s in cohort.history) == k
    assert [p.epoch for p in plans] == [3, 4]  # nothing eligible after it retires: planning stops
    assert [s.steps for p in plans for s in p.spends] == [25, 12]
    assert plans[-1].spends[0].retires_at == k and cohort.eps_u == budget
    assert calculator.epsilon_u(cohort.history + ((Q, 2_000_000, 1),)) > budget  # one more step would overrun


def test_a_contribution_recorded_at_its_budget_retires_at_once():
    calculator = SpendCalculator("rdp", DELTA_P)
    history = ((Q, 1_000_000, 100),)
    spent = calculator.epsilon_u(history)
    cohorts = cohorts_of([Member("x", "c", 1_000_000, 1_000_000, spent)], {"x": (history, spent)})
    plan = Scheduler(calculator, disjoint_groups(["c"]), sampling_rate_u=Q, steps_per_epoch=10).plan_epoch(
        cohorts, 1, 100)
    assert plan.spends[0].steps == 0 and cohorts[0].retired_at == 100 and cohorts[0].history == history


# -- calibration ----------------------------------------------------------------------------------


def test_classical_gaussian_matches_the_seed():
    # seed 002 (docs/design.md): sigma = 1 * sqrt(2 ln(1.25 / 1e-5)) / 1 = 4.8448
    assert classical_gaussian_sigma(1.0, 1e-5) == pytest.approx(4.8448, abs=1e-4)


@pytest.mark.parametrize("epsilon", [0.1, 0.5, 1.0, 3.0, 8.0])
def test_analytic_gaussian_against_dp_accounting(epsilon):
    from dp_accounting.pld import accountant, common

    ours = analytic_gaussian_sigma(epsilon, 1e-5)
    theirs = accountant.get_smallest_gaussian_noise(common.DifferentialPrivacyParameters(epsilon, 1e-5), 1, 1.0)
    assert ours == pytest.approx(theirs, rel=1e-6)
    assert gaussian_delta(ours, epsilon) <= 1e-5 < gaussian_delta(ours * (1 - 1e-6), epsilon)
    assert ours < classical_gaussian_sigma(epsilon, 1e-5)


def test_analytic_gaussian_scales_with_sensitivity():
    assert analytic_gaussian_sigma(1.0, 1e-6, 3.0) == pytest.approx(3 * analytic_gaussian_sigma(1.0, 1e-6), rel=1e-9)


@pytest.mark.parametrize("accountant, target, q, steps", [
    ("pld", 3.0, 0.01, 1000), ("rdp", 1.0, 0.001, 10000), ("pld", 8.0, 0.1, 100),
])
def test_noise_multiplier_for_a_target_epsilon(accountant, target, q, steps):
    result = noise_multiplier_for(target, 1e-5, q, steps, accountant, tolerance_u=100)
    chosen = get_accountant(accountant)
    assert result.epsilon_u <= round(target * 1e6)
    assert chosen.epsilon([Bucket(q, result.noise_multiplier, steps)], 1e-5).epsilon_u == result.epsilon_u
    below = chosen.epsilon([Bucket(q, (result.noise_multiplier_u - 100) / 1e6, steps)], 1e-5)
    assert below.epsilon_u > round(target * 1e6)  # 1e-4 less noise misses the target: it is the smallest
    assert result.evaluations < 40


def test_calibration_rejects_nonsense():
    for args in [(0.0, 1e-5, 0.01, 10), (1.0, 1.5, 0.01, 10), (1.0, 1e-5, 0.0, 10), (1.0, 1e-5, 0.01, 0)]:
        with pytest.raises(ValueError):
            noise_multiplier_for(*args, "rdp")
    with pytest.raises(ValueError):
        analytic_gaussian_sigma(-1.0, 1e-5)


def test_rdp_curve_cache_matches_a_fresh_library_accountant():
    from dp_accounting import dp_event, rdp

    library = rdp.RdpAccountant()
    library.compose(dp_event.PoissonSampledDpEvent(0.02, dp_event.GaussianDpEvent(0.9)), 333)
    assert RDPAccountant().epsilon([Bucket(0.02, 0.9, 333)], 1e-6).epsilon_u == math.ceil(library.get_epsilon(1e-6) * 1e6)


# -- write-ahead spend in the ledger ------------------------------------------------------------


def _scheduled(corpus):
    from govtrain.resolver.plan import read_corpus

    with corpus.open() as ledger:
        policy = ledger.policy
        admitted, withdrawn, _ = read_corpus(ledger)
    members = [a.member for cid, a in admitted.items() if cid not in withdrawn]
    calculator = SpendCalculator(policy.accountant, policy.delta_p)
    scheduler = Scheduler(calculator, disjoint_groups(policy.classes), sampling_rate_u=policy.sampling_rate_u,
                          steps_per_epoch=policy.steps_per_epoch)
    return cohorts_of(members), scheduler


def test_written_ahead_spend_verifies_with_recomputation(corpus):
    from govtrain.verify.verifier import verify_ledger
    from tests.test_signed_ledger import _admit

    _admit(corpus, "a")
    _admit(corpus, "b", noise_multiplier_u=1_300_000)
    _admit(corpus, "s", data_class="sensitive", clip_norm_u=500_000, eps_budget_u=3_000_000)
    cohorts, scheduler = _scheduled(corpus)
    for epoch in range(2):
        plan = scheduler.plan_epoch(cohorts, epoch, epoch * 10)
        with corpus.open() as ledger:
            stored = record_spend(ledger, plan.epoch, plan.sampling_rate_u, plan.spend_records(), run_id="r",
                                         epoch_steps=plan.steps, now=corpus.now)
            ledger.close_epoch(now=corpus.now)
        assert len(stored) == 3
    report = verify_ledger(corpus.url)
    assert report.spend_recomputed and report.by_kind["spend"] == 6
    from govtrain.resolver.plan import read_corpus

    with corpus.open() as ledger:
        recorded, _, _ = read_corpus(ledger)
    by_member = {m: c for c in cohorts for m in c.members}
    for cid, admitted in recorded.items():
        assert admitted.eps_u == by_member[cid].eps_u and tuple(admitted.history) == by_member[cid].history


def test_record_spend_refuses_and_writes_nothing(corpus):
    from govtrain.errors import GovtrainError
    from tests.conftest import snapshot
    from tests.test_signed_ledger import _admit

    _admit(corpus, "a")
    _admit(corpus, "w")
    with corpus.open() as ledger:
        ledger.withdraw("w", "test", now=corpus.now)
    cohorts, scheduler = _scheduled(corpus)
    plan = scheduler.plan_epoch(cohorts, 0, 0)
    ((cid, steps, sigma, eps),) = plan.spend_records()
    before = snapshot(corpus.url)
    bad = [
        (1, plan.sampling_rate_u, [(cid, steps, sigma, eps)], "bad_argument"),          # wrong epoch
        (0, 20_000, [(cid, steps, sigma, eps)], "bad_argument"),                        # not the policy's q
        (0, plan.sampling_rate_u, [("w", steps, sigma, eps)], "already_withdrawn"),
        (0, plan.sampling_rate_u, [("nobody", steps, sigma, eps)], "unknown_contribution"),
        (0, plan.sampling_rate_u, [(cid, steps, sigma - 1, eps)], "budget_exceeded"),   # below the signed sigma
        (0, plan.sampling_rate_u, [(cid, steps, sigma, 5_000_001)], "budget_exceeded"),  # over the signed budget
        (0, plan.sampling_rate_u, [(cid, steps, sigma, eps)] * 2, "bad_argument"),
    ]
    for epoch, q, records, code in bad:
        with corpus.open() as ledger:
            with pytest.raises(GovtrainError) as info:
                record_spend(ledger, epoch, q, records, run_id="r", epoch_steps=plan.steps, now=corpus.now)
        assert info.value.code.value == code, (records, info.value)
        assert snapshot(corpus.url) == before
    with corpus.open() as ledger:
        record_spend(ledger, 0, plan.sampling_rate_u, [(cid, steps, sigma, eps)], run_id="r", epoch_steps=plan.steps,
                            now=corpus.now)
        with pytest.raises(GovtrainError) as info:  # a second spend in the same epoch
            record_spend(ledger, 0, plan.sampling_rate_u, [(cid, steps, sigma, eps)], run_id="r",
                                epoch_steps=plan.steps, now=corpus.now)
    assert info.value.code.value == "budget_exceeded"
