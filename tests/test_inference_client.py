"""The split-inference client and the server's head (`govtrain.inference`), on a tiny released BERT:

- the client pools with the public base exactly as the released model pools (oracle: plain transformers and the
  pooling written out by hand), and the server's head is the released classifier (oracle: its saved weights);
- end to end through an httpx transport: the vector sent is clip(pooled) + the injected generator's noise, the
  answer is the head's, and both sides charge the same spend;
- the client charges its own budget before anything leaves; server refusals reach it with their codes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")

import govtrain  # noqa: E402
from govtrain.errors import Code, ConfigError, InferenceError  # noqa: E402
from govtrain.inference import (PooledEncoder, SessionStore, SplitClient, SplitHead, new_session_id,  # noqa: E402
                                release_for, session_budget)
from govtrain.inference.mechanism import add_noise, clip  # noqa: E402
from govtrain.inference.snr import expected_noise_norm, measure_norms  # noqa: E402
from tests.inference_release import split_server, train_release  # noqa: E402
from tests.test_release import TEXTS  # noqa: E402

BUDGET = session_budget(3.0, 1e-6)


@pytest.fixture(scope="module", params=["mean", "model"])
def release(request, tmp_path_factory):
    """(adapter folder, base folder, pooling) of a tiny BERT trained and released with each pooling."""
    folder, base = train_release(tmp_path_factory.mktemp(f"split-{request.param}"), request.param)
    return folder, base, request.param


@pytest.fixture(scope="module")
def sides(release):
    """(client's encoder, server's head) for the release."""
    folder, base, _ = release
    return PooledEncoder.from_release(folder, base=base), SplitHead(govtrain.load(folder, base=base))


def _oracle_pooled(base: Path, folder: Path, pooling: str, texts) -> np.ndarray:
    """The base's pooled states by plain transformers and the pooling written out by hand."""
    from govtrain.train.model import quiet_loading

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    with quiet_loading():  # the base's classifier head is what AutoModel leaves out: no news
        plain = transformers.AutoModel.from_pretrained(base, dtype=torch.float32).eval()
    inputs = tokenizer(list(texts), padding=True, padding_side="right", truncation=True, max_length=16,
                       return_tensors="pt")
    with torch.no_grad():
        out = plain(**inputs)
    if pooling == "model":
        return out.pooler_output.double().numpy()
    mask = inputs["attention_mask"].unsqueeze(-1).double()
    return ((out.last_hidden_state.double() * mask).sum(1) / mask.sum(1)).numpy()


def _saved_head(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    from safetensors.torch import load_file

    saved = load_file(str(folder / "adapter_model.safetensors"))
    return (saved["base_model.model.classifier.weight"].double().numpy(),
            saved["base_model.model.classifier.bias"].double().numpy())


# -- each side against an oracle -----------------------------------------------------------------------------


def test_the_client_pools_with_the_base_as_the_released_model_pools(release, sides):
    folder, base, pooling = release
    encoder, _ = sides
    pooled = encoder.pooled(TEXTS)
    assert pooled.shape == (len(TEXTS), 16) and encoder.dimension == 16 and pooled.dtype == np.float64
    assert np.allclose(pooled, _oracle_pooled(base, folder, pooling, TEXTS), atol=1e-5)
    alone = np.concatenate([encoder.pooled([t]) for t in TEXTS])  # each row its own text's: padding changes nothing
    assert np.allclose(alone, pooled, atol=1e-5)
    assert not np.allclose(pooled[0], pooled[1])


def test_the_servers_head_is_the_released_classifier(release, sides):
    folder, _, _ = release
    encoder, head = sides
    weight, bias = _saved_head(folder)
    pooled = encoder.pooled(TEXTS)
    assert np.allclose(head.logits(pooled), pooled @ weight.T + bias, atol=1e-5)
    # and on the adapted model's own pooled state it gives the released model's logits (checked at construction too)
    loaded = head.loaded
    from govtrain.inference.pooled import pooled_states, pooling_encoder

    adapted = pooled_states(pooling_encoder(loaded.model.get_base_model()), loaded.encode(TEXTS))
    assert np.allclose(head.logits(adapted.numpy()), loaded.logits(TEXTS).numpy(), atol=1e-5)
    assert not np.allclose(adapted.double().numpy(), pooled, atol=1e-3)  # the LoRA moved the states the client lacks


# -- end to end ----------------------------------------------------------------------------------------------


def test_a_query_goes_pooled_clipped_noised_and_charged_on_both_sides(tmp_path: Path, sides):
    encoder, head = sides
    server = SessionStore(tmp_path / "server.db")
    seen: list = []
    http = httpx.Client(transport=httpx.MockTransport(split_server(head, server, BUDGET, seen=seen)),
                        base_url="http://split.invalid")
    session = new_session_id()
    client = SplitClient(encoder, http, SessionStore(tmp_path / "client.db"), session_id=session, budget=BUDGET,
                         rng=np.random.default_rng(11))
    answers = client.classify_many(TEXTS[:3], epsilon=1.0, delta=1e-6, clip_norm=0.5)
    release = release_for(1.0, 1e-6, 0.5)
    replay = np.random.default_rng(11)
    for text, answer, request in zip(TEXTS, answers, seen):
        sent = json.loads(request.content)
        assert sent["session_id"] == session and sent["sigma"] == release.sigma
        clipped = clip(encoder.pooled([text])[0], 0.5)
        expected = add_noise(clipped, release, replay)  # the same draws, in the same order
        assert np.allclose(sent["vector"], expected, atol=1e-9)
        logits = head.logits(np.array(sent["vector"])[None])[0]
        assert answer.label == int(np.argmax(logits)) and np.allclose(answer.logits, logits)
        assert answer.label_name == f"LABEL_{answer.label}"
    assert [a.requests for a in answers] == [1, 2, 3]
    ours = client.state
    assert ours.requests == 3 and answers[-1].epsilon_spent == ours.spent_epsilon  # both sides charged the same
    assert server.session(session, owner="alice").mu_sq == ours.mu_sq == 3 * release.mu_sq


def test_the_client_charges_itself_before_anything_leaves(tmp_path: Path, sides):
    encoder, head = sides
    seen: list = []
    http = httpx.Client(transport=httpx.MockTransport(split_server(head, SessionStore(tmp_path / "server.db"),
                                                                   session_budget(100.0, 1e-6), seen=seen)),
                        base_url="http://split.invalid")
    rng = np.random.default_rng(3)
    client = SplitClient(encoder, http, SessionStore(tmp_path / "client.db"), session_id="s1",
                         budget=session_budget(1.2, 1e-6), rng=rng)
    client.classify(TEXTS[0], epsilon=1.0, delta=1e-6, clip_norm=1.0)
    before, drawn = client.state, rng.bit_generator.state
    with pytest.raises(InferenceError) as info:
        client.classify(TEXTS[1], epsilon=1.0, delta=1e-6, clip_norm=1.0)  # 1.47 > 1.2
    assert info.value.code is Code.SESSION_BUDGET_EXHAUSTED
    assert len(seen) == 1 and rng.bit_generator.state == drawn and client.state == before  # nothing sent or drawn
    with pytest.raises(InferenceError) as info:
        client.classify(TEXTS[1], epsilon=0.0, delta=1e-6, clip_norm=1.0)
    assert info.value.code is Code.BAD_PRIVACY_REQUEST and len(seen) == 1 and client.state == before


def test_server_refusals_reach_the_client_with_their_codes_and_its_own_charge_stands(tmp_path: Path, sides):
    encoder, head = sides
    server = SessionStore(tmp_path / "server.db")
    handler = split_server(head, server, session_budget(1.2, 1e-6))  # the server allows less than the client
    http = httpx.Client(transport=httpx.MockTransport(handler), base_url="http://split.invalid")
    client = SplitClient(encoder, http, SessionStore(tmp_path / "client.db"), session_id="s1", budget=BUDGET)
    client.classify(TEXTS[0], epsilon=1.0, delta=1e-6, clip_norm=1.0)
    with pytest.raises(InferenceError) as info:
        client.classify(TEXTS[1], epsilon=1.0, delta=1e-6, clip_norm=1.0)
    assert info.value.code is Code.SESSION_BUDGET_EXHAUSTED and "(429)" in info.value.detail
    assert client.state.requests == 2 and server.session("s1", owner="alice").requests == 1  # the vector left


@pytest.mark.parametrize("transport, status", [
    (lambda request: (_ for _ in ()).throw(httpx.ConnectError("refused")), None),
    (lambda request: httpx.Response(502, text="<html>bad gateway</html>"), 502),
    (lambda request: httpx.Response(200, json={"label": 1}), 200),
    (lambda request: httpx.Response(403, json={"ok": False, "code": "no_such_code", "detail": "?"}), 403),
])
def test_what_is_no_split_answer_is_split_transport(tmp_path: Path, sides, transport, status):
    encoder, _ = sides
    client = SplitClient(encoder, httpx.Client(transport=httpx.MockTransport(transport), base_url="http://x.invalid"),
                         SessionStore(tmp_path / "client.db"), session_id="s1", budget=BUDGET)
    with pytest.raises(InferenceError) as info:
        client.classify(TEXTS[0], epsilon=1.0, delta=1e-6, clip_norm=1.0)
    assert info.value.code is Code.SPLIT_TRANSPORT
    assert client.state.requests == 1  # charged: the client cannot know the vector did not arrive


# -- loading -------------------------------------------------------------------------------------------------


def test_the_client_loads_only_the_base_its_release_names(tmp_path: Path, release):
    folder, base, _ = release
    other = tmp_path / "other"
    other.mkdir()
    from tests.test_train import save_tiny_bert

    save_tiny_bert(other)
    config = json.loads((other / "config.json").read_text())
    config["layer_norm_eps"] = 1e-6  # another model, by one number
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as info:
        PooledEncoder.from_release(folder, base=other)
    assert info.value.code is Code.BASE_MODEL_MISMATCH
    with pytest.raises(ConfigError) as info:
        PooledEncoder.from_release(base)  # a model folder, not a release
    assert info.value.code is Code.ARTIFACT_UNREADABLE


def test_a_model_whose_head_reads_no_pooled_vector_is_unsupported():
    from govtrain.inference.pooled import pooling_encoder

    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=32, n_positions=16, num_labels=2)
    with pytest.raises(ConfigError) as info:
        pooling_encoder(transformers.GPT2ForSequenceClassification(config))
    assert info.value.code is Code.SPLIT_UNSUPPORTED and info.value.exit_code == 2


# -- seed 002's claim, measured --------------------------------------------------------------------------------


def test_the_norm_report_measures_what_reaches_the_server(release, sides):
    folder, base, pooling = release
    encoder, _ = sides
    report = measure_norms(encoder, TEXTS, epsilon=1.0, delta=1e-5, clip_norm=0.1, rng=np.random.default_rng(0))
    raw = np.linalg.norm(_oracle_pooled(base, folder, pooling, TEXTS), axis=1)
    assert report.texts == len(TEXTS) and report.dimension == 16
    assert report.raw_norm_mean == pytest.approx(raw.mean(), rel=1e-5) and report.raw_norm_min > 0.1
    assert report.clipped_norm_max <= 0.1 and report.clipped_norm_mean == pytest.approx(0.1)
    assert report.sigma == release_for(1.0, 1e-5, 0.1).sigma
    assert report.noise_norm_mean == pytest.approx(expected_noise_norm(report.sigma, 16), rel=0.2)
    assert report.snr < 0.05 and abs(report.cosine_mean) < 0.3


@pytest.mark.slow
def test_seed_002s_claim_on_minilm(tmp_path: Path):
    """The bundled MiniLM (d = 384) at the seed's epsilon 1, delta 1e-5: its mean-pooled states are far from
    norm 177, and after clipping to 1 the noise is ~146 times the signal."""
    from tests.test_release import _corpus, _run_toml, _train

    corpus = _corpus(tmp_path, "c")
    _train(_run_toml(corpus, "minilm", steps=1), corpus)
    report = measure_norms(PooledEncoder.from_release(corpus.dir / "adapter"), TEXTS, rng=np.random.default_rng(0))
    assert report.dimension == 384 and report.clipped_norm_max <= 1.0
    assert report.noise_norm_mean == pytest.approx(expected_noise_norm(report.sigma, 384), rel=0.02)
    assert report.snr == pytest.approx(1 / 146, rel=0.05)
    assert report.raw_norm_max < 177  # not the seed's post-transformer norm
