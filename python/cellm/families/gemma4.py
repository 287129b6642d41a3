"""Gemma 4's text model (`gemma4_text`): Gemma 3-like layers with per-layer input embeddings,
head widths per layer, a `proportional` RoPE on full layers, KV-shared last layers and a
per-layer residual scale (the engine's `gemma4` architecture). Its RMSNorms multiply by a
plain `w`, so weights are stored as they are.

Checkpoints come as a text model (`gemma4_text`) or as published (`gemma4`:
`Gemma4ForConditionalGeneration`, the text config in `text_config`, its tensors under
`model.language_model.`); the published ones' vision and audio towers are left out (the engine
does not run them yet), and so are the K/V projections KV-shared layers never use."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Optional

from ..errors import FormatError, UnsupportedArchitecture
from .base import ConfigReader, Dims, Family, ModelType
from .gemma3 import round_to
from .rope import rope_description

# Gemma4TextConfig's RoPE when the config gives none.
DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
        "rope_theta": 1_000_000.0,
    },
}
KINDS = ("full_attention", "sliding_attention")


def _layer_types(r: ConfigReader, num_layers: int) -> list[str]:
    """Every sixth layer (1-based) is full, the rest slide; the last is always full."""
    types = r.config.get("layer_types")
    if types is None:
        types = [
            "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(num_layers)
        ]
    types = list(types)
    if types:
        types[-1] = "full_attention"  # as Gemma4TextConfig forces it
    return types


def _head_dims(r: ConfigReader, layer_types: list[str], head_dim: int, kv_heads: int) -> list[int]:
    """Each layer's head width: `per_layer_config`'s override, or, in configs without one,
    `global_head_dim` (512 by default) on full layers, as Gemma4TextConfig derives it."""
    overrides = r.config.get("per_layer_config")
    if overrides is None:
        wide = r.get_int("global_head_dim", r.config.get("global_head_dim") or 512)
        return [wide if t == "full_attention" else head_dim for t in layer_types]
    if not isinstance(overrides, Mapping):
        raise FormatError(f"{r.source}: per_layer_config must be an object, got {overrides!r}")
    dims = [head_dim] * len(layer_types)
    for key, layer in overrides.items():
        i = int(key) if isinstance(key, (int, str)) and str(key).isdigit() else -1
        if not 0 <= i < len(layer_types) or not isinstance(layer, Mapping):
            raise FormatError(f"{r.source}: per_layer_config has a bad entry {key!r}: {layer!r}")
        odd = sorted(set(layer) - {"head_dim", "num_key_value_heads"})
        if odd or layer.get("num_key_value_heads", kv_heads) != kv_heads:
            raise UnsupportedArchitecture(
                f"{r.source}: per_layer_config[{key}] overrides {sorted(layer)}; only head_dim "
                "may differ per layer"
            )
        dims[i] = r.get_int(f"per_layer_config[{key}].head_dim", layer.get("head_dim", head_dim))
    return dims


def _kv_from(r: ConfigReader, layer_types: list[str]) -> list[Optional[int]]:
    """The last `num_kv_shared_layers` layers read the cache of the last earlier layer of
    their type (Gemma4TextConfig.kv_sharing_modes)."""
    n = len(layer_types)
    shared = r.get_int("num_kv_shared_layers", minimum=0)
    if shared >= n:
        raise UnsupportedArchitecture(
            f"{r.source}: num_kv_shared_layers {shared} leaves no layer that writes a KV cache"
        )
    first = n - shared
    sources: list[Optional[int]] = [None] * n
    for i in range(first, n):
        own = [j for j in range(first) if layer_types[j] == layer_types[i]]
        if not own:
            raise FormatError(
                f"{r.source}: layer {i} shares the KV cache of a {layer_types[i]} layer, but no "
                f"layer before {first} is one"
            )
        sources[i] = own[-1]
    return sources


def _rope(r: ConfigReader, kind: str, head_dim: int, max_pos: int) -> dict[str, Any]:
    params = r.config.get("rope_parameters") or DEFAULT_ROPE
    if not isinstance(params, Mapping) or not isinstance(params.get(kind), Mapping):
        raise FormatError(f"{r.source}: rope_parameters needs a {kind!r} object")
    own = {"rope_parameters": {"full_attention": dict(params[kind])}}
    return rope_description(own, r.model_type, head_dim, max_pos, r.source)


def _extras(r: ConfigReader, dims: Dims) -> dict[str, Any]:
    config = r.config
    if r.get_bool("enable_moe_block"):
        raise UnsupportedArchitecture(f"{r.source}: Gemma 4's MoE block is not supported")
    if config.get("use_bidirectional_attention") == "all":
        raise UnsupportedArchitecture(f"{r.source}: bidirectional attention is not supported")
    num_layers = r.get_int("num_hidden_layers")
    layer_types = _layer_types(r, num_layers)
    kv_heads = r.get_int("num_key_value_heads")
    head_dims = _head_dims(r, layer_types, dims.head_dim, kv_heads)
    width = {t: {d for d, k in zip(head_dims, layer_types) if k == t} for t in KINDS}
    if any(len(w) > 1 for w in width.values()):
        raise UnsupportedArchitecture(
            f"{r.source}: layers of one type with different head widths are not supported"
        )
    kv_from = _kv_from(r, layer_types)
    inter = r.get_int("intermediate_size")
    double = r.get_bool("use_double_wide_mlp")
    out: dict[str, Any] = {
        "layer_types": layer_types,
        "head_dim": max(head_dims),
        "attention_scale": 1.0,  # q and k are RMS-normed instead
        # HF casts sqrt(hidden) to the embedding's dtype before scaling.
        "embedding_multiplier": round_to(dims.hidden**0.5, dims.embedding_dtype),
        "gemma4": {
            "head_dims": head_dims,
            "mlp_widths": [2 * inter if double and src is not None else inter for src in kv_from],
            "kv_from": kv_from,
            "values_from_keys": r.get_bool("attention_k_eq_v"),
        },
    }
    for kind, key in (("full_attention", "rope"), ("sliding_attention", "rope_local")):
        if width[kind]:
            out[key] = _rope(r, kind, width[kind].pop(), dims.max_pos)
    per_layer = config.get("hidden_size_per_layer_input", r.get("hidden_size_per_layer_input"))
    if per_layer:
        w = r.get_int("hidden_size_per_layer_input")
        vocab = r.get_int("vocab_size")
        if r.get_int("vocab_size_per_layer_input") != vocab:
            raise UnsupportedArchitecture(
                f"{r.source}: vocab_size_per_layer_input differs from vocab_size ({vocab})"
            )
        out["gemma4"]["per_layer_input"] = {
            "width": w,
            "embed_scale": round_to(w**0.5, dims.embedding_dtype),
        }
    if config.get("final_logit_softcapping") is not None:
        out["final_logit_softcap"] = r.get_float("final_logit_softcapping", positive=True)
    return out


WRAPPER = "gemma4"
TEXT_PREFIX = "model.language_model."
_SHARED_KV = re.compile(
    r"^model\.(?:language_model\.)?layers\.(\d+)\.self_attn\.(?:k_proj|v_proj|k_norm|v_norm)\."
)
_TOWERS = {
    "model.vision_tower.": "vision",
    "model.embed_vision.": "vision",
    "model.audio_tower.": "audio",
    "model.embed_audio.": "audio",
}


def _flat_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The published config's `text_config` with the outer tying (Gemma4Config ties by
    default); a text model's config as it is."""
    if config.get("model_type") != WRAPPER:
        return dict(config)
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        raise FormatError("a gemma4 config needs a text_config object")
    return {
        **text,
        "model_type": WRAPPER,
        "tie_word_embeddings": config.get("tie_word_embeddings", True),
    }


def _checkpoint_name(model: Mapping[str, Any], name: str) -> str:
    if model["model_type"] == WRAPPER and name.startswith("model."):
        return TEXT_PREFIX + name[len("model.") :]
    return name


def _unused(model: Mapping[str, Any], name: str) -> Optional[str]:
    m = _SHARED_KV.match(name)
    kv_from = model.get("gemma4", {}).get("kv_from", [])
    if m and int(m.group(1)) < len(kv_from) and kv_from[int(m.group(1))] is not None:
        return "K/V projections of KV-shared layers, which read an earlier layer's cache"
    if model["model_type"] == WRAPPER:
        for prefix, tower in _TOWERS.items():
            if name.startswith(prefix):
                return f"Gemma 4's {tower} tower; cellm runs its text model only"
    return None


_TEXT = ModelType(
    {
        "vocab_size": 262_144,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 30,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131_072,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "sliding_window": 512,
        "rope_theta": 1_000_000.0,
        "vocab_size_per_layer_input": 262_144,
        "hidden_size_per_layer_input": 256,
        "num_kv_shared_layers": 0,
    },
    # Gemma4TextAttention always norms q and k; Gemma4TextMLP has no biases.
    fixed={"mlp_bias": False, "qk_norm": True},
    layer_types=_layer_types,
    layer_kinds=frozenset(KINDS),
    act_key="hidden_activation",
    extras=_extras,
)

FAMILY = Family(
    architecture="gemma4",
    model_types={"gemma4_text": _TEXT, WRAPPER: _TEXT},
    flat_config=_flat_config,
    checkpoint_name=_checkpoint_name,
    unused_tensor=_unused,
    chat_format="gemma4",
)
