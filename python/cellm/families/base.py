"""What a family plug-in declares: how its HF `model_type`s and GGUF architectures become the
engine's model description, how its weights are rewritten on the way in, and how its chats
are formatted and parsed. The tensors themselves are the engine's to declare
(`cellm._core.expected_tensors`)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import numpy as np

from ..errors import FormatError

Transform = Callable[[np.ndarray], np.ndarray]
# Sizes and counts past this are refused (the engine's header stores u32-range sizes).
MAX_INT = 2**31 - 1
# Head widths past this are refused before RoPE tables of that size are computed.
MAX_HEAD_DIM = 1 << 16


@dataclass(frozen=True)
class Dims:
    """What config rules need to know about the model besides its config."""

    hidden: int
    head_dim: int
    max_pos: int
    embedding_dtype: str  # the checkpoint's, "F32" when unknown


class ConfigReader:
    """Typed access to config keys, falling back to the model type's defaults for absent or
    null keys; errors name the config file and the key (with its name in the source file,
    `labels`, where that differs: a GGUF file's metadata keys)."""

    def __init__(
        self,
        config: Mapping[str, Any],
        model_type: ModelType,
        source: str,
        labels: Optional[Mapping[str, str]] = None,
    ) -> None:
        self.config, self.model_type, self.source = config, model_type, source
        self.labels = labels or {}

    def name(self, key: str) -> str:
        """How error messages name config key `key`."""
        label = self.labels.get(key)
        return f"{label} ({key})" if label else key

    def get(self, key: str, default: Any = None) -> Any:
        value = self.config.get(key)
        if value is None:
            value = self.model_type.defaults.get(key, default)
        return value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise FormatError(f"{self.source} is missing {self.name(key)!r}")
        return value

    def get_int(self, key: str, value: Any = None, minimum: int = 1, maximum: int = MAX_INT) -> int:
        value = self.require(key) if value is None else value
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise FormatError(
                f"{self.source}: {self.name(key)} must be an integer >= {minimum}, got {value!r}"
            )
        if value > maximum:
            raise FormatError(
                f"{self.source}: {self.name(key)} is {value:,}, more than {maximum:,}"
            )
        return int(value)

    def get_float(self, key: str, default: Any = None, *, positive: bool = False) -> float:
        """A finite number (> 0 with `positive`)."""
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise FormatError(f"{self.source}: {self.name(key)} must be a number, got {value!r}")
        try:
            number = float(value)
        except OverflowError:  # an integer past float's range
            number = math.inf
        if not math.isfinite(number):
            raise FormatError(
                f"{self.source}: {self.name(key)} must be a finite number, got {value!r}"
            )
        if positive and not number > 0:
            raise FormatError(
                f"{self.source}: {self.name(key)} must be a number > 0, got {value!r}"
            )
        return number

    def get_bool(self, key: str, default: bool = False) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise FormatError(
                f"{self.source}: {self.name(key)} must be true or false, got {value!r}"
            )
        return value


# Each layer's type when the config has no `layer_types` (as the HF config class derives it).
LayerTypeRule = Callable[[ConfigReader, int], list[str]]
# Which layers apply RoPE (all of them when a model type has no rule).
RopeLayerRule = Callable[[ConfigReader, int], list[bool]]
# Family-specific description keys, and overrides of the common ones.
Extras = Callable[[ConfigReader, Dims], dict[str, Any]]


def full_attention(r: ConfigReader, num_layers: int) -> list[str]:
    return ["full_attention"] * num_layers


@dataclass(frozen=True)
class ModelType:
    """How one HF `model_type` maps onto its family's description.

    `defaults` are the HF config class's defaults for keys a config.json may omit; `fixed` are
    values the HF modelling code hard-codes whatever the config says.
    """

    defaults: Mapping[str, Any]
    fixed: Mapping[str, Any] = field(default_factory=dict)
    layer_types: LayerTypeRule = full_attention
    # The layer types the engine runs for this model type.
    layer_kinds: frozenset[str] = frozenset({"full_attention"})
    rope_layers: Optional[RopeLayerRule] = None
    extras: Optional[Extras] = None
    # Config keys that differ by model type.
    eps_key: str = "rms_norm_eps"
    act_key: str = "hidden_act"
    # False for models with learned positions and no rotary embedding (Whisper).
    rotary: bool = True


class MetadataGetter(Protocol):
    def __call__(self, key: str, required: bool = False) -> Any: ...


@dataclass(frozen=True)
class GGUFArch:
    """How one GGUF `general.architecture` maps onto a HF model type."""

    model_type: str
    # llama.cpp's converter `permute`s the rows of q and k (weights and biases) from HF's
    # half-split rotary layout to interleaved pairs for some architectures.
    permuted_qk: bool
    # Layer tensor names that differ from the common table in `cellm.convert.gguf_convert`.
    layer_names: Mapping[str, str] = field(default_factory=dict)
    # Whole-model tensor names (outside `blk.N.`) that differ from or add to the common table.
    global_names: Mapping[str, str] = field(default_factory=dict)
    # HF config keys the architecture's metadata holds beyond the common ones.
    config_keys: Optional[Callable[[MetadataGetter, Mapping[str, Any]], dict[str, Any]]] = None


class Checkpoint(Protocol):
    """The part of a checkpoint a family's rules may read."""

    @property
    def source(self) -> object: ...

    def __contains__(self, name: object) -> bool: ...
    def __iter__(self) -> Iterator[str]: ...
    def info(self, name: str) -> Any: ...


def _no_transform(model: Mapping[str, Any], name: str) -> Optional[Transform]:
    return None


def _same_tensor(model: Mapping[str, Any], name: str) -> Optional[tuple[str, tuple[int, ...]]]:
    return None


def _nothing_to_settle(model: dict[str, Any], checkpoint: Checkpoint) -> None:
    return None


def _same_config(config: Mapping[str, Any]) -> dict[str, Any]:
    return dict(config)


def _same_name(model: Mapping[str, Any], name: str) -> str:
    return name


def _nothing_unused(model: Mapping[str, Any], name: str) -> Optional[str]:
    return None


# An encoder family's whole description, made from its config by the family itself.
Describe = Callable[[ConfigReader], dict[str, Any]]


@dataclass(frozen=True)
class Family:
    """One engine architecture (a name in the engine's registry) and everything Python knows
    about it. A module in `cellm.families` that defines `FAMILY` is picked up by the registry.
    """

    architecture: str
    model_types: Mapping[str, ModelType]
    gguf: Mapping[str, GGUFArch] = field(default_factory=dict)
    # A float32 rewrite stored tensor `name` needs, or None.
    tensor_transform: Callable[[Mapping[str, Any], str], Optional[Transform]] = _no_transform
    # The checkpoint tensor (name, shape) a stored tensor is made from, when not itself.
    tensor_source: Callable[[Mapping[str, Any], str], Optional[tuple[str, tuple[int, ...]]]] = (
        _same_tensor
    )
    # Fills in description keys only the weights tell.
    settle_from_weights: Callable[[dict[str, Any], Checkpoint], None] = _nothing_to_settle
    # The config the description is made from: a vision-language model's `text_config`,
    # with what its rules need from the outer config.
    flat_config: Callable[[Mapping[str, Any]], dict[str, Any]] = _same_config
    # The checkpoint's name of a stored tensor (a VLM's text model sits under its own prefix).
    checkpoint_name: Callable[[Mapping[str, Any], str], str] = _same_name
    # Why a checkpoint tensor the engine does not read is left out on purpose (a tower the
    # engine does not run yet), or None: then an unread tensor is an error.
    unused_tensor: Callable[[Mapping[str, Any], str], Optional[str]] = _nothing_unused
    # The builtin chat template (`cellm.chat.BUILTIN_TEMPLATES`) for models without their own.
    chat_format: str = "chatml"
    # The family's tool-call format (a name in `cellm.tool_formats.FORMATS`), for a model
    # whose chat template names none; a template's own markers decide otherwise.
    tool_call_format: Optional[str] = None
    # Encoders (token classifiers, sentence embedders) describe themselves: their
    # description is not a decoder's, so the generic rules are skipped.
    describe: Optional[Describe] = None
