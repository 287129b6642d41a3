"""Model families as plug-ins. Each module here that defines `FAMILY` (a `base.Family`) is one
engine architecture: its HF model types and GGUF architectures, weight rewrites, chat format
and tool-call parser. Generic code looks families up here and names none of them.

Only families the engine's registry runs (`cellm._core.architectures()`) are offered, so the
list of supported architectures has one source: the Rust registry."""

from __future__ import annotations

import importlib
import pkgutil

from .. import _core
from ..errors import UnsupportedArchitecture
from .base import Family, GGUFArch, ModelType


def _discover() -> dict[str, Family]:
    engine = set(_core.architectures())
    found: dict[str, Family] = {}
    for info in pkgutil.iter_modules(__path__):
        family = getattr(importlib.import_module(f"{__name__}.{info.name}"), "FAMILY", None)
        if isinstance(family, Family) and family.architecture in engine:
            found[family.architecture] = family
    return found


FAMILIES: dict[str, Family] = _discover()
MODEL_TYPES: dict[str, tuple[Family, ModelType]] = {
    name: (family, model_type)
    for family in FAMILIES.values()
    for name, model_type in family.model_types.items()
}
GGUF_ARCHITECTURES: dict[str, tuple[Family, GGUFArch]] = {
    name: (family, arch) for family in FAMILIES.values() for name, arch in family.gguf.items()
}
SUPPORTED_MODEL_TYPES = tuple(sorted(MODEL_TYPES))


def by_architecture(architecture: str) -> Family:
    """The family of a `.cellm` file's `model.architecture`."""
    try:
        return FAMILIES[architecture]
    except KeyError:
        raise UnsupportedArchitecture(
            f"architecture {architecture!r} is not supported "
            f"(supported: {', '.join(sorted(FAMILIES))})"
        ) from None


def by_model_type(model_type: object, source: str) -> tuple[Family, ModelType]:
    """The family and rules of a HF config's `model_type`."""
    supported = f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    if model_type is None:
        raise UnsupportedArchitecture(f"{source} has no model_type {supported}")
    found = MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
    if found is None:
        raise UnsupportedArchitecture(
            f"{source}: model_type {model_type!r} is not supported {supported}"
        )
    return found


def by_gguf_architecture(name: object, source: str) -> GGUFArch:
    """How a GGUF file's `general.architecture` maps onto a model type."""
    found = GGUF_ARCHITECTURES.get(name) if isinstance(name, str) else None
    if found is None:
        raise UnsupportedArchitecture(
            f"{source}: GGUF architecture {name!r} is not supported "
            f"(supported: {', '.join(sorted(GGUF_ARCHITECTURES))})"
        )
    return found[1]


__all__ = [
    "FAMILIES",
    "SUPPORTED_MODEL_TYPES",
    "Family",
    "GGUFArch",
    "ModelType",
    "by_architecture",
    "by_gguf_architecture",
    "by_model_type",
]
