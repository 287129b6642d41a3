"""RoPE from a HF config: the rope parameters in either spelling, and the inverse frequencies
computed as HF transformers' `modeling_rope_utils.py` does.

The engine applies `inv_freq` as given, so every scaling rule is resolved here at conversion.
HF works in float32 torch tensors with Python scalars cast to float32; the numpy below keeps
the same operation order and dtypes so the values match HF's to float32 precision.
One deliberate difference: `base ** x` is evaluated in float64 and rounded once to float32,
which is the correctly rounded result (torch's vectorised SLEEF powf may differ by 1 ulp).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import FormatError, UnsupportedArchitecture
from .base import ModelType

F32 = np.float32
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "proportional")
# Rope parameters that must be finite numbers where given, and those that must also be > 0.
_NUMBERS = ("low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast", "beta_slow",
            "mscale", "mscale_all_dim")  # fmt: skip
_POSITIVE = ("rope_theta", "factor")


def _pow32(base: float, exps: np.ndarray) -> np.ndarray:
    # HF casts the Python-float base to float32 before the pow.
    powers: np.ndarray = np.float64(F32(base)) ** exps.astype(np.float64)
    return powers.astype(np.float32)


def _recip(x: np.ndarray) -> np.ndarray:
    # torch implements `scalar / tensor` as `tensor.reciprocal() * scalar`.
    recip: np.ndarray = F32(1.0) / x
    return recip


def default_inv_freq(base: float, dim: int) -> np.ndarray:
    """`1 / base ** (arange(0, dim, 2) / dim)` in float32."""
    exps = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / F32(dim)
    return _recip(_pow32(base, exps))


def linear_inv_freq(base: float, dim: int, factor: float) -> np.ndarray:
    return default_inv_freq(base, dim) / F32(factor)


def dynamic_base(base: float, dim: int, factor: float, max_position_embeddings: int) -> float:
    """Dynamic NTK's base at `seq_len = max_position_embeddings` (the conversion-time length)."""
    seq_len = max_position_embeddings
    return float(
        base * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    )


def llama3_inv_freq(
    base: float,
    dim: int,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    old_context_len: int,
) -> np.ndarray:
    inv_freq = default_inv_freq(base, dim)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = _recip(inv_freq) * F32(2 * math.pi)
    # Long wavelengths (low frequencies) are divided by factor, short ones kept as is...
    inv_freq_llama = np.where(wavelen > F32(low_freq_wavelen), inv_freq / F32(factor), inv_freq)
    # ...and the band in between is interpolated with a smooth factor.
    smooth_factor = (_recip(wavelen) * F32(old_context_len) - F32(low_freq_factor)) / F32(
        high_freq_factor - low_freq_factor
    )
    smoothed = (F32(1.0) - smooth_factor) * inv_freq_llama / F32(factor)
    smoothed = smoothed + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < F32(high_freq_wavelen)) & ~(wavelen > F32(low_freq_wavelen))
    return np.where(is_medium, smoothed, inv_freq_llama).astype(np.float32)


def yarn_attention_factor(
    factor: float, attention_factor: Any, mscale: Any, mscale_all_dim: Any
) -> float:
    if attention_factor is not None:
        return float(attention_factor)

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return get_mscale(factor)


def yarn_inv_freq(
    base: float,
    dim: int,
    factor: float,
    original_max_position_embeddings: int,
    beta_fast: float = 32,
    beta_slow: float = 1,
    truncate: bool = True,
) -> np.ndarray:
    def correction_dim(num_rotations: float) -> float:
        return (
            dim * math.log(original_max_position_embeddings / (num_rotations * 2 * math.pi))
        ) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp

    exps = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / F32(dim)
    pos_freqs = _pow32(base, exps)
    inv_freq_extrapolation = _recip(pos_freqs)
    inv_freq_interpolation = _recip(F32(factor) * pos_freqs)

    ramp = (np.arange(dim // 2, dtype=np.float32) - F32(low)) / F32(high - low)
    extrapolation_factor = F32(1.0) - np.clip(ramp, F32(0.0), F32(1.0))
    blended: np.ndarray = (
        inv_freq_interpolation * (F32(1.0) - extrapolation_factor)
        + inv_freq_extrapolation * extrapolation_factor
    )
    return blended.astype(np.float32)


def proportional_inv_freq(base: float, head_dim: int, partial: float, factor: float) -> np.ndarray:
    """Gemma 4's `proportional` RoPE: the first `int(partial * head_dim // 2)` frequencies of
    a default RoPE over the whole head (exponents over `head_dim`), then zeros up to
    `head_dim / 2`, so the head still pairs dim `i` with `i + head_dim / 2`."""
    angles = int(partial * head_dim // 2)
    exps = np.arange(0, 2 * angles, 2, dtype=np.int64).astype(np.float32) / F32(head_dim)
    rotated = _recip(_pow32(base, exps))
    inv_freq = np.concatenate([rotated, np.zeros(head_dim // 2 - angles, dtype=np.float32)])
    if factor != 1.0:
        inv_freq = inv_freq / F32(factor)
    return inv_freq.astype(np.float32)


def compute_inv_freq(
    rope_type: str, params: Mapping[str, Any], dim: int, max_position_embeddings: int
) -> tuple[np.ndarray, float]:
    """(inv_freq, attention_factor) for a standardised HF rope dict (`rope_theta` filled in).

    Raises KeyError for a missing required parameter and ValueError for an unknown type; the
    caller turns those into errors that name the config file.
    """
    base = float(params["rope_theta"])
    if rope_type == "default":
        return default_inv_freq(base, dim), 1.0
    if rope_type == "linear":
        return linear_inv_freq(base, dim, float(params["factor"])), 1.0
    if rope_type == "dynamic":
        # Dynamic NTK only changes the base past max_position_embeddings; at its base length
        # the formula reduces to the default frequencies.
        new_base = dynamic_base(base, dim, float(params["factor"]), max_position_embeddings)
        return default_inv_freq(new_base, dim), 1.0
    if rope_type == "llama3":
        inv = llama3_inv_freq(
            base,
            dim,
            float(params["factor"]),
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            int(params["original_max_position_embeddings"]),
        )
        return inv, 1.0
    if rope_type == "yarn":
        original = int(params["original_max_position_embeddings"])
        factor = params["factor"]
        if factor is None:
            factor = max_position_embeddings / original
        attention = yarn_attention_factor(
            float(factor),
            params.get("attention_factor"),
            params.get("mscale"),
            params.get("mscale_all_dim"),
        )
        inv = yarn_inv_freq(
            base,
            dim,
            float(factor),
            original,
            params.get("beta_fast") or 32,
            params.get("beta_slow") or 1,
            bool(params.get("truncate", True)),
        )
        return inv, attention
    if rope_type == "proportional":
        inv = proportional_inv_freq(
            base, dim, float(params.get("partial_rotary_factor", 1.0)), float(params["factor"])
        )
        return inv, 1.0
    raise ValueError(rope_type)


def rope_parameters(
    config: Mapping[str, Any], model_type: ModelType, source: str
) -> dict[str, Any]:
    """The standardised rope dict, accepting both HF spellings.

    transformers 5 writes `rope_parameters` (with `rope_theta` inside); older configs have a
    top-level `rope_theta` plus an optional `rope_scaling` whose type key is `type` or
    `rope_type`. Like transformers 5, a non-empty `rope_scaling` wins over `rope_parameters`.
    """
    raw = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(raw, dict):
        raise FormatError(f"{source}: rope parameters must be an object, got {raw!r}")
    params = dict(raw)
    # transformers 5 may nest one dict per layer type; this is the full-attention one (a
    # family with sliding layers reads theirs itself).
    if "full_attention" in params or "sliding_attention" in params:
        nested = params.get("full_attention")
        if not isinstance(nested, dict):
            raise FormatError(f"{source}: rope parameters lack a 'full_attention' entry")
        params = dict(nested)

    params.setdefault("rope_type", params.get("type", "default"))
    defaults = model_type.defaults
    if params.get("rope_theta") is None:
        theta = config.get("rope_theta")
        params["rope_theta"] = defaults["rope_theta"] if theta is None else theta
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        # HF gives a top-level original_max_position_embeddings priority (Phi3 convention).
        if config.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        else:
            params.setdefault(
                "original_max_position_embeddings",
                config.get("max_position_embeddings") or defaults["max_position_embeddings"],
            )
    return params


def rope_description(
    config: Mapping[str, Any], model_type: ModelType, head_dim: int, max_pos: int, source: str
) -> dict[str, Any]:
    """The model description's `rope` section: type, base and the inverse frequencies of the
    rotated part of each head."""
    params = rope_parameters(config, model_type, source)
    rope_type = params["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise UnsupportedArchitecture(
            f"{source}: rope_type {rope_type!r} is not supported (supported: "
            f"{', '.join(ROPE_TYPES)})"
        )
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial is None:
        partial = model_type.defaults.get("partial_rotary_factor", 1.0)
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise FormatError(f"{source}: partial_rotary_factor must be in (0, 1], got {partial!r}")
    # HF rotates the first int(head_dim * factor) dims of each head; proportional RoPE keeps
    # the whole head, with frequency 0 past them.
    proportional = rope_type == "proportional"
    if proportional:
        params = {"factor": 1.0, **params, "partial_rotary_factor": partial}
    rotary_dim = head_dim if proportional else int(head_dim * partial)
    if rotary_dim < 2 or rotary_dim % 2:
        raise UnsupportedArchitecture(
            f"{source}: a rotary dimension of {rotary_dim} (head_dim {head_dim} x "
            f"partial_rotary_factor {partial}) is not supported (it must be even)"
        )
    _check_numbers(params, source)
    try:
        # Values that overflow or divide by zero are refused below, without numpy warnings.
        with np.errstate(all="ignore"):
            inv_freq, attention_factor = compute_inv_freq(rope_type, params, rotary_dim, max_pos)
    except KeyError as e:
        raise FormatError(f"{source}: {rope_type} rope parameters lack {e.args[0]!r}") from None
    except (TypeError, ValueError, ZeroDivisionError, OverflowError) as e:
        raise FormatError(f"{source}: invalid {rope_type} rope parameters ({e})") from None
    turned = int(partial * head_dim // 2) if proportional else len(inv_freq)
    if not (np.all(np.isfinite(inv_freq)) and np.all(inv_freq[:turned] > 0) and turned >= 1):
        raise FormatError(
            f"{source}: the {rope_type} rope parameters give inverse frequencies that are not "
            f"finite positive numbers ({_summary(params)})"
        )
    if not math.isfinite(attention_factor):
        raise FormatError(
            f"{source}: the {rope_type} rope parameters give an attention factor of "
            f"{attention_factor} ({_summary(params)})"
        )
    return {
        "type": rope_type,
        "theta": float(params["rope_theta"]),
        "inv_freq": [float(x) for x in inv_freq],
        "attention_factor": float(attention_factor),
    }


def _check_numbers(params: Mapping[str, Any], source: str) -> None:
    """The numeric rope parameters that are present: finite numbers, some of them > 0."""
    for key in (*_POSITIVE, *_NUMBERS):
        value = params.get(key)
        if value is None:
            continue
        if not _finite(value):
            raise FormatError(
                f"{source}: rope parameter {key} must be a finite number, got {value!r}"
            )
        if key in _POSITIVE and not value > 0:
            raise FormatError(f"{source}: rope parameter {key} must be > 0, got {value!r}")


def _finite(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer past float's range
        return False


def _summary(params: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} {params[k]!r}" for k in (*_POSITIVE, *_NUMBERS) if k in params)
