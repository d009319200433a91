"""A class trained on its own adapter, served to a caller whose envelope excludes it with that adapter disabled,
must not have shaped the answer (issue 22, the serving review's proof). Training routes each example through the
default adapter and its own class's adapter only (`govtrain/routing/adapters.py`), so two runs that differ only in
the excluded class's rows serve the excluding caller the same logits, bit for bit. Real uvicorn on 127.0.0.1
(tests/serve_setup.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import govtrain  # noqa: E402
from govtrain.attest.keys import generate_key_pair  # noqa: E402
from govtrain.serve.rights import HEADER  # noqa: E402
from tests.release_setup import Released, release_policy, trained_release  # noqa: E402
from tests.serve_setup import TEXTS, deploy  # noqa: E402
from tests.test_train import tiny_model  # noqa: E402,F401

EXCLUDING_RESTRICTED = ["public", "sensitive"]  # restricted reached only its own adapter: served with it disabled


def _corpus_with_restricted_labels(root: Path, flip: int, policy: str | None = None):  # type: ignore[no-untyped-def]
    """The ledger and data of `trained_release` (tests/release_setup.py), release key included, in `root`, with
    restricted's labels XOR `flip`."""
    from govtrain.gate.admission import admit
    from tests.conftest import make_corpus
    from tests.test_api import BATCH_POLICY
    from tests.test_train import WORDS, _admit

    keys = root / "keys"
    keys.mkdir(parents=True)
    generate_key_pair(keys, "release")
    corpus = make_corpus(root, f"sqlite:///{root / 'ledger.db'}", release_policy(policy or BATCH_POLICY))
    _admit(corpus, "pub")
    _admit(corpus, "sens", data_class="sensitive", clip_norm_u=500_000, eps_budget_u=3_000_000)
    data = corpus.dir / "data" / "restr.jsonl"  # exactly tests.test_train._data's rows for "restr", labels aside
    data.write_text("".join(json.dumps({"text": f"{WORDS[i % 9]} movie {WORDS[9 + i % 8]} restr",
                                        "label": (i % 2) ^ flip}) + "\n" for i in range(40)))
    with corpus.open() as ledger:
        admit(ledger, corpus.attestation(data, contribution_id="restr", data_class="restricted", clip_norm_u=500_000,
                                         noise_multiplier_u=1_500_000, eps_budget_u=2_000_000), data, now=corpus.now)
    return corpus


def _train_with_restricted_labels(root: Path, base: Path, flip: int) -> Released:
    """The run of `trained_release` (tests/release_setup.py), on the same base and seed, with restricted's labels XOR
    `flip`."""
    from tests.test_api import QUIET
    from tests.test_release import _run_toml

    corpus = _corpus_with_restricted_labels(root, flip)
    with govtrain.GovernedRun.open(_run_toml(corpus, str(base)), corpus.url, insecure_seed=3, **QUIET) as run:
        for batch in run.batches():
            run.step(run.per_example_loss(run.model(**batch.inputs), batch))
        run.save()
    return Released(root, base)


def _served_without_restricted(released: Released) -> list[list[float]]:
    deployment = deploy(released)
    gate = deployment.start()
    try:
        answer = gate.classify(deployment.rights(classes=EXCLUDING_RESTRICTED)[HEADER], TEXTS)
    finally:
        gate.close()
    assert answer["disabled_adapters"] == ["restricted"] and answer["excluded_classes"] == ["restricted"]
    return [row["logits"] for row in answer["results"]]


@pytest.mark.slow
def test_a_class_served_with_its_own_adapter_disabled_still_shaped_the_answer(tmp_path_factory, tmp_path: Path):
    """Adversary: a caller whose envelope excludes `restricted` (or the contributor of `restricted`, who was
    promised that such callers never draw on its data). Attack: none needed: ask /v1/classify. The gate disables
    the `restricted` adapter and states `excluded_classes: ["restricted"]`, but training ran every adapter in every
    forward pass (`govtrain/train/model.py` `wrap_lora`: "every adapter in the forward pass"), so the default
    adapter and the head that public and sensitive trained were fitted to features that `restricted`'s adapter,
    itself trained on restricted's rows, shaped. Two runs that differ only in restricted's labels (same base, same
    seed; a control run shows training is deterministic) serve different logits to the excluding caller.
    Impact: docs/serving.md and the threat model ("It cannot draw on a class its envelope excludes") are false for
    every own-adapter class: its data reaches excluded callers through the shared parameters, which the manifest
    states it never reached (`classes[].adapter`, group `adapters=['restricted']`)."""
    reference = trained_release(tmp_path_factory)
    control = _train_with_restricted_labels(tmp_path / "control", reference.base, flip=0)
    flipped = _train_with_restricted_labels(tmp_path / "flipped", reference.base, flip=1)
    honest = _served_without_restricted(reference.copy(tmp_path / "reference"))
    assert _served_without_restricted(control) == honest  # the same rows train the same model, bit for bit
    # only restricted's rows differ: a caller excluded from restricted must be served the same answer
    assert _served_without_restricted(flipped) == honest


def _adapters(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The saved adapter's tensors: the default adapter's (LoRA factors and the head) and restricted's."""
    from safetensors.torch import load_file

    return {"default": load_file(folder / "adapter_model.safetensors"),
            "restricted": load_file(folder / "restricted" / "adapter_model.safetensors")}


@pytest.mark.parametrize("path, mechanism", [("trainer", "dpsgd"), ("cli", "dpsgd"),
                                             pytest.param("cli", "prism", marks=pytest.mark.slow),
                                             pytest.param("cli", "dp-muon", marks=pytest.mark.slow)])
def test_no_training_path_lets_an_own_adapter_class_shape_the_shared_weights(tmp_path: Path, tiny_model: Path,
                                                                               path: str, mechanism: str):
    """The Hugging Face Trainer and `govtrain train` (which tune trials run), with PRISM and DP-Muon, in
    physical chunks: two runs that differ only in restricted's labels save the same default adapter and head,
    bit for bit, and a different restricted adapter (restricted's rows did train it)."""
    from govtrain.integrations.hf import GovernedTrainer
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import train
    from tests.test_api import QUIET
    from tests.test_hf_trainer import MECHANISMS, _arguments
    from tests.test_train import _config

    saved = []
    for flip in (0, 1):
        corpus = _corpus_with_restricted_labels(tmp_path / f"flip-{flip}", flip)
        config = _config(corpus, tiny_model, 4, mechanism,
                         f"physical_batch = 3\nexpected_batch_size = 8\n{MECHANISMS[mechanism]}")
        if path == "cli":
            train(load_run_config(config), corpus.url, insecure_seed=5, **QUIET)
        else:
            with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=5, **QUIET) as run:
                GovernedTrainer(run, args=_arguments(tmp_path / f"trainer-{flip}")).train()
        saved.append(_adapters(corpus.dir / "adapter"))
    honest, flipped = saved
    assert honest["default"].keys() == flipped["default"].keys() and any("classifier" in k for k in honest["default"])
    for name, tensor in honest["default"].items():
        assert torch.equal(tensor, flipped["default"][name]), name
    assert any(not torch.equal(tensor, flipped["restricted"][name]) for name, tensor in honest["restricted"].items())
