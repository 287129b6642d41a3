"""Qwen3.5: gated DeltaNet layers and gated full-attention layers (q/k norms, partial
rotary). Its RMSNorms multiply by `1 + w` (stored so), except the DeltaNet's own norm.

Checkpoints come as published (`qwen3_5`: `Qwen3_5ForConditionalGeneration`, the text model's
config in `text_config` and its tensors under `model.language_model.`) or as a text model
alone (`qwen3_5_text`). The published ones also hold a vision tower, which the engine does
not run yet: it is left out, and conversion says so."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import numpy as np

from ..errors import FormatError
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


WRAPPER = "qwen3_5"
TEXT_PREFIX = "model.language_model."


def _flat_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The published config's `text_config`, with the outer tying (the wrapper's lm_head is
    tied or not by it); a text model's config as it is."""
    if config.get("model_type") != WRAPPER:
        return dict(config)
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        raise FormatError("a qwen3_5 config needs a text_config object")
    flat = {**text, "model_type": WRAPPER}
    if "tie_word_embeddings" in config:
        flat["tie_word_embeddings"] = config["tie_word_embeddings"]
    return flat


def _checkpoint_name(model: Mapping[str, Any], name: str) -> str:
    if model["model_type"] == WRAPPER and name.startswith("model."):
        return TEXT_PREFIX + name[len("model.") :]
    return name


def _unused(model: Mapping[str, Any], name: str) -> Optional[str]:
    if model["model_type"] != WRAPPER:
        return None
    if name.startswith("model.visual."):
        return "Qwen3.5's vision tower (model.visual.*); cellm runs its text model only"
    if name.startswith("mtp."):
        return "Qwen3.5's multi-token-prediction layers (mtp.*), which decoding does not use"
    return None


_TEXT = ModelType(
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
)

FAMILY = Family(
    architecture="qwen3_5",
    model_types={"qwen3_5_text": _TEXT, WRAPPER: _TEXT},
    tensor_transform=_one_plus_norms,
    flat_config=_flat_config,
    checkpoint_name=_checkpoint_name,
    unused_tensor=_unused,
)
