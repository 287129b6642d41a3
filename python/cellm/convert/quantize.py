"""Quantizing float weights at conversion (`--quantize`): GGUF block formats with ggml's
reference rounding (a converted model holds exactly the blocks llama.cpp's own quantizer would
write), and cellm's int8 per-row and int4 group-wise formats (docs/format.md). Input rows are
float32 with a length divisible by 32; output rows are bytes.

A user picks a scheme (`int8`, `int4`, `int4-affine`, or a GGUF format) and, for int4, a group
size; `stored_format` names the format that lands in the file. Groups of 32 are the GGUF
layouts q4_0 (symmetric) and q4_1 (affine), so those are written as such."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

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


def i8_row(x: np.ndarray) -> np.ndarray:
    """Whole rows: an f32 scale `max|w| / 127`, then the int8 values, rounded to nearest."""
    s = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
    qs = _round_half_away(x * _inverse(s)).clip(-127, 127).astype(np.int8)
    return np.concatenate([s.astype("<f4").view(np.uint8), qs.view(np.uint8)], axis=1)


def _int4_groups(x: np.ndarray, group: int, affine: bool) -> np.ndarray:
    """Groups of `group` values: the f16 scale (and bias), then 32-value sub-blocks of
    nibbles. Values are rounded with the f16 scale and bias the file stores."""
    g = x.reshape(-1, group)
    if affine:
        lo, hi = g.min(axis=1, keepdims=True), g.max(axis=1, keepdims=True)
        d = ((hi - lo) / np.float32(15)).astype(np.float16).astype(np.float32)
        m = lo.astype(np.float16).astype(np.float32)
        q = np.rint((g - m) * _inverse(d)).clip(0, 15).astype(np.uint8)
        head = [_f16_bytes(d), _f16_bytes(m)]
    else:
        # As q4_0: the value of largest magnitude maps to -8, so the range -8..7 is all used.
        d = (_signed_extreme(g) / np.float32(-8)).astype(np.float16).astype(np.float32)
        q = (np.rint(g * _inverse(d)) + 8).clip(0, 15).astype(np.uint8)
        head = [_f16_bytes(d)]
    packed = _pack_nibbles(q.reshape(-1, BLOCK)).reshape(len(g), -1)
    return np.concatenate([*head, packed], axis=1)


# Stored format -> (quantizer over rows, values per unit it works on): 32-value blocks for the
# GGUF formats and groups, whole rows (None) for i8_row.
_FORMATS: dict[str, tuple[Callable[[np.ndarray], np.ndarray], Optional[int]]] = {
    "q8_0": (q8_0, BLOCK),
    "q4_0": (q4_0, BLOCK),
    "q4_1": (q4_1, BLOCK),
    "q5_0": (q5_0, BLOCK),
    "i8_row": (i8_row, None),
    "i4_g64": (lambda g: _int4_groups(g, 64, False), 64),
    "i4_g128": (lambda g: _int4_groups(g, 128, False), 128),
    "i4a_g64": (lambda g: _int4_groups(g, 64, True), 64),
    "i4a_g128": (lambda g: _int4_groups(g, 128, True), 128),
}

# User-facing schemes: cellm's by kind, and the GGUF formats by name.
SCHEMES = ("int8", "int4", "int4-affine", "q8_0", "q4_0", "q4_1", "q5_0")
GROUP_SIZES = (32, 64, 128)


def stored_format(scheme: str, group_size: Optional[int] = None) -> str:
    """The file format of `scheme` (with `group_size` for int4; default 64, MLX's)."""
    if scheme not in SCHEMES:
        raise InvalidArgument(f"cannot quantize to {scheme!r} (available: {', '.join(SCHEMES)})")
    if scheme in ("int4", "int4-affine"):
        group = 64 if group_size is None else group_size
        if group not in GROUP_SIZES:
            sizes = ", ".join(map(str, GROUP_SIZES))
            raise InvalidArgument(f"--group-size must be one of {sizes}, got {group}")
        if group == 32:
            return "q4_0" if scheme == "int4" else "q4_1"
        return f"i4{'a' if scheme == 'int4-affine' else ''}_g{group}"
    if group_size is not None:
        raise InvalidArgument(f"--group-size applies to int4 and int4-affine, not {scheme}")
    return "i8_row" if scheme == "int8" else scheme


@dataclass(frozen=True)
class Quantization:
    """What `--quantize` (with `--group-size` and `--embedding`) asks of a conversion: the
    stored format of every quantizable matrix, and of the token embedding (which a tied model
    also uses as its output head). A float dtype name for `embedding` keeps it unquantized."""

    scheme: str
    group_size: Optional[int]
    matrices: str
    embedding: str

    def format_for(self, name: str, cols: int, float_dtype: str) -> str:
        """The stored format of 2-D tensor `name`, whose rows hold `cols` values."""
        fmt = self.embedding if name == EMBEDDING else self.matrices
        if fmt in FLOAT_DTYPES:
            return fmt
        return fmt if quantizable(fmt, cols) else float_dtype

    def source_record(self) -> dict[str, Any]:
        """How the file's `source` section records it."""
        out: dict[str, Any] = {"quantize": self.scheme, "embedding": self.embedding}
        if self.group_size is not None:
            out["group_size"] = self.group_size
        return out


EMBEDDING = "model.embed_tokens.weight"
EIGHT_BIT = ("i8_row", "q8_0")
FLOAT_DTYPES = ("f32", "f16", "bf16")


def plan_quantization(
    scheme: Optional[str], group_size: Optional[int] = None, embedding: Optional[str] = None
) -> Optional[Quantization]:
    """The quantization a conversion's options ask for, or None for plain float weights.
    The embedding follows 8-bit schemes; below 8 bits it stays int8, since it is also the
    output head of a tied model and the logits are where 4-bit rounding hurts most (llama.cpp
    keeps that tensor at 6 bits for the same reason). `embedding` (a scheme or a float dtype)
    overrides it."""
    if scheme is None:
        if group_size is not None or embedding is not None:
            raise InvalidArgument("--group-size and --embedding need --quantize")
        return None
    matrices = stored_format(scheme, group_size)
    if embedding is None:
        embed = matrices if matrices in EIGHT_BIT else "i8_row"
    elif embedding in FLOAT_DTYPES:
        embed = embedding
    else:
        embed = stored_format(embedding, group_size if embedding.startswith("int4") else None)
    return Quantization(scheme, group_size, matrices, embed)


def quantizable(fmt: str, cols: int) -> bool:
    """Whether rows of `cols` values split into `fmt`'s units."""
    unit = _FORMATS[fmt][1] or BLOCK
    return cols % unit == 0


def quantize_rows(x: np.ndarray, fmt: str) -> np.ndarray:
    """`rows x cols` float32 -> `rows x row bytes` of stored format `fmt`."""
    rows, cols = x.shape
    quantizer, unit = _FORMATS[fmt]
    if not quantizable(fmt, cols):
        raise InvalidArgument(f"rows of {cols} values do not split into {fmt} units")
    x = np.ascontiguousarray(x, dtype=np.float32)
    units = x if unit is None else x.reshape(-1, unit)
    return quantizer(units).reshape(rows, -1)
