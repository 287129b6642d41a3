"""What a model's image processor hands the engine for one image."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import FormatError


@dataclass(frozen=True)
class ProcessedImage:
    """One image as the vision encoder reads it, and the text standing for it in a prompt."""

    # (patches of every tile, 3 * patch * patch) float32, tile after tile, each row-major.
    patches: np.ndarray
    # Per tile, its patch grid (rows, columns).
    grids: tuple[tuple[int, int], ...]
    # The prompt text that replaces the image's `<image>` placeholder.
    placeholder: str
    # How many image tokens `placeholder` holds: the encoder's feature rows for the image.
    tokens: int


def section(config: Mapping[str, Any], key: str) -> dict[str, Any]:
    """`config[key]` as a dict (empty when absent)."""
    value = config.get(key) or {}
    if not isinstance(value, Mapping):
        raise FormatError(f"processor config: {key} must be an object, got {value!r}")
    return dict(value)


def int_field(config: Mapping[str, Any], key: str, default: int) -> int:
    value = config.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise FormatError(f"processor config: {key} must be an integer >= 1, got {value!r}")
    return int(value)


def floats(config: Mapping[str, Any], key: str, default: list[float]) -> list[float]:
    value = config.get(key, default)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = [value] * 3
    if not (isinstance(value, list) and len(value) == 3):
        raise FormatError(f"processor config: {key} must be 3 numbers, got {value!r}")
    return [float(v) for v in value]
