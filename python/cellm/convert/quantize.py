"""Quantizing float weights into GGUF block formats at conversion (`--quantize`), with ggml's
reference rounding, so a converted model holds exactly the blocks llama.cpp's own quantizer
would write. Input rows are float32 with a length divisible by 32; output rows are bytes."""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..errors import InvalidArgument

BLOCK = 32


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype("<f2").reshape(-1, 1).view(np.uint8)


def _round_half_away(x: np.ndarray) -> np.ndarray:
    """C's roundf: halves away from zero (numpy's round goes to even)."""
    return np.sign(x) * np.floor(np.abs(x) + np.float32(0.5))


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def _signed_extreme(b: np.ndarray) -> np.ndarray:
    """Per block, the value of largest magnitude, sign kept (the first one on a tie)."""
    return np.take_along_axis(b, np.abs(b).argmax(axis=1)[:, None], axis=1)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Values 0..15 of each 32-block -> 16 bytes: element j low, element j + 16 high."""
    return (q[:, :16] & 0x0F) | (q[:, 16:] << 4)


def q8_0(b: np.ndarray) -> np.ndarray:
    d = np.abs(b).max(axis=1, keepdims=True) / np.float32(127)
    qs = _round_half_away(b * _inverse(d)).astype(np.int8)
    return np.concatenate([_f16_bytes(d), qs.view(np.uint8)], axis=1)


def q4_0(b: np.ndarray) -> np.ndarray:
    d = _signed_extreme(b) / np.float32(-8)
    q = np.trunc(b * _inverse(d) + np.float32(8.5)).clip(0, 15).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _pack_nibbles(q)], axis=1)


def q4_1(b: np.ndarray) -> np.ndarray:
    lo, hi = b.min(axis=1, keepdims=True), b.max(axis=1, keepdims=True)
    d = (hi - lo) / np.float32(15)
    q = np.trunc((b - lo) * _inverse(d) + np.float32(0.5)).clip(0, 15).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _f16_bytes(lo), _pack_nibbles(q)], axis=1)


def q5_0(b: np.ndarray) -> np.ndarray:
    d = _signed_extreme(b) / np.float32(-16)
    q = np.trunc(b * _inverse(d) + np.float32(16.5)).clip(0, 31).astype(np.uint8)
    # The fifth bits of the 32 values, bit j for value j, as a little-endian u32.
    qh = np.packbits(q >> 4, axis=1, bitorder="little")
    return np.concatenate([_f16_bytes(d), qh, _pack_nibbles(q)], axis=1)


QUANTIZERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "q8_0": q8_0,
    "q4_0": q4_0,
    "q4_1": q4_1,
    "q5_0": q5_0,
}


def check_quantization(fmt: str) -> str:
    if fmt not in QUANTIZERS:
        raise InvalidArgument(f"cannot quantize to {fmt!r} (available: {', '.join(QUANTIZERS)})")
    return fmt


def quantize_rows(x: np.ndarray, fmt: str) -> np.ndarray:
    """`rows x cols` float32 -> `rows x (cols / 32 * block bytes)` bytes of `fmt` blocks."""
    rows, cols = x.shape
    if cols % BLOCK:
        raise InvalidArgument(f"rows of {cols} values do not split into {BLOCK}-value blocks")
    blocks = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, BLOCK)
    return QUANTIZERS[fmt](blocks).reshape(rows, -1)
