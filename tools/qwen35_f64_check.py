"""Run the Qwen3.5 fixture in float64 numpy and compare it with HF's float32 reference logits
and with cellm's f32 engine.

The numpy model is a transcription of HF transformers' modeling_qwen3_5.py (text model only),
using the token-by-token (recurrent) form of the gated delta rule.

Why: the gated RMSNorm applied to the DeltaNet outputs divides by a tiny RMS at some positions,
so float32 rounding is amplified there. At position 1 of the fixture's first prompt, HF's own
f32 logits are 3.4e-3 away from the f64 values and cellm's are 1e-3 away; tests/test_parity.py
sets its qwen3_5 tolerance from this.

usage: python tools/qwen35_f64_check.py [--tokens N] [--prompt I]   (defaults: 8 tokens, prompt 0)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "hf-tiny" / "qwen3_5"
sys.path.insert(0, str(ROOT / "tests"))

import cellm  # noqa: E402
from cellm.convert import convert_hf  # noqa: E402
from cellm.convert.safetensors import open_checkpoint  # noqa: E402
from conftest import Reference  # noqa: E402

Weights = dict[str, np.ndarray]

# Epsilon of the l2norm applied to q and k inside HF's gated delta rule kernels.
L2NORM_EPS = 1e-6


def load_weights(directory: Path) -> Weights:
    """Every tensor of the checkpoint, widened to float64."""
    with open_checkpoint(directory) as ck:
        return {name: np.asarray(ck.view(name)).astype(np.float64) for name in ck}


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, offset: bool = True) -> np.ndarray:
    """Qwen3_5RMSNorm (scale by 1 + weight), or with offset=False the weight-only scaling
    of Qwen3_5RMSNormGated (whose silu gate is applied by the caller)."""
    scale = 1 + weight if offset else weight
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * scale


def l2norm(x: np.ndarray) -> np.ndarray:
    """HF's l2norm (eps 1e-6), applied to q and k with use_qk_l2norm_in_kernel=True."""
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + L2NORM_EPS)


def silu(x: np.ndarray) -> np.ndarray:
    """ACT2FN["silu"]."""
    return x / (1 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    """torch.sigmoid."""
    return 1 / (1 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    """F.softplus (no threshold: the fixture's inputs are small)."""
    return np.log1p(np.exp(x))


def rope(x: np.ndarray, cfg: dict) -> np.ndarray:
    """apply_rotary_pos_emb with partial rotary: only the first head_dim * partial_rotary_factor
    channels of each head rotate (rotate_half layout), with Qwen3_5TextRotaryEmbedding's
    default inverse frequencies. x: (T, heads, head_dim), positions 0..T-1."""
    params = cfg["rope_parameters"]
    rot = int(cfg["head_dim"] * params.get("partial_rotary_factor", 1.0))
    half = rot // 2
    inv_freq = 1 / params["rope_theta"] ** (np.arange(0, rot, 2) / rot)
    angles = np.arange(x.shape[0])[:, None] * inv_freq[None]
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
    a, b = x[..., :half], x[..., half:rot]
    out = x.copy()
    out[..., :half] = a * cos - b * sin
    out[..., half:rot] = b * cos + a * sin
    return out


def short_conv(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """causal_conv1d_fn with activation="silu": a depthwise causal convolution over time.
    x: (T, channels); weight: (channels, kernel)."""
    steps, kernel = x.shape[0], weight.shape[1]
    padded = np.vstack([np.zeros((kernel - 1, x.shape[1])), x])
    out = np.stack([(padded[t : t + kernel] * weight.T).sum(0) for t in range(steps)])
    return silu(out)


def delta_rule_recurrent(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray
) -> np.ndarray:
    """torch_recurrent_gated_delta_rule with use_qk_l2norm_in_kernel=True and no initial state.
    q, k: (T, k_heads, k_dim); v: (T, v_heads, v_dim); g, beta: (T, v_heads). Each q/k head
    serves v_heads // k_heads consecutive value heads. Returns (T, v_heads, v_dim)."""
    steps, v_heads, v_dim = v.shape
    k_dim = q.shape[-1]
    group = v_heads // q.shape[1]
    q = l2norm(q) / np.sqrt(k_dim)
    k = l2norm(k)
    out = np.zeros((steps, v_heads, v_dim))
    for head in range(v_heads):
        state = np.zeros((k_dim, v_dim))
        for t in range(steps):
            state = state * np.exp(g[t, head])
            key = k[t, head // group]
            delta = beta[t, head] * (v[t, head] - state.T @ key)
            state = state + np.outer(key, delta)
            out[t, head] = state.T @ q[t, head // group]
    return out


def deltanet_layer(h: np.ndarray, w: Weights, prefix: str, cfg: dict) -> np.ndarray:
    """Qwen3_5GatedDeltaNet.forward (no cache, no padding). h: (T, hidden)."""
    steps = h.shape[0]
    k_heads, k_dim = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    v_heads, v_dim = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
    key_size = k_heads * k_dim

    qkv = short_conv(h @ w[prefix + "in_proj_qkv.weight"].T, w[prefix + "conv1d.weight"][:, 0, :])
    q = qkv[:, :key_size].reshape(steps, k_heads, k_dim)
    k = qkv[:, key_size : 2 * key_size].reshape(steps, k_heads, k_dim)
    v = qkv[:, 2 * key_size :].reshape(steps, v_heads, v_dim)

    beta = sigmoid(h @ w[prefix + "in_proj_b.weight"].T)
    a = h @ w[prefix + "in_proj_a.weight"].T
    g = -np.exp(w[prefix + "A_log"]) * softplus(a + w[prefix + "dt_bias"])

    out = delta_rule_recurrent(q, k, v, g, beta)
    z = (h @ w[prefix + "in_proj_z.weight"].T).reshape(steps, v_heads, v_dim)
    out = rms_norm(out, w[prefix + "norm.weight"], cfg["rms_norm_eps"], offset=False) * silu(z)
    return out.reshape(steps, -1) @ w[prefix + "out_proj.weight"].T


def attention_layer(h: np.ndarray, w: Weights, prefix: str, cfg: dict) -> np.ndarray:
    """Qwen3_5Attention.forward with eager_attention_forward (causal, no cache): q_proj yields
    the query and an output gate per head, q/k get RMSNorm then partial RoPE, GQA over kv heads,
    and the attention output is multiplied by sigmoid(gate). h: (T, hidden)."""
    steps = h.shape[0]
    heads, kv_heads, dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    group = heads // kv_heads

    q_gate = (h @ w[prefix + "q_proj.weight"].T).reshape(steps, heads, 2 * dim)
    q, gate = q_gate[..., :dim], q_gate[..., dim:]
    k = (h @ w[prefix + "k_proj.weight"].T).reshape(steps, kv_heads, dim)
    v = (h @ w[prefix + "v_proj.weight"].T).reshape(steps, kv_heads, dim)
    q = rope(rms_norm(q, w[prefix + "q_norm.weight"], eps), cfg)
    k = rope(rms_norm(k, w[prefix + "k_norm.weight"], eps), cfg)

    causal_mask = np.triu(np.full((steps, steps), -np.inf), 1)
    out = np.zeros((steps, heads, dim))
    for head in range(heads):
        k_head, v_head = k[:, head // group], v[:, head // group]
        scores = q[:, head] @ k_head.T / np.sqrt(dim) + causal_mask
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out[:, head] = probs @ v_head
    out = out * sigmoid(gate)
    return out.reshape(steps, -1) @ w[prefix + "o_proj.weight"].T


def mlp(h: np.ndarray, w: Weights, prefix: str) -> np.ndarray:
    """Qwen3_5MLP: down_proj(silu(gate_proj(h)) * up_proj(h))."""
    gate = silu(h @ w[prefix + "gate_proj.weight"].T)
    up = h @ w[prefix + "up_proj.weight"].T
    return (gate * up) @ w[prefix + "down_proj.weight"].T


def forward(ids: list[int], w: Weights, cfg: dict) -> np.ndarray:
    """Qwen3_5ForCausalLM.forward: Qwen3_5DecoderLayer's pre-norm residual blocks (DeltaNet or
    full attention per layer_types, then MLP), final norm, lm_head. Returns (T, vocab) logits."""
    eps = cfg["rms_norm_eps"]
    embed = w["model.embed_tokens.weight"]
    x = embed[ids]
    for i, layer_type in enumerate(cfg["layer_types"]):
        prefix = f"model.layers.{i}."
        h = rms_norm(x, w[prefix + "input_layernorm.weight"], eps)
        if layer_type == "linear_attention":
            x = x + deltanet_layer(h, w, prefix + "linear_attn.", cfg)
        else:
            x = x + attention_layer(h, w, prefix + "self_attn.", cfg)
        h = rms_norm(x, w[prefix + "post_attention_layernorm.weight"], eps)
        x = x + mlp(h, w, prefix + "mlp.")
    lm_head = embed if cfg.get("tie_word_embeddings") else w["lm_head.weight"]
    return rms_norm(x, w["model.norm.weight"], eps) @ lm_head.T


def cellm_logits(ids: list[int]) -> np.ndarray:
    """cellm's logits for ids, from the fixture converted with f32 weights and f32 KV."""
    with tempfile.TemporaryDirectory() as tmp:
        path = convert_hf(FIXTURE, Path(tmp) / "qwen3_5.cellm", "f32")
        return cellm.LLM(path, kv_encoding="f32").logits(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8, help="positions to compare (default 8)")
    parser.add_argument("--prompt", type=int, default=0, help="reference prompt index (default 0)")
    args = parser.parse_args()

    cfg = json.loads((FIXTURE / "config.json").read_text())
    ref = Reference("qwen3_5")
    ids = ref.sequence(args.prompt)[: args.tokens]

    logits = forward(ids, load_weights(FIXTURE), cfg)
    hf = ref.logits[args.prompt][: len(ids)]
    ours = cellm_logits(ids)
    print("numpy vs HF", np.abs(logits - hf).max(-1).round(5))
    print("numpy vs ours", np.abs(logits - ours).max(-1).round(5))


if __name__ == "__main__":
    main()
