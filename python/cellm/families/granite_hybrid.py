"""Granite 4.0 (`granitemoehybrid`): Mamba-2 and attention layers (`layer_types`, spelled
`mamba`/`attention` in published configs), each with a shared SwiGLU MLP, and Granite's
multipliers. The dense checkpoints (no routed experts) run; the MoE ones are refused."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..errors import FormatError, UnsupportedArchitecture
from .base import ConfigReader, Dims, Family, ModelType
from .llama import COMMON_DEFAULTS, granite_scaling

# transformers' remap of the published spellings (configuration_utils._LEGACY_LAYER_TYPE_REMAP).
_SPELLINGS = {"mamba": "linear_attention", "attention": "full_attention"}


def _flat_config(config: Mapping[str, Any]) -> dict[str, Any]:
    flat = dict(config)
    types = flat.get("layer_types", flat.get("layers_block_type"))
    if isinstance(types, list):
        flat["layer_types"] = [_SPELLINGS.get(t, t) if isinstance(t, str) else t for t in types]
    return flat


def _layer_types(r: ConfigReader, num_layers: int) -> list[str]:
    """Every layer is Mamba-2 when the config lists none (GraniteMoeHybridConfig)."""
    return ["linear_attention"] * num_layers


def _rope_layers(r: ConfigReader, num_layers: int) -> list[bool]:
    """Attention layers turn q and k only with `position_embedding_type: rope`."""
    return [r.config.get("position_embedding_type") == "rope"] * num_layers


def _number(r: ConfigReader, value: Any) -> float:
    """A time-step bound: a number, or transformers 5's JSON spelling of a non-finite float
    (`{"__float__": "Infinity"}`)."""
    if isinstance(value, Mapping) and set(value) == {"__float__"}:
        value = value["__float__"]
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise FormatError(f"{r.source}: time_step_limit holds {value!r}, not a number") from None
    if math.isnan(number) or number < 0:
        raise FormatError(f"{r.source}: time_step_limit holds {value!r}")
    return number


def _extras(r: ConfigReader, dims: Dims) -> dict[str, Any]:
    experts = r.get_int("num_local_experts", minimum=0)
    if experts:
        raise UnsupportedArchitecture(
            f"{r.source}: Granite's routed experts (num_local_experts {experts}) are not "
            "supported; the dense Granite 4.0 models are"
        )
    out = {**granite_scaling(r, dims), "intermediate_size": r.get_int("shared_intermediate_size")}
    if "linear_attention" not in _flat_config(r.config).get("layer_types", ["linear_attention"]):
        return out
    if r.get(r.model_type.act_key) != "silu":
        raise UnsupportedArchitecture(f"{r.source}: Mamba-2 layers need hidden_act silu")
    heads = r.get_int("mamba_n_heads")
    inner = r.get_int("mamba_expand") * dims.hidden
    head_dim = r.get("mamba_d_head")
    head_dim = inner // heads if head_dim == "auto" else r.get_int("mamba_d_head")
    if heads * head_dim != inner:
        raise FormatError(
            f"{r.source}: mamba_n_heads * mamba_d_head ({heads} * {head_dim}) must be "
            f"mamba_expand * hidden_size ({inner})"
        )
    limit = r.get("time_step_limit") or (0.0, math.inf)
    if not isinstance(limit, (list, tuple)) or len(limit) != 2:
        raise FormatError(f"{r.source}: time_step_limit must be two numbers, got {limit!r}")
    lo, hi = (_number(r, v) for v in limit)
    out["mamba"] = {
        "heads": heads,
        "head_dim": head_dim,
        "state": r.get_int("mamba_d_state"),
        "groups": r.get_int("mamba_n_groups"),
        "conv_taps": r.get_int("mamba_d_conv"),
        "conv_bias": r.get_bool("mamba_conv_bias"),
        "proj_bias": r.get_bool("mamba_proj_bias"),
        "dt_min": lo,
        "dt_max": hi if math.isfinite(hi) else None,
    }
    return out


FAMILY = Family(
    architecture="granitemoehybrid",
    model_types={
        "granitemoehybrid": ModelType(
            {
                **COMMON_DEFAULTS,
                "max_position_embeddings": 2048,
                "tie_word_embeddings": False,
                "num_local_experts": 8,
                "shared_intermediate_size": 1024,
                "mamba_n_heads": 128,
                "mamba_n_groups": 1,
                "mamba_d_state": 256,
                "mamba_d_head": "auto",
                "mamba_d_conv": 4,
                "mamba_expand": 2,
                "mamba_conv_bias": True,
                "mamba_proj_bias": False,
            },
            # The shared MLP has no biases.
            fixed={"mlp_bias": False},
            layer_types=_layer_types,
            layer_kinds=frozenset({"full_attention", "linear_attention"}),
            rope_layers=_rope_layers,
            extras=_extras,
        ),
    },
    flat_config=_flat_config,
)
