"""The llama-like family: llama (llama3 rope scaling), qwen2 (qkv bias), qwen3 (q/k norm,
free head_dim), granite (embedding/residual/attention multipliers, logits scaling) and
smollm3 (layers without RoPE). Their differences are config data: a new llama-like variant
is one more `ModelType` here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import FormatError
from .base import ConfigReader, Dims, Family, GGUFArch, MetadataGetter, ModelType

COMMON_DEFAULTS = {"rms_norm_eps": 1e-6, "hidden_act": "silu", "rope_theta": 10000.0}


def _sliding(r: ConfigReader) -> bool:
    return bool(r.config.get("use_sliding_window")) and r.config.get("sliding_window") is not None


# The sliding layers these rules derive are refused until a fixture checks them (the engine's
# llama loader would run them).
def qwen_layer_types(r: ConfigReader, num_layers: int) -> list[str]:
    """Qwen2/3: with `use_sliding_window`, layers from `max_window_layers` on slide."""
    if not _sliding(r):
        return ["full_attention"] * num_layers
    first = r.get_int("max_window_layers", r.config.get("max_window_layers", 28), minimum=0)
    return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]


def _smollm3_rope_layers(r: ConfigReader, num_layers: int) -> list[bool]:
    flags = r.config.get("no_rope_layers")
    if flags is None:
        # HF default: every `interval`-th layer (1-based) skips RoPE.
        interval = r.get_int("no_rope_layer_interval")
        return [(i + 1) % interval != 0 for i in range(num_layers)]
    if not isinstance(flags, list) or len(flags) != num_layers:
        raise FormatError(
            f"{r.source}: no_rope_layers must list one flag per layer ({num_layers}), got {flags!r}"
        )
    # Despite its name, a 1 in no_rope_layers means the layer *uses* RoPE.
    return [bool(x) for x in flags]


def _smollm3_layer_types(r: ConfigReader, num_layers: int) -> list[str]:
    """With `use_sliding_window`, the layers that use RoPE slide."""
    if not _sliding(r):
        return ["full_attention"] * num_layers
    uses_rope = _smollm3_rope_layers(r, num_layers)
    return ["full_attention" if rope else "sliding_attention" for rope in uses_rope]


def granite_scaling(r: ConfigReader, dims: Dims) -> dict[str, Any]:
    """Granite's embedding, residual and attention multipliers and its logits divisor."""
    return {
        "embedding_multiplier": r.get_float("embedding_multiplier", 1.0, positive=True),
        "residual_multiplier": r.get_float("residual_multiplier", 1.0, positive=True),
        "attention_scale": r.get_float("attention_multiplier", 1.0, positive=True),
        "logits_scale": 1.0 / r.get_float("logits_scaling", 1.0, positive=True),
    }


def _granite_gguf_keys(get: MetadataGetter, config: Mapping[str, Any]) -> dict[str, Any]:
    """llama.cpp's names for Granite's multipliers and logits divisor."""
    return {
        "attention_multiplier": get("attention.scale"),
        "embedding_multiplier": get("embedding_scale"),
        "residual_multiplier": get("residual_scale"),
        "logits_scaling": get("logit_scale"),
    }


# Defaults from transformers 5's config classes.
FAMILY = Family(
    architecture="llama",
    model_types={
        "llama": ModelType(
            {**COMMON_DEFAULTS, "max_position_embeddings": 2048, "tie_word_embeddings": False},
        ),
        "qwen2": ModelType(
            {**COMMON_DEFAULTS, "max_position_embeddings": 32768, "tie_word_embeddings": False},
            # Qwen2Attention builds q/k/v with bias=True and o_proj/MLP without, whatever the
            # config says.
            fixed={"attention_bias": True, "attention_out_bias": False, "mlp_bias": False},
            layer_types=qwen_layer_types,
        ),
        "qwen3": ModelType(
            {
                **COMMON_DEFAULTS,
                "max_position_embeddings": 32768,
                "tie_word_embeddings": False,
                "head_dim": 128,
            },
            fixed={"mlp_bias": False, "qk_norm": True},
            layer_types=qwen_layer_types,
        ),
        "granite": ModelType(
            {**COMMON_DEFAULTS, "max_position_embeddings": 2048, "tie_word_embeddings": False},
            extras=granite_scaling,
        ),
        "smollm3": ModelType(
            {
                **COMMON_DEFAULTS,
                "max_position_embeddings": 32768,
                "tie_word_embeddings": True,
                "rope_theta": 2000000.0,
                "no_rope_layer_interval": 4,
            },
            layer_types=_smollm3_layer_types,
            rope_layers=_smollm3_rope_layers,
        ),
    },
    gguf={
        "llama": GGUFArch("llama", permuted_qk=True),
        "qwen2": GGUFArch("qwen2", permuted_qk=False),
        # llama.cpp runs qwen3 with NEOX (half-split) RoPE, so its rows stay in HF's order;
        # granite inherits llama's permutation.
        "qwen3": GGUFArch("qwen3", permuted_qk=False),
        "granite": GGUFArch("granite", permuted_qk=True, config_keys=_granite_gguf_keys),
    },
)
