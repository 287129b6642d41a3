"""LFM2-VL: a SigLIP2 NaFlex tower, a 2x2 pixel unshuffle and a LayerNorm + MLP projector
(exact gelu) into an LFM2 text model."""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedArchitecture
from . import lfm2
from .base import Checkpoint, ConfigReader, Dims, Family, ModelType
from .vision import Renamed, flat_config, renamer, vision_section

checkpoint_name = renamer(
    "model.language_model.",
    "model.vision_tower.",
    {"connector.": "model.multi_modal_projector."},
)
# Siglip2VisionConfig's defaults.
VISION_DEFAULTS = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "num_patches": 256,
    "patch_size": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}
_LFM2 = lfm2.FAMILY.model_types["lfm2"]


def _extras(r: ConfigReader, dims: Dims) -> dict[str, Any]:
    vision = vision_section(r, "lfm2_vl", VISION_DEFAULTS)
    vc = {**VISION_DEFAULTS, **(r.config.get("vision_config") or {})}
    if r.get("projector_hidden_act") != "gelu":
        raise UnsupportedArchitecture(
            f"{r.source}: projector_hidden_act {r.get('projector_hidden_act')!r} is not supported"
        )
    vision.update(
        num_positions=vc["num_patches"],
        scale_factor=r.get_int("downsample_factor"),
        projector_hidden_size=r.get_int("projector_hidden_size"),
        projector_bias=r.get_bool("projector_bias"),
        projector_layernorm=r.get_bool("projector_use_layernorm"),
    )
    text = _LFM2.extras(r, dims) if _LFM2.extras else {}
    return {**text, "vision": vision}


def _settle_from_weights(model: dict[str, Any], checkpoint: Checkpoint) -> None:
    lfm2.FAMILY.settle_from_weights(model, Renamed(checkpoint, checkpoint_name))


FAMILY = Family(
    architecture="lfm2_vl",
    model_types={
        "lfm2_vl": ModelType(
            {
                **_LFM2.defaults,
                "image_token_id": 396,
                "downsample_factor": 2,
                "projector_hidden_size": 2560,
                "projector_hidden_act": "gelu",
                "projector_bias": True,
                "projector_use_layernorm": True,
            },
            fixed=_LFM2.fixed,
            layer_types=_LFM2.layer_types,
            layer_kinds=_LFM2.layer_kinds,
            eps_key=_LFM2.eps_key,
            extras=_extras,
        ),
    },
    settle_from_weights=_settle_from_weights,
    flat_config=flat_config("lfm2_vl"),
    checkpoint_name=lambda model, name: checkpoint_name(name),
)
