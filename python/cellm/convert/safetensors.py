"""A small, validating safetensors reader (single files and sharded checkpoints).

The format is: u64 little-endian header length, a JSON header mapping tensor names to
`{"dtype", "shape", "data_offsets": [begin, end]}` (offsets relative to the end of the header),
then the raw little-endian data. Files are memory-mapped so a tensor is read lazily, page by
page, and a multi-GB checkpoint never has to fit in memory.
"""

from __future__ import annotations

import math
import os
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

if TYPE_CHECKING:
    from typing_extensions import TypeGuard  # typing's from Python 3.10

from ..errors import FormatError
from .jsonfiles import parse_json_object, read_json

# Bytes per element of every dtype the safetensors spec defines: needed to validate sizes even
# for tensors we never read (an int64 buffer in a checkpoint must not make the file "invalid").
_ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}

# How each readable dtype is viewed in numpy; bf16 has no numpy dtype, so it is kept as raw
# uint16 bits and widened by `to_f32`.
_NUMPY_DTYPE: dict[str, np.dtype[Any]] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
}

# The safetensors reference implementation refuses headers above 100 MB; a larger value here
# means the first 8 bytes are not a safetensors length at all.
_MAX_HEADER_LEN = 100_000_000

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its file, dtype, shape and absolute byte range."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: Path
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class SafetensorsFile:
    """One memory-mapped `.safetensors` file whose header has been fully validated."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.tensors: dict[str, TensorInfo] = {}
        self.metadata: dict[str, Any] = {}
        self._map: Optional[np.memmap] = None
        self._parse()

    def _parse(self) -> None:
        path = self.path
        try:
            # Non-blocking, and checked before reading: a named pipe must not hang the open().
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise FormatError(f"{path} is not a regular file")
                size = st.st_size
                prefix = f.read(8)
                if len(prefix) < 8:
                    raise FormatError(
                        f"{path} is truncated: {size} bytes, too short for a safetensors header"
                    )
                (header_len,) = struct.unpack("<Q", prefix)
                if header_len > _MAX_HEADER_LEN:
                    raise FormatError(
                        f"{path} is not a safetensors file: header length {header_len} is "
                        "implausible"
                    )
                if 8 + header_len > size:
                    raise FormatError(
                        f"{path} is truncated: the header needs bytes 8..{8 + header_len} "
                        f"but the file has {size}"
                    )
                raw = f.read(header_len)
        except FileNotFoundError:
            raise FormatError(f"{path}: no such file or directory") from None
        except OSError as e:
            raise FormatError(f"{path}: cannot read: {e.strerror or e}") from None
        header = parse_json_object(raw, f"{path} (safetensors header)")

        data_start = 8 + header_len
        for name, entry in header.items():
            if name == "__metadata__":
                self.metadata = entry if isinstance(entry, dict) else {}
                continue
            self.tensors[name] = self._parse_entry(name, entry, data_start, size)
        self._check_layout(data_start, size)

    def _parse_entry(self, name: str, entry: Any, data_start: int, size: int) -> TensorInfo:
        path = self.path
        bad = FormatError(f"{path}: tensor {name} has a malformed header entry: {entry!r}")
        if not isinstance(entry, dict):
            raise bad
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or not _is_int_list(shape) or not _is_int_list(offsets):
            raise bad
        if len(offsets) != 2 or any(d < 0 for d in shape):
            raise bad
        begin, end = offsets
        if not 0 <= begin <= end:
            raise bad
        if dtype not in _ITEMSIZE:
            raise FormatError(f"{path}: tensor {name} has unknown dtype {dtype}")
        need = math.prod(shape) * _ITEMSIZE[dtype]
        if end - begin != need:
            raise FormatError(
                f"{path}: tensor {name} spans {end - begin} bytes but dtype {dtype} and shape "
                f"{list(shape)} need {need}"
            )
        start, stop = data_start + begin, data_start + end
        if stop > size:
            raise FormatError(
                f"{path} is truncated: tensor {name} needs bytes {start}..{stop} "
                f"but the file has {size}"
            )
        return TensorInfo(name, dtype, tuple(shape), path, start, stop)

    def _check_layout(self, data_start: int, size: int) -> None:
        """The tensors' byte ranges must tile the data section exactly, as the safetensors
        spec requires (and its reference reader checks): sorted by offset, each begins where
        the previous one ended, from the section's first byte to the file's last. A header
        length off by one byte, which would shift every tensor, fails here, as do overlapping
        tensors and gaps."""
        pos, prev = data_start, None
        for start, end, name in sorted((t.start, t.end, t.name) for t in self.tensors.values()):
            if start != pos:
                after = f"tensor {prev} ends at {pos - data_start}" if prev else "it begins at 0"
                problem = "overlaps another tensor" if start < pos else "leaves a gap"
                raise FormatError(
                    f"{self.path}: tensor {name} {problem}: its data_offsets begin at "
                    f"{start - data_start}, but {after} (wrong header length or data_offsets)"
                )
            pos, prev = end, name
        if pos != size:
            raise FormatError(
                f"{self.path}: the tensors' data_offsets end at {pos - data_start} but the data "
                f"section has {size - data_start} bytes (wrong header length or data_offsets)"
            )

    def _mapping(self) -> np.memmap:
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._map

    def view(self, name: str) -> np.ndarray:
        """A zero-copy view of a tensor in its stored dtype (BF16 as uint16 bits)."""
        info = self.tensors[name]
        dtype = _NUMPY_DTYPE.get(info.dtype)
        if dtype is None:
            raise FormatError(
                f"{self.path}: tensor {name} has dtype {info.dtype}; only F32, F16 and BF16 "
                "are supported"
            )
        if info.nbytes == 0:
            return np.zeros(info.shape, dtype=dtype)
        raw = self._mapping()[info.start : info.end]
        return raw.view(dtype).reshape(info.shape)

    def close(self) -> None:
        # Dropping our reference lets numpy unmap once no views remain.
        self._map = None


class Checkpoint:
    """All tensors of a HF checkpoint directory, whether in one file or several shards."""

    def __init__(self, files: list[SafetensorsFile], source: Optional[Path] = None) -> None:
        self.files = files
        # What error messages name: the checkpoint directory (or the single file).
        self.source = source if source is not None else (files[0].path if files else Path("."))
        self._where: dict[str, SafetensorsFile] = {}
        for f in files:
            for name in f.tensors:
                other = self._where.get(name)
                if other is not None:
                    raise FormatError(f"tensor {name} appears in both {other.path} and {f.path}")
                self._where[name] = f

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def info(self, name: str) -> TensorInfo:
        return self._where[name].tensors[name]

    def view(self, name: str) -> np.ndarray:
        return self._where[name].view(name)

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def to_f32(array: np.ndarray, dtype: str) -> np.ndarray:
    """Widen a stored tensor (F32/F16/BF16 bits) to float32."""
    if dtype == "BF16":
        # bf16 is the upper half of a binary32: shifting the bits up is exact.
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32, copy=False)


def open_checkpoint(directory: Path) -> Checkpoint:
    """Open `model.safetensors`, or every shard listed by `model.safetensors.index.json`."""
    directory = Path(directory)
    single = directory / SINGLE_NAME
    index = directory / INDEX_NAME
    if single.is_file():
        return Checkpoint([SafetensorsFile(single)], directory)
    if index.is_file():
        return _open_sharded(index, directory)
    hint = ""
    if any(directory.glob("*.bin")) or any(directory.glob("*.pt")):
        hint = " (PyTorch .bin checkpoints are not supported; save it with safetensors)"
    raise FormatError(f"{directory} has no {SINGLE_NAME} or {INDEX_NAME}{hint}")


def _open_sharded(index: Path, directory: Path) -> Checkpoint:
    doc = read_json(index, required=True)
    weight_map = doc.get("weight_map") if doc is not None else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise FormatError(f"{index} has no weight_map")

    shards: dict[str, SafetensorsFile] = {}
    for name, shard in weight_map.items():
        # A shard must be a plain file name next to the index: no path escapes.
        if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
            raise FormatError(f"{index}: tensor {name} maps to an invalid shard name {shard!r}")
        if shard not in shards:
            path = index.parent / shard
            if not path.is_file():
                raise FormatError(f"{path}: no such file (listed in {index})")
            shards[shard] = SafetensorsFile(path)
        if name not in shards[shard].tensors:
            raise FormatError(f"{index} puts tensor {name} in {shard}, but that file lacks it")
    return Checkpoint(list(shards.values()), directory)


def _is_int_list(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    )
