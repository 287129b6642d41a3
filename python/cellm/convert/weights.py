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


# Per engine architecture: the tensors of one decoder layer, given its name prefix and type.
_LAYERS: dict[str, Callable[[Mapping[str, Any], str, str], Shapes]] = {
    "llama": lambda model, p, _: _llama_layer(model, p),
    "gemma3": lambda model, p, _: _gemma3_layer(model, p),
    "lfm2": _lfm2_layer,
    "qwen3_5": _qwen3_5_layer,
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
        out += layer(model, f"model.layers.{i}.", kind)
    out.append((_FINAL_NORM.get(arch, "model.norm.weight"), (hidden,)))
    if not model["tie_word_embeddings"]:
        out.append(("lm_head.weight", (model["vocab_size"], hidden)))
    return out


def tensor_transform(
    model: Mapping[str, Any], name: str
) -> Optional[Callable[[np.ndarray], np.ndarray]]:
    """A float32 rewrite a tensor needs before it is stored, or None.

    Gemma's and Qwen3.5's RMSNorms multiply by `1 + w`; storing `1 + w` (computed in float32,
    as HF does) lets every family share one norm.
    """
    one_plus = model["architecture"] == "gemma3" or (
        # Qwen3.5's gated DeltaNet norm is a plain `w`; its other RMSNorms are `1 + w`.
        model["architecture"] == "qwen3_5" and not name.endswith("linear_attn.norm.weight")
    )
    if one_plus and name.endswith("norm.weight"):
        return lambda w: w + np.float32(1.0)
    return None


def stored_as_f32(name: str, shape: tuple[int, ...]) -> bool:
    """Tensors kept in f32 whatever the requested dtype: vectors (norms, biases) are tiny and
    precision-sensitive, and the engine reads convolution kernels as f32."""
    return len(shape) == 1 or name.endswith(("conv.conv.weight", "conv1d.weight"))


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
    for name, shape in plan:
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
    wanted = {name for name, _ in plan}
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
