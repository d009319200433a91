"""Fuzzing the TOML files govtrain reads: the corpus policy, run configs, tune grids and inference policies.

Targets: `policy` (load_policy), `run_config` (load_run_config), `grid` (load_grid, then plan_trials against a valid
run config: every trial is built and validated before anything is charged) and `inference_policy`
(load_inference_policy). Each input is written as the file and read through the public loader, beside the key files
the seeds name.
"""

from __future__ import annotations

import datetime
import functools
import random
import tomllib
from pathlib import Path

import tomli_w
from hypothesis import given
from hypothesis import strategies as st

from govtrain.policy.config import load_policy
from govtrain.serve.policy import load_inference_policy
from govtrain.train.config import load_run_config
from govtrain.train.tune import load_grid, plan_trials
from tests.conftest import KEYS_EXAMPLE, REPO, TEST_POLICY
from tests.fuzz.common import Target, check, fuzz_settings, main, mutated
from tests.fuzz.world import world

RUN = (REPO / "examples" / "run.toml").read_bytes()
GRID = b"""[grid]
"optimizer.lr" = [0.001, 0.01]
training.steps = [5, 10]

[select]
data = "held-out.jsonl"
"""


@functools.cache
def _folder() -> Path:
    """The world's key folder (the policies' key files lie there) with run.toml and inference.toml's neighbours."""
    keys = world().dir / "keys"
    (keys / "run.toml").write_bytes(RUN)
    return keys


def _write(name: str, data: bytes) -> Path:
    path = _folder() / name
    path.write_bytes(data)
    return path


def run_policy(data: bytes) -> None:
    load_policy(_write("fuzz-policy.toml", data))


def run_run_config(data: bytes) -> None:
    load_run_config(_write("fuzz-run.toml", data))


def run_grid(data: bytes) -> None:
    grid = load_grid(_write("fuzz-grid.toml", data))
    plan_trials(load_run_config(_folder() / "run.toml"), _folder() / "run.toml", grid, "tune-fuzz")


def run_inference_policy(data: bytes) -> None:
    load_inference_policy(_write("fuzz-inference.toml", data))


def _inference_seed() -> bytes:
    text = (REPO / "examples" / "inference.toml").read_text().replace("../keys.example/", "")
    return text.replace("../demo-out/", "./").encode()


def _policy_seeds() -> list[bytes]:
    return [TEST_POLICY.encode(), (KEYS_EXAMPLE / "policy.toml").read_bytes(),
            (KEYS_EXAMPLE / "policy-contribution.toml").read_bytes()]


TARGETS = [
    Target("policy", run_policy, _policy_seeds, ("govtrain/policy/config.py", "govtrain/policy/model.py"),
           setup=_folder),
    Target("run_config", run_run_config, lambda: [RUN, (REPO / "examples" / "run-contribution.toml").read_bytes()],
           ("govtrain/train/config.py",), setup=_folder),
    Target("grid", run_grid, lambda: [GRID], ("govtrain/train/tune.py",), setup=_folder),
    Target("inference_policy", run_inference_policy, lambda: [_inference_seed()], ("govtrain/serve/policy.py",),
           setup=_folder),
]

# -- hypothesis: valid documents with one value replaced by a random TOML value -------------------------------------

toml_scalars = st.one_of(
    st.integers(-(2**70), 2**70), st.decimals(allow_nan=False, allow_infinity=False).map(float), st.floats(),
    st.text(max_size=20), st.booleans(), st.dates(), st.datetimes(), st.times(),
    st.datetimes(timezones=st.just(datetime.timezone.utc)),
)
toml_values = st.recursive(toml_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=3)), max_leaves=8)


def _replace(document: dict, rng: random.Random, value: object, delete: bool) -> dict:
    """`document` with one key at a random depth set to `value` (or deleted, or a new key added)."""
    node = document
    while True:
        keys = [k for k, v in node.items() if isinstance(v, dict)] if isinstance(node, dict) else []
        if not keys or rng.random() < 0.4:
            break
        node = node[rng.choice(keys)]
    if isinstance(node, dict):
        if node and delete:
            del node[rng.choice(sorted(node))]
        else:
            node[rng.choice([*sorted(node), "extra"]) if node else "extra"] = value
    return document


def edited(seeds: list[bytes]) -> st.SearchStrategy[bytes]:
    def build(seed: bytes, r: int, value: object, delete: bool) -> bytes:
        try:
            return tomli_w.dumps(_replace(tomllib.loads(seed.decode()), random.Random(r), value, delete)).encode()
        except (TypeError, ValueError):  # a value tomli_w cannot write (a NaN key, a tz-less time...): the seed
            return seed
    return st.builds(build, st.sampled_from(seeds), st.integers(0, 2**32), toml_values, st.booleans())


@fuzz_settings()
@given(st.one_of(edited(_policy_seeds()), mutated(_policy_seeds())))
def test_policy(data: bytes) -> None:
    check(lambda: run_policy(data))


@fuzz_settings()
@given(st.one_of(edited([RUN]), mutated([RUN])))
def test_run_config(data: bytes) -> None:
    check(lambda: run_run_config(data))


@fuzz_settings()
@given(st.one_of(edited([GRID]), mutated([GRID]),
                 st.builds(lambda key, values: tomli_w.dumps({"grid": {key: values}, "select": {"data": "x.jsonl"}})
                           .encode(), st.sampled_from(["optimizer.lr", "training.steps", "lora.r", "model.task",
                                                       "prism.rank", "x.y", "optimizer"]),
                           st.lists(toml_values, min_size=1, max_size=3))))
def test_grid(data: bytes) -> None:
    check(lambda: run_grid(data))


@fuzz_settings()
@given(st.one_of(edited([_inference_seed()]), mutated([_inference_seed()])))
def test_inference_policy(data: bytes) -> None:
    check(lambda: run_inference_policy(data))


@fuzz_settings(0.1)
@given(st.sampled_from([run_policy, run_run_config, run_grid, run_inference_policy]),
       st.sampled_from([b"a = " + b"[" * 3000 + b"]" * 3000, b"a = " + b"9" * 5000, b"a = {b = " * 2000, b"\xff"]))
def test_hostile_toml(run, data: bytes) -> None:  # type: ignore[no-untyped-def]
    """Nesting past the recursion limit, integers past the digit limit, bytes that are not UTF-8."""
    assert check(lambda: run(data)) is not None


if __name__ == "__main__":
    main(TARGETS)
