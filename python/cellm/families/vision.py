"""What the vision-language families share: the text model's config and tensors live
nested in the checkpoint (`text_config`, `model.text_model.*`), and the vision tower and
connector become the description's `vision` section and the `vision.*` / `connector.*`
tensors the engine's loader asks for. (No `FAMILY`: the families are `idefics3`, `lfm2_vl`.)"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Callable

from ..errors import FormatError, UnsupportedArchitecture
from .base import Checkpoint, ConfigReader

# The outer config keys a family's rules read besides the text config.
OUTER_KEYS = (
    "vision_config",
    "image_token_id",
    "scale_factor",
    "downsample_factor",
    "projector_hidden_size",
    "projector_hidden_act",
    "projector_bias",
    "projector_use_layernorm",
)


def flat_config(model_type: str) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    """The text config, renamed `model_type`, with the outer keys and tying."""

    def flatten(config: Mapping[str, Any]) -> dict[str, Any]:
        text = config.get("text_config")
        if not isinstance(text, Mapping):
            raise FormatError(f"a {model_type} config needs a text_config object")
        flat = {**text, **{k: config[k] for k in OUTER_KEYS if k in config}}
        if "tie_word_embeddings" in config:
            flat["tie_word_embeddings"] = config["tie_word_embeddings"]
        flat["model_type"] = model_type
        return flat

    return flatten


def renamer(
    text_prefix: str, vision_prefix: str, connector: Mapping[str, str]
) -> Callable[[str], str]:
    """Stored name -> checkpoint name: `model.*` under `text_prefix`, `vision.*` under
    `vision_prefix`, `connector.*` by the `connector` table; anything else as it is."""

    def name(stored: str) -> str:
        if stored.startswith("model."):
            return text_prefix + stored[len("model.") :]
        if stored.startswith("vision."):
            return vision_prefix + stored[len("vision.") :]
        for short, full in connector.items():
            if stored.startswith(short):
                return full + stored[len(short) :]
        return stored

    return name


def vision_section(r: ConfigReader, connector: str, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The tower's shape, from `vision_config` over the HF vision config class's
    `defaults`; `num_positions` and the activation come from the caller's rules."""
    vc = r.config.get("vision_config")
    if vc is None:
        vc = {}
    if not isinstance(vc, Mapping):
        raise FormatError(f"{r.source}: vision_config must be an object")
    v = ConfigReader(
        {**defaults, **{k: x for k, x in vc.items() if x is not None}}, r.model_type, r.source
    )
    act = v.get("hidden_act")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedArchitecture(
            f"{r.source}: vision_config.hidden_act {act!r} is not supported"
        )
    heads = v.get_int("num_attention_heads")
    hidden = v.get_int("hidden_size")
    if hidden % heads:
        raise FormatError(
            f"{r.source}: vision_config.hidden_size {hidden} is not a multiple of its "
            f"num_attention_heads {heads}"
        )
    if v.get_int("num_channels") != 3:
        raise UnsupportedArchitecture(f"{r.source}: vision_config.num_channels must be 3")
    return {
        "connector": connector,
        "hidden_size": hidden,
        "intermediate_size": v.get_int("intermediate_size"),
        "num_layers": v.get_int("num_hidden_layers"),
        "num_heads": heads,
        "patch_size": v.get_int("patch_size"),
        "norm_eps": v.get_float("layer_norm_eps", positive=True),
        "image_token_id": r.get_int("image_token_id", minimum=0),
    }


class Renamed:
    """A checkpoint seen through stored names (for rules written against them)."""

    def __init__(self, checkpoint: Checkpoint, name: Callable[[str], str]) -> None:
        self.checkpoint, self.name = checkpoint, name

    @property
    def source(self) -> object:
        return self.checkpoint.source

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.name(name) in self.checkpoint

    def __iter__(self) -> Iterator[str]:
        return iter(self.checkpoint)

    def info(self, name: str) -> Any:
        return self.checkpoint.info(self.name(name))
