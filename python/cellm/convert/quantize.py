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
    rounded: np.ndarray = np.sign(x) * np.floor(np.abs(x) + np.float32(0.5))
    return rounded


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


def _seq_sum(v: np.ndarray) -> np.ndarray:
    """Row sums accumulated left to right in float32, as ggml's C loops do (numpy's own sum
    is pairwise, which rounds differently)."""
    return np.cumsum(v, axis=1, dtype=np.float32)[:, -1:]


def _make_qkx2_quants(
    x: np.ndarray, w: np.ndarray, nmax: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's make_qkx2_quants (rmin -1, rdelta 0.1, 20 steps, squared error) for each row of
    `x` (sub-blocks) with importance weights `w`: the weighted least-squares scale and min
    over 21 candidate grids. Returns (scale, -min, levels)."""
    f32 = np.float32
    lo = np.minimum(x.min(axis=1, keepdims=True), f32(0))
    hi = x.max(axis=1, keepdims=True)
    flat = hi == lo
    span = np.where(flat, f32(1), hi - lo)
    sum_w, sum_x = _seq_sum(w), _seq_sum(w * x)
    iscale = f32(nmax) / span
    levels = np.clip(np.rint(iscale * (x - lo)), 0, nmax)
    scale = f32(1) / iscale
    diff = scale * levels + lo - x
    best = _seq_sum(w * (diff * diff))
    for step in range(21):
        # ggml moves `min` to each better fit, and later grids are spanned from it.
        span = np.where(flat, f32(1), hi - lo)
        iscale = (f32(-1) + f32(0.1) * f32(step) + f32(nmax)) / span
        aux = np.clip(np.rint(iscale * (x - lo)), 0, nmax).astype(np.float32)
        sum_l, sum_l2 = _seq_sum(w * aux), _seq_sum(w * aux * aux)
        sum_xl = _seq_sum(w * aux * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        with np.errstate(divide="ignore", invalid="ignore"):
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            positive = this_min > 0
            this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
        this_min = np.where(positive, f32(0), this_min)
        diff = this_scale * aux + this_min - x
        err = _seq_sum(w * (diff * diff))
        better = (det > 0) & (err < best) & ~flat
        levels = np.where(better, aux, levels)
        best = np.where(better, err, best)
        scale = np.where(better, this_scale, scale)
        lo = np.where(better, this_min, lo)
    scale = np.where(flat, f32(0), scale)
    levels = np.where(flat, f32(0), levels)
    return scale.astype(np.float32), (-lo).astype(np.float32), levels


def q4_k(b: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q4_K_ref on 256-value super-blocks: 8 sub-blocks of 32 with 6-bit
    scales and mins relative to the super-block's f16 `d` and `dmin`."""
    f32 = np.float32
    n = len(b)
    sub = b.reshape(n * 8, 32)
    av = np.sqrt(_seq_sum(sub * sub) / f32(32))
    scales, mins, levels = _make_qkx2_quants(sub, av + np.abs(sub), 15)
    scales, mins = scales.reshape(n, 8), mins.reshape(n, 8)
    max_scale, max_min = scales.max(axis=1, keepdims=True), mins.max(axis=1, keepdims=True)
    inv_scale = np.where(max_scale > 0, f32(63) / np.where(max_scale > 0, max_scale, 1), 0)
    inv_min = np.where(max_min > 0, f32(63) / np.where(max_min > 0, max_min, 1), 0)
    ls = np.minimum(np.rint(inv_scale * scales), 63).astype(np.uint8)
    lm = np.minimum(np.rint(inv_min * mins), 63).astype(np.uint8)
    d = (max_scale / f32(63)).astype(np.float16)
    dmin = (max_min / f32(63)).astype(np.float16)
    # Levels again from the 6-bit scales actually stored (sub-blocks with d = 0 keep theirs).
    sd = d.astype(f32) * ls
    sm = dmin.astype(f32) * lm
    with np.errstate(divide="ignore", invalid="ignore"):
        again = np.clip(np.rint((b.reshape(n, 8, 32) + sm[..., None]) / sd[..., None]), 0, 15)
    levels = np.where(sd[..., None] != 0, again, levels.reshape(n, 8, 32)).astype(np.uint8)
    scale_bytes = np.zeros((n, 12), np.uint8)
    scale_bytes[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    scale_bytes[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    scale_bytes[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    q = levels.reshape(n, 4, 2, 32)  # chunks of 64: low nibbles then high nibbles
    packed = (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(n, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scale_bytes, packed], axis=1)


def q1_0(b: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q1_0_ref on 128-value blocks: `d` = mean |x| (summed left to right
    in float32), one bit per value, set where the value is >= 0."""
    d = _seq_sum(np.abs(b)) / np.float32(b.shape[1])
    bits = np.packbits(b >= 0, axis=1, bitorder="little")
    return np.concatenate([_f16_bytes(d), bits], axis=1)


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


def _pack_crumbs(q: np.ndarray) -> np.ndarray:
    """Values 0..3 of each 32-value sub-block -> 8 bytes: byte j holds values j, j + 8, j + 16,
    j + 24 in bits 0-1, 2-3, 4-5, 6-7."""
    packed: np.ndarray = q[:, 0:8] | (q[:, 8:16] << 2) | (q[:, 16:24] << 4) | (q[:, 24:32] << 6)
    return packed


def _low_bit_groups(x: np.ndarray, group: int, bits: int) -> np.ndarray:
    """cellm int2 / int3, affine (MLX style) groups of `group`: `d` = range / (2^bits - 1) and
    `m` = minimum as the f16s the file stores, values rounded with them; per 32-value
    sub-block the two low bits of each value, then (int3) the third bits as 4 bytes."""
    g = x.reshape(-1, group)
    top = 2**bits - 1
    lo, hi = g.min(axis=1, keepdims=True), g.max(axis=1, keepdims=True)
    d = ((hi - lo) / np.float32(top)).astype(np.float16).astype(np.float32)
    m = lo.astype(np.float16).astype(np.float32)
    q = np.rint((g - m) * _inverse(d)).clip(0, top).astype(np.uint8).reshape(-1, BLOCK)
    packed = _pack_crumbs(q & 3)
    if bits == 3:
        third = np.packbits(q >> 2, axis=1, bitorder="little")
        packed = np.concatenate([packed, third], axis=1)
    return np.concatenate([_f16_bytes(d), _f16_bytes(m), packed.reshape(len(g), -1)], axis=1)


# Stored format -> (quantizer over rows, values per unit it works on): 32-value blocks for the
# GGUF formats and groups, whole rows (None) for i8_row.
_FORMATS: dict[str, tuple[Callable[[np.ndarray], np.ndarray], Optional[int]]] = {
    "q8_0": (q8_0, BLOCK),
    "q4_0": (q4_0, BLOCK),
    "q4_1": (q4_1, BLOCK),
    "q5_0": (q5_0, BLOCK),
    "q4_k": (q4_k, 256),
    "q1_0": (q1_0, 128),
    "i8_row": (i8_row, None),
    "i4_g64": (lambda g: _int4_groups(g, 64, False), 64),
    "i4_g128": (lambda g: _int4_groups(g, 128, False), 128),
    "i4a_g64": (lambda g: _int4_groups(g, 64, True), 64),
    "i4a_g128": (lambda g: _int4_groups(g, 128, True), 128),
    "i2a_g64": (lambda g: _low_bit_groups(g, 64, 2), 64),
    "i2a_g128": (lambda g: _low_bit_groups(g, 128, 2), 128),
    "i3a_g64": (lambda g: _low_bit_groups(g, 64, 3), 64),
    "i3a_g128": (lambda g: _low_bit_groups(g, 128, 3), 128),
}

# User-facing schemes: cellm's by kind, and the GGUF formats by name.
SCHEMES = (
    "int8",
    "int4",
    "int4-affine",
    "int3",
    "int2",
    "q8_0",
    "q4_0",
    "q4_1",
    "q5_0",
    "q4_k",
    "q1_0",
)
GROUP_SIZES = (32, 64, 128)
# int3 and int2 are affine groups of 64 or 128 values.
LOW_BIT_GROUP_SIZES = (64, 128)


def stored_format(scheme: str, group_size: Optional[int] = None) -> str:
    """The file format of `scheme` (with `group_size` for int4, int3 and int2; default 64,
    MLX's)."""
    if scheme not in SCHEMES:
        raise InvalidArgument(f"cannot quantize to {scheme!r} (available: {', '.join(SCHEMES)})")
    if scheme in ("int3", "int2"):
        group = 64 if group_size is None else group_size
        if group not in LOW_BIT_GROUP_SIZES:
            sizes = ", ".join(map(str, LOW_BIT_GROUP_SIZES))
            raise InvalidArgument(f"--group-size for {scheme} must be one of {sizes}, got {group}")
        return f"i{scheme[-1]}a_g{group}"
    if scheme in ("int4", "int4-affine"):
        group = 64 if group_size is None else group_size
        if group not in GROUP_SIZES:
            sizes = ", ".join(map(str, GROUP_SIZES))
            raise InvalidArgument(f"--group-size must be one of {sizes}, got {group}")
        if group == 32:
            return "q4_0" if scheme == "int4" else "q4_1"
        return f"i4{'a' if scheme == 'int4-affine' else ''}_g{group}"
    if group_size is not None:
        raise InvalidArgument(
            f"--group-size applies to int4, int4-affine, int3 and int2, not {scheme}"
        )
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
        grouped = embedding.startswith(("int4", "int3", "int2"))
        embed = stored_format(embedding, group_size if grouped else None)
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
