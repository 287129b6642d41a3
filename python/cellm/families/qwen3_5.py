"""Qwen3.5: gated DeltaNet layers and gated full-attention layers (q/k norms, partial
rotary). Its RMSNorms multiply by `1 + w` (stored so), except the DeltaNet's own norm."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import numpy as np

from .base import ConfigReader, Dims, Family, ModelType, Transform
from .llama import COMMON_DEFAULTS


def _layer_types(r: ConfigReader, num_layers: int) -> list[str]:
    """Every `full_attention_interval`-th layer (1-based) attends; the others are DeltaNets."""
    interval = r.config.get("full_attention_interval")
    interval = 4 if interval is None else r.get_int("full_attention_interval", interval)
    return [
        "linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)
    ]


def _extras(r: ConfigReader, dims: Dims) -> dict[str, Any]:
    """The gated DeltaNet layers' shapes; full-attention layers gate their output."""
    return {
        "attn_output_gate": True,
        "linear_attention": {
            "conv_taps": r.get_int("linear_conv_kernel_dim", minimum=2),
            "k_heads": r.get_int("linear_num_key_heads"),
            "v_heads": r.get_int("linear_num_value_heads"),
            "k_dim": r.get_int("linear_key_head_dim"),
            "v_dim": r.get_int("linear_value_head_dim"),
        },
    }


def _one_plus_norms(model: Mapping[str, Any], name: str) -> Optional[Transform]:
    # The gated DeltaNet norm is a plain `w`; the other RMSNorms are `1 + w`.
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return lambda w: w + np.float32(1.0)
    return None


FAMILY = Family(
    architecture="qwen3_5",
    model_types={
        "qwen3_5_text": ModelType(
            {
                **COMMON_DEFAULTS,
                "max_position_embeddings": 32768,
                "tie_word_embeddings": False,
                "head_dim": 256,
                "partial_rotary_factor": 0.25,
                "linear_conv_kernel_dim": 4,
                "linear_key_head_dim": 128,
                "linear_value_head_dim": 128,
                "linear_num_key_heads": 16,
                "linear_num_value_heads": 32,
            },
            # Qwen3_5Attention always has q/k norms; Qwen3_5MLP has no biases.
            fixed={"mlp_bias": False, "qk_norm": True},
            layer_types=_layer_types,
            layer_kinds=frozenset({"full_attention", "linear_attention"}),
            extras=_extras,
        ),
    },
    tensor_transform=_one_plus_norms,
)
