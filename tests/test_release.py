"""What leaves govtrain (`govtrain/release/`): the adapter folder records what reproduces its predictions and
names its base model portably; `govtrain.load` gives the trained model's exact logits, as `govtrain eval` does;
plain transformers/peft give the same logits or refuse loudly, never [CLS] for mean pooling; the model card
states the ledger's figures; Hugging Face ids load from the local cache only, bound by their tree hash."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from click.testing import CliRunner  # noqa: E402

import govtrain  # noqa: E402
from govtrain.cli.main import cli  # noqa: E402
from govtrain.errors import Code, ConfigError, IntegrityError  # noqa: E402
from govtrain.release.artifact import CARD, RECORD, adapter_sha256, read_record  # noqa: E402
from govtrain.release.verify import verify_adapter  # noqa: E402
from govtrain.train.config import load_run_config  # noqa: E402
from govtrain.release.tree import tree_sha256  # noqa: E402
from tests.test_api import _corpus as api_corpus  # noqa: E402
from tests import causal_models  # noqa: E402
from tests.conftest import Corpus, make_corpus  # noqa: E402
from tests.test_api import BATCH_POLICY, QUIET  # noqa: E402
from tests.test_train import WORDS, _admit, save_tiny_bert, tiny_model  # noqa: E402,F401

# The test policy without its adapter class: the default adapter alone, as plain peft loads one.
_HEAD, _ATTESTERS = BATCH_POLICY.split("[classes.restricted]")[0], BATCH_POLICY.split("[[attesters]]", 1)[1]
ONE_ADAPTER = (_HEAD + "[[attesters]]" + _ATTESTERS).replace('classes = ["public", "sensitive", "restricted"]',
                                                             'classes = ["public", "sensitive"]')
TEXTS = [f"{WORDS[i % 9]} movie {WORDS[9 + i % 8]} {'plot ' * (i % 4)}".strip() for i in range(12)]
REVISION = "0123456789abcdef0123456789abcdef01234567"


def _corpus(tmp_path: Path, name: str, policy: str = ONE_ADAPTER) -> Corpus:
    return api_corpus(tmp_path, name, policy)


def _run_toml(corpus: Corpus, base: str, *, pooling: str = "mean", task: str = "sequence-classification",
              steps: int = 4, targets: str = '["query", "value"]') -> Path:
    path = corpus.dir / "run.toml"
    model = f'pooling = "{pooling}"' if task == "sequence-classification" else ""
    path.write_text(f"""
[model]
base = "{base}"
task = "{task}"
max_length = 16
{model}
[lora]
r = 2
target_modules = {targets}
[optimizer]
lr = 0.05
[training]
steps = {steps}
expected_batch_size = 4
data = "data"
output = "adapter"
run_id = "release-run"
""")
    return path


def _train(config_path: Path, corpus: Corpus):
    """(result, the trained model's logits on TEXTS, its encoded inputs), the model as the run left it."""
    with govtrain.GovernedRun.open(config_path, corpus.url, insecure_seed=3, **QUIET) as run:
        for batch in run.batches():
            run.step(run.per_example_loss(run.model(**batch.inputs), batch))
        result = run.save()
        inputs = _encode(run.tokenizer, load_run_config(config_path).file.model.max_length)
        with torch.no_grad():
            logits = run.model(**inputs).logits
    return result, logits, inputs


def _encode(tokenizer, max_length: int = 16) -> dict:
    return dict(tokenizer(TEXTS, padding=True, padding_side="right", truncation=True, max_length=max_length,
                          return_tensors="pt"))


def _plain_classifier(base: Path, folder: Path):
    base_model = transformers.AutoModelForSequenceClassification.from_pretrained(base, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(base_model, folder).eval()


# -- the folder --------------------------------------------------------------------------------------------


def test_the_adapter_folder_records_its_task_pooling_labels_and_base_and_no_path(tmp_path: Path, tiny_model: Path):
    corpus = _corpus(tmp_path, "c", BATCH_POLICY)  # with the restricted class's adapter
    config_path = _run_toml(corpus, str(tiny_model))
    result, _, _ = _train(config_path, corpus)
    folder = corpus.dir / "adapter"
    record = read_record(folder)
    assert (record.task, record.pooling, record.num_labels, record.max_length) == ("sequence-classification", "mean",
                                                                                  2, 16)
    assert record.id2label == {"0": "LABEL_0", "1": "LABEL_1"} and record.label2id == {"LABEL_0": 0, "LABEL_1": 1}
    assert record.heads == ["classifier", "score"] and record.adapters == ["default", "restricted"]
    assert record.base_model.name == tiny_model.name and record.base_model.spec is None  # a local folder
    assert record.base_model.sha256 == tree_sha256(tiny_model).hex()
    assert record.run.run_id == "release-run" and record.run.ledger_origin == "test.invalid/govtrain/1"
    assert {"tokenizer.json", "tokenizer_config.json", RECORD, CARD} <= {p.name for p in folder.iterdir()}
    for path in folder.rglob("*"):  # never a path of this machine: not the base's, not the run's
        if path.is_file():
            assert str(tiny_model).encode() not in path.read_bytes() and str(tmp_path).encode() not in path.read_bytes()
    for config in (folder / "adapter_config.json", folder / "restricted" / "adapter_config.json"):
        written = json.loads(config.read_text())
        assert written["base_model_name_or_path"] == tiny_model.name and "govtrain.load" in written["task_type"]
    # The run entry's hash covers exactly the folder without its card, which cites the run entry.
    assert result.adapter_sha256 == adapter_sha256(folder) != tree_sha256(folder)
    (folder / CARD).write_text("edited on the Hub")
    assert adapter_sha256(folder) == result.adapter_sha256
    from govtrain.release.artifact import STATE
    from govtrain.release.tree import NOT_HASHED as _NOT_ADAPTER

    # an earlier govtrain's pickled run state is never read, but stays out of an adapter's hash (hashes unchanged)
    assert set(STATE) == set(_NOT_ADAPTER) | {"run-state.pt", "run-state.pt.tmp"}


# -- govtrain.load and govtrain eval -----------------------------------------------------------------------


@pytest.mark.parametrize("pooling", ["mean", "model"])
def test_the_loader_gives_the_trained_models_logits_and_eval_scores_with_them(tmp_path: Path, tiny_model: Path,
                                                                              pooling: str):
    from govtrain.train.evaluate import load_trained

    corpus = _corpus(tmp_path, "c", BATCH_POLICY)
    config_path = _run_toml(corpus, str(tiny_model), pooling=pooling)
    _, trained, inputs = _train(config_path, corpus)
    folder = corpus.dir / "adapter"
    loaded = govtrain.load(folder, base=tiny_model)
    assert type(loaded.model).__name__ == "PeftModel" and not loaded.model.training
    assert loaded.model.active_adapters == ["default", "restricted"]
    assert all(torch.equal(loaded.encode(TEXTS)[k], v) for k, v in inputs.items())
    assert torch.equal(loaded.logits(TEXTS), trained)
    assert torch.allclose(loaded.logits(TEXTS, batch_size=5), trained, atol=1e-6)  # padding: rounding only
    evaluated, _ = load_trained(load_run_config(config_path), folder)  # govtrain eval's path
    with torch.no_grad():
        assert torch.equal(evaluated(**inputs).logits, trained)
    assert loaded.predict(TEXTS) == trained.argmax(-1).tolist()
    rows = [{"text": t, "label": i % 2} for i, t in enumerate(TEXTS)]
    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = CliRunner().invoke(cli, ["eval", "--config", str(config_path), "--data", str(data), "--json"])
    assert run.exit_code == 0, run.output
    accuracy = sum(p == r["label"] for p, r in zip(loaded.predict(TEXTS), rows)) / len(rows)
    assert json.loads(run.stdout)["accuracy"] == accuracy


def test_the_loader_gives_a_causal_lms_logits(tmp_path: Path):
    from tests.test_causal_lm import _contribution, _rows

    model = causal_models.save(tmp_path / "tiny-llama", "llama", layers=6)
    folder = tmp_path / "lm"
    folder.mkdir()
    corpus = make_corpus(folder, f"sqlite:///{folder / 'ledger.db'}", BATCH_POLICY)
    _contribution(corpus, "text", _rows("text", 20))
    _contribution(corpus, "chats", _rows("chat", 20), data_class="restricted", clip_norm_u=500_000,
                  noise_multiplier_u=1_500_000, eps_budget_u=1_000_000)
    config_path = _run_toml(corpus, str(model), task="causal-lm", targets='["q_proj", "v_proj"]')
    _, trained, inputs = _train(config_path, corpus)
    loaded = govtrain.load(corpus.dir / "adapter", base=model)
    assert loaded.record.task == "causal-lm" and loaded.record.heads == [] and loaded.record.num_labels is None
    with torch.no_grad():
        assert torch.equal(loaded.model(**inputs).logits, trained)
    with pytest.raises(TypeError, match="causal LM"):
        loaded.predict(TEXTS)


def test_the_loader_refuses_another_base_model_and_what_govtrain_did_not_release(tmp_path: Path, tiny_model: Path):
    corpus = _corpus(tmp_path, "c")
    _train(_run_toml(corpus, str(tiny_model), steps=2), corpus)
    folder = corpus.dir / "adapter"
    with pytest.raises(ConfigError) as local:  # a local base: only its owner can point to it
        govtrain.load(folder)
    assert local.value.code is Code.MODEL_UNREADABLE and "base=" in local.value.detail
    other = tmp_path / "other"
    shutil.copytree(tiny_model, other)
    config = (other / "config.json").read_text()
    (other / "config.json").write_text(config.replace('"hidden_act"', '"_x": 1,\n  "hidden_act"'))  # same weights
    with pytest.raises(ConfigError) as mismatch:
        govtrain.load(folder, base=other)
    assert mismatch.value.code is Code.BASE_MODEL_MISMATCH and tree_sha256(tiny_model).hex() in mismatch.value.detail
    (folder / RECORD).unlink()
    with pytest.raises(ConfigError) as unreadable:
        govtrain.load(folder, base=tiny_model)
    assert unreadable.value.code is Code.ARTIFACT_UNREADABLE
    (folder / RECORD).write_text('{"format": "govtrain-adapter", "version": 2}')
    with pytest.raises(ConfigError) as version:
        govtrain.load(folder, base=tiny_model)
    assert version.value.code is Code.ARTIFACT_UNREADABLE and "version" in version.value.detail


def test_the_loader_holds_the_base_bytes_it_hashed_whatever_the_file_becomes(tmp_path: Path, tiny_model: Path,
                                                                            monkeypatch):
    """transformers maps a float32 safetensors file into the tensors it loads: a base rewritten in place after the
    tree hash was checked would change the loaded model. govtrain.load hashes while it copies, loads the copy, and
    copies the tensors out of the mapping; the private copy is deleted."""
    import tempfile

    from tests.release_setup import negate_tensor

    corpus = _corpus(tmp_path, "c")
    _train(_run_toml(corpus, str(tiny_model), steps=2), corpus)
    base, private = tmp_path / "base", tmp_path / "tmp"
    shutil.copytree(tiny_model, base)
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    loaded = govtrain.load(corpus.dir / "adapter", base=base)
    before = loaded.logits(TEXTS)
    assert list(private.iterdir()) == []  # the copy it loaded from is gone, and nothing maps it any more
    maps = Path("/proc/self/maps")
    assert not maps.exists() or str(private) not in maps.read_text()
    negate_tensor(base / "model.safetensors", "bert.embeddings.word_embeddings.weight")
    assert torch.equal(loaded.logits(TEXTS), before)
    with pytest.raises(ConfigError) as edited:  # the edit is real: loading the folder now is refused
        govtrain.load(corpus.dir / "adapter", base=base)
    assert edited.value.code is Code.BASE_MODEL_MISMATCH
    copy = tmp_path / "copy"
    copy.mkdir()
    assert tree_sha256(base, copy_into=copy) == tree_sha256(base)  # the copy's hash is the hash's definition
    assert {p.relative_to(copy): p.read_bytes() for p in copy.rglob("*") if p.is_file()} == \
        {p.relative_to(base): p.read_bytes() for p in base.rglob("*") if p.is_file()}


def test_eval_refuses_a_config_that_does_not_describe_the_adapter(tmp_path: Path, tiny_model: Path):
    corpus = _corpus(tmp_path, "c")
    config_path = _run_toml(corpus, str(tiny_model), steps=2)
    _train(config_path, corpus)
    data = tmp_path / "heldout.jsonl"
    data.write_text(json.dumps({"text": "good movie", "label": 1}) + "\n")
    config_path.write_text(config_path.read_text().replace('pooling = "mean"', 'pooling = "model"'))
    result = CliRunner().invoke(cli, ["eval", "--config", str(config_path), "--data", str(data)])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert result.stderr.startswith("error[run_config_invalid]: ") and "pooling = 'model'" in result.stderr


# -- the plain transformers/peft path ----------------------------------------------------------------------


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """As govtrain runs: no Hub lookups (huggingface_hub read HF_HUB_OFFLINE when this process imported it)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def _plain_paths(base: Path, folder: Path, **auto) -> dict:
    return {
        "PeftModel.from_pretrained": lambda: _plain_classifier(base, folder),
        "AutoPeftModelForSequenceClassification": lambda: peft.AutoPeftModelForSequenceClassification.from_pretrained(
            folder, dtype=torch.float32, **auto).eval(),
        "transformers on the folder": lambda: transformers.AutoModelForSequenceClassification.from_pretrained(
            folder, dtype=torch.float32, **auto).eval(),
    }


def test_plain_peft_refuses_a_mean_pooling_adapter_naming_govtrain_load(tmp_path: Path, tiny_model: Path,
                                                                         monkeypatch):
    """The demo's case: mean pooling loaded the standard way would pool [CLS] and predict at chance."""
    corpus = _corpus(tmp_path, "c")
    _train(_run_toml(corpus, str(tiny_model), pooling="mean", steps=2), corpus)
    folder = corpus.dir / "adapter"
    for name, plain in _plain_paths(tiny_model, folder).items():
        if name == "transformers on the folder":  # it loads the base by its name first: a local folder's is not found
            with pytest.raises(OSError):
                plain()
            continue
        with pytest.raises(ValueError, match=r"govtrain\.load") as refused:
            plain()
        assert "mean" in str(refused.value), name
    # Given the base by name where it can find it, it reads the adapter's config and refuses too.
    monkeypatch.chdir(tiny_model.parent)
    with pytest.raises(ValueError, match=r"govtrain\.load"):
        _plain_paths(tiny_model, folder)["transformers on the folder"]()


def test_a_model_pooling_adapter_loads_plainly_with_the_loaders_logits(tmp_path: Path, tiny_model: Path):
    corpus = _corpus(tmp_path, "c")
    _, trained, inputs = _train(_run_toml(corpus, str(tiny_model), pooling="model"), corpus)
    folder = corpus.dir / "adapter"
    assert read_record(folder).plain_refusal is None
    loaded = govtrain.load(folder, base=tiny_model)
    plain = _plain_classifier(tiny_model, folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        assert torch.equal(plain(**_encode(tokenizer)).logits, loaded.logits(TEXTS))
        assert torch.equal(loaded.logits(TEXTS), trained)


def test_a_trainer_checkpoint_is_completed_as_the_release_is(tmp_path: Path, tiny_model: Path):
    """The Trainer's checkpoints (and save_model) are no release, but they leave govtrain: their adapter configs
    refuse the plain path too, and `govtrain.load` reads them."""
    from govtrain.integrations.hf import GovernedTrainer

    corpus = _corpus(tmp_path, "c")
    arguments = transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), use_cpu=True,
                                               save_strategy="steps", save_steps=2, report_to=[], disable_tqdm=True,
                                               lr_scheduler_type="constant")
    with govtrain.GovernedRun.open(_run_toml(corpus, str(tiny_model), steps=2), corpus.url, insecure_seed=3,
                                   **QUIET) as run:
        GovernedTrainer(run, args=arguments).train()
    checkpoint = tmp_path / "trainer" / "checkpoint-2"
    written = json.loads((checkpoint / "adapter_config.json").read_text())
    assert written["base_model_name_or_path"] == tiny_model.name and "govtrain.load" in written["task_type"]
    assert not (checkpoint / CARD).exists() and read_record(checkpoint).run.run_id == "release-run"
    with pytest.raises(ValueError, match=r"govtrain\.load"):
        _plain_classifier(tiny_model, checkpoint)
    final = govtrain.load(corpus.dir / "adapter", base=tiny_model).logits(TEXTS)
    assert torch.equal(govtrain.load(checkpoint, base=tiny_model).logits(TEXTS), final)  # its last step's weights


# -- the model card ------------------------------------------------------------------------------------------


def test_the_model_card_states_the_ledgers_epsilon_per_class_and_how_to_verify(tmp_path: Path, tiny_model: Path):
    import yaml

    from govtrain.cli.verify import verify_cli
    from govtrain.ledger.ledger import Ledger
    from govtrain.ledger.status import contribution_status

    corpus = _corpus(tmp_path, "c")
    result, _, _ = _train(_run_toml(corpus, str(tiny_model), steps=12), corpus)
    folder = corpus.dir / "adapter"
    card = (folder / CARD).read_text()
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["library_name"] == "peft" and "base_model" not in front  # a local folder is no Hub id
    assert "differential-privacy" in front["tags"] and front["pipeline_tag"] == "text-classification"
    rows = re.findall(r"^\| (\w+) \| ([0-9.]+) \| 1e-05 \| 1 \|$", card, re.M)
    stated = {name: round(float(eps) * 1e6) for name, eps in rows}
    with Ledger.open(corpus.url) as ledger:
        ledger_eps = {name: contribution_status(ledger, cid)["eps_u"] for name, cid in (("public", "pub"),
                                                                                         ("sensitive", "sens"))}
        run_seq = next(s.seq for s in ledger.store.entries(kinds=("run",)))
        checkpoint = ledger.store.checkpoint_covering(run_seq)
    assert stated == ledger_eps and all(v > 0 for v in stated.values())
    assert stated == {name: round(eps[-1] * 1e6) for name, eps in result.eps_by_class.items() if name in stated}
    assert "privacy unit**: example" in card.replace("Privacy unit", "privacy unit") and "DP-SGD" in card
    assert f"entry {run_seq}" in card and "release-run" in card and "test.invalid/govtrain/1" in card
    assert checkpoint.note.rstrip("\n") in card and checkpoint.size > run_seq
    assert "refuse this folder on purpose" in card
    assert f'govtrain.load("THIS_FOLDER", base="PATH/TO/{tiny_model.name}")' in card
    # How to verify, as the card says: govtrain-verify against the card's checkpoint, then the folder's binding.
    note = tmp_path / "checkpoint.txt"
    note.write_text(re.search(r"```text\n(.*?)```", card, re.S).group(1))
    verified = CliRunner().invoke(verify_cli, ["--ledger", corpus.url, "--trusted-checkpoint", str(note)])
    assert verified.exit_code == 0, verified.output
    report = verify_adapter(folder, corpus.url)
    assert report.card == "matches" and report.facts.eps_by_class == ledger_eps
    assert report.facts.adapter_sha256 == result.adapter_sha256 and "ε" in str(report)
    (folder / CARD).write_text(card.replace("library_name: peft", "library_name: peft\nlicense: mit"))
    assert verify_adapter(folder, corpus.url).card == "differs"  # a card edited on the Hub: the weights still bind
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes() + b" ")
    with pytest.raises(IntegrityError) as tampered:
        verify_adapter(folder, corpus.url)
    assert tampered.value.code is Code.ADAPTER_MISMATCH and tampered.value.exit_code == 4


# -- Hugging Face ids ----------------------------------------------------------------------------------------


def fake_hub_cache(root: Path, repo_id: str, source: Path, revision: str = REVISION) -> Path:
    """A Hugging Face cache in `root` holding `source`'s files as `repo_id` at `revision` (refs/main), laid out as
    huggingface_hub writes it: content-addressed blobs, the snapshot's files linked to them."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for path in sorted(source.iterdir()):
        blob = repo / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        blob.write_bytes(path.read_bytes())
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def test_a_hugging_face_id_loads_from_the_cache_bound_by_its_tree_hash(tmp_path: Path, tiny_model: Path,
                                                                       monkeypatch):
    from govtrain.ledger.entries import decode_entry
    from govtrain.ledger.ledger import Ledger
    from govtrain.resolver.load import model_path

    cache = tmp_path / "hf-cache"
    snapshot = fake_hub_cache(cache, "org/tiny-bert", tiny_model)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert model_path("org/tiny-bert") == snapshot and tree_sha256(snapshot) == tree_sha256(tiny_model)
    corpus = _corpus(tmp_path, "c")
    config_path = _run_toml(corpus, "org/tiny-bert", pooling="model")
    assert load_run_config(config_path).model_spec == "org/tiny-bert"
    _, trained, _ = _train(config_path, corpus)
    folder = corpus.dir / "adapter"
    with Ledger.open(corpus.url) as ledger:
        run = next(decode_entry(e.body, seq=e.seq, kind="run") for e in ledger.store.entries(kinds=("run",)))
    assert run["base_model_sha256"] == tree_sha256(tiny_model)
    base = read_record(folder).base_model
    assert (base.name, base.revision, base.spec) == ("org/tiny-bert", REVISION, "org/tiny-bert")
    written = json.loads((folder / "adapter_config.json").read_text())
    assert (written["base_model_name_or_path"], written["revision"], written["task_type"]) == ("org/tiny-bert",
                                                                                              REVISION, None)
    assert "base_model: org/tiny-bert\n" in (folder / CARD).read_text()
    loaded = govtrain.load(folder)  # found in the cache by its id, no base= needed
    assert torch.equal(loaded.logits(TEXTS), trained)
    # Plain peft, the standard way, from the same cache: the same logits.
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    for name, plain in _plain_paths(snapshot, folder, cache_dir=str(cache)).items():
        with torch.no_grad():
            assert torch.equal(plain()(**_encode(tokenizer)).logits, trained), name
    # A cached model whose files changed is not the one the adapter was trained on.
    (snapshot / "config.json").unlink()
    (snapshot / "config.json").write_text((tiny_model / "config.json").read_text() + "\n")
    with pytest.raises(ConfigError) as changed:
        govtrain.load(folder)
    assert changed.value.code is Code.BASE_MODEL_MISMATCH


def test_the_loader_takes_the_cached_revision_trained_on_not_what_refs_main_names_now(tmp_path: Path,
                                                                                        tiny_model: Path, monkeypatch):
    """A cache that has since fetched a newer revision (refs/main moved) still holds the one the adapter was trained
    on: the loader takes that one. Where the cache lacks it, the error names the revision to download."""
    cache = tmp_path / "hf-cache"
    fake_hub_cache(cache, "org/tiny-bert", tiny_model)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    corpus = _corpus(tmp_path, "c")
    _, trained, _ = _train(_run_toml(corpus, "org/tiny-bert", pooling="model"), corpus)
    folder = corpus.dir / "adapter"
    repo = cache / "models--org--tiny-bert"
    newer = repo / "snapshots" / ("b" * 40)
    shutil.copytree(repo / "snapshots" / REVISION, newer, symlinks=True)
    (newer / "config.json").unlink()
    (newer / "config.json").write_text((tiny_model / "config.json").read_text() + "\n")  # another tree hash
    (repo / "refs" / "main").write_text("b" * 40)
    assert torch.equal(govtrain.load(folder).logits(TEXTS), trained)
    shutil.rmtree(repo / "snapshots" / REVISION)
    with pytest.raises(ConfigError) as missing:
        govtrain.load(folder)
    assert missing.value.code is Code.MODEL_UNREADABLE
    assert f"hf download org/tiny-bert --revision {REVISION}" in str(missing.value)


def test_a_hugging_face_id_not_in_the_cache_says_how_to_get_it(tmp_path: Path, monkeypatch):
    from govtrain.resolver.load import model_path

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(ConfigError) as missing:
        model_path("org/absent")
    assert missing.value.code is Code.MODEL_UNREADABLE
    assert "hf download org/absent" in missing.value.detail and "HF_HOME" in missing.value.detail
    config_path = tmp_path / "run.toml"
    config_path.write_text('[model]\nbase = "org/absent"\n[lora]\ntarget_modules = ["query"]\n'
                           '[training]\nsteps = 1\ndata = "data"\noutput = "adapter"\n')
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    data = tmp_path / "heldout.jsonl"
    data.write_text(json.dumps({"text": "good movie", "label": 1}) + "\n")
    result = CliRunner().invoke(cli, ["eval", "--config", str(config_path), "--data", str(data)])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert result.stderr.startswith("error[model_unreadable]: org/absent: ") and "hf download" in result.stderr
    (tmp_path / "org" / "absent").mkdir(parents=True)  # a folder of that name, beside the config, wins
    assert load_run_config(config_path).model_spec == str(tmp_path / "org" / "absent")


# -- the real MiniLM -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_demo_style_minilm_adapter_loads_exactly_through_govtrain_and_never_plainly(tmp_path: Path):
    """The issue's case on the bundled MiniLM: mean pooling (as the demo trains). `govtrain.load` finds the base by
    its name and gives the trained logits; the standard path refuses, naming govtrain.load; nothing names a path
    inside the virtual environment."""
    from govtrain.resolver.load import model_path

    corpus = _corpus(tmp_path, "c")
    result, trained, _ = _train(_run_toml(corpus, "minilm", steps=2), corpus)
    folder = corpus.dir / "adapter"
    base = read_record(folder).base_model
    assert (base.name, base.spec) == ("sentence-transformers/all-MiniLM-L6-v2", "minilm")
    assert "base_model: sentence-transformers/all-MiniLM-L6-v2\n" in (folder / CARD).read_text()
    assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == base.name
    assert all(b"site-packages" not in p.read_bytes() for p in folder.rglob("*") if p.is_file())
    assert torch.equal(govtrain.load(folder).logits(TEXTS), trained)
    assert verify_adapter(folder, corpus.url).facts.adapter_sha256 == result.adapter_sha256
    minilm = model_path("minilm")
    for name, plain in _plain_paths(minilm, folder).items():
        # transformers loads the base by its Hub name first: offline and not cached, it cannot
        with pytest.raises(OSError if name == "transformers on the folder" else ValueError,
                           match=None if name == "transformers on the folder" else r"govtrain\.load"):
            plain()
    # The same with the model's own pooler: the standard path reproduces it.
    corpus = _corpus(tmp_path, "pooler")
    _, trained, inputs = _train(_run_toml(corpus, "minilm", pooling="model", steps=2), corpus)
    with torch.no_grad():
        assert torch.equal(_plain_classifier(minilm, corpus.dir / "adapter")(**inputs).logits, trained)
