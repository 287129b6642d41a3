"""Normalise a HF `config.json` into the `.cellm` model description (docs/format.md, `model`).

Every source quirk (key spellings, per-model-type defaults, hard-coded biases, RoPE scaling
rules) is resolved here, with the rules of the model's family (`cellm.families`), so the
engine only ever sees one description.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from pathlib import Path
from typing import Any, Optional

from ..errors import FormatError, UnsupportedArchitecture
from ..families import Family, ModelType, by_model_type
from ..families.base import MAX_HEAD_DIM, ConfigReader, Dims
from ..families.rope import rope_description
from .jsonfiles import read_json


def load_config(directory: Path) -> dict[str, Any]:
    """Read `config.json` of a checkpoint directory (it must exist: that is what makes it HF)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FormatError(f"{directory} has no config.json (not a HuggingFace checkpoint)")
    config = read_json(path, required=True)
    assert config is not None
    return config


def family_of(config: Mapping[str, Any], source: str = "config.json") -> Family:
    """The family of a HF config (UnsupportedArchitecture for a model type none declares)."""
    return by_model_type(config.get("model_type"), source)[0]


# HF activation names -> the engine's.
_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
    "gelu": "gelu",
}


def normalise_config(
    config: Mapping[str, Any],
    tensor_names: Optional[Container[str]] = None,
    source: str = "config.json",
    embedding_dtype: str = "F32",
    labels: Optional[Mapping[str, str]] = None,
) -> dict[str, Any]:
    """The `model` section for `config`.

    `tensor_names` (the checkpoint's tensors) lets the weights settle tying: without an
    `lm_head.weight` the model can only be tied. None means: trust the config alone.
    `embedding_dtype` is the checkpoint's embedding dtype, to which Gemma rounds its scale.
    `labels` names config keys in error messages as the source file calls them (GGUF keys).
    """
    family, model_type = by_model_type(config.get("model_type"), source)
    config = family.flat_config(config)
    r = ConfigReader(config, model_type, source, labels)
    if family.describe is not None:
        return family.describe(r)

    hidden = r.get_int("hidden_size")
    num_heads = r.get_int("num_attention_heads")
    num_layers = r.get_int("num_hidden_layers")
    num_kv_heads = r.get_int("num_key_value_heads", config.get("num_key_value_heads") or num_heads)
    head_dim = r.get_int(
        "head_dim", r.get("head_dim") or _div(hidden, num_heads, r), maximum=MAX_HEAD_DIM
    )
    if num_heads % num_kv_heads:
        raise FormatError(
            f"{source}: num_attention_heads ({num_heads}) is not a multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )
    if head_dim % 2:
        raise FormatError(f"{source}: head_dim must be even for RoPE, got {head_dim}")
    max_pos = r.get_int("max_position_embeddings")

    act_key = model_type.act_key
    act = r.get(act_key)
    if not isinstance(act, str):
        raise FormatError(f"{source}: {act_key} must be a string, got {act!r}")
    hidden_act = _ACTIVATIONS.get(act)
    if hidden_act is None:
        raise UnsupportedArchitecture(f"{source}: {act_key} {act!r} is not supported")
    layer_types = _layer_types(model_type, num_layers, r)

    attention_bias = model_type.fixed.get("attention_bias", r.get_bool("attention_bias"))
    # HF's llama-style attention passes `bias=config.attention_bias` to o_proj as well.
    attention_out_bias = model_type.fixed.get("attention_out_bias", attention_bias)
    # A config saying "untied" with no lm_head tensor can only work tied.
    tied = r.get_bool("tie_word_embeddings") or (
        tensor_names is not None and "lm_head.weight" not in tensor_names
    )

    extra: dict[str, Any] = {}
    if "sliding_attention" in layer_types:
        extra["sliding_window"] = r.get_int("sliding_window")
    if model_type.extras is not None:
        extra.update(model_type.extras(r, Dims(hidden, head_dim, max_pos, embedding_dtype)))

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
        "norm_eps": r.get_float(model_type.eps_key, positive=True),
        "max_position_embeddings": max_pos,
        "tie_word_embeddings": tied,
        "hidden_act": hidden_act,
        "attention_bias": attention_bias,
        "attention_out_bias": attention_out_bias,
        "mlp_bias": model_type.fixed.get("mlp_bias", r.get_bool("mlp_bias")),
        "qk_norm": model_type.fixed.get("qk_norm", False),
        "rope": (
            rope_description(config, model_type, head_dim, max_pos, source)
            if model_type.rotary
            else {"inv_freq": []}
        ),
        "rope_layers": (
            model_type.rope_layers(r, num_layers) if model_type.rope_layers else [True] * num_layers
        ),
        # A model type's extras may override these four.
        "embedding_multiplier": 1.0,
        "residual_multiplier": 1.0,
        "attention_scale": head_dim**-0.5,
        "logits_scale": 1.0,
        "layer_types": layer_types,
        **extra,
    }


def _layer_types(model_type: ModelType, num_layers: int, r: ConfigReader) -> list[str]:
    """Each layer's type (the config's, or as the model type derives it), checked against
    what the engine runs for it."""
    layer_types = r.config.get("layer_types")
    if layer_types is None:
        layer_types = model_type.layer_types(r, num_layers)
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise FormatError(f"{r.source}: layer_types must list one type per layer ({num_layers})")
    allowed = model_type.layer_kinds
    odd = sorted({str(t) for t in layer_types if t not in allowed})
    if odd:
        raise UnsupportedArchitecture(
            f"{r.source}: layer types {odd} are not supported for {r.config['model_type']} "
            f"(supported: {', '.join(sorted(allowed))})"
        )
    return list(layer_types)


def _div(hidden: int, heads: int, r: ConfigReader) -> int:
    if hidden % heads:
        raise FormatError(
            f"{r.source}: hidden_size ({hidden}) is not a multiple of num_attention_heads "
            f"({heads}); set head_dim"
        )
    return hidden // heads
