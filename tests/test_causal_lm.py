"""task = "causal-lm": row forms, target marking, truncation and padding rules, per-example losses, and the routing
layer's clipped sums against a batch-size-1 autograd loop on tiny random Llama, GPT-2 and Qwen2 models."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from click.testing import CliRunner  # noqa: E402

from govtrain.cli.main import cli  # noqa: E402
from govtrain.errors import Code, ConfigError  # noqa: E402
from govtrain.resolver.model import describe  # noqa: E402
from govtrain.resolver.profile import resolve  # noqa: E402
from govtrain.routing.layout import probe_batches  # noqa: E402
from govtrain.routing.router import Router  # noqa: E402
from govtrain.tasks import CausalLM  # noqa: E402
from govtrain.tasks.causal_lm import Chat, Completion, Text, tokens  # noqa: E402
from govtrain.train.config import LoraSection, RunFile  # noqa: E402
from govtrain.train.model import wrap_lora  # noqa: E402
from govtrain.verify.verifier import verify_ledger  # noqa: E402
from tests import causal_models  # noqa: E402
from tests.conftest import Corpus  # noqa: E402
from tests.test_resolver import cls  # noqa: E402

TASK = CausalLM()
ROWS = [
    {"text": "the cat sat on the mat"},
    {"prompt": "what is the capital of france", "completion": "paris"},
    {"text": "a dog"},
    {"prompt": "where did the cat sit", "completion": "on the red mat"},
    {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello world"},
                  {"role": "user", "content": "who sat"}, {"role": "assistant", "content": "the cat"}]},
    {"text": "good movie very good"},
]


def _examples(rows=ROWS):
    return [TASK.example(row, f"rows:{i + 1}") for i, row in enumerate(rows)]


def _tokenizer(**kwargs):
    tokenizer = causal_models.tokenizer(**kwargs)
    tokenizer.pad_token = tokenizer.eos_token  # as load_base does for a tokenizer without one
    return tokenizer


# -- rows ------------------------------------------------------------------------------------------


def test_each_row_form_becomes_its_example():
    text, pair, _, _, chat, _ = _examples()
    assert text == Text("the cat sat on the mat") and pair == Completion("what is the capital of france", "paris")
    assert isinstance(chat, Chat) and chat.messages[1] == ("assistant", "hello world")
    custom = CausalLM(prompt_column="q", completion_column="a", messages_column="conv", text_column="body")
    assert custom.example({"q": "", "a": "yes", "id": 7}, "x:1") == Completion("", "yes")  # other columns ignored
    assert custom.example({"body": "a b"}, "x:2") == Text("a b")


@pytest.mark.parametrize("row, says", [
    ({"label": 1}, "need exactly one of"),
    ({"text": "a", "prompt": "b", "completion": "c"}, "need exactly one of"),  # two forms: never guessed
    ({"text": "a", "messages": []}, "need exactly one of"),
    ({"text": ""}, "non-empty"),
    ({"text": 3}, "non-empty"),
    ({"prompt": "q"}, "non-empty str"),
    ({"prompt": "q", "completion": ""}, "non-empty str"),
    ({"prompt": None, "completion": "a"}, "non-empty str"),
    ({"messages": "hello"}, "must be a list"),
    ({"messages": []}, "must be a list"),
    ({"messages": [{"role": "user"}]}, "must be a list"),
    ({"messages": [{"role": "user", "content": ["an image"]}]}, "must be a list"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no \"assistant\" message"),
])
def test_rows_the_task_cannot_use_are_refused_with_their_place(row, says):
    with pytest.raises(ConfigError) as info:
        TASK.example(row, "contrib.jsonl:4")
    assert info.value.code is Code.BAD_DATA and info.value.detail.startswith("contrib.jsonl:4: ") and says in \
        info.value.detail
    assert "\n" not in info.value.line()


# -- targets ---------------------------------------------------------------------------------------


def test_a_completion_is_the_only_target_and_its_boundary_is_exact():
    tokenizer = _tokenizer()
    row = tokens(Completion("what is the capital of france", "paris"), tokenizer)
    prompt = tokenizer("what is the capital of france")["input_ids"]  # BOS and the prompt's words
    assert row.ids == prompt + tokenizer("paris", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert row.targets == [False] * len(prompt) + [True, True]  # "paris" and the EOS after it
    text = tokens(Text("the cat sat"), tokenizer)
    assert text.ids[0] == tokenizer.bos_token_id and text.targets == [False, True, True, True]


def test_chat_targets_are_the_assistant_turns_with_their_end_markers():
    tokenizer = _tokenizer()
    chat = _examples()[4]
    row = tokens(chat, tokenizer)
    words = [tokenizer.convert_ids_to_tokens(i) for i, target in zip(row.ids, row.targets) if target]
    assert words == ["hello", "world", "<|im_end|>", "the", "cat", "<|im_end|>"]


def test_a_template_that_rewrites_earlier_turns_trains_on_the_last_assistant_turn_only():
    tokenizer = _tokenizer(chat_template=causal_models.REWRITING_TEMPLATE)
    row = tokens(_examples()[4], tokenizer)
    assert [tokenizer.convert_ids_to_tokens(i) for i, t in zip(row.ids, row.targets) if t] == ["the", "cat",
                                                                                              "<|im_end|>"]


def test_messages_need_a_chat_template():
    tokenizer = _tokenizer(chat_template=None)
    with pytest.raises(ConfigError) as info:
        TASK.check(_examples(), tokenizer, 64)
    assert info.value.code is Code.BAD_DATA and info.value.detail.startswith("rows:5: ") and "chat template" in \
        info.value.detail
    TASK.check([e for e in _examples() if not isinstance(e, Chat)], tokenizer, 64)  # the other forms need none


def test_an_example_truncation_leaves_without_a_target_is_refused_before_any_step():
    tokenizer = _tokenizer()
    long_prompt = Completion(" ".join(["the cat"] * 10), "yes", where="c.jsonl:9")
    TASK.check([long_prompt], tokenizer, 32)
    with pytest.raises(ConfigError) as info:
        TASK.check([long_prompt], tokenizer, 12)
    assert info.value.code is Code.BAD_DATA and "c.jsonl:9: no target token within model.max_length = 12" in \
        info.value.detail
    TASK.check([Text("cat")], tokenizer, 32)  # BOS, then one word to predict
    with pytest.raises(ConfigError) as info:
        TASK.check([Text("cat", where="c.jsonl:2")], _tokenizer(bos=False), 32)  # no BOS: one token, no target
    assert info.value.detail == "c.jsonl:2: no target token (a text needs two tokens or more)"
    with pytest.raises(ConfigError):
        TASK.encode([long_prompt], tokenizer, 12, "cpu")  # encode refuses it too, whoever calls it


def test_padding_with_eos_never_hides_a_real_eos_target_and_is_right_sided():
    tokenizer = _tokenizer()
    batch = TASK.encode(_examples()[1:4], tokenizer, 64, "cpu")  # the first is padded to the third's length
    ids, mask, labels = batch.inputs["input_ids"], batch.inputs["attention_mask"], batch.targets
    eos = tokenizer.eos_token_id
    completion_end = int(mask[0].sum()) - 1
    assert ids[0, completion_end] == eos and labels[0, completion_end] == eos  # the completion's EOS is a target
    padded = mask[0] == 0
    assert padded.any() and (ids[0][padded] == eos).all() and (labels[0][padded] == -100).all()
    assert all(mask[i, :int(mask[i].sum())].all() for i in range(3))  # real tokens first, padding after


def test_the_loss_is_each_examples_own_mean_over_its_target_tokens():
    tokenizer = _tokenizer()
    net = causal_models.model("llama").double().eval()
    examples = _examples()
    batch = TASK.encode(examples, tokenizer, 64, "cpu")
    with torch.no_grad():
        losses = TASK.per_example_loss(net(**batch.inputs), batch)
        for i, example in enumerate(examples):  # alone, unpadded: the same loss
            alone = TASK.encode([example], tokenizer, 64, "cpu")
            logits = net(**alone.inputs).logits[0, :-1]
            labels = alone.targets[0, 1:]
            keep = labels != -100
            by_hand = torch.nn.functional.cross_entropy(logits[keep], labels[keep])
            assert torch.allclose(losses[i], by_hand, atol=1e-10), i
    assert losses.dtype == torch.float64 and losses.shape == (len(examples),)


# -- the routing layer against a batch-size-1 loop -------------------------------------------------


def _net(family: str):
    base = causal_models.model(family, layers=2)
    net = wrap_lora(base, LoraSection(r=2, target_modules=causal_models.TARGETS[family]), [], heads=())
    for name, param in net.named_parameters():  # random B factors: the gradients reach every factor
        if ".lora_B." in name:
            with torch.no_grad():
                param.normal_(0, 0.5)
    return net.double().eval()


def _loop(net, examples, tokenizer, clip):
    """Each example alone through plain autograd: its gradient, clipped to its own C, summed."""
    params = {n: p for n, p in net.named_parameters() if p.requires_grad}
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    norms = []
    for example, c in zip(examples, clip):
        net.zero_grad(set_to_none=True)
        batch = TASK.encode([example], tokenizer, 64, "cpu")
        TASK.per_example_loss(net(**batch.inputs), batch).sum().backward()
        norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in params.values() if p.grad is not None))
        norms.append(norm)
        for name, param in params.items():
            if param.grad is not None:
                total[name] += min(1.0, c / norm) * param.grad
    net.zero_grad(set_to_none=True)
    return total, norms


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_clipped_per_sample_sums_equal_the_batch_size_one_loop(family: str):
    """Examples of different lengths (padding), prompt/completion masking and chat turns in one batch: the
    router's per-sample norms and clipped sum equal one-at-a-time autograd, in float64."""
    tokenizer = _tokenizer()
    net = _net(family)
    resolution = resolve({"all": cls("all", band=(0, 1))}, describe(net))
    router = Router(net, resolution, insecure_seed=0)
    router.probe(probe_batches(tokenizer, 16))  # every tapped call has the batch first
    examples = _examples()
    _, norms = _loop(net, examples, tokenizer, [math.inf] * len(examples))
    clip = [norms[i] / 2 if i % 2 else 1e9 for i in range(len(examples))]  # some clipped, some not
    expected, _ = _loop(net, examples, tokenizer, clip)
    batch = TASK.encode(examples, tokenizer, 64, "cpu")
    with router.capture():
        losses = TASK.per_example_loss(net(**batch.inputs), batch)
    report = router.privatize(losses, ["all"] * len(examples), torch.tensor(clip, dtype=torch.float64), {}, 1.0)
    assert report.clipped == len(examples) // 2 and math.isclose(report.max_norm, max(norms), rel_tol=1e-9)
    trained = [n for n, p in net.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n for n in trained)
    for name in trained:
        param = net.get_parameter(name)
        assert torch.allclose(param.grad, expected[name], atol=1e-6, rtol=1e-6), name
    router.close()


def test_the_lm_head_and_a_tied_embedding_stay_frozen():
    net = _net("llama")
    inner = net.base_model.model
    assert inner.lm_head.weight is inner.model.embed_tokens.weight  # tied
    assert not inner.lm_head.weight.requires_grad
    assert not any("lm_head" in n or "embed" in n for n, p in net.named_parameters() if p.requires_grad)


def test_mean_pooling_is_refused_for_a_causal_lm():
    base = {"training": {"steps": 1, "data": "d", "output": "o"}}
    RunFile.model_validate({"model": {"base": "x", "task": "causal-lm"}, **base})
    with pytest.raises(ValueError, match="pooling applies to sequence-classification only"):
        RunFile.model_validate({"model": {"base": "x", "task": "causal-lm", "pooling": "mean"}, **base})
    with pytest.raises(ValueError, match="num_labels applies to sequence-classification only"):
        RunFile.model_validate({"model": {"base": "x", "task": "causal-lm", "num_labels": 2}, **base})


# -- govtrain train end to end on a tiny random Llama ----------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return causal_models.save(tmp_path_factory.mktemp("tiny-llama"), "llama", layers=6)


def _contribution(corpus: Corpus, name: str, rows: list[dict], **overrides) -> None:
    from govtrain.gate.admission import admit

    path = corpus.dir / "data" / f"{name}.jsonl"
    path.parent.mkdir(exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with corpus.open() as ledger:
        admit(ledger, corpus.attestation(path, contribution_id=name, **overrides), path, now=corpus.now)


def _rows(kind: str, n: int) -> list[dict]:
    words = causal_models.WORDS
    if kind == "text":
        return [{"text": f"the {words[i % 9]} sat on the {words[9 + i % 8]} mat"} for i in range(n)]
    if kind == "pair":
        return [{"prompt": f"what is the capital of {('france', 'italy')[i % 2]}",
                 "completion": ("paris", "rome")[i % 2]} for i in range(n)]
    return [{"messages": [{"role": "user", "content": f"say {words[i % 5]}"},
                          {"role": "assistant", "content": f"{words[i % 5]} hello"}]} for i in range(n)]


def _run_toml(corpus: Corpus, model: Path, steps: int, max_length: int = 24) -> Path:
    path = corpus.dir / "run.toml"
    path.write_text(f"""
[model]
base = "{model}"
task = "causal-lm"
max_length = {max_length}
[lora]
r = 2
target_modules = ["q_proj", "v_proj", "o_proj"]
[optimizer]
lr = 0.01
[training]
steps = {steps}
data = "data"
output = "adapter"
run_id = "lm-run"
""")
    return path


def test_govtrain_train_on_a_tiny_llama_writes_spend_ahead_resumes_after_a_kill_and_verifies(corpus: Corpus,
                                                                                           tiny_llama: Path):
    from govtrain.ledger.entries import decode_entry
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import STATE_FILE, train

    _contribution(corpus, "text", _rows("text", 40))
    _contribution(corpus, "pairs", _rows("pair", 40), data_class="sensitive", clip_norm_u=500_000,
                  eps_budget_u=3_000_000)
    _contribution(corpus, "chats", _rows("chat", 40), data_class="restricted", clip_norm_u=500_000,
                  noise_multiplier_u=1_500_000, eps_budget_u=1_000_000)
    config_path = _run_toml(corpus, tiny_llama, 25)
    config = load_run_config(config_path)
    with pytest.raises(KeyboardInterrupt):  # killed in ledger epoch 1, after its spend was written
        train(config, corpus.url, insecure_seed=5, log=lambda line: None, checkpoint_every=4, interrupt_after_steps=14)
    assert (corpus.dir / "adapter" / STATE_FILE).is_file()
    with corpus.open() as ledger:  # epoch 1's spend is in the ledger although only 4 of its steps ran
        written = [decode_entry(e.body, seq=e.seq, kind="spend") for e in ledger.store.entries(kinds=("spend",))]
    assert sorted({(s["epoch"], s["steps"]) for s in written}) == [(0, 10), (1, 10)]
    verify_ledger(corpus.url)
    result = CliRunner().invoke(cli, ["train", "--config", str(config_path), "--ledger", corpus.url,
                                      "--insecure-seed", "5", "--json"])
    assert result.exit_code == 0, result.output
    assert "resuming lm-run at step 12" in result.stderr
    body = json.loads(result.stdout)
    assert body["steps"] == 25 and body["epochs"] == [0, 1, 2]
    assert not (corpus.dir / "adapter" / STATE_FILE).exists()
    assert (corpus.dir / "adapter" / "restricted" / "adapter_config.json").is_file()
    report = verify_ledger(corpus.url)
    assert report.spend_recomputed and report.by_kind["run"] == 1
    with corpus.open() as ledger:
        spends = [decode_entry(e.body, seq=e.seq, kind="spend") for e in ledger.store.entries(kinds=("spend",))]
    assert sorted((s["contribution_id"], s["epoch"], s["steps"]) for s in spends) == sorted(
        (c, e, t) for c in ("text", "pairs", "chats") for e, t in ((0, 10), (1, 10), (2, 5)))
    verify = CliRunner().invoke(cli, ["ledger", "verify", "--ledger", corpus.url])
    assert verify.exit_code == 0, verify.output


def test_a_row_without_a_target_refuses_the_run_before_any_spend(corpus: Corpus, tiny_llama: Path):
    from tests.conftest import snapshot

    _contribution(corpus, "long", [{"prompt": " ".join(["the cat"] * 20), "completion": "yes"}])
    before = snapshot(corpus.url)
    result = CliRunner().invoke(cli, ["train", "--config", str(_run_toml(corpus, tiny_llama, 5, max_length=16)),
                                      "--ledger", corpus.url])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error[bad_data]: long.jsonl:1: no target token within model.max_length = 16")
    assert snapshot(corpus.url) == before


def test_plan_resolves_profiles_on_the_causal_lm_a_run_config_names(corpus: Corpus, tiny_llama: Path):
    """`govtrain plan --config` builds the causal LM (no classifier head) with the run's LoRA: the profiles
    reach the LoRA factors of their layers and nothing outside the stack."""
    _contribution(corpus, "text", _rows("text", 10))
    config = _run_toml(corpus, tiny_llama, 10)
    result = CliRunner().invoke(cli, ["plan", "--ledger", corpus.url, "--config", str(config), "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["classes"]["public"]["layers"] == "3-5" and plan["classes"]["sensitive"]["layers"] == "4-5"
    # q, v and o LoRA pairs in each reached layer and nothing else (head = true finds no head to reach)
    classes = plan["classes"]
    assert classes["public"]["parameters"] == 3 * 3 * 2 and classes["sensitive"]["parameters"] == 2 * 3 * 2
