"""openai/privacy-filter: a bidirectional token classifier labelling personal data in BIOES
spans (an encoder: `cellm.PrivacyFilter`, not `cellm.LLM`).

Two rewrites at conversion. Its RoPE rotates interleaved pairs (2i, 2i+1); the engine's
rotates half-split pairs (i, i + d/2), so q and k rows are reordered within each head (q.k is
unchanged when both are). Its experts are stored `x @ W` style, `[experts, in, out]`; the
engine multiplies `x W^T` by row blocks, so each becomes `[experts * out, in]`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import numpy as np

from ..errors import FormatError
from .base import MAX_HEAD_DIM, ConfigReader, Family, ModelType, Transform
from .rope import rope_description

# The HF config class's defaults (the real model's shape).
_DEFAULTS = {
    "vocab_size": 200064,
    "hidden_size": 640,
    "intermediate_size": 640,
    "num_hidden_layers": 8,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "attention_bias": True,
    "rope_theta": 150000.0,
}


def labels(r: ConfigReader) -> list[str]:
    """`id2label` as a list indexed by label id (every id from 0 present)."""
    raw = r.require("id2label")
    if not isinstance(raw, Mapping) or not raw:
        raise FormatError(f"{r.source}: id2label must be a non-empty object")
    try:
        by_id = {int(k): v for k, v in raw.items()}
    except ValueError:
        raise FormatError(f"{r.source}: id2label keys must be integers") from None
    if sorted(by_id) != list(range(len(by_id))) or not all(
        isinstance(v, str) for v in by_id.values()
    ):
        raise FormatError(f"{r.source}: id2label must name every id from 0 to {len(by_id) - 1}")
    return [by_id[i] for i in range(len(by_id))]


def describe(r: ConfigReader) -> dict[str, Any]:
    hidden = r.get_int("hidden_size")
    heads = r.get_int("num_attention_heads")
    kv_heads = r.get_int("num_key_value_heads")
    head_dim = r.get_int("head_dim", maximum=MAX_HEAD_DIM)
    if heads % kv_heads:
        raise FormatError(
            f"{r.source}: num_attention_heads ({heads}) is not a multiple of "
            f"num_key_value_heads ({kv_heads})"
        )
    max_pos = r.get_int("max_position_embeddings")
    return {
        "architecture": "openai_privacy_filter",
        "model_type": r.config["model_type"],
        "vocab_size": r.get_int("vocab_size"),
        "hidden_size": hidden,
        "num_layers": r.get_int("num_hidden_layers"),
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "norm_eps": r.get_float("rms_norm_eps", positive=True),
        "max_position_embeddings": max_pos,
        "sliding_window": r.get_int("sliding_window"),
        "attention_bias": r.get_bool("attention_bias"),
        "rope": rope_description(r.config, r.model_type, head_dim, max_pos, r.source),
        "experts": r.get_int("num_local_experts"),
        "experts_per_token": r.get_int("num_experts_per_tok"),
        "expert_intermediate_size": r.get_int("intermediate_size"),
        "swiglu_limit": r.get_float("swiglu_limit", positive=True),
        "swiglu_alpha": r.get_float("swiglu_alpha", positive=True),
        "labels": labels(r),
        "tie_word_embeddings": False,
    }


def _half_split(head_dim: int) -> np.ndarray:
    """Row order within a head that turns interleaved pairs into half-split ones."""
    return np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])


def _per_head_rows(head_dim: int) -> Transform:
    order = _half_split(head_dim)

    def permute(w: np.ndarray) -> np.ndarray:
        rows = w.reshape(-1, head_dim, *w.shape[1:]) if w.ndim > 1 else w.reshape(-1, head_dim)
        out: np.ndarray = rows[:, order].reshape(w.shape)
        return out

    return permute


def _transposed_experts(w: np.ndarray) -> np.ndarray:
    """`[experts, in, out]` -> `[experts * out, in]`."""
    out: np.ndarray = np.ascontiguousarray(w.transpose(0, 2, 1)).reshape(-1, w.shape[1])
    return out


def tensor_transform(model: Mapping[str, Any], name: str) -> Optional[Transform]:
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")) or name.endswith(
        ("self_attn.k_proj.weight", "self_attn.k_proj.bias")
    ):
        return _per_head_rows(int(model["head_dim"]))
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return _transposed_experts
    return None


def tensor_source(model: Mapping[str, Any], name: str) -> Optional[tuple[str, tuple[int, ...]]]:
    e, h, inter = model["experts"], model["hidden_size"], model["expert_intermediate_size"]
    if name.endswith("experts.gate_up_proj"):
        return name, (e, h, 2 * inter)
    if name.endswith("experts.down_proj"):
        return name, (e, inter, h)
    return None


FAMILY = Family(
    architecture="openai_privacy_filter",
    model_types={"openai_privacy_filter": ModelType(defaults=_DEFAULTS)},
    tensor_transform=tensor_transform,
    tensor_source=tensor_source,
    describe=describe,
)
