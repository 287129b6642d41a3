"""A reader for GGUF files (versions 2 and 3): metadata, tensor infos and zero-copy data views.

Layout: magic `GGUF`, u32 version, u64 tensor count, u64 metadata count, the metadata
key/values, the tensor infos, padding to `general.alignment` (default 32), then the data.
Tensor dims are stored innermost first; `GGUFTensor.shape` is the row-major (PyTorch) order.
"""

from __future__ import annotations

import math
import mmap
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np

from ..errors import FormatError, UnsupportedArchitecture

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# Metadata arrays nest arrays at most this deep (real files: 1; llama.cpp's own limit is 1 too
# for most keys); deeper is a corrupted or hostile file, not a recursion to follow.
MAX_ARRAY_DEPTH = 4
# ggml tensors have at most 4 dimensions (GGML_MAX_DIMS).
MAX_DIMS = 4

# Metadata value types: id -> struct code (scalars); 8 = string, 9 = array.
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
# Numeric arrays are returned as numpy arrays (token scores and types can be 150k long).
_NUMPY = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "u1",
          10: "<u8", 11: "<i8", 12: "<f8"}  # fmt: skip

# ggml tensor types: id -> (cellm format name, elements per block, bytes per block).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("f32", 1, 4),
    1: ("f16", 1, 2),
    2: ("q4_0", 32, 18),
    3: ("q4_1", 32, 20),
    6: ("q5_0", 32, 22),
    8: ("q8_0", 32, 34),
    12: ("q4_k", 256, 144),
    13: ("q5_k", 256, 176),
    14: ("q6_k", 256, 210),
    30: ("bf16", 1, 2),
    # ggml's Q1_0 (1 bit + an f16 scale per 128); PrismML's fork gave its Q1_0_g128 the same
    # id and layout, so Bonsai's GGUFs read as this.
    41: ("q1_0", 128, 18),
}
_GGML_NAMES = {7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 15: "Q8_K", 16: "IQ2_XXS",
               17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
               23: "IQ4_XS", 29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
               40: "NVFP4"}  # fmt: skip


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # row-major: shape[-1] is the contiguous row length
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def format(self) -> str:
        return GGML_TYPES[self.ggml_type][0]


class _Cursor:
    """Sequential little-endian reads with truncation errors instead of struct.error."""

    def __init__(self, buf: Any, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise FormatError(f"{self.path}: truncated GGUF header (at byte {self.pos})")
        view = memoryview(self.buf)[self.pos : self.pos + n]
        self.pos += n
        return view

    def scalar(self, code: str) -> Any:
        return struct.unpack("<" + code, self.take(struct.calcsize(code)))[0]

    def string(self) -> str:
        raw = self.take(self.scalar("Q"))
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError(f"{self.path}: a GGUF string is not UTF-8") from None

    def count(self, n: int, item_bytes: int, what: str) -> int:
        """`n`, checked against the bytes left: each of the `n` items takes `item_bytes` or
        more, so a count the file cannot hold is refused at once, not read item by item."""
        left = len(self.buf) - self.pos
        if n * item_bytes > left:
            raise FormatError(
                f"{self.path}: {what} claims {n:,} items, but only {left:,} bytes follow "
                "(truncated or corrupted GGUF file)"
            )
        return n

    def value(self, vtype: int, key: str, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise FormatError(
                    f"{self.path}: GGUF metadata {key} nests arrays more than "
                    f"{MAX_ARRAY_DEPTH} deep"
                )
            item = self.scalar("I")
            count = self.scalar("Q")
            if item in _NUMPY:
                dt = np.dtype(_NUMPY[item])
                self.count(count, dt.itemsize, f"GGUF metadata array {key}")
                # A copy: views would pin the mmap open (close() raises BufferError).
                arr = np.frombuffer(self.take(count * dt.itemsize), dtype=dt)
                return arr.astype(bool) if item == 7 else arr.copy()
            if item not in (_STRING, _ARRAY):
                raise FormatError(
                    f"{self.path}: GGUF metadata {key} has unknown array item type {item}"
                )
            # Strings take 8 bytes or more (their length), arrays 12 (item type and count).
            self.count(count, 8 if item == _STRING else 12, f"GGUF metadata array {key}")
            return [self.value(item, key, depth + 1) for _ in range(count)]
        raise FormatError(f"{self.path}: GGUF metadata {key} has unknown value type {vtype}")


class GGUFFile:
    """An mmap'd GGUF file. `metadata` maps keys to values; `tensors` maps names to infos."""

    def __init__(self, path: Union[str, os.PathLike[str]]) -> None:
        self.path = Path(path)
        self._map = self._open()
        try:
            self._parse()
        except BaseException:
            try:
                self.close()
            except BufferError:  # a view in the traceback: the map closes when it goes
                pass
            raise

    def _open(self) -> mmap.mmap:
        # Non-blocking, and checked before mapping: a named pipe must not hang the open().
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            raise FormatError(f"{self.path}: no such file or directory") from None
        except OSError as e:
            raise FormatError(f"{self.path}: cannot read: {e.strerror or e}") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise FormatError(f"{self.path} is not a regular file")
            return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except ValueError:  # mmap of an empty file
            raise FormatError(f"{self.path}: empty file, not GGUF") from None
        finally:
            os.close(fd)

    def _parse(self) -> None:
        cur = _Cursor(self._map, self.path)
        if len(self._map) < 4 or bytes(cur.take(4)) != MAGIC:
            raise FormatError(f"{self.path}: not a GGUF file (bad magic)")
        self.version = cur.scalar("I")
        if self.version not in (2, 3):
            raise FormatError(f"{self.path}: GGUF version {self.version} is not supported (2, 3)")
        n_tensors, n_kv = cur.scalar("Q"), cur.scalar("Q")
        # A key/value takes 13 bytes or more, a tensor info 24.
        cur.count(n_kv, 13, "the GGUF metadata count")
        cur.count(n_tensors, 24, "the GGUF tensor count")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar("I"), key)
        infos = [self._tensor_info(cur) for _ in range(n_tensors)]
        align = self._alignment()
        data_start = -(-cur.pos // align) * align
        self.tensors: dict[str, GGUFTensor] = {}
        for name, gtype, shape, rel in infos:
            if name in self.tensors:
                raise FormatError(f"{self.path}: tensor {name} is listed twice")
            self.tensors[name] = t = self._check_tensor(name, gtype, shape, data_start + rel, align)
            if t.offset + t.nbytes > len(self._map):
                raise FormatError(
                    f"{self.path} is truncated: tensor {name} needs bytes "
                    f"{t.offset}..{t.offset + t.nbytes} but the file has {len(self._map)}"
                )
        self._check_overlaps()

    def _alignment(self) -> int:
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if (
            isinstance(align, bool)
            or not isinstance(align, (int, np.integer))
            or align <= 0
            or align & (align - 1)
        ):
            raise FormatError(
                f"{self.path}: general.alignment must be a positive power of two, got {align!r}"
            )
        return int(align)

    def _check_overlaps(self) -> None:
        # Two tensors sharing bytes means a corrupted (or hostile) table: one would silently
        # read the other's data.
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in self.tensors.values())
        spans = [s for s in spans if s[1] > s[0]]
        for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:]):
            if start_b < end_a:
                raise FormatError(
                    f"{self.path}: the data of tensors {a} and {b} overlap (bytes "
                    f"{start_b}..{end_a})"
                )

    def _tensor_info(self, cur: _Cursor) -> tuple[str, int, tuple[int, ...], int]:
        name = cur.string()
        n_dims = cur.scalar("I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise FormatError(
                f"{self.path}: tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS})"
            )
        dims = [cur.scalar("Q") for _ in range(n_dims)]
        gtype, offset = cur.scalar("I"), cur.scalar("Q")
        return name, gtype, tuple(reversed(dims)), offset

    def _check_tensor(
        self, name: str, gtype: int, shape: tuple[int, ...], offset: int, align: int
    ) -> GGUFTensor:
        if gtype not in GGML_TYPES:
            label = _GGML_NAMES.get(gtype, f"type {gtype}")
            raise UnsupportedArchitecture(
                f"{self.path}: tensor {name} uses ggml {label}, which cellm does not support"
            )
        _, block, block_bytes = GGML_TYPES[gtype]
        if not shape or shape[-1] % block:
            raise FormatError(
                f"{self.path}: tensor {name} rows of {shape} don't fit {block}-blocks"
            )
        if offset % align:
            raise FormatError(
                f"{self.path}: tensor {name} is not aligned (offset {offset}, alignment {align})"
            )
        # Python integers: a product of hostile dims must not wrap around in int64.
        nbytes = math.prod(shape) // block * block_bytes
        return GGUFTensor(name, gtype, shape, offset, nbytes)

    def data(self, name: str) -> memoryview:
        """The raw bytes of a tensor (zero-copy)."""
        t = self.tensors[name]
        return memoryview(self._map)[t.offset : t.offset + t.nbytes]

    def close(self) -> None:
        self._map.close()  # raises BufferError while numpy views of the map are alive

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
