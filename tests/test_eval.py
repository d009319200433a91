"""`govtrain eval`: the adapter loaded as training built the model (pooling, every adapter), figures against a
by-hand computation, one-line errors, and nothing written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from govtrain.cli.main import cli  # noqa: E402
from govtrain.tasks import task_for  # noqa: E402
from govtrain.train.config import load_run_config  # noqa: E402
from govtrain.train.evaluate import load_trained  # noqa: E402
from govtrain.train.model import load_model  # noqa: E402
from tests import causal_models  # noqa: E402
from tests.test_train import WORDS, tiny_model  # noqa: E402, F401  (the tiny BERT fixture)


def _config(folder: Path, model: Path, task: str, extra: str = "") -> Path:
    path = folder / "run.toml"
    targets = '["q_proj", "v_proj"]' if task == "causal-lm" else '["query", "value"]'
    path.write_text(f"""
[model]
base = "{model}"
task = "{task}"
max_length = 24
{extra}
[lora]
r = 2
target_modules = {targets}
[training]
steps = 1
data = "data"
output = "adapter"
""")
    return path


def _trained(config_path: Path, adapters: list[str]) -> torch.nn.Module:
    """The run's model with random LoRA factors and head, saved where training.output points: as if trained."""
    config = load_run_config(config_path)
    model, _, _ = load_model(config, adapters)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.normal_(0, 0.5)
    model.save_pretrained(config.output_dir)
    return model


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _eval(*args: str):
    return CliRunner().invoke(cli, ["eval", *args])


def test_classification_accuracy_with_mean_pooling_and_every_adapter(tmp_path: Path, tiny_model: Path):  # noqa: F811
    config_path = _config(tmp_path, tiny_model, "sequence-classification", 'pooling = "mean"')
    trained = _trained(config_path, ["restricted"]).eval()
    rows = [{"text": f"{WORDS[i % 9]} movie {WORDS[9 + i % 8]} plot", "label": int(i % 3 == 0)} for i in range(30)]
    data = _write(tmp_path / "heldout.jsonl", rows)
    config = load_run_config(config_path)
    loaded, tokenizer = load_trained(config, config.output_dir)  # pooling and the restricted adapter come back
    inputs = tokenizer([r["text"] for r in rows], padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = trained(**inputs).logits
        assert torch.allclose(loaded(**inputs).logits, expected, atol=1e-6)
    labels = torch.tensor([r["label"] for r in rows])
    accuracy = int((expected.argmax(-1) == labels).sum()) / len(rows)
    before = _files(tmp_path)
    result = _eval("--config", str(config_path), "--data", str(data), "--json")  # default adapter: training.output
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["ok"] and body["task"] == "sequence-classification" and body["examples"] == 30
    assert math.isclose(body["accuracy"], accuracy, abs_tol=1e-12) and body["majority"] == 20 / 30
    text = _eval("--config", str(config_path), "--data", str(data), "--adapter", str(config.output_dir))
    assert text.exit_code == 0 and text.stdout == f"30 examples: accuracy {accuracy:.4f} (always the majority label: " \
                                                  f"{20 / 30:.4f})\n"
    assert _files(tmp_path) == before  # evaluation writes nothing


def test_causal_lm_per_token_loss_and_perplexity(tmp_path: Path):
    model = causal_models.save(tmp_path / "tiny-llama", "llama", layers=2)
    config_path = _config(tmp_path, model, "causal-lm")
    trained = _trained(config_path, ["restricted"]).eval()
    rows = [{"text": "the cat sat on the mat"}, {"prompt": "what is the capital of france", "completion": "paris"},
            {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello world"}]},
            {"text": "a dog sat"}]
    data = _write(tmp_path / "heldout.jsonl", rows)
    config = load_run_config(config_path)
    task = task_for(config.file)
    tokenizer = causal_models.tokenizer()
    loss_sum, count = 0.0, 0
    with torch.no_grad():  # by hand: each example alone, every target token weighs the same
        for i, row in enumerate(rows):
            from govtrain.tasks.causal_lm import tokens

            marked = tokens(task.example(row, f"h:{i}"), tokenizer)
            ids = torch.tensor([marked.ids])
            logits = trained(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, :-1]
            keep = torch.tensor(marked.targets[1:])
            loss_sum += float(F.cross_entropy(logits[keep], ids[0, 1:][keep], reduction="sum"))
            count += int(keep.sum())
    result = _eval("--config", str(config_path), "--data", str(data), "--json")
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["task"] == "causal-lm" and body["examples"] == 4 and body["tokens"] == count
    assert math.isclose(body["loss"], loss_sum / count, rel_tol=1e-5)
    assert math.isclose(body["perplexity"], math.exp(loss_sum / count), rel_tol=1e-5)
    text = _eval("--config", str(config_path), "--data", str(data))
    assert text.exit_code == 0 and text.stdout.startswith(f"4 examples, {count} target tokens: loss ")


def test_eval_errors_are_one_line(tmp_path: Path):
    model = causal_models.save(tmp_path / "tiny-llama", "llama", layers=2)
    config_path = _config(tmp_path, model, "causal-lm")
    good = _write(tmp_path / "good.jsonl", [{"text": "the cat sat"}])
    missing = _eval("--config", str(config_path), "--data", str(good), "--adapter", str(tmp_path / "nowhere"))
    assert missing.exit_code == 2 and missing.stderr.startswith("error[bad_argument]: --adapter ")
    _trained(config_path, [])
    for rows, line in (([{"text": "the cat"}, {"label": 1}], "error[bad_data]: bad.jsonl:2: need exactly one of"),
                       ([], "error[bad_data]: --data "),
                       ([{"prompt": " ".join(["the cat"] * 20), "completion": "yes"}],
                        "error[bad_data]: bad.jsonl:1: no target token within model.max_length = 24")):
        bad = _write(tmp_path / "bad.jsonl", rows)
        result = _eval("--config", str(config_path), "--data", str(bad), "--json")
        assert result.exit_code == 2 and result.stderr.startswith(line) and result.stderr.count("\n") == 1, \
            result.output
        assert json.loads(result.stdout)["code"] == "bad_data"
    absent = _eval("--config", str(config_path), "--data", str(tmp_path / "absent.jsonl"))
    assert absent.exit_code == 2 and absent.stderr.startswith("error[data_unreadable]: --data ")


def test_the_demos_non_private_reference_is_scored_by_govtrain_eval(tmp_path: Path, tiny_model: Path):  # noqa: F811
    """examples/nonprivate.py on a tiny case: it trains the run's model and saves an adapter `govtrain eval` loads,
    so the demo scores both rows one way."""
    import importlib.util

    from tests.conftest import REPO

    spec = importlib.util.spec_from_file_location("nonprivate", REPO / "examples" / "nonprivate.py")
    nonprivate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nonprivate)
    config_path = _config(tmp_path, tiny_model, "sequence-classification", 'pooling = "mean"\n[optimizer]\nlr = 0.02')
    rows = [{"text": f"{WORDS[i % 2]} movie {WORDS[9 + i % 8]}", "label": i % 2} for i in range(24)]
    train = _write(tmp_path / "contrib-00.jsonl", rows)
    config = load_run_config(config_path)
    model, tokenizer = nonprivate.train_nonprivate(config, [train], steps=30, batch=8)
    model.save_pretrained(tmp_path / "nonprivate")
    heldout = _write(tmp_path / "heldout.jsonl", rows)
    result = _eval("--config", str(config_path), "--data", str(heldout), "--adapter", str(tmp_path / "nonprivate"),
                   "--json")
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["accuracy"] == 1.0 and body["majority"] == 0.5  # "good" against "bad" is learnt in 30 steps


def test_a_classifier_whose_tokenizer_pads_left_is_evaluated_on_right_padded_batches(tmp_path: Path):
    """Evaluation runs the task's encode, which pads right whatever the tokenizer says: a GPT-2 classifier's
    logits in a batch equal its logits on each example alone, the figures do not depend on the batch size,
    and the tokenizer still pads left for its owner."""
    from govtrain.train.evaluate import evaluate
    from tests.test_attacks_user_code import save_classifier

    model_dir = save_classifier(tmp_path / "gpt2-left", "gpt2", "left")
    config_path = _config(tmp_path, model_dir, "sequence-classification")
    config_path.write_text(config_path.read_text().replace('["query", "value"]', '["c_attn", "c_proj"]'))
    config = load_run_config(config_path)
    model, tokenizer, _ = load_model(config, [])
    task = task_for(config.file)
    words = causal_models.WORDS
    examples = [task.example({"text": " ".join(words[:2 + 3 * i]), "label": i % 2}, f"h:{i}") for i in range(6)]
    batch = task.encode(examples, tokenizer, 24, "cpu")
    mask = batch.inputs["attention_mask"]
    assert (mask[:, :-1] >= mask[:, 1:]).all() and (mask == 0).any()  # padded, on the right
    with torch.no_grad():
        together = model(**batch.inputs).logits
        alone = torch.cat([model(**task.encode([e], tokenizer, 24, "cpu").inputs).logits for e in examples])
    assert torch.allclose(together, alone, atol=1e-5)
    assert evaluate(model, tokenizer, task, examples, 24, batch_size=6) == \
        evaluate(model, tokenizer, task, examples, 24, batch_size=1)
    assert tokenizer.padding_side == "left"
