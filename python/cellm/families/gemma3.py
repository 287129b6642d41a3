"""Gemma 3 (`gemma3_text`): interleaved sliding and full layers with their own RoPE, q/k
norms, sandwich norms, a gelu-tanh MLP, a sqrt(hidden) embedding scale and optional
soft-caps. Its RMSNorm multiplies by `1 + w`, which conversion stores."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import numpy as np

from .base import ConfigReader, Dims, Family, GGUFArch, MetadataGetter, ModelType, Transform
from .rope import rope_description


def _layer_types(r: ConfigReader, num_layers: int) -> list[str]:
    """Every `sliding_window_pattern`-th layer (1-based) is full, the rest slide."""
    config = r.config
    pattern = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6
    pattern = r.get_int("sliding_window_pattern", pattern)
    return [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
    ]


def _extras(r: ConfigReader, dims: Dims) -> dict[str, Any]:
    """The attention scale, embedding scale, local RoPE and soft-caps."""
    config = r.config
    params = config.get("rope_parameters")
    sliding = params.get("sliding_attention") if isinstance(params, dict) else None
    # Older configs give local layers a plain rope_local_base_freq and never scale them.
    local_params = dict(sliding) if isinstance(sliding, dict) else {"rope_type": "default"}
    local_params.setdefault("rope_theta", r.get_float("rope_local_base_freq", positive=True))
    local = {**config, "rope_scaling": None, "rope_parameters": {"full_attention": local_params}}
    out: dict[str, Any] = {
        "attention_scale": r.get_float("query_pre_attn_scalar", positive=True) ** -0.5,
        # HF casts sqrt(hidden) to the embedding's dtype before scaling.
        "embedding_multiplier": round_to(dims.hidden**0.5, dims.embedding_dtype),
        "rope_local": rope_description(local, r.model_type, dims.head_dim, dims.max_pos, r.source),
    }
    for key, name in (
        ("attn_logit_softcapping", "attn_logit_softcap"),
        ("final_logit_softcapping", "final_logit_softcap"),
    ):
        if config.get(key) is not None:
            out[name] = r.get_float(key, positive=True)
    return out


def round_to(value: float, dtype: str) -> float:
    """`value` as the checkpoint's dtype `dtype` holds it (HF casts Gemma's scales so)."""
    numpy_dtype = {"BF16": None, "F16": np.float16}.get(dtype, np.float32)
    if numpy_dtype is None:  # bfloat16: keep the top 16 bits, rounding to nearest even
        bits = int(np.array(value, dtype=np.float32).view(np.uint32))
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return float(np.array(bits, dtype=np.uint32).view(np.float32))
    return float(numpy_dtype(value))


def _one_plus_norms(model: Mapping[str, Any], name: str) -> Optional[Transform]:
    """`1 + w` for every RMSNorm (computed in float32, as HF does), so the engine shares one
    norm with the other families."""
    if name.endswith("norm.weight"):
        return lambda w: w + np.float32(1.0)
    return None


def _gguf_keys(get: MetadataGetter, config: Mapping[str, Any]) -> dict[str, Any]:
    """What llama.cpp's gemma3 loader reads or hard-codes: the window and its layer pattern
    (every 6th layer full unless `attention.sliding_window_pattern` says otherwise), local
    layers' RoPE base (10000), attention scaled by 1/sqrt(head_dim), optional soft-caps.
    `config` holds the keys read so far, with the implied `head_dim`."""
    pattern = get("attention.sliding_window_pattern")
    layer_types = None
    if isinstance(pattern, list):  # one flag per layer, true = sliding
        layer_types = ["sliding_attention" if p else "full_attention" for p in pattern]
    return {
        "sliding_window": get("attention.sliding_window"),
        "sliding_window_pattern": pattern if isinstance(pattern, int) else None,
        "layer_types": layer_types,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": config["head_dim"],
        "attn_logit_softcapping": get("attn_logit_softcapping"),
        "final_logit_softcapping": get("final_logit_softcapping"),
    }


FAMILY = Family(
    architecture="gemma3",
    model_types={
        "gemma3_text": ModelType(
            {
                "rms_norm_eps": 1e-6,
                "hidden_activation": "gelu_pytorch_tanh",
                "max_position_embeddings": 131072,
                "tie_word_embeddings": True,
                "head_dim": 256,
                "query_pre_attn_scalar": 256,
                "sliding_window": 4096,
                "rope_theta": 1_000_000.0,
                "rope_local_base_freq": 10_000.0,
            },
            # Gemma3Attention always has q/k norms; its MLP has no biases.
            fixed={"mlp_bias": False, "qk_norm": True},
            layer_types=_layer_types,
            layer_kinds=frozenset({"full_attention", "sliding_attention"}),
            act_key="hidden_activation",
            extras=_extras,
        ),
    },
    gguf={
        # llama.cpp's Gemma3Model stores norms with the `1 + w` already added, as cellm does.
        "gemma3": GGUFArch(
            "gemma3_text",
            permuted_qk=False,
            layer_names={
                "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm",
            },
            config_keys=_gguf_keys,
        ),
    },
    tensor_transform=_one_plus_norms,
    chat_format="gemma",
    # FunctionGemma (a gemma3_text checkpoint) writes `<start_function_call>call:...`.
    tool_call_format="functiongemma",
)
