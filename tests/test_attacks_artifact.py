"""Attacks on what leaves govtrain (review of the artifacts): a released adapter folder, its govtrain.json, its
base model and its card. Each negative test asserts the specific error code and that nothing was loaded or
changed: no model returned, no code of the folder run, the ledger as it was, no adapter written.
"""

from __future__ import annotations

import builtins
import json
import os
import re
import shutil
import struct
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from click.testing import CliRunner  # noqa: E402

import govtrain  # noqa: E402
from govtrain.cli.main import cli  # noqa: E402
from govtrain.errors import Code, ConfigError  # noqa: E402
from govtrain.release.artifact import RECORD, STATE, read_record  # noqa: E402
from govtrain.release.verify import verify_adapter  # noqa: E402
from govtrain.models import loading as train_model  # noqa: E402
from govtrain.release.tree import tree_sha256  # noqa: E402
from tests.conftest import snapshot  # noqa: E402
from tests.test_api import BATCH_POLICY, QUIET  # noqa: E402
from tests.test_release import ONE_ADAPTER, TEXTS, _corpus, _run_toml, _train, offline  # noqa: E402,F401
from tests.test_train import WORDS, tiny_model  # noqa: E402,F401

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]


@pytest.fixture(scope="module")
def mean_art(tmp_path_factory, tiny_model: Path) -> dict:
    """A mean-pooling adapter (the default adapter alone) trained on the tiny BERT, its corpus and logits."""
    corpus = _corpus(tmp_path_factory.mktemp("art-mean"), "c", ONE_ADAPTER)
    config = _run_toml(corpus, str(tiny_model), steps=2)
    _, logits, _ = _train(config, corpus)
    return dict(corpus=corpus, config=config, folder=corpus.dir / "adapter", logits=logits)


def _copy(art: dict, to: Path) -> Path:
    return Path(shutil.copytree(art["folder"], to, symlinks=True))


def _edit_record(folder: Path, spec: str | None = None, **fields) -> None:
    record = json.loads((folder / RECORD).read_text())
    record.update(fields)
    if spec is not None:
        record["base_model"]["spec"] = spec
    (folder / RECORD).write_text(json.dumps(record))


def _written(output: Path) -> list[str]:
    """What a run left in its output folder besides its lock: nothing, where it was refused."""
    return sorted(p.name for p in output.glob("*") if p.name not in STATE) if output.exists() else []


def _refused(code: Code, folder: Path, **kwargs) -> ConfigError:
    """govtrain.load(folder) refuses with `code`, in one line, and returns nothing."""
    with pytest.raises(ConfigError) as raised:
        govtrain.load(folder, **kwargs)
    assert raised.value.code is code, raised.value
    assert "\n" not in str(raised.value)
    return raised.value


# -- p1: a base whose checkpoint lacks weights the model needs ---------------------------------------------


def _headless_bert(folder: Path) -> Path:
    """A BERT saved without its pooler (as an encoder-only export is)."""
    folder.mkdir()
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    transformers.BertTokenizerFast(vocab=str(folder / "vocab.txt")).save_pretrained(folder)
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=16, num_hidden_layers=6, num_attention_heads=2, intermediate_size=24,
                                     vocab_size=len(VOCAB), max_position_embeddings=64)
    transformers.BertModel(config, add_pooling_layer=False).save_pretrained(folder)
    return folder


def _deberta_v2(folder: Path) -> Path:
    """A DeBERTa-v2 base as microsoft/deberta-v3-* ship: no ContextPooler in the checkpoint."""
    folder.mkdir()
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    transformers.BertTokenizerFast(vocab=str(folder / "vocab.txt")).save_pretrained(folder)
    torch.manual_seed(0)
    config = transformers.DebertaV2Config(hidden_size=16, num_hidden_layers=6, num_attention_heads=2,
                                          intermediate_size=24, vocab_size=len(VOCAB), max_position_embeddings=64,
                                          pooler_hidden_size=16)
    transformers.DebertaV2Model(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("base, targets", [(_headless_bert, '["query", "value"]'),
                                           (_deberta_v2, '["query_proj", "value_proj"]')], ids=["bert", "deberta"])
def test_p1_a_base_lacking_weights_it_needs_is_refused_at_train_and_at_load(tmp_path: Path, monkeypatch, base,
                                                                            targets):
    """The attack: a base checkpoint without its pooler under pooling = "model". transformers draws the missing
    weights at random on every load, and they are not in the adapter, so govtrain.load / eval would predict with
    a model other than the trained one (and another at each load). Training refuses it; an adapter trained on
    one anyway (by a govtrain before the fix) is refused at load."""
    path = base(tmp_path / "base")
    corpus = _corpus(tmp_path, "c", ONE_ADAPTER)
    config = _run_toml(corpus, str(path), pooling="model", steps=2, targets=targets)
    before = snapshot(corpus.url)
    with pytest.raises(ConfigError) as raised:
        govtrain.GovernedRun.open(config, corpus.url, insecure_seed=3, **QUIET)
    assert raised.value.code is Code.MODEL_UNREADABLE and "pooler" in raised.value.detail
    assert snapshot(corpus.url) == before and _written(corpus.dir / "adapter") == []

    with monkeypatch.context() as old:  # an earlier govtrain, which did not look
        old.setattr(train_model, "check_initialised", lambda *args: None)
        _train(config, corpus)
    folder = corpus.dir / "adapter"
    assert "pooler" in _refused(Code.MODEL_UNREADABLE, folder, base=path).detail


def test_p1_a_mean_pooling_run_on_a_base_without_its_pooler_is_accepted(tmp_path: Path):
    """The refusal is no broader than the attack: under pooling = "mean" the pooler is never used, so a base
    without one trains and loads with the trained model's logits."""
    path = _headless_bert(tmp_path / "base")
    corpus = _corpus(tmp_path, "c", ONE_ADAPTER)
    _, trained, _ = _train(_run_toml(corpus, str(path), pooling="mean", steps=2), corpus)
    assert torch.allclose(govtrain.load(corpus.dir / "adapter", base=path).logits(TEXTS), trained, atol=1e-5)


# -- p2: code named by a folder ----------------------------------------------------------------------------


def _evil(folder: Path, marker: Path) -> None:
    (folder / "evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
                                    "from transformers import PreTrainedTokenizerFast as EvilTok\n"
                                    "from transformers import BertForSequenceClassification as EvilModel\n"
                                    "from transformers import BertConfig as EvilConfig\n")


def _auto_map_tokenizer(folder: Path, marker: Path) -> None:
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("tokenizer_class", None)
    config["auto_map"] = {"AutoTokenizer": [None, "evil.EvilTok"]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    _evil(folder, marker)


def _auto_map_config(folder: Path, marker: Path) -> None:
    (folder / "config.json").write_text(json.dumps({"model_type": "evil", "auto_map": {
        "AutoConfig": "evil.EvilConfig", "AutoModelForSequenceClassification": "evil.EvilModel"}}))
    _evil(folder, marker)


@pytest.fixture
def answer_yes(monkeypatch) -> list:
    """transformers' remote-code prompt, answered 'y' (as one keystroke would): the prompts asked are listed."""
    asked: list = []
    monkeypatch.setattr(builtins, "input", lambda prompt="": asked.append(prompt) or "y")
    return asked


@pytest.mark.parametrize("plant", [_auto_map_tokenizer, _auto_map_config], ids=["tokenizer_config", "config"])
def test_p2_an_adapter_folder_naming_code_to_run_is_refused_without_running_it(tmp_path: Path, mean_art: dict,
                                                                              tiny_model: Path, answer_yes, plant):
    """The attack: a hostile adapter folder whose tokenizer_config.json or config.json has an auto_map and a .py
    beside it. govtrain.load (and so `govtrain eval`) handed the decision to transformers' prompt: one 'y' ran
    the folder's code. Now the folder is refused, no prompt is shown and nothing of it runs."""
    marker = tmp_path / "PWNED"
    folder = _copy(mean_art, tmp_path / "hostile")
    plant(folder, marker)
    assert "auto_map" in _refused(Code.ARTIFACT_UNREADABLE, folder, base=tiny_model).detail
    run = tmp_path / "run.toml"
    run.write_text(mean_art["config"].read_text().replace('data = "data"',
                                                          f'data = "{mean_art["corpus"].dir / "data"}"'))
    data = tmp_path / "heldout.jsonl"
    data.write_text(json.dumps({"text": "good movie", "label": 1}) + "\n")
    result = CliRunner().invoke(cli, ["eval", "--config", str(run), "--data", str(data), "--adapter", str(folder)])
    assert result.exit_code == 2 and result.stderr.startswith("error[artifact_unreadable]: "), result.output
    assert not marker.exists() and answer_yes == []


@pytest.mark.parametrize("plant, refused", [(_auto_map_tokenizer, False), (_auto_map_config, True)],
                         ids=["tokenizer_config", "config"])
def test_p2_a_base_folder_naming_code_runs_none_of_it(tmp_path: Path, tiny_model: Path, answer_yes, plant, refused):
    """The attack, on the base: a base folder whose tokenizer_config.json or config.json names code (auto_map).
    Every load passes trust_remote_code=False, so transformers neither prompts nor runs it: a BERT whose tokenizer
    names code trains with BERT's own tokenizer; a model that only its code builds is refused as model_unreadable,
    the ledger as it was."""
    marker = tmp_path / "PWNED"
    base = Path(shutil.copytree(tiny_model, tmp_path / "base"))
    plant(base, marker)
    corpus = _corpus(tmp_path, "c", ONE_ADAPTER)
    config = _run_toml(corpus, str(base), steps=2)
    before = snapshot(corpus.url)
    if refused:
        with pytest.raises(ConfigError) as raised:
            _train(config, corpus)
        assert raised.value.code is Code.MODEL_UNREADABLE and "auto_map" in raised.value.detail, raised.value
        assert snapshot(corpus.url) == before and _written(corpus.dir / "adapter") == []
    else:
        _train(config, corpus)
    assert not marker.exists() and answer_yes == []


# -- p3: govtrain.json naming paths ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_adapters(tmp_path_factory, tiny_model: Path) -> dict:
    """A folder with the default adapter and the restricted class's adapter in its sub-folder."""
    corpus = _corpus(tmp_path_factory.mktemp("art-two"), "c", BATCH_POLICY)
    _train(_run_toml(corpus, str(tiny_model), steps=2), corpus)
    return dict(folder=corpus.dir / "adapter")


def _spec_path(folder: Path, tmp_path: Path, tiny_model: Path) -> None:
    _edit_record(folder, spec=str(tiny_model))


def _spec_relative(folder: Path, tmp_path: Path, tiny_model: Path) -> None:
    _edit_record(folder, spec="../base")


def _adapter_outside(folder: Path, tmp_path: Path, tiny_model: Path) -> None:
    outside = tmp_path / "outside_place"
    shutil.move(folder / "restricted", outside)
    _edit_record(folder, adapters=["default", str(outside)])


def _adapter_up(folder: Path, tmp_path: Path, tiny_model: Path) -> None:
    shutil.move(folder / "restricted", tmp_path / "restricted")
    _edit_record(folder, adapters=["default", "../restricted"])


@pytest.mark.parametrize("edit", [_spec_path, _spec_relative, _adapter_outside, _adapter_up],
                         ids=["spec absolute", "spec relative", "adapter absolute", "adapter ../"])
def test_p3_a_record_naming_a_path_is_refused(tmp_path: Path, two_adapters: dict, tiny_model: Path, monkeypatch,
                                              edit):
    """The attack: govtrain.json's base_model.spec or an `adapters` entry set to a path, which govtrain.load
    followed out of the folder (a base or adapter weights of the loading machine's choosing). The record is
    refused by read_record's validation, before anything is loaded."""
    folder = Path(shutil.copytree(two_adapters["folder"], tmp_path / "a" / "adapter"))
    shutil.copytree(tiny_model, tmp_path / "a" / "base")
    monkeypatch.chdir(folder)
    edit(folder, tmp_path, tiny_model)
    with pytest.raises(ConfigError) as raised:
        read_record(folder)
    assert raised.value.code is Code.ARTIFACT_UNREADABLE
    spec = json.loads((folder / RECORD).read_text())["base_model"]["spec"]
    _refused(Code.ARTIFACT_UNREADABLE, folder, **({} if spec else {"base": tiny_model}))


def test_p3_a_record_spec_shaped_as_a_hub_id_never_reads_a_local_folder(tmp_path: Path, mean_art: dict,
                                                                         tiny_model: Path, monkeypatch):
    """The attack, within the id pattern: spec = "org/name" while the working directory holds a folder org/name.
    A record's spec is a Hub id, looked up in the Hugging Face cache only, never that folder."""
    folder = _copy(mean_art, tmp_path / "a")
    shutil.copytree(tiny_model, tmp_path / "org" / "name")
    _edit_record(folder, spec="org/name")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert "cache" in _refused(Code.MODEL_UNREADABLE, folder).detail


# -- p4: a damaged folder ----------------------------------------------------------------------------------


DAMAGE = {
    "adapter_config.json not JSON": lambda f: (f / "adapter_config.json").write_text("{"),
    "adapter_config.json a list": lambda f: (f / "adapter_config.json").write_text("[]"),
    "weights truncated": lambda f: (f / "adapter_model.safetensors").write_bytes(
        (f / "adapter_model.safetensors").read_bytes()[:100]),
    "tokenizer missing": lambda f: [(f / "tokenizer.json").unlink(), (f / "tokenizer_config.json").unlink()],
    "labels do not fit the head": lambda f: _edit_record(f, num_labels=3, id2label={"0": "a", "1": "b", "2": "c"},
                                                         label2id={"a": 0, "b": 1, "c": 2}),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_p4_a_damaged_folder_is_one_artifact_unreadable_error(tmp_path: Path, mean_art: dict, tiny_model: Path,
                                                              damage):
    """The attack: a damaged or edited folder (a file not JSON, truncated weights, no tokenizer, a record whose
    labels do not fit the saved head). govtrain.load raised the libraries' own exceptions (error[internal] from
    `govtrain eval`); now one artifact_unreadable line naming the folder."""
    folder = _copy(mean_art, tmp_path / "a")
    DAMAGE[damage](folder)
    assert str(folder) in _refused(Code.ARTIFACT_UNREADABLE, folder, base=tiny_model).detail


# -- p7: a base rewritten in place -------------------------------------------------------------------------


def test_p7_a_base_changed_in_place_keeping_size_and_mtime_is_hashed_again(tmp_path: Path, mean_art: dict,
                                                                          tiny_model: Path):
    """The attack: in the process that loaded an adapter, its base is rewritten in place with the same size and
    its mtime put back. The tree-hash cache keyed on (path, size, mtime) took it for the trained-on base; keyed on
    ctime and inode too, it is hashed again and refused as base_model_mismatch."""
    base = Path(shutil.copytree(tiny_model, tmp_path / "base"))
    assert torch.allclose(govtrain.load(mean_art["folder"], base=base).logits(TEXTS), mean_art["logits"], atol=1e-5)
    weights = base / "model.safetensors"
    stat = weights.stat()
    data = bytearray(weights.read_bytes())
    header_len = struct.unpack("<Q", data[:8])[0]
    start, end = json.loads(data[8:8 + header_len])["bert.embeddings.word_embeddings.weight"]["data_offsets"]
    data[8 + header_len + start:8 + header_len + end] = bytes(end - start)  # word embeddings zeroed: same size
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights.stat().st_size == stat.st_size and weights.stat().st_mtime_ns == stat.st_mtime_ns
    assert tree_sha256(base) != tree_sha256(tiny_model)
    assert tree_sha256(base).hex() in _refused(Code.BASE_MODEL_MISMATCH, mean_art["folder"], base=base).detail


# -- p8: a card that states other figures ------------------------------------------------------------------


def test_p8_a_card_stating_a_false_epsilon_leads_the_verify_line_with_a_warning(tmp_path: Path, mean_art: dict):
    """The attack: the folder's README.md claims ε 0.000001 per class. The binding to the ledger holds (by
    design verify_adapter does not raise on a card), but its line no longer starts "ok:" for a caller or user
    to read as all clear: it leads with the card that differs and says to trust the ledger's figures."""
    folder = _copy(mean_art, tmp_path / "a")
    assert str(verify_adapter(folder, mean_art["corpus"].url)).startswith("ok: ")
    card = (folder / "README.md").read_text()
    forged = re.sub(r"^(\| \w+ \| )[0-9.]+( \|)", r"\g<1>0.000001\g<2>", card, flags=re.M)
    assert forged != card
    (folder / "README.md").write_text(forged)
    before = snapshot(mean_art["corpus"].url)
    report = verify_adapter(folder, mean_art["corpus"].url)
    assert report.card == "differs"
    line = str(report)
    assert line.startswith("the model card differs") and "ledger" in line.split("ok: ")[0]
    assert snapshot(mean_art["corpus"].url) == before
