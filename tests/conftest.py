"""Shared fixtures: keys, a test policy, an initialised ledger and attestation builders."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from govtrain.attest.cose import sign_attestation
from govtrain.attest.descriptor import Descriptor
from govtrain.attest.keys import generate_key_pair, load_private_key
from govtrain.encoding import cbor
from govtrain.encoding.cbor import Tag
from govtrain.ledger.ledger import Ledger
from govtrain.policy.config import load_policy

REPO = Path(__file__).resolve().parent.parent


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker's share of the cores: its torch threads, and those of the processes it starts
    (through OMP_NUM_THREADS, read when torch loads). Workers that each spin the machine's every core only contend."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores // workers))
KEYS_EXAMPLE = REPO / "keys.example"

TEST_POLICY = """
origin = "test.invalid/govtrain/1"
delta = 1e-5
accountant = "prv"
sampling_rate = 0.01
steps_per_epoch = 10
retention_epochs = 1
max_validity_days = 30
clock_skew_seconds = 60

[floor]
min_noise_multiplier = 0.5
max_clip_norm = 4.0

[classes.public]
clip_norm = 1.0
min_noise_multiplier = 0.8
eps_budget = 8.0
max_eps_budget = 10.0
fraction = [0.5, 1.0]
head = true

[classes.sensitive]
clip_norm = 0.5
min_noise_multiplier = 1.0
eps_budget = 3.0
max_eps_budget = 4.0
band = [4, 5]

[classes.restricted]
clip_norm = 0.5
min_noise_multiplier = 1.5
eps_budget = 1.0
max_eps_budget = 2.0
adapter = "restricted"

[[attesters]]
name = "main"
public_key_file = "attester.pub"
classes = ["public", "sensitive", "restricted"]

[[attesters]]
name = "limited"
public_key_file = "limited.pub"
classes = ["public"]

[[ledger_keys]]
name = "test.invalid/govtrain/1"
public_key_file = "ledger.pub"
"""


# Seconds each of the longest files took in the default tier (3 workers on this 2-core machine, 2026-12-08): under
# pytest-xdist's --dist loadfile a file runs whole on one worker, so the longest go first and the short ones fill in
# behind them, instead of one long file starting last and running alone (the Makefile passes --no-loadscope-reorder,
# else xdist orders the files by their number of tests). A file not listed counts as short.
FILE_SECONDS = {
    "test_crash.py": 182,
    "test_attacks_user_code.py": 162,
    "test_attacks_distributed_kills.py": 158,
    "test_distributed_fsdp.py": 141,
    "test_compiled_routing.py": 137,
    "test_distributed.py": 137,
    "test_rehearsal.py": 97,
    "test_attacks_second_run.py": 85,
    "test_audit.py": 72,
    "test_hf_trainer.py": 71,
    "test_attacks_selection.py": 62,
    "test_ledger_load.py": 61,
    "test_accounting.py": 57,
    "fuzz/test_atheris.py": 54,
    "test_attacks_hyperparameters.py": 46,
    "test_train.py": 38,
    "test_ledger_robustness.py": 36,
    "test_attacks_hyperparameters_review.py": 34,
    "test_schedule.py": 33,
    "test_tune.py": 32,
    "test_api.py": 32,
    "test_privatizers_e2e.py": 30,
    "test_signed_ledger.py": 29,
    "test_release.py": 25,
    "test_attacks_identity_sampling.py": 23,
    "test_docs.py": 22,
    "test_attacks_class_adapters.py": 22,
    "test_audit_privatizers.py": 21,
    "test_attacks_run_state.py": 20,
    "test_attacks_run_state_mac.py": 20,
    "test_nonfinite.py": 20,
    "test_progress.py": 17,
    "test_bench_inference.py": 17,
    "test_attacks_run_state_review.py": 16,
    "test_serve.py": 16,
    "test_attacks_fsdp_review.py": 16,
    "test_postgres.py": 16,
    "test_privatizers_core.py": 15,
    "test_attacks_ledger_index.py": 15,
    "test_attacks_rehearsal.py": 15,
    "test_attacks_ledger.py": 14,
    "test_attacks_ledger_index_review.py": 13,
    "test_audit_bounds.py": 13,
}


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move everything collection made (the suite's modules, items and the libraries they import: ~640,000 objects in
    each worker) out of the cyclic garbage collector's reach: it is never garbage, and each full collection walked
    all of it (0.33 s; accelerate runs one at every Trainer's start). Objects the tests make are collected as before."""
    import gc

    gc.freeze()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        def seconds(item: pytest.Item) -> int:
            path = item.nodeid.split("::")[0]
            return FILE_SECONDS.get(path.removeprefix("tests/"), 0)

        items.sort(key=seconds, reverse=True)  # stable: each file's tests keep their order


@dataclass
class Corpus:
    """A test corpus: key files, a policy, an initialised ledger and a clock."""

    dir: Path
    policy_path: Path
    url: str
    attester: Ed25519PrivateKey
    limited: Ed25519PrivateKey
    now: int

    @property
    def attester_key(self) -> Path:
        return self.dir / "attester.key"

    def open(self) -> Ledger:
        return Ledger.open(self.url)

    def data(self, name: str, records: int = 3, *, salt: str = "") -> Path:
        path = self.dir / name
        lines = [json.dumps({"text": f"{name} {salt} example {i}", "label": i % 2}) for i in range(records)]
        path.write_text("\n".join(lines) + "\n")
        return path

    def descriptor_map(self, data: Path, **overrides: object) -> dict:
        raw = data.read_bytes()
        fields = {
            "v": 1,
            "contribution_id": data.name.replace(".jsonl", ""),
            "contributor": "alice@example.org",
            "data_class": "public",
            "data_sha256": hashlib.sha256(raw).digest(),
            "records": sum(1 for line in raw.splitlines() if line.strip()),
            "clip_norm_u": 1_000_000,
            "noise_multiplier_u": 1_000_000,
            "eps_budget_u": 5_000_000,
            "not_before": self.now - 60,
            "not_after": self.now + 7 * 86_400,
            "issued_at": self.now - 60,
            "salt": hashlib.sha256(data.name.encode()).digest()[:16],
        }
        fields.update(overrides)
        return fields

    def attestation(self, data: Path, *, key: Ed25519PrivateKey | None = None, **overrides: object) -> bytes:
        descriptor = Descriptor(**self.descriptor_map(data, **overrides))  # type: ignore[arg-type]
        return sign_attestation(descriptor, key or self.attester)


def append_runs(ledger: Ledger, count: int, now: int) -> None:
    """`count` run entries in one signed append: bulk for tests of large ledgers."""
    from govtrain.ledger.entries import run_entry

    with ledger.append(now) as appender:
        for i in range(count):
            appender.add("run", now, lambda seq, i=i: run_entry(
                seq, now, run_id=f"r{i}", run_nonce=lease(f"r{i}"), mechanism="dpsgd", device="cpu",
                precision="fp32", config_sha256=bytes(32), base_model_sha256=bytes(32), adapter_sha256=None))


def lease(run_id: str) -> bytes:
    """A fixed lease nonce per run id, for tests that write spend and run entries by hand (a run draws its own)."""
    return hashlib.sha256(b"test lease " + run_id.encode()).digest()[:16]


def noise_groups_for(ledger: Ledger, contribution_ids) -> list[dict]:
    """A schedule `record_spend` accepts for these contributions charged together: each one's class a noise group
    of its own, at the largest signed sigma*C among them of that class (spend rule 7's bound, met exactly)."""
    from govtrain.ledger.spend_rules import noise_groups_record

    signed = ledger.spend_book().signed
    top: dict[frozenset, int] = {}
    for c in contribution_ids:
        if c in signed:
            key = frozenset((signed[c].data_class,))
            top[key] = max(top.get(key, 0), signed[c].noise_pu)
    return noise_groups_record(top)


def record_spend(ledger: Ledger, epoch: int, sampling_rate_u: int, records, *, run_id: str = "r", epoch_steps: int,
                 now: int, run_nonce: bytes | None = None, noise_groups: list[dict] | None = None):
    """`Ledger.record_spend` with the test lease of `run_id` and `noise_groups_for` the records by default."""
    groups = noise_groups if noise_groups is not None else noise_groups_for(ledger, [r[0] for r in records])
    return ledger.record_spend(epoch, sampling_rate_u, records, run_id=run_id, epoch_steps=epoch_steps, now=now,
                               run_nonce=run_nonce if run_nonce is not None else lease(run_id), noise_groups=groups)


def snapshot(url: str) -> tuple[int, bytes | None, int]:
    """(entry count, last leaf hash, admissions): what a rejection must leave unchanged."""
    with Ledger.open(url) as ledger:
        return ledger.size(), ledger.head_leaf_hash(), len(ledger.store.admissions())


def sign_raw(payload: bytes, key: Ed25519PrivateKey, *, protected: bytes | None = None,
             unprotected: dict | None = None, tag: int | None = 18, signature: bytes | None = None) -> bytes:
    """A COSE_Sign1 over arbitrary payload bytes: for attestations that are malformed on purpose."""
    from govtrain.attest.cose import sig_structure
    from govtrain.attest.keys import key_id

    if protected is None:
        protected = cbor.encode({1: -8, 4: key_id(key.public_key())})
    if signature is None:
        signature = key.sign(sig_structure(protected, payload))
    body = [protected, unprotected if unprotected is not None else {}, payload, signature]
    return cbor.encode(Tag(tag, body) if tag is not None else body)


def copy_demo_keys(target: Path) -> Path:
    """keys.example into `target` with private keys at 0600 (git does not keep modes)."""
    target.mkdir(parents=True, exist_ok=True)
    for name in ("attester.key", "attester.pub", "ledger.key", "ledger.pub", "release.key", "release.pub",
                 "policy.toml"):
        shutil.copy(KEYS_EXAMPLE / name, target / name)
    for name in ("attester.key", "ledger.key", "release.key"):
        (target / name).chmod(0o600)
    return target


def make_corpus(tmp_path: Path, url: str, policy_text: str = TEST_POLICY) -> Corpus:
    keys = copy_demo_keys(tmp_path / "keys")
    generate_key_pair(keys, "limited")
    policy_path = keys / "test-policy.toml"
    policy_path.write_text(policy_text)
    policy, digest = load_policy(policy_path)
    Ledger.init(url, policy, digest, key_path=keys / "ledger.key").close()
    return Corpus(
        dir=keys,
        policy_path=policy_path,
        url=url,
        attester=load_private_key(keys / "attester.key"),
        limited=load_private_key(keys / "limited.key"),
        now=int(time.time()),
    )


@pytest.fixture(autouse=True)
def auto_is_the_cpu(request, monkeypatch):
    """`training.device = "auto"` means CUDA on a machine that has it. The suite checks CPU semantics and builds
    its own inputs on the CPU (as do `use_cpu=True` Trainers), so outside tests/test_hardware.py, which names its
    devices, "auto" is the CPU on every machine: the suite passes alike with and without a GPU."""
    if request.module.__name__.rpartition(".")[2] != "test_hardware":
        import torch

        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def corpus(tmp_path: Path) -> Corpus:
    return make_corpus(tmp_path, f"sqlite:///{tmp_path / 'ledger.db'}")


@pytest.fixture
def pg_url():
    """A fresh PostgreSQL database per test. Skips loudly without a server; under CI, fails instead."""
    import os
    import uuid

    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import OperationalError

    def unavailable(reason: str):
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL is required under CI: {reason}")
        pytest.skip(f"POSTGRESQL TESTS SKIPPED: {reason} (start one with: export "
                    "GOVTRAIN_TEST_PG_URL=$(bash .ci/postgres.sh))")

    admin = os.environ.get("GOVTRAIN_TEST_PG_URL")
    if not admin:
        unavailable("GOVTRAIN_TEST_PG_URL is not set")
    engine = create_engine(admin, isolation_level="AUTOCOMMIT")
    name = f"govtrain_test_{uuid.uuid4().hex[:12]}"
    try:
        with engine.connect() as connection:
            connection.exec_driver_sql(f"CREATE DATABASE {name}")
    except OperationalError as e:
        unavailable(f"cannot reach the server: {str(e.orig).splitlines()[0]}")
    yield make_url(admin).set(database=name).render_as_string(hide_password=False)
    with engine.connect() as connection:
        connection.exec_driver_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    engine.dispose()


@pytest.fixture
def pg_corpus(tmp_path: Path, pg_url: str) -> Corpus:
    return make_corpus(tmp_path, pg_url)


def rates_met(monkeypatch: pytest.MonkeyPatch, optimizer: object, read=lambda o: o.param_groups[0]["lr"]) -> list:
    """What `read(optimizer)` is each time its `step` runs (by default the first group's learning rate: what the
    governed update meets), recorded by wrapping the step of its class for this test only: a hook or method placed
    on the run's own optimizer instance is refused (issue 34, the review of item 8)."""
    met: list = []
    kind = type(optimizer)
    step = kind.step

    def recorded(self, *args, **kwargs):
        if self is optimizer:
            met.append(read(self))
        return step(self, *args, **kwargs)

    monkeypatch.setattr(kind, "step", recorded)
    return met
