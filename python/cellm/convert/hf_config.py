"""Normalise a HF `config.json` into the `.cellm` model description (docs/format.md, `model`).

Every source quirk (key spellings, per-family defaults, hard-coded biases, RoPE scaling rules)
is resolved here so the engine only ever sees one description.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ..errors import FormatError, UnsupportedArchitecture
from .jsonfiles import read_json
from .rope import ROPE_TYPES, compute_inv_freq


@dataclass(frozen=True)
class Family:
    """How one HF `model_type` maps onto an engine family.

    `defaults` are the HF config class defaults for keys a config.json may omit; `fixed` are
    values the HF modelling code hard-codes whatever the config says.
    """

    architecture: str
    defaults: Mapping[str, Any]
    fixed: Mapping[str, Any] = field(default_factory=dict)
    # granite: embedding/residual/attention/logits multipliers from the config.
    granite_scaling: bool = False
    # smollm3: some layers skip RoPE (`no_rope_layers`).
    nope_layers: bool = False
    # How HF derives `layer_types` when the config omits it: "qwen", "smollm3", "gemma3",
    # "lfm2" or None.
    sliding_rule: Optional[str] = None
    # The layer types the engine runs for this family.
    layer_kinds: frozenset[str] = frozenset({"full_attention"})
    # Config keys that differ by family.
    eps_key: str = "rms_norm_eps"
    act_key: str = "hidden_act"
    # Family-specific description keys (and overrides of the common ones).
    extras: Optional[Callable[[_Reader, Dims], dict[str, Any]]] = None


@dataclass(frozen=True)
class Dims:
    """What family extras need to know about the model besides its config."""

    hidden: int
    head_dim: int
    max_pos: int
    embedding_dtype: str  # the checkpoint's, "F32" when unknown


def load_config(directory: Path) -> dict[str, Any]:
    """Read `config.json` of a checkpoint directory (it must exist: that is what makes it HF)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FormatError(f"{directory} has no config.json (not a HuggingFace checkpoint)")
    config = read_json(path, required=True)
    assert config is not None
    return config


def family_of(config: Mapping[str, Any], source: str = "config.json") -> Family:
    model_type = config.get("model_type")
    if model_type is None:
        raise UnsupportedArchitecture(
            f"{source} has no model_type (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise UnsupportedArchitecture(
            f"{source}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    return family


class _Reader:
    """Typed access to config keys, falling back to the family defaults for absent/null keys."""

    def __init__(self, config: Mapping[str, Any], family: Family, source: str) -> None:
        self.config, self.family, self.source = config, family, source

    def get(self, key: str, default: Any = None) -> Any:
        value = self.config.get(key)
        if value is None:
            value = self.family.defaults.get(key, default)
        return value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise FormatError(f"{self.source} is missing {key!r}")
        return value

    def get_int(self, key: str, value: Any = None, minimum: int = 1) -> int:
        value = self.require(key) if value is None else value
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise FormatError(
                f"{self.source}: {key} must be an integer >= {minimum}, got {value!r}"
            )
        return value

    def get_float(self, key: str, default: Any = None) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise FormatError(f"{self.source}: {key} must be a number, got {value!r}")
        return float(value)

    def get_bool(self, key: str, default: bool = False) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise FormatError(f"{self.source}: {key} must be true or false, got {value!r}")
        return value


# HF activation names -> the engine's.
_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
}


def normalise_config(
    config: Mapping[str, Any],
    tensor_names: Optional[Container[str]] = None,
    source: str = "config.json",
    embedding_dtype: str = "F32",
) -> dict[str, Any]:
    """The `model` section for `config`.

    `tensor_names` (the checkpoint's tensors) lets the weights settle tying: without an
    `lm_head.weight` the model can only be tied. None means: trust the config alone.
    `embedding_dtype` is the checkpoint's embedding dtype, to which Gemma rounds its scale.
    """
    family = family_of(config, source)
    r = _Reader(config, family, source)

    hidden = r.get_int("hidden_size")
    num_heads = r.get_int("num_attention_heads")
    num_layers = r.get_int("num_hidden_layers")
    num_kv_heads = r.get_int("num_key_value_heads", config.get("num_key_value_heads") or num_heads)
    head_dim = r.get_int("head_dim", r.get("head_dim") or _div(hidden, num_heads, r))
    if num_heads % num_kv_heads:
        raise FormatError(
            f"{source}: num_attention_heads ({num_heads}) is not a multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )
    if head_dim % 2:
        raise FormatError(f"{source}: head_dim must be even for RoPE, got {head_dim}")
    max_pos = r.get_int("max_position_embeddings")

    act_key = family.act_key
    hidden_act = _ACTIVATIONS.get(r.get(act_key))
    if hidden_act is None:
        raise UnsupportedArchitecture(f"{source}: {act_key} {r.get(act_key)!r} is not supported")
    layer_types = _layer_types(config, family, num_layers, r)

    attention_bias = family.fixed.get("attention_bias", r.get_bool("attention_bias"))
    # HF's llama-style attention passes `bias=config.attention_bias` to o_proj as well.
    attention_out_bias = family.fixed.get("attention_out_bias", attention_bias)
    # A config saying "untied" with no lm_head tensor can only work tied.
    tied = r.get_bool("tie_word_embeddings") or (
        tensor_names is not None and "lm_head.weight" not in tensor_names
    )

    if family.granite_scaling:
        embedding_multiplier = r.get_float("embedding_multiplier", 1.0)
        residual_multiplier = r.get_float("residual_multiplier", 1.0)
        attention_scale = r.get_float("attention_multiplier", 1.0)
        logits_scaling = r.get_float("logits_scaling", 1.0)
        if logits_scaling == 0:
            raise FormatError(f"{source}: logits_scaling must not be 0")
        logits_scale = 1.0 / logits_scaling
    else:
        embedding_multiplier = residual_multiplier = logits_scale = 1.0
        attention_scale = head_dim**-0.5
    extra: dict[str, Any] = {}
    if "sliding_attention" in layer_types:
        extra["sliding_window"] = r.get_int("sliding_window")
    if family.extras is not None:
        extra.update(family.extras(r, Dims(hidden, head_dim, max_pos, embedding_dtype)))

    return {
        "architecture": family.architecture,
        "model_type": config["model_type"],
        "vocab_size": r.get_int("vocab_size"),
        "hidden_size": hidden,
        "intermediate_size": r.get_int("intermediate_size"),
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "norm_eps": r.get_float(family.eps_key),
        "max_position_embeddings": max_pos,
        "tie_word_embeddings": tied,
        "hidden_act": hidden_act,
        "attention_bias": attention_bias,
        "attention_out_bias": attention_out_bias,
        "mlp_bias": family.fixed.get("mlp_bias", r.get_bool("mlp_bias")),
        "qk_norm": family.fixed.get("qk_norm", False),
        "rope": rope_description(config, family, head_dim, max_pos, source),
        "rope_layers": _rope_layers(config, family, num_layers, r),
        "embedding_multiplier": embedding_multiplier,
        "residual_multiplier": residual_multiplier,
        "attention_scale": attention_scale,
        "logits_scale": logits_scale,
        "layer_types": layer_types,
        **extra,
    }


def _gemma3_extras(r: _Reader, dims: Dims) -> dict[str, Any]:
    """Gemma 3's attention scale, embedding scale, local RoPE and soft-caps."""
    config = r.config
    params = config.get("rope_parameters")
    sliding = params.get("sliding_attention") if isinstance(params, dict) else None
    # Older configs give local layers a plain rope_local_base_freq and never scale them.
    local_params = dict(sliding) if isinstance(sliding, dict) else {"rope_type": "default"}
    local_params.setdefault("rope_theta", r.get_float("rope_local_base_freq"))
    local = {**config, "rope_scaling": None, "rope_parameters": {"full_attention": local_params}}
    out: dict[str, Any] = {
        "attention_scale": r.get_float("query_pre_attn_scalar") ** -0.5,
        # HF casts sqrt(hidden) to the embedding's dtype before scaling.
        "embedding_multiplier": _round_to(dims.hidden**0.5, dims.embedding_dtype),
        "rope_local": rope_description(local, r.family, dims.head_dim, dims.max_pos, r.source),
    }
    for key, name in (
        ("attn_logit_softcapping", "attn_logit_softcap"),
        ("final_logit_softcapping", "final_logit_softcap"),
    ):
        if config.get(key) is not None:
            out[name] = r.get_float(key)
    return out


def _lfm2_extras(r: _Reader, dims: Dims) -> dict[str, Any]:
    """The short convolutions' kernel length and bias. (The feed-forward width comes from the
    weights: `block_auto_adjust_ff_dim` shrinks the config's `intermediate_size`.)"""
    return {"conv": {"taps": r.get_int("conv_L_cache", minimum=2), "bias": r.get_bool("conv_bias")}}


def _qwen3_5_extras(r: _Reader, dims: Dims) -> dict[str, Any]:
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


def _deepseek_v3_extras(r: _Reader, dims: Dims) -> dict[str, Any]:
    """Multi-head latent attention and the MoE router's shape. The q/k head is `nope + rope`
    wide; RoPE covers the `rope` part (HF's `head_dim`), and yarn scaling also scales the
    softmax by mscale^2."""
    nope, rope = r.get_int("qk_nope_head_dim"), r.get_int("qk_rope_head_dim")
    # An explicit null means a plain q_proj; only an absent key takes the default rank.
    q_lora = r.config["q_lora_rank"] if "q_lora_rank" in r.config else r.get("q_lora_rank")
    if r.get_bool("attention_bias"):
        raise UnsupportedArchitecture(f"{r.source}: MLA with attention_bias is not supported")
    rope_desc = rope_description(r.config, r.family, rope, dims.max_pos, r.source)
    params = rope_parameters(r.config, r.family, r.source)
    scale = (nope + rope) ** -0.5
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        factor = float(params["factor"])
        if factor > 1:  # HF's yarn_get_mscale
            mscale = 0.1 * float(params["mscale_all_dim"]) * math.log(factor) + 1.0
            scale *= mscale * mscale
    experts = r.get_int("n_routed_experts")
    return {
        "head_dim": nope + rope,
        "rope": rope_desc,
        "attention_scale": scale,
        "mla": {
            "q_lora_rank": None if q_lora is None else r.get_int("q_lora_rank"),
            "kv_lora_rank": r.get_int("kv_lora_rank"),
            "nope_dim": nope,
            "rope_dim": rope,
            "v_dim": r.get_int("v_head_dim"),
            "rope_interleave": r.get_bool("rope_interleave"),
        },
        "moe": {
            "experts": experts,
            "experts_per_token": r.get_int("num_experts_per_tok"),
            "groups": r.get_int("n_group"),
            "groups_per_token": r.get_int("topk_group"),
            "norm_topk_prob": r.get_bool("norm_topk_prob"),
            "routed_scaling_factor": r.get_float("routed_scaling_factor"),
            "shared_experts": r.get_int("n_shared_experts", minimum=0),
            "expert_intermediate_size": r.get_int("moe_intermediate_size"),
            "first_moe_layer": r.get_int("first_k_dense_replace", minimum=0),
        },
    }


def _round_to(value: float, dtype: str) -> float:
    numpy_dtype = {"BF16": None, "F16": np.float16}.get(dtype, np.float32)
    if numpy_dtype is None:  # bfloat16: keep the top 16 bits, rounding to nearest even
        bits = int(np.array(value, dtype=np.float32).view(np.uint32))
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return float(np.array(bits, dtype=np.uint32).view(np.float32))
    return float(numpy_dtype(value))


def rope_parameters(config: Mapping[str, Any], family: Family, source: str) -> dict[str, Any]:
    """The standardised rope dict, accepting both HF spellings.

    transformers 5 writes `rope_parameters` (with `rope_theta` inside); older configs have a
    top-level `rope_theta` plus an optional `rope_scaling` whose type key is `type` or
    `rope_type`. Like transformers 5, a non-empty `rope_scaling` wins over `rope_parameters`.
    """
    raw = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(raw, dict):
        raise FormatError(f"{source}: rope parameters must be an object, got {raw!r}")
    params = dict(raw)
    # transformers 5 may nest one dict per layer type; this is the full-attention one (Gemma's
    # sliding layers get theirs in `_gemma_extras`).
    if "full_attention" in params or "sliding_attention" in params:
        nested = params.get("full_attention")
        if not isinstance(nested, dict):
            raise FormatError(f"{source}: rope parameters lack a 'full_attention' entry")
        params = dict(nested)

    params.setdefault("rope_type", params.get("type", "default"))
    if params.get("rope_theta") is None:
        theta = config.get("rope_theta")
        params["rope_theta"] = family.defaults["rope_theta"] if theta is None else theta
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        # HF gives a top-level original_max_position_embeddings priority (Phi3 convention).
        if config.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        else:
            params.setdefault(
                "original_max_position_embeddings",
                config.get("max_position_embeddings") or family.defaults["max_position_embeddings"],
            )
    return params


def rope_description(
    config: Mapping[str, Any], family: Family, head_dim: int, max_pos: int, source: str
) -> dict[str, Any]:
    params = rope_parameters(config, family, source)
    rope_type = params["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise UnsupportedArchitecture(
            f"{source}: rope_type {rope_type!r} is not supported (supported: "
            f"{', '.join(ROPE_TYPES)})"
        )
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial is None:
        partial = family.defaults.get("partial_rotary_factor", 1.0)
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise FormatError(f"{source}: partial_rotary_factor must be in (0, 1], got {partial!r}")
    # HF rotates the first int(head_dim * factor) dims of each head.
    rotary_dim = int(head_dim * partial)
    if rotary_dim < 2 or rotary_dim % 2:
        raise UnsupportedArchitecture(
            f"{source}: a rotary dimension of {rotary_dim} (head_dim {head_dim} x "
            f"partial_rotary_factor {partial}) is not supported (it must be even)"
        )
    try:
        inv_freq, attention_factor = compute_inv_freq(rope_type, params, rotary_dim, max_pos)
    except KeyError as e:
        raise FormatError(f"{source}: {rope_type} rope parameters lack {e.args[0]!r}") from None
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise FormatError(f"{source}: invalid {rope_type} rope parameters ({e})") from None
    return {
        "type": rope_type,
        "theta": float(params["rope_theta"]),
        "inv_freq": [float(x) for x in inv_freq],
        "attention_factor": float(attention_factor),
    }


def _rope_layers(
    config: Mapping[str, Any], family: Family, num_layers: int, r: _Reader
) -> list[bool]:
    if not family.nope_layers:
        return [True] * num_layers
    flags = config.get("no_rope_layers")
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


def _layer_types(
    config: Mapping[str, Any], family: Family, num_layers: int, r: _Reader
) -> list[str]:
    """Each layer's type, checked against what the family runs."""
    layer_types = config.get("layer_types")
    if layer_types is None:
        layer_types = _derived_layer_types(config, family, num_layers, r)
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise FormatError(f"{r.source}: layer_types must list one type per layer ({num_layers})")
    allowed = family.layer_kinds
    odd = sorted({str(t) for t in layer_types if t not in allowed})
    if odd:
        raise UnsupportedArchitecture(
            f"{r.source}: layer types {odd} are not supported for {config['model_type']} "
            f"(supported: {', '.join(sorted(allowed))})"
        )
    return list(layer_types)


def _derived_layer_types(
    config: Mapping[str, Any], family: Family, num_layers: int, r: _Reader
) -> list[str]:
    # Mirrors the HF config classes' __post_init__ for configs without layer_types.
    sliding = bool(config.get("use_sliding_window")) and config.get("sliding_window") is not None
    if family.sliding_rule == "qwen3_5":
        interval = config.get("full_attention_interval") or 4
        return [
            "linear_attention" if (i + 1) % interval else "full_attention"
            for i in range(num_layers)
        ]
    if family.sliding_rule == "lfm2":
        attention = config.get("full_attn_idxs")
        if attention is None:
            attention = range(num_layers)
        return ["full_attention" if i in attention else "conv" for i in range(num_layers)]
    if family.sliding_rule == "gemma3":
        pattern = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6
        return [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    if not sliding or family.sliding_rule is None:
        return ["full_attention"] * num_layers
    if family.sliding_rule == "qwen":
        max_window_layers = config.get("max_window_layers", 28)
        return [
            "sliding_attention" if i >= max_window_layers else "full_attention"
            for i in range(num_layers)
        ]
    uses_rope = _rope_layers(config, family, num_layers, r)
    return ["full_attention" if rope else "sliding_attention" for rope in uses_rope]


def _div(hidden: int, heads: int, r: _Reader) -> int:
    if hidden % heads:
        raise FormatError(
            f"{r.source}: hidden_size ({hidden}) is not a multiple of num_attention_heads "
            f"({heads}); set head_dim"
        )
    return hidden // heads


_COMMON = {"rms_norm_eps": 1e-6, "hidden_act": "silu", "rope_theta": 10000.0}

# The one model_type -> engine family table (defaults from transformers 5's config classes).
FAMILIES: dict[str, Family] = {
    "llama": Family(
        "llama",
        {**_COMMON, "max_position_embeddings": 2048, "tie_word_embeddings": False},
    ),
    "qwen2": Family(
        "llama",
        {**_COMMON, "max_position_embeddings": 32768, "tie_word_embeddings": False},
        # Qwen2Attention builds q/k/v with bias=True and o_proj/MLP without, ignoring the config.
        fixed={"attention_bias": True, "attention_out_bias": False, "mlp_bias": False},
        sliding_rule="qwen",
    ),
    "qwen3": Family(
        "llama",
        {
            **_COMMON,
            "max_position_embeddings": 32768,
            "tie_word_embeddings": False,
            "head_dim": 128,
        },
        fixed={"mlp_bias": False, "qk_norm": True},
        sliding_rule="qwen",
    ),
    "granite": Family(
        "llama",
        {**_COMMON, "max_position_embeddings": 2048, "tie_word_embeddings": False},
        granite_scaling=True,
    ),
    "smollm3": Family(
        "llama",
        {
            **_COMMON,
            "max_position_embeddings": 32768,
            "tie_word_embeddings": True,
            "rope_theta": 2000000.0,
            "no_rope_layer_interval": 4,
        },
        nope_layers=True,
        sliding_rule="smollm3",
    ),
    "gemma3_text": Family(
        "gemma3",
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
        sliding_rule="gemma3",
        layer_kinds=frozenset({"full_attention", "sliding_attention"}),
        act_key="hidden_activation",
        extras=_gemma3_extras,
    ),
    "lfm2": Family(
        "lfm2",
        {
            "norm_eps": 1e-5,
            "hidden_act": "silu",
            "max_position_embeddings": 128_000,
            "tie_word_embeddings": True,
            "rope_theta": 1_000_000.0,
            "conv_L_cache": 3,
            "conv_bias": False,
        },
        # Lfm2Attention: no biases, always q/k norms; Lfm2MLP: no biases.
        fixed={"attention_bias": False, "mlp_bias": False, "qk_norm": True},
        sliding_rule="lfm2",
        layer_kinds=frozenset({"full_attention", "conv"}),
        eps_key="norm_eps",
        extras=_lfm2_extras,
    ),
    "qwen3_5_text": Family(
        "qwen3_5",
        {
            **_COMMON,
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
        sliding_rule="qwen3_5",
        layer_kinds=frozenset({"full_attention", "linear_attention"}),
        extras=_qwen3_5_extras,
    ),
    "deepseek_v3": Family(
        "deepseek_v3",
        {
            **_COMMON,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "rope_interleave": True,
            "n_routed_experts": 256,
            "num_experts_per_tok": 8,
            "n_group": 8,
            "topk_group": 4,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "n_shared_experts": 1,
            "moe_intermediate_size": 2048,
            "first_k_dense_replace": 3,
        },
        fixed={"mlp_bias": False, "qk_norm": False, "attention_out_bias": False},
        extras=_deepseek_v3_extras,
    ),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
