"""LFM2: gated short convolutions and attention layers (q/k norms), a SwiGLU feed-forward."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import FormatError
from .base import Checkpoint, ConfigReader, Dims, Family, GGUFArch, MetadataGetter, ModelType


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


def _gguf_keys(get: MetadataGetter, config: Mapping[str, Any]) -> dict[str, Any]:
    """llama.cpp's lfm2 metadata: one KV head count per layer, 0 on the convolution layers
    (which is how it tells them apart), the convolution length, and the norm epsilon under
    the common key. Its `feed_forward_length` is already the adjusted width."""
    out = {
        "conv_L_cache": get("shortconv.l_cache"),
        "norm_eps": get("attention.layer_norm_rms_epsilon"),
    }
    kv_heads = get("attention.head_count_kv")
    if isinstance(kv_heads, list):
        attention = [i for i, n in enumerate(kv_heads) if n]
        out["full_attn_idxs"] = attention
        out["num_key_value_heads"] = [kv_heads[i] for i in attention] or None
    return out


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
    gguf={
        # llama.cpp runs lfm2 with NEOX (half-split) RoPE: q/k rows stay in HF's order.
        "lfm2": GGUFArch(
            "lfm2",
            permuted_qk=False,
            layer_names={
                "attn_norm": "operator_norm",
                "attn_output": "self_attn.out_proj",
                "attn_q_norm": "self_attn.q_layernorm",
                "attn_k_norm": "self_attn.k_layernorm",
                "ffn_norm": "ffn_norm",
                "ffn_gate": "feed_forward.w1",
                "ffn_up": "feed_forward.w3",
                "ffn_down": "feed_forward.w2",
                "shortconv.conv": "conv.conv",
                "shortconv.in_proj": "conv.in_proj",
                "shortconv.out_proj": "conv.out_proj",
            },
            # The final norm, named for where HF's checkpoint declares it.
            global_names={"token_embd_norm.weight": "model.embedding_norm.weight"},
            config_keys=_gguf_keys,
        ),
    },
    settle_from_weights=_settle_from_weights,
    # <|tool_call_start|>[name(key=value)]<|tool_call_end|>
    tool_call_format="lfm2",
)
