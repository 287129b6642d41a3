"""Tensor formats of the `.cellm` file and conversion into them, in bounded-size chunks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import InvalidArgument
from .safetensors import to_f32

# `.cellm` format name -> numpy dtype of its stored elements (bf16 kept as raw uint16 bits).
FORMAT_DTYPE: dict[str, np.dtype[Any]] = {
    "f32": np.dtype("<f4"),
    "f16": np.dtype("<f2"),
    "bf16": np.dtype("<u2"),
}
FORMATS = tuple(FORMAT_DTYPE)
# Block formats, stored as raw bytes (hence uint8 chunks): GGUF's, kept as the source's blocks,
# and cellm's int8/int4: name -> (elements per block, bytes per block). Layouts in
# docs/format.md.
BLOCK_FORMATS = {
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "q5_0": (32, 22),
    "q8_0": (32, 34),
    "q4_k": (256, 144),
    "q5_k": (256, 176),
    "q6_k": (256, 210),
    "q1_0": (128, 18),
    "i8_row": (32, 32),
    "i4_g64": (64, 34),
    "i4_g128": (128, 66),
    "i4a_g64": (64, 36),
    "i4a_g128": (128, 68),
    "i2a_g64": (64, 20),
    "i2a_g128": (128, 36),
    "i3a_g64": (64, 28),
    "i3a_g128": (128, 52),
    # The same blocks with 8 rows interleaved (interleave.py), for the engine's group kernels.
    "q8_0x8": (32, 34),
    "q4_0x8": (32, 18),
    "q4_1x8": (32, 20),
    "q5_0x8": (32, 22),
    "q4_kx8": (256, 144),
    "q6_kx8": (256, 210),
}
# Rows per group of the interleaved formats.
INTERLEAVED_ROWS = {
    name: 8 for name in ("q8_0x8", "q4_0x8", "q4_1x8", "q5_0x8", "q4_kx8", "q6_kx8")
}
# Bytes before each row's blocks (i8_row's f32 scale).
ROW_HEADER = {"i8_row": 4}

# Source dtype that already *is* a given format, so it can be copied bit for bit.
_SAME = {"F32": "f32", "F16": "f16", "BF16": "bf16"}

# Convert at most this many source bytes at once: bounds the temporaries of a large tensor
# (an embedding can be several GB) while keeping numpy's per-call overhead negligible.
CHUNK_BYTES = 32 << 20


def check_format(fmt: str) -> str:
    if fmt not in FORMAT_DTYPE:
        raise InvalidArgument(f"dtype must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return fmt


def format_nbytes(fmt: str, shape: tuple[int, ...]) -> int:
    n = int(np.prod(shape, dtype=np.int64))
    if fmt in BLOCK_FORMATS:
        block, block_bytes = BLOCK_FORMATS[fmt]
        rows = n // shape[-1] if shape and shape[-1] else 0
        return n // block * block_bytes + rows * ROW_HEADER.get(fmt, 0)
    return n * FORMAT_DTYPE[fmt].itemsize


def storage_dtype(fmt: str) -> np.dtype:
    """The dtype of the chunks a tensor of `fmt` is written as (raw bytes for block formats)."""
    return np.dtype("u1") if fmt in BLOCK_FORMATS else FORMAT_DTYPE[fmt]


def check_block_format(fmt: str, shape: tuple[int, ...]) -> None:
    """A block-format tensor's rows must hold whole blocks (blocks never cross rows)."""
    block = BLOCK_FORMATS[fmt][0]
    if len(shape) < 2 or shape[-1] % block:
        raise InvalidArgument(
            f"a {fmt} tensor needs 2+ dimensions with rows of whole {block}-element blocks, "
            f"got shape {list(shape)}"
        )
    group = INTERLEAVED_ROWS.get(fmt, 1)
    if int(np.prod(shape[:-1])) % group:
        raise InvalidArgument(f"a {fmt} tensor needs a multiple of {group} rows, got {list(shape)}")


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16) with round-to-nearest-even, NaNs kept quiet."""
    bits = np.ascontiguousarray(x, dtype="<f4").view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit rounds half-way cases to the even neighbour;
    # overflow past the largest finite value correctly becomes infinity.
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    # The rounding add could turn a NaN payload into infinity: force a quiet NaN instead.
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    out = np.where(nan, (bits >> 16) | 0x0040, rounded)
    return out.astype("<u2")


def convert(array: np.ndarray, src: str, fmt: str) -> np.ndarray:
    """Convert a stored array (`src` = F32/F16/BF16 safetensors dtype) to a `.cellm` format."""
    if _SAME.get(src) == fmt:
        return np.ascontiguousarray(array, dtype=FORMAT_DTYPE[fmt])
    if fmt == "f16" and src == "F32":
        return array.astype("<f2")
    wide = to_f32(array, src)
    if fmt == "f32":
        return np.ascontiguousarray(wide, dtype="<f4")
    if fmt == "f16":
        return wide.astype("<f2")
    return f32_to_bf16(wide)


def convert_chunks(array: np.ndarray, src: str, fmt: str) -> Iterator[np.ndarray]:
    """Yield `array` converted to `fmt`, row block by row block, in row-major order."""
    if array.ndim < 2 or array.nbytes <= CHUNK_BYTES:
        yield convert(array, src, fmt)
        return
    rows_per_chunk = max(1, CHUNK_BYTES // max(1, array[0].nbytes))
    for start in range(0, array.shape[0], rows_per_chunk):
        yield convert(array[start : start + rows_per_chunk], src, fmt)


def float32_chunks(array: np.ndarray, src: str) -> Iterator[np.ndarray]:
    """Yield `array` as float32, row block by row block (what quantizers consume)."""
    rows_per_chunk = max(1, CHUNK_BYTES // max(1, 4 * array[0].size))
    for start in range(0, array.shape[0], rows_per_chunk):
        yield to_f32(np.asarray(array[start : start + rows_per_chunk]), src)


def numpy_format(array: np.ndarray) -> str:
    """The source dtype name of an in-memory array: float32, float16 or uint16 (bf16 bits)."""
    if array.dtype == np.float32:
        return "F32"
    if array.dtype == np.float16:
        return "F16"
    if array.dtype == np.uint16:
        return "BF16"
    raise InvalidArgument(
        f"cannot store a {array.dtype} array; expected float32, float16 or uint16 bf16 bits"
    )
