"""cellm's multi-head latent attention (deepseek_v3) on both query paths, against a float64
numpy transcription of HF transformers' DeepseekV3ForCausalLM (modeling_deepseek_v3.py).

The fixture tests/fixtures/hf-tiny/deepseek_v3 uses the low-rank query path (q_a_proj ->
q_a_layernorm -> q_b_proj) and carries HF's own logits. The direct path (q_lora_rank null: one
`self_attn.q_proj`) has no HF reference, so:

1. the numpy transcription is first checked against HF's reference logits on the low-rank
   fixture, which proves the transcription itself;
2. a direct-q variant of the fixture is built (same weights, q_proj random) and cellm is compared
   with the same transcription on it, in one call and as prefill + token-by-token decode.

The transcription is the expanded (non-absorbed) attention exactly as HF computes it; cellm runs
the absorbed form with a compressed latent cache, so agreement also checks that rewrite.

Weights are read with the minimal safetensors reader of tests/convert_helpers.py, not cellm's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cellm import LLM
from cellm.convert import convert_hf
from conftest import FIXTURES, Reference
from convert_helpers import load_safetensors, save_safetensors

FIXTURE = FIXTURES / "deepseek_v3"
Weights = dict[str, np.ndarray]
Config = dict[str, Any]

# float64 transcription vs HF's float32 forward: only float32 rounding separates them.
TRANSCRIPTION_ATOL = 1e-4
# cellm at f32 weights and f32 KV vs the float64 transcription: the same math, so they differ
# only by float32 rounding and summation order (~1e-5 on this model); a wrong rope layout,
# norm or routing moves logits by >0.1.
ATOL = 1e-3
# Tokens of the first reference sequence used to validate the transcription against HF.
VALIDATION_TOKENS = 12
# Default epsilon of DeepseekV3RMSNorm, used by q_a_layernorm and kv_a_layernorm (HF builds
# them without passing config.rms_norm_eps).
NORM_DEFAULT_EPS = 1e-6


# ----------------------------------------------------------------------------- numpy model


def load_weights(directory: Path) -> Weights:
    """Every tensor of `directory`/model.safetensors (all F32 here), widened to float64."""
    tensors = load_safetensors(directory / "model.safetensors")
    return {name: arr.astype(np.float64) for name, (_, arr) in tensors.items()}


def linear(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """nn.Linear without bias (attention_bias is false): x @ W^T."""
    return x @ weight.T


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """DeepseekV3RMSNorm: x / sqrt(mean(x^2) + eps), scaled by the plain weight."""
    return weight * (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps))


def silu(x: np.ndarray) -> np.ndarray:
    """ACT2FN["silu"]."""
    return x / (1.0 + np.exp(-x))


def gated_mlp(x: np.ndarray, w: Weights, prefix: str) -> np.ndarray:
    """DeepseekV3MLP.forward: down(silu(gate(x)) * up(x)); also each expert and the shared
    experts (the legacy per-expert layout of DeepseekV3Experts' gate_up_proj/down_proj)."""
    gate = linear(x, w[prefix + "gate_proj.weight"])
    up = linear(x, w[prefix + "up_proj.weight"])
    return linear(silu(gate) * up, w[prefix + "down_proj.weight"])


def rope_cos_sin(config: Config, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DeepseekV3RotaryEmbedding.forward with compute_default_rope_parameters: cos/sin of
    cat(freqs, freqs), dim = config.head_dim (which DeepseekV3Config sets to qk_rope_head_dim)."""
    params = config["rope_parameters"]
    assert params["rope_type"] == "default", "only default rope is transcribed"
    dim = config["qk_rope_head_dim"]
    inv_freq = 1.0 / (params["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    freqs = positions[:, None].astype(np.float64) * inv_freq
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb), np.sin(emb)


def apply_rope_interleave(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """apply_rotary_pos_emb_interleave for one tensor [..., seq, rope]: pairs (x0, x1), (x2, x3)
    rotated by one angle each; the result is laid out evens-then-odds, as HF returns it."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def query_states(x: np.ndarray, w: Weights, prefix: str, config: Config) -> np.ndarray:
    """The q projection of DeepseekV3Attention.forward, [seq, heads * qk_head_dim]: q_proj when
    q_lora_rank is None, else q_b_proj(q_a_layernorm(q_a_proj(x)))."""
    if config["q_lora_rank"] is None:
        return linear(x, w[prefix + "q_proj.weight"])
    q_a = linear(x, w[prefix + "q_a_proj.weight"])
    q_a = rms_norm(q_a, w[prefix + "q_a_layernorm.weight"], NORM_DEFAULT_EPS)
    return linear(q_a, w[prefix + "q_b_proj.weight"])


def attention(
    x: np.ndarray, w: Weights, prefix: str, config: Config, cos: np.ndarray, sin: np.ndarray
) -> np.ndarray:
    """DeepseekV3Attention.forward (with expand_kv and eager_attention_forward), causal, no
    cache: per-head q split into q_pass/q_rot; kv_a_proj_with_mqa split into the latent (then
    kv_a_layernorm) and the single shared k_rot; rope on q_rot and k_rot; kv_b_proj expands the
    latent into k_nope and v per head; softmax(q k^T * qk_head_dim**-0.5) v; o_proj."""
    assert config["rope_interleave"], "only the interleaved rope layout is transcribed"
    seq = x.shape[0]
    heads = config["num_attention_heads"]
    nope, rope = config["qk_nope_head_dim"], config["qk_rope_head_dim"]
    rank, v_dim = config["kv_lora_rank"], config["v_head_dim"]

    q = query_states(x, w, prefix, config).reshape(seq, heads, nope + rope).transpose(1, 0, 2)
    q_pass, q_rot = q[..., :nope], q[..., nope:]

    compressed_kv = linear(x, w[prefix + "kv_a_proj_with_mqa.weight"])
    kv_nope, k_rot = compressed_kv[:, :rank], compressed_kv[:, rank:]
    kv_nope = rms_norm(kv_nope, w[prefix + "kv_a_layernorm.weight"], NORM_DEFAULT_EPS)

    q_rot = apply_rope_interleave(q_rot, cos, sin)
    k_rot = apply_rope_interleave(k_rot, cos, sin)
    query = np.concatenate([q_pass, q_rot], axis=-1)

    kv = linear(kv_nope, w[prefix + "kv_b_proj.weight"])
    kv = kv.reshape(seq, heads, nope + v_dim).transpose(1, 0, 2)
    k_nope, value = kv[..., :nope], kv[..., nope:]
    key = np.concatenate([k_nope, np.broadcast_to(k_rot, (heads, seq, rope))], axis=-1)

    scores = query @ key.transpose(0, 2, 1) * (nope + rope) ** -0.5
    future = np.triu(np.ones((seq, seq), dtype=bool), k=1)
    scores = np.where(future, -np.inf, scores)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = (probs @ value).transpose(1, 0, 2).reshape(seq, heads * v_dim)
    return linear(out, w[prefix + "o_proj.weight"])


def route(x: np.ndarray, w: Weights, prefix: str, config: Config) -> tuple[np.ndarray, np.ndarray]:
    """DeepseekV3TopkRouter.forward -> (topk_weights, topk_indices), each [seq, top_k]: sigmoid
    scores; choice by scores + e_score_correction_bias, restricted to the topk_group groups with
    the largest sum of their top-2 choice scores; weights are the uncorrected scores of the
    chosen experts, normalised (norm_topk_prob) and scaled by routed_scaling_factor."""
    experts, groups = config["n_routed_experts"], config["n_group"]
    top_k, topk_group = config["num_experts_per_tok"], config["topk_group"]
    scores = 1.0 / (1.0 + np.exp(-linear(x, w[prefix + "gate.weight"])))
    choice = scores + w[prefix + "gate.e_score_correction_bias"]
    per_group = choice.reshape(-1, groups, experts // groups)
    group_scores = -np.sort(-per_group, axis=-1)[..., :2].sum(-1)
    kept_groups = np.argsort(-group_scores, axis=-1, kind="stable")[:, :topk_group]
    group_mask = np.zeros_like(group_scores, dtype=bool)
    np.put_along_axis(group_mask, kept_groups, True, axis=-1)
    expert_mask = np.repeat(group_mask, experts // groups, axis=-1)
    choice = np.where(expert_mask, choice, -np.inf)
    indices = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(scores, indices, axis=-1)
    if config["norm_topk_prob"]:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * config["routed_scaling_factor"], indices


def moe(x: np.ndarray, w: Weights, prefix: str, config: Config) -> np.ndarray:
    """DeepseekV3MoE.forward: the routed experts (DeepseekV3Experts: each token's chosen
    experts weighted by its router weights) plus the shared experts."""
    weights, indices = route(x, w, prefix, config)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for weight, expert in zip(weights[t], indices[t]):
            out[t] += weight * gated_mlp(x[t], w, f"{prefix}experts.{expert}.")
    return out + gated_mlp(x, w, prefix + "shared_experts.")


def decoder_layer(
    x: np.ndarray, w: Weights, i: int, config: Config, cos: np.ndarray, sin: np.ndarray
) -> np.ndarray:
    """DeepseekV3DecoderLayer.forward: pre-norm attention and MLP, each with a residual; the MLP
    is dense for layers < first_k_dense_replace and the MoE after."""
    p = f"model.layers.{i}."
    eps = config["rms_norm_eps"]
    h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
    x = x + attention(h, w, p + "self_attn.", config, cos, sin)
    h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
    if i < config["first_k_dense_replace"]:
        return x + gated_mlp(h, w, p + "mlp.")
    return x + moe(h, w, p + "mlp.", config)


def forward(w: Weights, config: Config, ids: list[int]) -> np.ndarray:
    """DeepseekV3ForCausalLM.forward: embed, decoder layers, final norm, untied lm_head;
    [len(ids), vocab] next-token logits in float64."""
    assert not config["tie_word_embeddings"]
    x = w["model.embed_tokens.weight"][np.asarray(ids)]
    cos, sin = rope_cos_sin(config, np.arange(len(ids)))
    for i in range(config["num_hidden_layers"]):
        x = decoder_layer(x, w, i, config, cos, sin)
    x = rms_norm(x, w["model.norm.weight"], config["rms_norm_eps"])
    return linear(x, w["lm_head.weight"])


# ----------------------------------------------------------------------------- checkpoints


def write_direct_q_variant(directory: Path) -> None:
    """The fixture with q_lora_rank null: q_a_proj/q_a_layernorm/q_b_proj replaced by a random
    `self_attn.q_proj` [heads * qk_head_dim, hidden] per layer, and a non-zero router
    correction bias (the fixture's is all zeros, which would leave its use untested)."""
    shutil.copytree(FIXTURE, directory)
    config = json.loads((directory / "config.json").read_text())
    config["q_lora_rank"] = None
    (directory / "config.json").write_text(json.dumps(config, indent=2))

    low_rank = ("q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight")
    tensors = {
        name: entry
        for name, entry in load_safetensors(FIXTURE / "model.safetensors").items()
        if not name.endswith(low_rank)
    }
    rows = config["num_attention_heads"] * (config["qk_nope_head_dim"] + config["qk_rope_head_dim"])
    rng = np.random.default_rng(0)
    for i in range(config["num_hidden_layers"]):
        q_proj = (rng.standard_normal((rows, config["hidden_size"])) * 0.05).astype(np.float32)
        tensors[f"model.layers.{i}.self_attn.q_proj.weight"] = ("F32", q_proj)
        bias = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
        if bias in tensors:
            shape = tensors[bias][1].shape
            tensors[bias] = ("F32", (rng.standard_normal(shape) * 0.5).astype(np.float32))
    save_safetensors(directory / "model.safetensors", tensors)


class Model:
    """One checkpoint directory: its config, float64 weights and cellm at f32 weights and KV."""

    def __init__(self, directory: Path, converted: Path) -> None:
        self.config: Config = json.loads((directory / "config.json").read_text())
        self.weights = load_weights(directory)
        self.llm = LLM(converted, kv_encoding="f32")

    def reference(self, ids: list[int]) -> np.ndarray:
        return forward(self.weights, self.config, ids)


@pytest.fixture(scope="module", params=["q_lora", "q_proj"])
def model(request, converted, tmp_path_factory) -> Model:
    """The fixture as is (low-rank q) or its direct-q variant."""
    if request.param == "q_lora":
        return Model(FIXTURE, converted("deepseek_v3", "f32"))
    root = tmp_path_factory.mktemp("mla-direct-q")
    write_direct_q_variant(root / "hf")
    m = Model(root / "hf", convert_hf(root / "hf", root / "direct-q.cellm", "f32"))
    assert m.config["q_lora_rank"] is None and "model.layers.0.self_attn.q_proj.weight" in m.weights
    return m


# ----------------------------------------------------------------------------- tests


def test_transcription_matches_hf_reference():
    """The numpy forward reproduces HF's own logits on the low-rank-q fixture."""
    ref = Reference("deepseek_v3")
    config = json.loads((FIXTURE / "config.json").read_text())
    assert config["q_lora_rank"] is not None
    ids = ref.sequence(0)[:VALIDATION_TOKENS]
    got = forward(load_weights(FIXTURE), config, ids)
    err = float(np.abs(got - ref.logits[0][:VALIDATION_TOKENS]).max())
    assert err < TRANSCRIPTION_ATOL, f"max |dlogit| numpy f64 vs HF f32 = {err}"


def test_logits_match_transcription(model):
    ids = Reference("deepseek_v3").sequence(0)
    got = model.llm.logits(ids)
    err = float(np.abs(got - model.reference(ids)).max())
    assert err < ATOL, f"max |dlogit| cellm vs numpy = {err}"


def test_prefill_then_token_by_token_decode_match_transcription(model):
    ref = Reference("deepseek_v3")
    seq, n = ref.sequence(0), len(ref.prompts[0]["input_ids"])
    engine = model.llm._engine
    session = engine.create_session()
    rows = [engine.step([(session, seq[:n])])[0]]
    rows += [engine.step([(session, [t])])[0] for t in seq[n:]]
    engine.free_session(session)
    err = float(np.abs(np.stack(rows) - model.reference(seq)[n - 1 :]).max())
    assert err < ATOL, f"max |dlogit| cellm decode vs numpy = {err}"
