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


# Per engine architecture: the tensors of one decoder layer, given its name prefix.
_LAYERS = {"llama": _llama_layer, "gemma3": _gemma3_layer}


def expected_tensors(model: Mapping[str, Any]) -> Shapes:
    """(name, shape) of every tensor the engine reads, in file order (embedding, layers, head)."""
    hidden = model["hidden_size"]
    layer = _LAYERS[model["architecture"]]
    out: Shapes = [("model.embed_tokens.weight", (model["vocab_size"], hidden))]
    for i in range(model["num_layers"]):
        out += layer(model, f"model.layers.{i}.")
    out.append(("model.norm.weight", (hidden,)))
    if not model["tie_word_embeddings"]:
        out.append(("lm_head.weight", (model["vocab_size"], hidden)))
    return out


def tensor_transform(
    model: Mapping[str, Any], name: str
) -> Optional[Callable[[np.ndarray], np.ndarray]]:
    """A float32 rewrite a tensor needs before it is stored, or None.

    Gemma's RMSNorm multiplies by `1 + w`; storing `1 + w` (computed in float32, as HF does)
    lets every family share one norm.
    """
    if model["architecture"] == "gemma3" and name.endswith("norm.weight"):
        return lambda w: w + np.float32(1.0)
    return None


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
        if info.shape != shape:
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
