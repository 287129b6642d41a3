"""Which tensors a llama-family model needs, with which shapes, checked against a checkpoint."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, Optional

import numpy as np

from ..errors import FormatError
from .safetensors import Checkpoint

# Buffers some older checkpoints saved but that conversion recomputes (`model.rope`).
_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
_READABLE = ("F32", "F16", "BF16")


Shapes = list[tuple[str, tuple[int, ...]]]


def _attention(model: Mapping[str, Any], p: str) -> Shapes:
    hidden, hd = model["hidden_size"], model["head_dim"]
    q_out, kv_out = model["num_heads"] * hd, model["num_kv_heads"] * hd
    out: Shapes = []
    for proj, rows in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
        out.append((f"{p}self_attn.{proj}.weight", (rows, hidden)))
        if model["attention_bias"]:
            out.append((f"{p}self_attn.{proj}.bias", (rows,)))
    out.append((p + "self_attn.o_proj.weight", (hidden, q_out)))
    if model["attention_out_bias"]:
        out.append((p + "self_attn.o_proj.bias", (hidden,)))
    if model["qk_norm"]:
        out.append((p + "self_attn.q_norm.weight", (hd,)))
        out.append((p + "self_attn.k_norm.weight", (hd,)))
    return out


def _gated_mlp(model: Mapping[str, Any], p: str) -> Shapes:
    hidden, inter = model["hidden_size"], model["intermediate_size"]
    out: Shapes = []
    for proj, shape in (
        ("gate_proj", (inter, hidden)),
        ("up_proj", (inter, hidden)),
        ("down_proj", (hidden, inter)),
    ):
        out.append((f"{p}mlp.{proj}.weight", shape))
        if model["mlp_bias"]:
            out.append((f"{p}mlp.{proj}.bias", shape[:1]))
    return out


def _norms(model: Mapping[str, Any], p: str, *names: str) -> Shapes:
    return [(f"{p}{n}.weight", (model["hidden_size"],)) for n in names]


def _llama_layer(model: Mapping[str, Any], p: str) -> Shapes:
    return (
        _norms(model, p, "input_layernorm")
        + _attention(model, p)
        + _norms(model, p, "post_attention_layernorm")
        + _gated_mlp(model, p)
    )


def _gemma3_layer(model: Mapping[str, Any], p: str) -> Shapes:
    return (
        _norms(model, p, "input_layernorm")
        + _attention(model, p)
        + _norms(model, p, "post_attention_layernorm", "pre_feedforward_layernorm")
        + _gated_mlp(model, p)
        + _norms(model, p, "post_feedforward_layernorm")
    )


def _lfm2_layer(model: Mapping[str, Any], p: str, kind: str) -> Shapes:
    hidden, inter = model["hidden_size"], model["intermediate_size"]
    out = _norms(model, p, "operator_norm")
    if kind == "conv":
        conv = model["conv"]
        out += [
            (p + "conv.in_proj.weight", (3 * hidden, hidden)),
            (p + "conv.conv.weight", (hidden, conv["taps"])),
            (p + "conv.out_proj.weight", (hidden, hidden)),
        ]
        if conv["bias"]:
            out += [
                (p + "conv.in_proj.bias", (3 * hidden,)),
                (p + "conv.conv.bias", (hidden,)),
                (p + "conv.out_proj.bias", (hidden,)),
            ]
    else:
        hd = model["head_dim"]
        q_out, kv_out = model["num_heads"] * hd, model["num_kv_heads"] * hd
        a = p + "self_attn."
        out += [
            (a + "q_proj.weight", (q_out, hidden)),
            (a + "k_proj.weight", (kv_out, hidden)),
            (a + "v_proj.weight", (kv_out, hidden)),
            (a + "out_proj.weight", (hidden, q_out)),
            (a + "q_layernorm.weight", (hd,)),
            (a + "k_layernorm.weight", (hd,)),
        ]
    return out + [
        (p + "ffn_norm.weight", (hidden,)),
        (p + "feed_forward.w1.weight", (inter, hidden)),
        (p + "feed_forward.w3.weight", (inter, hidden)),
        (p + "feed_forward.w2.weight", (hidden, inter)),
    ]


def _qwen3_5_layer(model: Mapping[str, Any], p: str, kind: str) -> Shapes:
    hidden = model["hidden_size"]
    out = _norms(model, p, "input_layernorm")
    if kind == "linear_attention":
        la = model["linear_attention"]
        key_dim, value_dim = la["k_heads"] * la["k_dim"], la["v_heads"] * la["v_dim"]
        conv_dim = 2 * key_dim + value_dim
        a = p + "linear_attn."
        out += [
            (a + "in_proj_qkv.weight", (conv_dim, hidden)),
            (a + "in_proj_z.weight", (value_dim, hidden)),
            (a + "in_proj_b.weight", (la["v_heads"], hidden)),
            (a + "in_proj_a.weight", (la["v_heads"], hidden)),
            (a + "conv1d.weight", (conv_dim, la["conv_taps"])),
            (a + "A_log", (la["v_heads"],)),
            (a + "dt_bias", (la["v_heads"],)),
            (a + "norm.weight", (la["v_dim"],)),
            (a + "out_proj.weight", (hidden, value_dim)),
        ]
    else:
        # q_proj also yields the output gate: two rows per query row.
        out += [
            (n, (2 * s[0], s[1]) if n.endswith("q_proj.weight") else s)
            for n, s in _attention(model, p)
        ]
    return out + _norms(model, p, "post_attention_layernorm") + _gated_mlp(model, p)


def _deepseek_layer(model: Mapping[str, Any], p: str, index: int) -> Shapes:
    hidden, heads, m = model["hidden_size"], model["num_heads"], model["mla"]
    qk, rank = m["nope_dim"] + m["rope_dim"], m["kv_lora_rank"]
    a = p + "self_attn."
    out = _norms(model, p, "input_layernorm")
    if m["q_lora_rank"] is None:
        out.append((a + "q_proj.weight", (heads * qk, hidden)))
    else:
        out += [
            (a + "q_a_proj.weight", (m["q_lora_rank"], hidden)),
            (a + "q_a_layernorm.weight", (m["q_lora_rank"],)),
            (a + "q_b_proj.weight", (heads * qk, m["q_lora_rank"])),
        ]
    out += [
        (a + "kv_a_proj_with_mqa.weight", (rank + m["rope_dim"], hidden)),
        (a + "kv_a_layernorm.weight", (rank,)),
        (a + "kv_b_proj.k_absorb.weight", (heads * rank, m["nope_dim"])),
        (a + "kv_b_proj.v_up.weight", (heads * m["v_dim"], rank)),
        (a + "o_proj.weight", (hidden, heads * m["v_dim"])),
    ]
    out += _norms(model, p, "post_attention_layernorm")
    moe = model["moe"]
    if index < moe["first_moe_layer"]:
        return out + _gated_mlp(model, p)
    inter = moe["expert_intermediate_size"]
    out += [
        (p + "mlp.gate.weight", (moe["experts"], hidden)),
        (p + "mlp.gate.e_score_correction_bias", (moe["experts"],)),
    ]
    experts = [f"experts.{e}" for e in range(moe["experts"])]
    for name, width in [(e, inter) for e in experts] + [
        ("shared_experts", inter * moe["shared_experts"])
    ] * (moe["shared_experts"] > 0):
        out += [
            (f"{p}mlp.{name}.gate_proj.weight", (width, hidden)),
            (f"{p}mlp.{name}.up_proj.weight", (width, hidden)),
            (f"{p}mlp.{name}.down_proj.weight", (hidden, width)),
        ]
    return out


# Per engine architecture: the tensors of one decoder layer, given its name prefix and type.
_LAYERS: dict[str, Callable[[Mapping[str, Any], str, str], Shapes]] = {
    "llama": lambda model, p, _: _llama_layer(model, p),
    "gemma3": lambda model, p, _: _gemma3_layer(model, p),
    "lfm2": _lfm2_layer,
    "qwen3_5": _qwen3_5_layer,
    "deepseek_v3": lambda model, p, _: [],  # numbered layers: see expected_tensors
}
# The final norm's name, where a family renames it.
_FINAL_NORM = {"lfm2": "model.embedding_norm.weight"}


def expected_tensors(model: Mapping[str, Any]) -> Shapes:
    """(name, shape) of every tensor the engine reads, in file order (embedding, layers, head)."""
    hidden = model["hidden_size"]
    arch = model["architecture"]
    layer = _LAYERS[arch]
    types = model.get("layer_types") or ["full_attention"] * model["num_layers"]
    out: Shapes = [("model.embed_tokens.weight", (model["vocab_size"], hidden))]
    for i, kind in enumerate(types):
        if arch == "deepseek_v3":
            out += _deepseek_layer(model, f"model.layers.{i}.", i)
        else:
            out += layer(model, f"model.layers.{i}.", kind)
    out.append((_FINAL_NORM.get(arch, "model.norm.weight"), (hidden,)))
    if not model["tie_word_embeddings"]:
        out.append(("lm_head.weight", (model["vocab_size"], hidden)))
    return out


_K_ABSORB, _V_UP = ".kv_b_proj.k_absorb.weight", ".kv_b_proj.v_up.weight"


def tensor_source(model: Mapping[str, Any], name: str) -> tuple[str, tuple[int, ...]]:
    """The checkpoint tensor (name, shape) a stored tensor is made from: itself, except for
    MLA's `kv_b_proj`, which is split into `k_absorb` and `v_up`."""
    if model["architecture"] == "deepseek_v3" and name.endswith((_K_ABSORB, _V_UP)):
        m = model["mla"]
        prefix = name.rsplit(".kv_b_proj.", 1)[0]
        shape = (model["num_heads"] * (m["nope_dim"] + m["v_dim"]), m["kv_lora_rank"])
        return prefix + ".kv_b_proj.weight", shape
    return name, ()


def _mla_transform(model: Mapping[str, Any], name: str) -> Optional[Callable]:
    """MLA weights in the engine's layout: `kv_b_proj` split per head into `W_UK^T`
    (`k_absorb`, `rank x nope`) and `W_UV` (`v_up`, `v x rank`); with `rope_interleave`, the
    rope rows of q and of the shared key reordered from (x0, x1), (x2, x3)... pairs to HF's
    half-split layout (evens, then odds), which is the same rotation."""
    m, heads = model["mla"], model["num_heads"]
    nope, rope, rank, v = m["nope_dim"], m["rope_dim"], m["kv_lora_rank"], m["v_dim"]
    if name.endswith(_K_ABSORB):
        return lambda w: (
            w.reshape(heads, nope + v, rank)[:, :nope, :].transpose(0, 2, 1).reshape(-1, nope)
        )
    if name.endswith(_V_UP):
        return lambda w: w.reshape(heads, nope + v, rank)[:, nope:, :].reshape(-1, rank)
    if not m["rope_interleave"]:
        return None
    half_split = np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)])
    if name.endswith(("q_proj.weight", "q_b_proj.weight")):
        order = np.concatenate(
            [h * (nope + rope) + np.r_[np.arange(nope), nope + half_split] for h in range(heads)]
        )
        return lambda w: w[order]
    if name.endswith(("kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias")):
        order = np.r_[np.arange(rank), rank + half_split]
        return lambda w: w[order]
    return None


def tensor_transform(
    model: Mapping[str, Any], name: str
) -> Optional[Callable[[np.ndarray], np.ndarray]]:
    """A float32 rewrite a tensor needs before it is stored, or None.

    Gemma's and Qwen3.5's RMSNorms multiply by `1 + w`; storing `1 + w` (computed in float32,
    as HF does) lets every family share one norm. MLA weights are re-laid out.
    """
    if model["architecture"] == "deepseek_v3":
        return _mla_transform(model, name)
    one_plus = model["architecture"] == "gemma3" or (
        # Qwen3.5's gated DeltaNet norm is a plain `w`; its other RMSNorms are `1 + w`.
        model["architecture"] == "qwen3_5" and not name.endswith("linear_attn.norm.weight")
    )
    if one_plus and name.endswith("norm.weight"):
        return lambda w: w + np.float32(1.0)
    return None


_F32_MATRICES = ("conv.conv.weight", "conv1d.weight", "mlp.gate.weight")


def stored_as_f32(name: str, shape: tuple[int, ...]) -> bool:
    """Tensors kept in f32 whatever the requested dtype: vectors (norms, biases) are tiny and
    precision-sensitive, the engine reads convolution kernels as f32, and HF runs MoE routers
    in f32."""
    return len(shape) == 1 or name.endswith(_F32_MATRICES)


def settle_from_weights(model: dict[str, Any], checkpoint: Checkpoint) -> None:
    """Fill in what only the weights tell: LFM2's feed-forward width (the config's number is
    adjusted by `block_auto_adjust_ff_dim` in HF's code)."""
    if model["architecture"] == "lfm2":
        name = "model.layers.0.feed_forward.w1.weight"
        if name not in checkpoint:
            raise FormatError(f"{checkpoint.source} is missing tensor {name}")
        model["intermediate_size"] = int(checkpoint.info(name).shape[0])


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def plan_tensors(model: Mapping[str, Any], checkpoint: Checkpoint) -> Shapes:
    """The expected tensors, after checking the checkpoint has each one with the right shape.

    Tensors the model would not use are an error rather than silently dropped: they mean the
    config and the weights disagree (e.g. biases present but `attention_bias` false).
    """
    plan = expected_tensors(model)
    sources = []
    for stored, stored_shape in plan:
        name, shape = tensor_source(model, stored)
        shape = shape or stored_shape
        sources.append(name)
        if name not in checkpoint:
            raise FormatError(
                f"{checkpoint.source} is missing tensor {name} "
                f"(required for model_type {model['model_type']})"
            )
        info = checkpoint.info(name)
        # Size-1 axes may go (Conv1d's [channels, 1, taps] is stored as [channels, taps]).
        if _squeezed(info.shape) != _squeezed(shape):
            raise FormatError(
                f"{info.path}: tensor {name} has shape {list(info.shape)}, expected "
                f"{list(shape)} from config.json"
            )
        if info.dtype not in _READABLE:
            raise FormatError(
                f"{info.path}: tensor {name} has dtype {info.dtype}; only F32, F16 and BF16 "
                "are supported"
            )
    wanted = set(sources)
    # A tied model's lm_head.weight (when a checkpoint stores it anyway) is the embedding.
    skipped = {"lm_head.weight"} if model["tie_word_embeddings"] else set()
    extra = sorted(
        n for n in checkpoint if n not in wanted and n not in skipped and not _IGNORED.match(n)
    )
    if extra:
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        raise FormatError(
            f"{checkpoint.source} has tensors a {model['model_type']} model does not use: "
            f"{', '.join(extra[:3])}{more} (does config.json match the weights?)"
        )
    return plan
