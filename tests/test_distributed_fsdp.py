"""A sharded model through the run (`training.fsdp = true`; docs/distributed.md "Sharded models"), 2 gloo ranks.

`govtrain/distributed/fsdp.py` shards each transformer block and the root with FSDP2. Against the single process on
the same seed, with public and sensitive classes at their own (C, σ): every step's privatized gradient (each rank's
shards gathered) equals the single process's to 1e-6, the spend is the single process's and written once, and the
adapter the lead writes equals the single process's. `govtrain train --nproc 2` with fsdp resumes after a kill and
verifies. A sharded run on one process, with prism or dp-muon, or under the HF Trainer is refused with one line.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from safetensors.torch import load_file  # noqa: E402

from govtrain.train.config import load_run_config  # noqa: E402
from govtrain.train.loop import train  # noqa: E402
from govtrain.verify.verifier import verify_ledger  # noqa: E402
from tests.test_distributed import (  # noqa: E402,F401
    children,
    finish,
    govtrain_train,
    make_world,
    run_entries,
    same_release,
    spends,
    start_ranks,
    tiny,
)

FSDP = "fsdp = true\n"


@pytest.mark.slow
@pytest.mark.parametrize("unit", ["example", pytest.param("contribution", marks=pytest.mark.long)])
def test_two_sharded_ranks_release_the_single_process_gradient_and_adapter(tmp_path, tiny, unit):
    one = make_world(tmp_path / "one", tiny, unit=unit)
    two = make_world(tmp_path / "two", tiny, unit=unit, extra=FSDP)
    done = finish(start_ranks(*one, tmp_path / "out-one", 0) + start_ranks(*two, tmp_path / "out-two", 2))
    assert [code for code, _ in done] == [0, 0, 0], "\n".join(err[-3000:] for _, err in done)
    single, ranks = same_release(tmp_path / "out-one", tmp_path / "out-two")
    assert single["steps"] == ranks[0]["steps"] == 3
    assert spends(two[0].url) == spends(one[0].url) != []
    report = verify_ledger(two[0].url)
    assert report.spend_recomputed and report.by_kind["run"] == 1
    adapters = sorted(p.relative_to(one[0].dir / "adapter") for p in (one[0].dir / "adapter").rglob("*.safetensors"))
    assert adapters and adapters == sorted(p.relative_to(two[0].dir / "adapter")
                                           for p in (two[0].dir / "adapter").rglob("*.safetensors"))
    same_adapters(two[0], one[0], adapters)


def same_adapters(mine, theirs, adapters) -> None:  # type: ignore[no-untyped-def]
    """Each of `adapters` (paths in the output folder) that corpus `mine` saved equals `theirs`'s to 1e-5."""
    for adapter in adapters:
        got, expected = (load_file(str(corpus.dir / "adapter" / adapter)) for corpus in (mine, theirs))
        assert got.keys() == expected.keys() and got
        for key in got:
            torch.testing.assert_close(got[key], expected[key], rtol=0, atol=1e-5,
                                       msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.slow
def test_govtrain_train_nproc_2_sharded_resumes_after_a_kill_exactly_and_verifies(tmp_path, tiny):
    """`govtrain train --nproc 2` with fsdp: a follower killed mid-epoch stops both ranks (`rank_lost`, exit 2);
    the same command again puts the lead's run state back as each rank's shards (weights and AdamW moments) and
    completes the run: every epoch charged once, never under-counted, the ledger verifies, and the adapter equals
    that of the single process stopped in the same ledger epoch and resumed from the same checkpoint (step 10: the
    follower is killed just after epoch 1's spend is written ahead) on the same seed."""
    corpus, config = make_world(tmp_path / "w", tiny, steps=40, rate=0.05, extra=FSDP)
    launcher = govtrain_train(corpus, config, "--nproc", "2")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not any(e >= 1 for _, e, *_ in spends(corpus.url)):
        time.sleep(0.05)  # until the second ledger epoch's spend is written ahead
    ranks = children(launcher.pid)
    assert set(ranks) == {0, 1}, ranks
    os.kill(ranks[1], signal.SIGKILL)
    _, stderr = launcher.communicate(timeout=240)
    assert launcher.returncode == 2 and "error[rank_lost]" in stderr, stderr[-3000:]
    before = spends(corpus.url)
    assert run_entries(corpus.url) == 0 and before
    again = govtrain_train(corpus, config, "--nproc", "2")
    stdout, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr[-3000:]
    assert json.loads(stdout.splitlines()[-1])["steps"] == 40
    after = spends(corpus.url)
    assert set(before) <= set(after)
    assert sorted((c, e) for c, e, *_ in after) == sorted({(c, e) for c, e, *_ in after})
    assert run_entries(corpus.url) == 1 and verify_ledger(corpus.url).spend_recomputed

    # the oracle: one process of the same run, stopped in the same ledger epoch, resumed from the same checkpoint
    alone, alone_config = make_world(tmp_path / "alone", tiny, steps=40, rate=0.05)
    with pytest.raises(KeyboardInterrupt):
        train(load_run_config(alone_config), alone.url, insecure_seed=3, log=lambda line: None,
              interrupt_after_steps=14)
    train(load_run_config(alone_config), alone.url, insecure_seed=3, log=lambda line: None)
    assert spends(alone.url) == after
    same_adapters(corpus, alone, ["adapter_model.safetensors"])


# -- refusals: one line, nothing written ------------------------------------------------------------------------


@pytest.mark.parametrize("setting, said", [
    ('mechanism = "prism"', "training.fsdp trains mechanism 'dpsgd' only"),
    ('mechanism = "dp-muon"', "training.fsdp trains mechanism 'dpsgd' only"),
    ("compiled = true", "training.fsdp and training.compiled"),
    ("[noise]\nmicrobatches = 2", "microbatches > 1"),
])
def test_what_fsdp_does_not_run_is_refused_when_the_config_is_read(tmp_path, tiny, setting, said):
    from govtrain.errors import Code, ConfigError

    corpus, config = make_world(tmp_path / "w", tiny, extra=FSDP)
    text = config.read_text().replace('mechanism = "dpsgd"\n', "") + ("\n" if setting.startswith("[") else "")
    config.write_text(text.replace("[training]\n", f"[training]\n{setting}\n") if not setting.startswith("[")
                      else text + setting + "\n")
    with pytest.raises(ConfigError) as refused:
        load_run_config(config)
    assert refused.value.code is Code.RUN_CONFIG_INVALID and said in str(refused.value)


def test_a_sharded_run_in_one_process_is_refused_before_anything_is_written(tmp_path, tiny):
    import govtrain
    from govtrain.errors import Code, ConfigError
    from tests.conftest import snapshot

    corpus, config = make_world(tmp_path / "w", tiny, extra=FSDP)
    before = snapshot(corpus.url)
    with pytest.raises(ConfigError) as refused:
        govtrain.GovernedRun.open(config, corpus.url, insecure_seed=1, log=lambda line: None)
    assert refused.value.code is Code.RUN_CONFIG_INVALID and "--nproc N or torchrun" in str(refused.value)
    assert snapshot(corpus.url) == before
    assert not (corpus.dir / "adapter").exists() or not any((corpus.dir / "adapter").iterdir())


@pytest.mark.slow
def test_the_hf_trainer_refuses_a_sharded_run_on_every_rank_before_any_spend(tmp_path, tiny):
    from tests.test_hf_distributed import start_trainers

    corpus, config = make_world(tmp_path / "w", tiny, steps=2, extra=FSDP)
    done = finish(start_trainers(corpus, config, tmp_path / "out", 2), timeout=180)
    for code, err in done:
        assert code != 0 and "error[run_config_invalid]" in err and "training.fsdp" in err, err[-2000:]
    assert spends(corpus.url) == [] and run_entries(corpus.url) == 0


# -- a tiny Llama, its three classes reaching different depths and an adapter of their own ---------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    from tests import causal_models

    return causal_models.save(tmp_path_factory.mktemp("tiny-llama"), "llama", layers=6)


def llama_world(folder: Path, model: Path, extra: str = "") -> tuple:
    """Public text (every layer, the head), sensitive pairs (layers 4-5, C = 0.5) and restricted chats (an adapter of
    their own, σ = 1.5): the tests' policy, on tests/test_causal_lm.py's rows."""
    from tests.conftest import TEST_POLICY, make_corpus
    from tests.test_causal_lm import _contribution, _rows, _run_toml

    folder.mkdir(parents=True)
    corpus = make_corpus(folder, f"sqlite:///{folder / 'ledger.db'}", TEST_POLICY.replace("sampling_rate = 0.01\n",
                                                                                          "sampling_rate = 0.1\n"))
    _contribution(corpus, "text", _rows("text", 24))
    _contribution(corpus, "pairs", _rows("pair", 24), data_class="sensitive", clip_norm_u=500_000,
                  eps_budget_u=3_000_000)
    _contribution(corpus, "chats", _rows("chat", 24), data_class="restricted", clip_norm_u=500_000,
                  noise_multiplier_u=1_500_000, eps_budget_u=1_000_000)
    config = _run_toml(corpus, model, 3)
    config.write_text(config.read_text() + "physical_batch = 3\n" + extra)
    return corpus, config


@pytest.mark.slow
def test_a_sharded_tiny_llama_with_depth_routing_and_a_class_adapter_is_the_single_process_run(tmp_path, llama):
    one = llama_world(tmp_path / "one", llama)
    two = llama_world(tmp_path / "two", llama, FSDP)
    done = finish(start_ranks(*one, tmp_path / "out-one", 0) + start_ranks(*two, tmp_path / "out-two", 2))
    assert [code for code, _ in done] == [0, 0, 0], "\n".join(err[-3000:] for _, err in done)
    single, _ = same_release(tmp_path / "out-one", tmp_path / "out-two")
    for reference in single["grads"]:
        assert any(".restricted." in name for name in reference), "the restricted class's adapter moved nothing"
        assert any(".layers.0." in name for name in reference) and any(".layers.5." in name for name in reference)
    assert spends(two[0].url) == spends(one[0].url) != []
    assert verify_ledger(two[0].url).spend_recomputed
    same_adapters(two[0], one[0], ["adapter_model.safetensors", "restricted/adapter_model.safetensors"])
