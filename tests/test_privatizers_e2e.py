"""Issue 24 end to end: every privatizer through `govtrain train` and `govtrain-verify` (docs/privatizers.md).

For each of banded-mf, blt, laplace, discrete-gaussian and skellam a tiny run completes, its spend and run entries
record the privatizer, the ledger verifies with the accountant on, and each spend's ε is what its recorded charge
implies, recomputed here from the record. A banded-mf run killed mid-epoch resumes to the uninterrupted run's
adapter; a spend whose privatizer record implies more than its ε (appended and signed by the ledger key's holder)
is flagged; a family below its policy floor is refused before any spend.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402

from govtrain.privatizers.charges import spend_item  # noqa: E402
from govtrain.accounting.spend import SpendCalculator  # noqa: E402
from govtrain.cli.main import cli  # noqa: E402
from govtrain.cli.verify import verify_cli  # noqa: E402
from govtrain.errors import ConfigError  # noqa: E402
from govtrain.ledger.entries import decode_entry  # noqa: E402
from govtrain.privatizers import from_record  # noqa: E402
from govtrain.privatizers.base import Charge  # noqa: E402
from govtrain.units import MICRO  # noqa: E402
from tests.conftest import TEST_POLICY, Corpus, make_corpus, snapshot  # noqa: E402
from tests.test_train import _admit, _config  # noqa: E402

STEPS = 12  # two ledger epochs under TEST_POLICY (10 steps each): 10, then 2
NOISE = {
    "banded-mf": 'privatizer = "banded-mf"\nbands = 2',
    "blt": 'privatizer = "blt"\nbuffers = 2\nmin_separation = 3',
    "laplace": 'privatizer = "laplace"',
    "discrete-gaussian": 'privatizer = "discrete-gaussian"\ngranularity_bits = 12',
    "skellam": 'privatizer = "skellam"',
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from tests.test_train import save_tiny_bert

    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


def _entries(corpus: Corpus, kind: str) -> list[dict]:
    with corpus.open() as ledger:
        return [decode_entry(e.body, seq=e.seq, kind=e.kind) for e in ledger.store.entries(kinds=(kind,))]


def _train_cli(corpus: Corpus, model: Path, name: str, steps: int = STEPS) -> dict:
    config = _config(corpus, model, steps, extra=f"[noise]\n{NOISE[name]}")
    result = CliRunner().invoke(cli, ["train", "--config", str(config), "--ledger", corpus.url, "--insecure-seed", "1",
                                      "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _two_contributions(corpus: Corpus) -> None:
    _admit(corpus, "pub", noise_multiplier_u=2_000_000, eps_budget_u=8_000_000)
    _admit(corpus, "sens", data_class="sensitive", clip_norm_u=500_000, noise_multiplier_u=2_000_000,
           eps_budget_u=4_000_000)


@pytest.mark.parametrize("name", list(NOISE))
def test_each_privatizer_trains_records_verifies_and_charges_what_its_record_implies(corpus: Corpus,
                                                                                    tiny_model: Path, name: str):
    _two_contributions(corpus)
    body = _train_cli(corpus, tiny_model, name)
    assert body["steps"] == STEPS and body["epochs"] == [0, 1]

    verified = CliRunner().invoke(verify_cli, ["--ledger", corpus.url, "--json"])
    assert verified.exit_code == 0, verified.output
    report = json.loads(verified.stdout)
    assert report["spend_recomputed"] is True  # the accountant recomputed every spend from its record

    spends, runs = _entries(corpus, "spend"), _entries(corpus, "run")
    assert len(spends) == 4 and len(runs) == 1
    record = runs[0]["privatizer"]
    assert record["name"] == name and all(s["privatizer"] == record for s in spends)
    privatizer = from_record(record)  # the record rebuilds the privatizer exactly
    assert privatizer.record() == record
    if privatizer.quantized:  # the dimension was bound before the first spend: the run's trainable coordinates
        assert 0 < record["dimension"] <= _trained_coordinates(corpus)
    if name in ("banded-mf", "blt"):
        assert record["horizon"] == STEPS

    with corpus.open() as ledger:
        policy = ledger.policy
    calculator = SpendCalculator(policy.accountant, policy.delta_p)
    for contribution in ("pub", "sens"):
        history = []
        for spend in sorted((s for s in spends if s["contribution_id"] == contribution), key=lambda s: s["epoch"]):
            charge = privatizer.charge(sampling_rate_u=spend["sampling_rate_u"],
                                       noise_multiplier_u=spend["noise_multiplier_u"], steps=spend["steps"])
            _check_charge(name, record, spend, charge)
            history.append(spend_item(spend))
            assert spend["eps_u"] == calculator.epsilon_u(tuple(history)), (contribution, spend["epoch"])
    calculator.close()


def _check_charge(name: str, record: dict, spend: dict, charge: Charge) -> None:
    """The charge the docs state for each privatizer, from the spend's own numbers."""
    q, sigma, steps = spend["sampling_rate_u"], spend["noise_multiplier_u"], spend["steps"]
    if name == "banded-mf":
        b = record["bands"]
        assert (charge.family, charge.sampling_rate_u, charge.noise_multiplier_u, charge.rounds) == \
            ("gaussian", min(MICRO, b * q), sigma, math.ceil(steps / b))
    elif name == "blt":
        assert (charge.family, charge.sampling_rate_u, charge.rounds) == \
            ("gaussian", MICRO, math.ceil(steps / record["min_separation"]))
        assert 0 < charge.noise_multiplier_u < sigma  # σ/√m, m > 1 for a strategy with memory
    else:
        assert (charge.family, charge.sampling_rate_u, charge.noise_multiplier_u, charge.rounds) == \
            (name, q, sigma, steps)
        assert charge.params == (record["granularity_bits"], record["beta_exp"], record["dimension"])


def _trained_coordinates(corpus: Corpus) -> int:
    """The coordinates the run's adapters hold: the default adapter's and each class adapter's."""
    from safetensors.torch import load_file

    return sum(v.numel() for path in (corpus.dir / "adapter").rglob("*.safetensors") for v in load_file(path).values())


def _adapter_sha(corpus: Corpus) -> str:
    return hashlib.sha256((corpus.dir / "adapter" / "adapter_model.safetensors").read_bytes()).hexdigest()


def test_a_banded_mf_run_killed_mid_epoch_resumes_to_the_uninterrupted_adapter(tmp_path: Path, tiny_model: Path):
    from tests import run_state_keys
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import STATE_FILE, train

    finished = {}
    for case in ("whole", "killed"):
        (tmp_path / case).mkdir()
        corpus = make_corpus(tmp_path / case, f"sqlite:///{tmp_path / case / 'ledger.db'}")
        _two_contributions(corpus)
        config = load_run_config(_config(corpus, tiny_model, 16, extra='[noise]\nprivatizer = "banded-mf"\nbands = 3'))
        if case == "killed":
            with pytest.raises(KeyboardInterrupt):
                train(config, corpus.url, insecure_seed=3, log=lambda _: None, checkpoint_every=4,
                      interrupt_after_steps=14)  # in ledger epoch 1, after its checkpoint at step 12
            state = run_state_keys.read(corpus.dir / "adapter" / STATE_FILE, corpus)
            assert state["step"] == 12 and state["noise"]["state"]["step"] == 12  # the noise stream's position
            lines: list[str] = []
            result = train(config, corpus.url, insecure_seed=3, log=lines.append, checkpoint_every=4)
            assert any(line.startswith("resuming test-run at step 12") for line in lines)
        else:
            result = train(config, corpus.url, insecure_seed=3, log=lambda _: None, checkpoint_every=4)
        assert result.steps == 16
        finished[case] = (_adapter_sha(corpus), [s["privatizer"] for s in _entries(corpus, "spend")])
        assert CliRunner().invoke(verify_cli, ["--ledger", corpus.url]).exit_code == 0
    assert finished["killed"][0] == finished["whole"][0]  # the same noise stream, draws and updates
    assert finished["killed"][1][0] == finished["whole"][1][0]  # the same strategy recorded


def test_a_spend_whose_privatizer_record_implies_more_than_its_epsilon_is_flagged(corpus: Corpus, tiny_model: Path):
    """After an honest banded-mf run, the ledger key's holder appends a spend (another run, a later epoch) whose
    record is a 4-band strategy but whose ε is what the run's 2-band record would imply: the verifier recomputes
    the charge from the record and names the spend. The same spend with the ε its record implies verifies."""
    from govtrain.verify.verifier import verify_ledger

    _two_contributions(corpus)
    _train_cli(corpus, tiny_model, "banded-mf")
    honest = [s for s in _entries(corpus, "spend") if s["contribution_id"] == "pub"]
    recorded = honest[0]["privatizer"]
    assert verify_ledger(corpus.url).spend_recomputed
    tampered = from_record(recorded).__class__(bands=4, horizon=recorded["horizon"]).record()
    corpus = dataclasses.replace(corpus, now=int(time.time()) + 1)  # the run wrote at the wall clock's time
    with corpus.open() as ledger:
        policy = ledger.policy
        ledger.close_epoch(now=corpus.now)  # the run's epochs are closed; the forged spend opens the next

    def implied(*records: dict) -> int:  # the pub's ε after the run and one forged 10-step spend per record
        history = [spend_item(s) for s in honest] + [spend_item({
            "sampling_rate_u": 10_000, "noise_multiplier_u": 2_000_000, "steps": 10, "privatizer": r}) for r in records]
        with SpendCalculator(policy.accountant, policy.delta_p) as calculator:
            return calculator.epsilon_u(tuple(history))

    # the control: the 4-band record with the ε it implies verifies (another run may use another privatizer)
    _forged_spend(corpus, "pub", eps_u=implied(tampered), privatizer=tampered, run_id="forged-a")
    assert verify_ledger(corpus.url).spend_recomputed
    with corpus.open() as ledger:
        ledger.close_epoch(now=corpus.now)
    # the attack: the 4-band record with the ε a 2-band one would imply
    assert implied(tampered, recorded) < implied(tampered, tampered)
    _forged_spend(corpus, "pub", eps_u=implied(tampered, recorded), privatizer=tampered, run_id="forged-b")
    from govtrain.errors import IntegrityError

    with pytest.raises(IntegrityError) as info:
        verify_ledger(corpus.url)
    assert info.value.code.value == "bad_spend" and "privatizer imply" in info.value.detail
    failed = CliRunner().invoke(verify_cli, ["--ledger", corpus.url])
    assert failed.exit_code != 0 and "bad_spend" in failed.output


def _forged_spend(corpus: Corpus, contribution: str, *, eps_u: int, privatizer: dict, run_id: str) -> None:
    """What an operator holding the ledger key can append past the writer's checks: a spend of its own making
    (10 steps at TEST_POLICY's q and the contribution's signed σ = 2), signed."""
    from govtrain.ledger.entries import spend_entry
    from tests.conftest import lease, noise_groups_for

    with corpus.open() as ledger:
        leaf = ledger.store.entry(ledger.store.admission(contribution).seq).leaf_hash
        fields = dict(contribution_id=contribution, admit_leaf=leaf, run_id=run_id, run_nonce=lease(run_id),
                      epoch=ledger.epoch(), epoch_steps=10, steps=10, sampling_rate_u=10_000,
                      noise_multiplier_u=2_000_000, accountant="prv", delta_p=10_000_000, privacy_unit="example",
                      eps_u=eps_u, noise_groups=noise_groups_for(ledger, [contribution]), privatizer=privatizer)
        with ledger.append(corpus.now) as appender:
            appender.add("spend", corpus.now, lambda seq: spend_entry(seq, corpus.now, **fields))


FLOORED_POLICY = TEST_POLICY.replace("[classes.public]", "[floor.families]\nlaplace = 4.0\n\n[classes.public]", 1)


@pytest.mark.parametrize("privatizer, code", [("laplace", "below_family_floor"),
                                              ("discrete-gaussian", "family_not_allowed")])
def test_a_family_below_its_floor_or_not_allowed_is_refused_before_any_spend(tmp_path: Path, tiny_model: Path,
                                                                             privatizer: str, code: str):
    corpus = make_corpus(tmp_path, f"sqlite:///{tmp_path / 'ledger.db'}", FLOORED_POLICY)
    _two_contributions(corpus)  # signed at σ = 2, below laplace's floor of 4
    before = snapshot(corpus.url)
    config = _config(corpus, tiny_model, STEPS, extra=f"[noise]\n{NOISE[privatizer]}")
    result = CliRunner().invoke(cli, ["train", "--config", str(config), "--ledger", corpus.url])
    assert result.exit_code == 2 and result.stderr.startswith(f"error[{code}]:"), result.output
    assert snapshot(corpus.url) == before and not (corpus.dir / "adapter" / "run-state.safetensors").exists()


@pytest.mark.parametrize("noise, fragment", [
    ('privatizer = "banded-mf"', "needs noise.bands"),
    ('privatizer = "blt"\nbuffers = 2', "needs noise.min_separation"),
    ('privatizer = "blt"\nbuffers = 2\nmin_separation = 13', "more than the run's 12 steps"),
    ('privatizer = "banded-mf"\nbands = 2\nmin_separation = 2', "noise.min_separation does not apply"),
    ('privatizer = "laplace"\nmin_separation = 2', "noise.min_separation does not apply"),
])
def test_a_correlated_privatizers_fields_are_validated_before_anything_is_written(corpus: Corpus, tiny_model: Path,
                                                                                  noise: str, fragment: str):
    _two_contributions(corpus)
    before = snapshot(corpus.url)
    config = _config(corpus, tiny_model, STEPS, extra=f"[noise]\n{noise}")
    result = CliRunner().invoke(cli, ["train", "--config", str(config), "--ledger", corpus.url])
    assert result.exit_code == 2 and result.stderr.startswith("error[privatizer_invalid]:"), result.output
    assert fragment in result.stderr
    assert snapshot(corpus.url) == before


def test_the_cyclic_sampler_draws_each_unit_at_most_once_per_cycle(corpus: Corpus, tiny_model: Path):
    """A banded-mf run's draws (observed per step) come from the cyclic sampler: each contribution's examples
    are drawn from one part per step, so no example is drawn twice within b consecutive steps."""
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import train
    from govtrain.train.run import Run

    _two_contributions(corpus)
    config = load_run_config(_config(corpus, tiny_model, STEPS, extra=f"[noise]\n{NOISE['banded-mf']}"))
    seen: list[tuple[int, int]] = []
    original = Run._draw

    def draw(self, live):  # type: ignore[no-untyped-def]
        chunks = original(self, live)
        # by microbatch, each drawn unit as its example indices (`Run._draw`)
        seen.extend((self.result.steps, i) for drawn in chunks for unit in drawn for i in unit)
        assert type(self.sampler).__name__ == "CyclicPoissonSampler" and self.sampler.cycle == 2
        assert self.sampler.partition_key == b"test-run"
        return chunks

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Run, "_draw", draw)
        train(config, corpus.url, insecure_seed=1, log=lambda _: None)
    steps_of: dict[int, list[int]] = {}
    for step, example in seen:
        steps_of.setdefault(example, []).append(step)
    assert seen and all(b - a >= 2 for s in steps_of.values() for a, b in zip(s, s[1:]))
    assert len({step % 2 for step, _ in seen}) == 2  # both parts are drawn


def test_build_refuses_a_correlated_privatizer_without_the_horizon():
    from govtrain.privatizers import build
    from govtrain.train.config import NoiseSection

    with pytest.raises(ConfigError) as info:
        build(NoiseSection(privatizer="banded-mf", bands=2))
    assert info.value.code.value == "privatizer_invalid" and "horizon" in info.value.detail
    built = build(NoiseSection(privatizer="blt", buffers=2, min_separation=4), horizon=40)
    assert built.record()["min_separation"] == 4 and from_record(built.record()).record() == built.record()
