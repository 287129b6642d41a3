"""LFM2: gated short convolutions and attention layers (q/k norms), a SwiGLU feed-forward."""

from __future__ import annotations

from typing import Any

from ..errors import FormatError
from .base import Checkpoint, ConfigReader, Dims, Family, ModelType


def _layer_types(r: ConfigReader, num_layers: int) -> list[str]:
    """Layers listed in `full_attn_idxs` attend; the others convolve."""
    attention = r.config.get("full_attn_idxs")
    if attention is None:
        return ["full_attention"] * num_layers
    if not isinstance(attention, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in attention
    ):
        raise FormatError(f"{r.source}: full_attn_idxs must be a list of layer indices")
    chosen = set(attention)
    return ["full_attention" if i in chosen else "conv" for i in range(num_layers)]


def _extras(r: ConfigReader, dims: Dims) -> dict[str, Any]:
    """The short convolutions' kernel length and bias. (The feed-forward width comes from the
    weights: `block_auto_adjust_ff_dim` shrinks the config's `intermediate_size`.)"""
    return {"conv": {"taps": r.get_int("conv_L_cache", minimum=2), "bias": r.get_bool("conv_bias")}}


def _settle_from_weights(model: dict[str, Any], checkpoint: Checkpoint) -> None:
    """The feed-forward width, as HF's `block_auto_adjust_ff_dim` computed it."""
    name = "model.layers.0.feed_forward.w1.weight"
    if name not in checkpoint:
        raise FormatError(f"{checkpoint.source} is missing tensor {name}")
    model["intermediate_size"] = int(checkpoint.info(name).shape[0])


FAMILY = Family(
    architecture="lfm2",
    model_types={
        "lfm2": ModelType(
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
            layer_types=_layer_types,
            layer_kinds=frozenset({"full_attention", "conv"}),
            eps_key="norm_eps",
            extras=_extras,
        ),
    },
    settle_from_weights=_settle_from_weights,
)
