"""Policy floors per noise family ([floor.families]; govtrain/privatizers/families/floors.py): the policy file,
its canonical record (absent when unset: every existing header keeps its bytes), the ledger header's CDDL, and
the refusal of a run whose privatizer's family the policy does not allow or would charge below its floor."""

from __future__ import annotations

import pytest

from govtrain.encoding import cbor
from govtrain.errors import Code, ConfigError, IntegrityError
from govtrain.ledger.ledger import Ledger
from govtrain.policy.model import Policy
from govtrain.privatizers.families.floors import check_family_floor, family_floor
from tests.conftest import TEST_POLICY, make_corpus

FAMILY_POLICY = TEST_POLICY.replace("max_clip_norm = 4.0\n", """max_clip_norm = 4.0

[floor.families]
laplace = 3.0
discrete-gaussian = 1.2
gaussian = 0.7
""")


def _policy(tmp_path, text: str) -> Policy:
    corpus = make_corpus(tmp_path, f"sqlite:///{tmp_path}/ledger.db", text)
    with Ledger.open(corpus.url) as ledger:
        return ledger.policy


def test_the_table_is_read_recorded_and_read_back(tmp_path):
    policy = _policy(tmp_path, FAMILY_POLICY)
    assert dict(policy.family_floors) == {"laplace": 3_000_000, "discrete-gaussian": 1_200_000, "gaussian": 700_000}
    record = policy.to_record()
    assert record["floor"]["families"] == {"discrete-gaussian": 1_200_000, "gaussian": 700_000, "laplace": 3_000_000}
    assert Policy.from_record(cbor.decode(cbor.encode(record))) == policy


def test_a_policy_without_the_table_keeps_its_record(tmp_path):
    policy = _policy(tmp_path, TEST_POLICY)
    assert dict(policy.family_floors) == {}
    assert set(policy.to_record()["floor"]) == {"min_noise_multiplier_u", "max_clip_norm_u"}


def test_the_header_with_the_table_matches_the_ledger_cddl(tmp_path):
    pycddl = pytest.importorskip("pycddl")
    from tests.test_schemas import LEDGER

    corpus = make_corpus(tmp_path, f"sqlite:///{tmp_path}/ledger.db", FAMILY_POLICY)
    with Ledger.open(corpus.url) as ledger:
        header = next(iter(ledger.store.entries()))
    schema = pycddl.Schema(LEDGER)
    schema.validate_cbor(header.body)
    broken = cbor.decode(header.body)
    broken["policy"]["floor"]["families"] = {"laplace": "3"}
    with pytest.raises(Exception):
        schema.validate_cbor(cbor.encode(broken))


@pytest.mark.parametrize("table, detail", [
    ("binomial = 1.0\n", "floor.families"),
    ("laplace = 0\n", "floor.families"),
    ("laplace = true\n", "floor.families"),
])
def test_a_bad_table_is_refused_at_init(tmp_path, table, detail):
    text = TEST_POLICY.replace("max_clip_norm = 4.0\n", f"max_clip_norm = 4.0\n\n[floor.families]\n{table}")
    with pytest.raises(ConfigError) as refused:
        make_corpus(tmp_path, f"sqlite:///{tmp_path}/ledger.db", text)
    assert refused.value.code is Code.POLICY_INVALID and detail in refused.value.detail
    assert not (tmp_path / "ledger.db").exists()  # nothing initialised


def test_a_tampered_header_table_is_an_integrity_failure(tmp_path):
    record = _policy(tmp_path, FAMILY_POLICY).to_record()
    record["floor"]["families"]["skellam"] = 0
    with pytest.raises(IntegrityError) as refused:
        Policy.from_record(record)
    assert refused.value.code is Code.BAD_LEDGER_HEADER


def test_without_the_table_every_family_trains_at_the_corpus_floor(tmp_path):
    policy = _policy(tmp_path, TEST_POLICY)
    for family in ("gaussian", "laplace", "discrete-gaussian", "skellam"):
        assert family_floor(policy, family) == policy.floor_min_noise_multiplier_u == 500_000
        check_family_floor(policy, family, [("c1", 500_000)])
        with pytest.raises(ConfigError) as refused:
            check_family_floor(policy, family, [("c1", 499_999)])
        assert refused.value.code is Code.BELOW_FAMILY_FLOOR


def test_with_the_table_each_family_has_its_own_floor_and_unnamed_ones_are_refused(tmp_path):
    policy = _policy(tmp_path, FAMILY_POLICY)
    check_family_floor(policy, "laplace", [("public", 3_000_000), ("sensitive", 4_000_000)])
    with pytest.raises(ConfigError) as refused:
        check_family_floor(policy, "laplace", [("public", 3_000_000), ("contribution c7", 2_999_999)])
    assert refused.value.code is Code.BELOW_FAMILY_FLOOR and "contribution c7" in refused.value.detail
    check_family_floor(policy, "discrete-gaussian", [("x", 1_200_000)])
    with pytest.raises(ConfigError) as refused:
        check_family_floor(policy, "skellam", [("x", 50_000_000)])
    assert refused.value.code is Code.FAMILY_NOT_ALLOWED
    # gaussian trains whatever the table says, never below the corpus floor (0.5 < its own 0.7 here)
    assert family_floor(policy, "gaussian") == 700_000
    with pytest.raises(ConfigError):
        check_family_floor(policy, "gaussian", [("x", 600_000)])


def test_gaussian_never_falls_below_the_corpus_floor(tmp_path):
    text = FAMILY_POLICY.replace("gaussian = 0.7\n", "gaussian = 0.1\n").replace("discrete-gaussian = 1.2\n", "")
    policy = _policy(tmp_path, text)
    assert family_floor(policy, "gaussian") == 500_000
