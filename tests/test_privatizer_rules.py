"""The records' rules (`govtrain.privatizers.rules`): what the verifier, the planner and the scheduler charge a
privatizer record through, torch-free, and what the ledger admits as a record (docs/privatizers.md).

The findings of tests/test_attacks_privatizer_review.py are proved there; these tests hold the fixes' edges: the
rules agree with the classes the writer runs, the record shape and the CDDL admit bounded lists of int63 and
nothing nested, the cache keys lists, a record's every failure is coded, m is exact near θ = 1 and fast at any
separation, and a family's RUN.toml section still builds without a dimension.
"""

from __future__ import annotations

import math
import time
from fractions import Fraction

import pycddl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from govtrain import units
from govtrain.privatizers.charges import bucketer, spend_item
from govtrain.encoding import cbor
from govtrain.errors import ConfigError, IntegrityError
from govtrain.ledger.entries import PRIVATIZER_LIST_MAX, check_privatizer_record
from govtrain.privatizers import REGISTRY, build, from_record, rules
from govtrain.privatizers.mf.charge import factor_p
from govtrain.privatizers.rules import BLT_MAX_BUFFERS, RULES, check_record, record_charge
from tests.conftest import REPO, Corpus
from tests.test_attacks_privatizer_record import _flagged, _forged_spend
from tests.test_attacks_privatizer_review import BANDED, BLT, _exact_blt_factor, _dg
from tests.test_signed_ledger import _admit

P = units.PICO
LATTICES = [{"name": name, "granularity_bits": bits, "beta_exp": 40, "dimension": 5_000}
            for name, bits in (("laplace", 16), ("discrete-gaussian", 16), ("skellam", 8))]
RECORDS = [{"name": "gaussian"}, {"name": "gaussian", "microbatches": 4}, BANDED, BLT,
           {**BLT, "buffers": 2, "theta_p": [900_000_000_000, 400_000_000_000],
            "omega_p": [300_000_000_000, 100_000_000_000]}, *LATTICES]
NEAR_ONE = {"name": "blt", "buffers": 1, "horizon": 100, "min_separation": 1, "theta_p": [P - 1], "omega_p": [P]}


def _code(error: pytest.ExceptionInfo) -> str:
    return error.value.code.value


# -- the two registries ------------------------------------------------------------------------------------------

def test_the_rules_name_the_privatizers_the_classes_do():
    assert list(RULES) == list(REGISTRY)


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: f"{r['name']}-{len(r)}")
@pytest.mark.parametrize("q_u, sigma_u, steps", [(10_000, 1_000_000, 10), (400_000, 3_141_593, 7), (1, 800_000, 0)])
def test_the_writer_charges_what_the_verifier_recomputes(record, q_u, sigma_u, steps):
    """The class the writer runs (`from_record`, its `charge`), the scheduler's bucketer and the verifier's
    `spend_item` give one charge for every privatizer."""
    from govtrain.accounting.records import as_item

    privatizer = from_record(record)
    charged = privatizer.charge(sampling_rate_u=q_u, noise_multiplier_u=sigma_u, steps=steps)
    assert record_charge(record, sampling_rate_u=q_u, noise_multiplier_u=sigma_u, steps=steps) == charged
    entry = {"sampling_rate_u": q_u, "noise_multiplier_u": sigma_u, "steps": steps, "privatizer": dict(record)}
    assert spend_item(entry) == bucketer(privatizer)(q_u, sigma_u, steps) == as_item(charged)


# -- the record's shape and the CDDL ---------------------------------------------------------------------------

def _privatizer_schema() -> pycddl.Schema:
    return pycddl.Schema("root-rule = privatizer\n" + (REPO / "schemas" / "ledger.cddl").read_text())


@pytest.mark.parametrize("record", [BANDED, BLT, {"name": "x", "v": list(range(PRIVATIZER_LIST_MAX))},
                                    {"name": "x", "v": [], "w": [2 ** 63 - 1]},
                                    {"name": "x", "v": [P, -1, 0], "w": [-(2 ** 63 - 1)]}])
def test_a_record_may_hold_bounded_lists_of_int63(record):
    """Lists of signed 63-bit ints: a banded strategy's coefficients after the first may be negative
    (`mf.charge.check_banded` admits them, and its charge holds for any signs)."""
    check_privatizer_record(record, what="r")
    if all(v >= 0 for value in record.values() if type(value) is list for v in value):
        # pycddl 0.6 refuses any negative integer against a range (`nint63 = -9223372036854775807..-1`, RFC 8610)
        _privatizer_schema().validate_cbor(cbor.encode(record))


@pytest.mark.parametrize("value, code", [
    (list(range(PRIVATIZER_LIST_MAX + 1)), "bad_value"),  # too long
    ([[1, 2]], "wrong_type"),  # nested
    ([{"a": 1}], "wrong_type"),
    ([1, -(2 ** 63)], "wrong_type"),  # beyond int63
    ([2 ** 63], "wrong_type"),  # beyond int63
    ([True], "wrong_type"),  # a bool is no int
    (["1"], "wrong_type"),
    ({"a": 1}, "wrong_type"),  # a map
])
def test_a_record_refuses_long_nested_or_out_of_range_lists(value, code):
    record = {"name": "blt", "theta_p": value}
    with pytest.raises(IntegrityError) as refused:
        check_privatizer_record(record, what="r")
    assert _code(refused) == code
    if value != [[1, 2]]:  # pycddl 0.6 does not check an array nested in a choice inside a map (RFC 8610 does)
        with pytest.raises(Exception):  # the CDDL refuses it too
            _privatizer_schema().validate_cbor(cbor.encode(record))


# -- the cache ---------------------------------------------------------------------------------------------------

def test_the_cache_keys_list_records_and_tells_a_list_from_a_tuple():
    """A decoded record (lists) charges through the cache; a tuple of the same ints is another key (what the rule
    is handed is the record's own value, not a frozen copy), and the cache never holds a record's mutation."""
    rules.cache_clear()
    record = {**BANDED, "coefficients_p": list(BANDED["coefficients_p"])}
    first = record_charge(record, sampling_rate_u=10_000, noise_multiplier_u=1_000_000, steps=10)
    assert record_charge(dict(record), sampling_rate_u=10_000, noise_multiplier_u=1_000_000, steps=10) == first
    assert len(rules._CHARGERS) == 1
    record_charge({**record, "coefficients_p": tuple(record["coefficients_p"])}, sampling_rate_u=10_000,
                  noise_multiplier_u=1_000_000, steps=10)
    assert len(rules._CHARGERS) == 2
    record["coefficients_p"][0] = P  # the caller's list changes after the charge: the cached rule did not keep it
    with pytest.raises(ConfigError) as refused:
        record_charge(record, sampling_rate_u=10_000, noise_multiplier_u=1_000_000, steps=10)
    assert _code(refused) == "privatizer_invalid"  # norm above 1


# -- every failure coded -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("record", [
    {**_dg(), "dimension": None},  # text or null where an int goes
    {"name": "discrete-gaussian", "granularity_bits": 16, "beta_exp": 40},  # a field missing
    {"name": "skellam", "granularity_bits": 9, "beta_exp": 40, "dimension": 10},  # above Skellam's bound
    {**BLT, "theta_p": [P]},  # θ = 1
    {**BLT, "theta_p": [[1]]},  # nested
    {**BLT, "buffers": BLT_MAX_BUFFERS + 1, "theta_p": [P // 2] * (BLT_MAX_BUFFERS + 1),
     "omega_p": [1] * (BLT_MAX_BUFFERS + 1)},  # more buffers than a charge computes
    {**BANDED, "coefficients_p": {"a": 1}},  # a map
    {"name": "gaussian", "x": float("nan")},
    {"name": "gaussian", "microbatches": 1},  # k = 1 is the ordinary step: never recorded
    {"name": "gaussian", "microbatches": "4"},
])
def test_a_record_the_rules_refuse_is_privatizer_invalid_for_writer_and_verifier(record):
    for call in (lambda: check_record(record), lambda: from_record(record),
                 lambda: spend_item({"sampling_rate_u": 10_000, "noise_multiplier_u": 1_000_000, "steps": 10,
                                     "privatizer": record})):
        with pytest.raises(ConfigError) as refused:
            call()
        assert _code(refused) == "privatizer_invalid"


def test_a_record_whose_class_raises_anything_is_privatizer_invalid(monkeypatch):
    """`from_record` turns whatever a record makes its class raise into privatizer_invalid (here RuntimeError)."""
    from govtrain.privatizers.gaussian import IIDGaussian

    def broken(cls, record):
        raise RuntimeError("a record this class cannot rebuild")

    monkeypatch.setattr(IIDGaussian, "from_record", classmethod(broken))
    with pytest.raises(ConfigError) as refused:
        from_record({"name": "gaussian"})
    assert _code(refused) == "privatizer_invalid" and "cannot rebuild" in refused.value.detail


def test_a_blt_with_no_noise_left_is_refused_by_writer_and_flagged_by_verifier(corpus: Corpus):
    """m ≈ 2·10^12 > σ²: ⌊σ/√m⌋ = 0. Chosen: privatizer_invalid (a record under which the spend's σ adds no noise
    describes no Gaussian mechanism to charge), so the verifier flags bad_privatizer and the writer refuses."""
    with pytest.raises(ConfigError) as refused:
        record_charge(NEAR_ONE, sampling_rate_u=10_000, noise_multiplier_u=1_000_000, steps=10)
    assert _code(refused) == "privatizer_invalid" and "no noise" in refused.value.detail
    assert record_charge(NEAR_ONE, sampling_rate_u=10_000, noise_multiplier_u=10 ** 12,
                         steps=10).noise_multiplier_u > 0  # at a σ large enough, the same record charges
    _admit(corpus, "a")
    _forged_spend(corpus, "a", eps_u=1_000_000, privatizer=NEAR_ONE)
    assert "no noise" in _flagged(corpus, "bad_privatizer").detail


def test_a_record_may_not_bring_the_multiplier_below_the_least_charged():
    """A BLT whose m brings σ = 1 under 0.1 is refused (the accountants' cost grows as 1/σ²); the same record at a
    σ that stays above charges; a spend whose own σ is below 0.1 (no record's doing) keeps it under a record that
    does not lower it."""
    record = {**BLT, "theta_p": [999_000_000_000], "omega_p": [P]}  # m ≈ 2000
    for sigma_u, refused in ((1_000_000, True), (10_000_000, False)):
        call = lambda: record_charge(record, sampling_rate_u=10_000, noise_multiplier_u=sigma_u, steps=10)  # noqa
        if refused:
            with pytest.raises(ConfigError):
                call()
        else:
            assert call().noise_multiplier_u >= rules.MIN_CHARGED_MULTIPLIER_U
    assert record_charge(BANDED, sampling_rate_u=10_000, noise_multiplier_u=50_000,
                         steps=10).noise_multiplier_u == 50_000


# -- m, exactly --------------------------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(st.lists(st.tuples(st.one_of(st.integers(1, P - 1), st.sampled_from([1, P - 1, P - 2, P - 1000, P // 2])),
                          st.integers(0, P // 4)), min_size=1, max_size=4),
       st.integers(1, 40))
def test_factor_p_is_the_exact_m_rounded_up(pairs, separation):
    """Against the closed form in rationals: m·10^12 ≤ factor_p (rounded up, never below), and tight (within 10^-4
    relative: a factor_p that also bounds the float64 strategy the stream applies stays within it)."""
    theta_p, omega_p = [t for t, _ in pairs], [w for _, w in pairs]
    exact = _exact_blt_factor(theta_p, omega_p, separation) * P
    found = factor_p(theta_p, omega_p, separation)
    assert exact <= found <= exact * (1 + Fraction(1, 10_000)) + 1


def test_factor_p_is_fast_at_any_separation():
    """A forged min_separation of 2^62 costs squarings, not a 2^62-term power (16 buffers: well under a second)."""
    start = time.perf_counter()
    m_p = factor_p([P - 1], [P], 2 ** 62)
    assert m_p >= P
    theta, omega = [P - 1 - i for i in range(16)], [P // 16] * 16
    factor_p(theta, omega, 2 ** 40)
    assert time.perf_counter() - start < 5


def test_finding_5s_records_charge_no_more_than_the_exact_multiplier():
    """The charged multiplier is at most ⌊σ/√m_exact⌋, and within 10^-4 of it (m rounded up, tightly)."""
    record = {"name": "blt", "buffers": 2, "horizon": 1_000, "min_separation": 15, "theta_p": [P - 3, P - 453],
              "omega_p": [32_956_838_681, 388_039_618_544]}
    exact = _exact_blt_factor(record["theta_p"], record["omega_p"], 15)
    for sigma_u in (10 ** 12, 7 * 10 ** 12 + 1, 10 ** 14):
        charged = record_charge(record, sampling_rate_u=10_000, noise_multiplier_u=sigma_u, steps=10)
        allowed = math.isqrt(sigma_u * sigma_u * exact.denominator // exact.numerator)
        assert allowed * 9_999 // 10_000 <= charged.noise_multiplier_u <= allowed


# -- the families' RUN.toml ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["laplace", "discrete-gaussian", "skellam"])
def test_a_family_builds_from_run_toml_without_a_dimension_and_records_every_field(name):
    """A record needs its dimension (finding 4); RUN.toml never sets one: `init` binds it from the slots."""
    from govtrain.train.config import NoiseSection

    privatizer = build(NoiseSection(privatizer=name, beta_exp=30))
    assert privatizer.dimension is None and privatizer.beta_exp == 30
    privatizer.bind(123)
    record = privatizer.record()
    assert set(record) == {"name", "granularity_bits", "beta_exp", "dimension"} and record["dimension"] == 123
    check_record(record)
    with pytest.raises(ConfigError) as refused:
        build(NoiseSection(privatizer=name, bands=2))
    assert _code(refused) == "privatizer_invalid"


def test_the_rules_and_the_charge_import_neither_torch_nor_numpy():
    import subprocess
    import sys

    code = ("import sys\nfrom govtrain.privatizers.rules import record_charge\n"
            f"for record in {RECORDS!r}:\n"
            "    record_charge(record, sampling_rate_u=10_000, noise_multiplier_u=1_000_000, steps=10)\n"
            "assert not {'torch', 'numpy'} & set(sys.modules), sorted({'torch', 'numpy'} & set(sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-600:]


def test_the_fraction_oracle_by_hand():
    """The oracle itself: one buffer, b = 1, θ = ω = ½: r(0) = 1 + ¼/¾ = 4/3, Σ r(i) = ½/½ + ¼·½/(¾·½) = 4/3,
    m = (4/3 + 8/3) / (4/3) = 3; factor_p rounds up (¼/¾ at 2^-256 toward a larger m): 3·10^12, or one more."""
    assert _exact_blt_factor([P // 2], [P // 2], 1) == 3
    assert 3 * P <= factor_p([P // 2], [P // 2], 1) <= 3 * P + 1
