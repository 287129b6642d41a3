"""Row-interleaved block formats (`q8_0x8`, `q4_0x8`, `q4_1x8`, `q5_0x8`, `q4_kx8`, `q6_kx8`;
docs/format.md).

The converter stores matrices of these block formats with 8 rows interleaved so the engine's
group kernels read 4 quants of 8 rows per load. The bytes are the source blocks, permuted:
per group of 8 rows and block column, the f16 fields field by field (each for rows 0..8),
then the rest of each block (q5_0: `qh`, then `qs`; q4_k: `scales`, then `qs`; q6_k: `ql`,
`qh`, `scales`) in 4-byte chunks, chunk by chunk (each for rows 0..8).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .dtypes import BLOCK_FORMATS
from .writer import TensorEntry

ROWS = 8
# Source format -> (interleaved format, bytes of f16 fields, their offset in a source block).
VARIANTS = {
    "q8_0": ("q8_0x8", 2, 0),
    "q4_0": ("q4_0x8", 2, 0),
    "q4_1": ("q4_1x8", 4, 0),
    "q5_0": ("q5_0x8", 2, 0),
    "q4_k": ("q4_kx8", 4, 0),
    "q6_k": ("q6_kx8", 2, 208),  # q6_k's `d` comes last in its block, first in the column
}
SOURCE = {x8: src for src, (x8, _, _) in VARIANTS.items()}


def interleavable(fmt: str, shape: tuple[int, ...]) -> bool:
    rows = int(np.prod(shape[:-1])) if len(shape) >= 2 else 0
    return fmt in VARIANTS and rows > 0 and rows % ROWS == 0


def interleave_rows(raw: np.ndarray, fmt: str) -> np.ndarray:
    """`raw` (rows x row bytes, uint8, rows a multiple of 8) in `fmt`, as its x8 layout."""
    rows, row_bytes = raw.shape
    _, head, at = VARIANTS[fmt]
    block_bytes = BLOCK_FORMATS[fmt][1]
    g, cols = rows // ROWS, row_bytes // block_bytes
    blocks = raw.reshape(g, ROWS, cols, block_bytes)
    fields = blocks[..., at : at + head].reshape(g, ROWS, cols, head // 2, 2)
    rest = np.concatenate([blocks[..., :at], blocks[..., at + head :]], axis=3)
    rest = rest.reshape(g, ROWS, cols, (block_bytes - head) // 4, 4)
    # -> group, column, field/chunk, row, bytes
    fields = fields.transpose(0, 2, 3, 1, 4).reshape(g, cols, -1)
    rest = rest.transpose(0, 2, 3, 1, 4).reshape(g, cols, -1)
    return np.concatenate([fields, rest], axis=2).reshape(rows, row_bytes)


def deinterleave_rows(raw: np.ndarray, x8: str) -> np.ndarray:
    """The inverse of `interleave_rows`: an x8 tensor's bytes back as `rows x row bytes` of
    its source format."""
    fmt = SOURCE[x8]
    rows, row_bytes = raw.shape
    _, head, at = VARIANTS[fmt]
    block_bytes = BLOCK_FORMATS[fmt][1]
    g, cols = rows // ROWS, row_bytes // block_bytes
    columns = raw.reshape(g, cols, ROWS * block_bytes)
    fields = columns[..., : ROWS * head].reshape(g, cols, head // 2, ROWS, 2)
    rest = columns[..., ROWS * head :].reshape(g, cols, (block_bytes - head) // 4, ROWS, 4)
    # -> group, row, column, field/chunk, bytes
    fields = fields.transpose(0, 3, 1, 2, 4).reshape(g, ROWS, cols, head)
    rest = rest.transpose(0, 3, 1, 2, 4).reshape(g, ROWS, cols, -1)
    blocks = np.concatenate([rest[..., :at], fields, rest[..., at:]], axis=3)
    return blocks.reshape(rows, row_bytes)


def interleaved_chunks(
    chunks: Iterator[np.ndarray], fmt: str, row_bytes: int
) -> Iterator[np.ndarray]:
    """Re-chunks a stream of `fmt` rows into whole groups of 8 and interleaves each."""
    pending = np.zeros((0, row_bytes), dtype=np.uint8)
    for chunk in chunks:
        rows = np.ascontiguousarray(chunk).view(np.uint8).reshape(-1, row_bytes)
        pending = np.concatenate([pending, rows]) if len(pending) else rows
        whole = len(pending) - len(pending) % ROWS
        if whole:
            yield interleave_rows(pending[:whole], fmt).reshape(-1)
            pending = pending[whole:]
    if len(pending):
        raise ValueError(f"{len(pending)} rows left over after whole groups of {ROWS}")


def interleaved(entry: TensorEntry) -> TensorEntry:
    """`entry` in its format's x8 layout when it has one and its rows form whole groups; the
    engine reads both layouts, the x8 one with faster kernels."""
    if not interleavable(entry.format, entry.shape):
        return entry
    src = entry
    row_bytes = src.nbytes // int(np.prod(src.shape[:-1]))
    return TensorEntry(
        src.name,
        VARIANTS[src.format][0],
        src.shape,
        lambda: interleaved_chunks(iter(src.chunks()), src.format, row_bytes),
        src.params,
    )
