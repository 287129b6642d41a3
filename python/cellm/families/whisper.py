"""Whisper (speech to text): an audio encoder and a text decoder with learned positions and
cross-attention (`crates/cellm-models/src/whisper`). The common description fields describe
the decoder; the `whisper` section the encoder. The tensors keep HF's names; the
convolution kernels are stored tap-major for the engine's one-product convolution.

CTranslate2 directories (faster-whisper's models) are converted by
`cellm.convert.ct2_whisper`, into the same description and names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import numpy as np

from ..errors import UnsupportedArchitecture
from .base import ConfigReader, Dims, Family, ModelType, Transform

# WhisperConfig's defaults (whisper-tiny's shape, as the HF config class has them).
DEFAULTS = {
    "vocab_size": 51865,
    "num_mel_bins": 80,
    "encoder_layers": 4,
    "encoder_attention_heads": 6,
    "decoder_layers": 4,
    "decoder_attention_heads": 6,
    "decoder_ffn_dim": 1536,
    "encoder_ffn_dim": 1536,
    "d_model": 384,
    "max_source_positions": 1500,
    "max_target_positions": 448,
    "activation_function": "gelu",
    "scale_embedding": False,
    "tie_word_embeddings": True,
    # PyTorch's LayerNorm default, which Whisper uses (the config has no key for it).
    "layer_norm_eps": 1e-5,
}
CONV_NAMES = ("model.encoder.conv1.weight", "model.encoder.conv2.weight")


def flat_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The decoder's shape under the names the common rules read."""
    c = {**DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    return {
        **c,
        "hidden_size": c["d_model"],
        "num_attention_heads": c["decoder_attention_heads"],
        "num_key_value_heads": c["decoder_attention_heads"],
        "num_hidden_layers": c["decoder_layers"],
        "intermediate_size": c["decoder_ffn_dim"],
        "max_position_embeddings": c["max_target_positions"],
    }


def whisper_section(r: ConfigReader) -> dict[str, Any]:
    """The encoder's shape (the description's `whisper` section)."""
    if r.get_bool("scale_embedding"):
        raise UnsupportedArchitecture(f"{r.source}: scale_embedding true is not supported")
    return {
        "num_mel_bins": r.get_int("num_mel_bins"),
        "encoder_layers": r.get_int("encoder_layers"),
        "encoder_heads": r.get_int("encoder_attention_heads"),
        "encoder_ffn_dim": r.get_int("encoder_ffn_dim"),
        "source_positions": r.get_int("max_source_positions"),
    }


def _extras(r: ConfigReader, dims: Dims) -> dict[str, Any]:
    return {"whisper": whisper_section(r)}


def conv_source(model: Mapping[str, Any], name: str) -> Optional[tuple[str, tuple[int, ...]]]:
    """A convolution kernel comes from PyTorch's `out x in x taps` tensor."""
    if name not in CONV_NAMES:
        return None
    d = model["hidden_size"]
    inp = model["whisper"]["num_mel_bins"] if name == CONV_NAMES[0] else d
    return name, (d, inp, 3)


def conv_transform(model: Mapping[str, Any], name: str) -> Optional[Transform]:
    """`out x in x taps` -> `out x (taps * in)`, tap-major (each tap's input frame whole)."""
    source = conv_source(model, name)
    if source is None:
        return None
    out, inp, taps = source[1]

    def tap_major(w: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(w.reshape(out, inp, taps).transpose(0, 2, 1)).reshape(
            out, taps * inp
        )

    return tap_major


FAMILY = Family(
    architecture="whisper",
    model_types={
        "whisper": ModelType(
            DEFAULTS,
            fixed={"attention_bias": True, "attention_out_bias": True, "mlp_bias": True},
            extras=_extras,
            eps_key="layer_norm_eps",
            act_key="activation_function",
            rotary=False,
        ),
    },
    tensor_transform=conv_transform,
    tensor_source=conv_source,
    flat_config=flat_config,
)
