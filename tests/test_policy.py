"""Policy: TOML validation with one clear error per invalid field, privacy-favouring rounding, the record."""

from __future__ import annotations

import json

import pytest
import tomli_w
import tomllib

from govtrain.encoding import cbor
from govtrain.errors import Code, ConfigError, IntegrityError
from govtrain.policy.config import json_schema, load_policy
from govtrain.policy.model import Policy
from tests.conftest import KEYS_EXAMPLE, REPO, copy_demo_keys


@pytest.fixture
def keys(tmp_path):
    return copy_demo_keys(tmp_path / "keys")


def _write(keys, document: dict):
    path = keys / "policy-under-test.toml"
    path.write_text(tomli_w.dumps(document))
    return path


def _example() -> dict:
    return tomllib.loads((KEYS_EXAMPLE / "policy.toml").read_text())


def test_example_policy_loads(keys):
    policy, digest = load_policy(keys / "policy.toml")
    assert sorted(policy.classes) == ["public", "restricted", "sensitive"]
    assert policy.delta_p == 10_000_000  # 1e-5 in pico-units
    assert policy.classes["public"].profile.fraction_u == (500_000, 1_000_000)
    assert policy.classes["sensitive"].profile.band == (4, 5)
    assert policy.classes["restricted"].profile.adapter == "restricted"
    assert policy.attesters[0].classes == {"public", "sensitive", "restricted"}
    assert len(digest) == 32


def test_rounding_favours_privacy(keys):
    doc = _example()
    doc["floor"]["min_noise_multiplier"] = 0.50000001
    doc["classes"]["public"].update(clip_norm=0.99999999, min_noise_multiplier=0.60000001, eps_budget=7.9999999,
                                    max_eps_budget=9.9999999, fraction=[0.4999999, 0.9999999])
    doc["delta"] = 1.0000000000009e-5
    policy, _ = load_policy(_write(keys, doc))
    public = policy.classes["public"]
    assert public.clip_norm_u == 999_999
    assert public.min_noise_multiplier_u == 600_001
    assert (public.eps_budget_u, public.max_eps_budget_u) == (7_999_999, 9_999_999)
    assert public.profile.fraction_u == (500_000, 999_999)  # narrower band
    assert policy.floor_min_noise_multiplier_u == 500_001
    assert policy.delta_p == 10_000_000


INVALID = [
    ("delta", lambda d: d.update(delta=0), "delta"),
    ("delta_one", lambda d: d.update(delta=1.0), "delta must be less than 1"),
    ("delta_text", lambda d: d.update(delta="1e-5"), "delta"),
    ("accountant", lambda d: d.update(accountant="moments"), "accountant"),
    ("both_rates", lambda d: d.update(expected_batch_size=64), "exactly one of sampling_rate"),
    ("no_rate", lambda d: d.pop("sampling_rate"), "exactly one of sampling_rate"),
    ("rate_above_one", lambda d: d.update(sampling_rate=1.5), "sampling_rate"),
    ("steps_float", lambda d: d.update(steps_per_epoch=5.0), "steps_per_epoch"),
    ("steps_zero", lambda d: d.update(steps_per_epoch=0), "steps_per_epoch"),
    ("unknown_top", lambda d: d.update(colour="blue"), "colour"),
    ("origin_spaces", lambda d: d.update(origin="my corpus"), "origin"),
    ("floor_missing", lambda d: d.pop("floor"), "floor"),
    ("floor_negative", lambda d: d["floor"].update(max_clip_norm=-1), "floor.max_clip_norm"),
    ("clip_negative", lambda d: d["classes"]["public"].update(clip_norm=-1.0), "classes.public.clip_norm"),
    ("clip_bool", lambda d: d["classes"]["public"].update(clip_norm=True), "classes.public.clip_norm"),
    ("clip_above_floor", lambda d: d["classes"]["public"].update(clip_norm=6.0), "exceeds floor.max_clip_norm"),
    ("noise_below_floor", lambda d: d["classes"]["public"].update(min_noise_multiplier=0.4), "below floor"),
    ("budget_above_max", lambda d: d["classes"]["public"].update(eps_budget=11.0), "max_eps_budget"),
    ("class_unknown_key", lambda d: d["classes"]["public"].update(depth=3), "classes.public.depth"),
    ("two_profiles", lambda d: d["classes"]["public"].update(band=[1, 2]), "exactly one depth profile"),
    ("no_profile", lambda d: d["classes"]["public"].pop("fraction"), "exactly one depth profile"),
    ("band_reversed", lambda d: d["classes"]["sensitive"].update(band=[5, 4]), "band"),
    ("band_negative", lambda d: d["classes"]["sensitive"].update(band=[-1, 4]), "classes.sensitive.band"),
    ("fraction_outside", lambda d: d["classes"]["public"].update(fraction=[0.5, 1.5]), "fraction"),
    ("layers_repeated", lambda d: (d["classes"]["public"].pop("fraction"),
                                   d["classes"]["public"].update(layers=[3, 3])), "layers"),
    ("heads_outside_band", lambda d: d["classes"]["sensitive"].update(heads={"2": [0]}), "outside the band"),
    ("heads_with_adapter", lambda d: d["classes"]["restricted"].update(heads={"1": [0]}), "adapter"),
    ("experts_outside_band", lambda d: d["classes"]["sensitive"].update(experts={"2": [0]}), "outside the band"),
    ("experts_with_adapter", lambda d: d["classes"]["restricted"].update(experts={"1": [0]}), "adapter"),
    ("experts_repeated", lambda d: d["classes"]["sensitive"].update(experts={"5": [1, 1]}), "distinct expert"),
    ("experts_empty", lambda d: d["classes"]["sensitive"].update(experts={"5": []}), "distinct expert"),
    ("router_with_adapter", lambda d: d["classes"]["restricted"].update(router=True), "router"),
    ("router_not_bool", lambda d: d["classes"]["sensitive"].update(router=1), "classes.sensitive.router"),
    ("adapter_name", lambda d: d["classes"]["restricted"].update(adapter="bad name"), "adapter"),
    ("class_name", lambda d: d["classes"].update({"bad name": d["classes"]["public"]}), "classes"),
    ("no_classes", lambda d: d.update(classes={}), "classes"),
    ("attester_unknown_class", lambda d: d["attesters"][0].update(classes=["secret"]), "unknown class"),
    ("attester_two_keys", lambda d: d["attesters"][0].update(public_key="AAAA"), "exactly one of public_key"),
    ("no_attesters", lambda d: d.update(attesters=[]), "attesters"),
    ("no_ledger_keys", lambda d: d.update(ledger_keys=[]), "ledger_keys"),
]


@pytest.mark.parametrize("name,mutate,fragment", INVALID, ids=[i[0] for i in INVALID])
def test_invalid_policy_field(keys, name, mutate, fragment):
    doc = _example()
    mutate(doc)
    with pytest.raises(ConfigError) as info:
        load_policy(_write(keys, doc))
    assert info.value.code == Code.POLICY_INVALID, info.value.detail
    assert fragment in info.value.detail, info.value.detail
    assert "\n" not in info.value.line()


def test_small_order_key_in_policy_is_refused(keys):
    import base64

    doc = _example()
    doc["attesters"][0].pop("public_key_file")
    doc["attesters"][0]["public_key"] = base64.b64encode(bytes.fromhex("01" + "00" * 31)).decode()
    with pytest.raises(ConfigError) as info:
        load_policy(_write(keys, doc))
    assert info.value.code == Code.BAD_PUBLIC_KEY and "attesters[0]" in info.value.detail


def test_missing_key_file_and_bad_toml(keys):
    doc = _example()
    doc["attesters"][0]["public_key_file"] = "nope.pub"
    with pytest.raises(ConfigError) as info:
        load_policy(_write(keys, doc))
    assert info.value.code == Code.KEY_UNREADABLE
    broken = keys / "broken.toml"
    broken.write_text("origin = ")
    with pytest.raises(ConfigError) as info:
        load_policy(broken)
    assert info.value.code == Code.POLICY_UNREADABLE
    with pytest.raises(ConfigError) as info:
        load_policy(keys / "absent.toml")
    assert info.value.code == Code.POLICY_UNREADABLE


def test_schema_file_is_generated_from_the_model():
    on_disk = json.loads((REPO / "schemas" / "policy.schema.json").read_text())
    assert on_disk == json_schema(), "regenerate: python -m govtrain.policy.config --schema > schemas/policy.schema.json"


def test_record_round_trip_and_tamper(keys):
    policy, _ = load_policy(keys / "policy.toml")
    record = cbor.decode(cbor.encode(policy.to_record()))
    again = Policy.from_record(record)
    assert again.to_record() == policy.to_record() and again.digest() == policy.digest()
    tampered = cbor.decode(cbor.encode(policy.to_record()))
    tampered["classes"]["public"]["clip_norm_u"] = 9_000_000  # above the floor
    with pytest.raises(IntegrityError):
        Policy.from_record(tampered)
    tampered = cbor.decode(cbor.encode(policy.to_record()))
    tampered["attesters"][0]["public_key"] = bytes.fromhex("01" + "00" * 31)
    with pytest.raises(IntegrityError) as info:
        Policy.from_record(tampered)
    assert info.value.code == Code.BAD_PUBLIC_KEY
    tampered = cbor.decode(cbor.encode(policy.to_record()))
    tampered["extra"] = 1
    with pytest.raises(IntegrityError):
        Policy.from_record(tampered)


def test_experts_and_router_round_trip_and_leave_other_records_unchanged(keys):
    plain, _ = load_policy(keys / "policy.toml")
    assert all("experts" not in cls.to_record()["profile"] and "router" not in cls.to_record()["profile"]
               for cls in plain.classes.values())  # a policy without them keeps its canonical bytes
    doc = _example()
    doc["classes"]["sensitive"].update(experts={"5": [1, 3], "4": [0]}, router=True)
    policy, _ = load_policy(_write(keys, doc))
    profile = policy.classes["sensitive"].profile
    assert profile.experts == ((4, (0,)), (5, (1, 3))) and profile.router
    assert policy.classes["sensitive"].to_record()["profile"]["experts"] == [[4, [0]], [5, [1, 3]]]
    record = cbor.decode(cbor.encode(policy.to_record()))
    assert Policy.from_record(record).digest() == policy.digest()
    for mutate in (lambda p: p.update(router=False), lambda p: p.update(experts=None),
                   lambda p: p.update(experts=[[5, [1, 3]], [4, [0]]]), lambda p: p.update(experts=[[5, "x"]])):
        tampered = cbor.decode(cbor.encode(policy.to_record()))
        mutate(tampered["classes"]["sensitive"]["profile"])
        with pytest.raises(IntegrityError):  # not canonical, unsorted, or not a list of indices
            Policy.from_record(tampered)
