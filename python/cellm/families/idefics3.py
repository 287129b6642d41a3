"""Idefics3 (SmolVLM): a SigLIP tower over square tiles, a pixel shuffle and one linear into
a llama text model. The tower's conv patch embedding is stored as a linear over patches in
(y, x, channel) order, the layout `cellm.vision` patchifies into."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import numpy as np

from ..errors import FormatError
from . import llama
from .base import ConfigReader, Dims, Family, ModelType, Transform
from .vision import flat_config, renamer, vision_section

PATCH_EMBED = "vision.embeddings.patch_embedding.weight"
checkpoint_name = renamer(
    "model.text_model.",
    "model.vision_model.",
    {"connector.proj.": "model.connector.modality_projection.proj."},
)
# Idefics3VisionConfig's defaults.
VISION_DEFAULTS = {
    "hidden_size": 1152,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 32,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}


def _extras(r: ConfigReader, dims: Dims) -> dict[str, Any]:
    vision = vision_section(r, "idefics3", VISION_DEFAULTS)
    vc = {**VISION_DEFAULTS, **(r.config.get("vision_config") or {})}
    side, patch = vc["image_size"], vision["patch_size"]
    if not isinstance(side, int) or side % patch:
        raise FormatError(
            f"{r.source}: vision_config.image_size {side!r} is not a multiple of patch_size"
        )
    scale = r.get_int("scale_factor")
    if (side // patch) % scale:
        raise FormatError(f"{r.source}: scale_factor {scale} does not divide the patch grid")
    return {"vision": {**vision, "num_positions": (side // patch) ** 2, "scale_factor": scale}}


def _patch_embedding(model: Mapping[str, Any], name: str) -> Optional[tuple[str, tuple[int, ...]]]:
    """The conv kernel `[dim, 3, p, p]` the linear patch embedding is made from."""
    if name != PATCH_EMBED:
        return None
    v = model["vision"]
    return checkpoint_name(name), (v["hidden_size"], 3, v["patch_size"], v["patch_size"])


def _conv_as_linear(model: Mapping[str, Any], name: str) -> Optional[Transform]:
    if name != PATCH_EMBED:
        return None
    v = model["vision"]
    d, p = v["hidden_size"], v["patch_size"]
    return lambda w: np.ascontiguousarray(w.reshape(d, 3, p, p).transpose(0, 2, 3, 1)).reshape(
        d, -1
    )


_LLAMA = llama.FAMILY.model_types["llama"]

FAMILY = Family(
    architecture="idefics3",
    model_types={
        "idefics3": ModelType(
            # Idefics3Config's text default is llama with rms_norm_eps 1e-5.
            {**_LLAMA.defaults, "rms_norm_eps": 1e-5, "scale_factor": 2, "image_token_id": 128257},
            fixed=_LLAMA.fixed,
            extras=_extras,
        ),
    },
    tensor_source=_patch_embedding,
    tensor_transform=_conv_as_linear,
    flat_config=flat_config("idefics3"),
    checkpoint_name=lambda model, name: checkpoint_name(name),
)
