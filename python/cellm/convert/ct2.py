"""A validating reader of CTranslate2's `model.bin` (binary versions 4 to 6), without importing
ctranslate2. The layout (CTranslate2's `ModelSpec.save`, read back by `src/models/model.cc`),
all little-endian:

    u32 binary version; string spec name; u32 spec revision
    u32 variable count, then per variable:
        string name; u8 rank; u32 x rank dims; u8 dtype id; u32 byte count; the bytes
    u32 alias count, then per alias: string alias; string variable name

where a string is a u16 length that counts a trailing NUL, then the bytes and the NUL. Dtype
ids: 0 float32, 1 int8, 2 int16, 3 int32, 4 float16, 5 bfloat16. A quantized weight `X/weight`
(int8 or int16) has its scale in `X/weight_scale`: float32, one per row for int8 (127 / the
row's largest magnitude) or one scalar for int16; the float weight is `q / scale`.

The file is memory-mapped; a float tensor is a zero-copy view of it."""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ..errors import FormatError

SUPPORTED_VERSIONS = (4, 5, 6)
# Dtype id -> (name, numpy dtype).
DTYPES: dict[int, tuple[str, np.dtype[Any]]] = {
    0: ("float32", np.dtype("<f4")),
    1: ("int8", np.dtype("i1")),
    2: ("int16", np.dtype("<i2")),
    3: ("int32", np.dtype("<i4")),
    4: ("float16", np.dtype("<f2")),
    5: ("bfloat16", np.dtype("<u2")),
}
# The safetensors dtype names the converter's float paths read.
FLOAT_NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
_MAX_RANK = 8


@dataclass(frozen=True)
class Variable:
    name: str
    dtype: str  # a DTYPES name
    shape: tuple[int, ...]
    start: int  # byte offset in the file
    end: int


def is_ct2_model(path: Path) -> bool:
    """Whether `path` starts like a CTranslate2 model.bin (a plausible version and spec name)."""
    try:
        with open(path, "rb") as f:
            head = f.read(6)
    except OSError:
        return False
    if len(head) < 6:
        return False
    version, length = struct.unpack("<IH", head)
    return bool(1 <= version <= 64 and 1 <= length <= 256)


class Ct2Model:
    """The variables and aliases of one `model.bin`."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.variables: dict[str, Variable] = {}
        self.aliases: dict[str, str] = {}
        self._map: Optional[np.memmap] = None
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise FormatError(f"{self.path} is not a regular file")
                self._map = np.memmap(f, dtype=np.uint8, mode="r")
        except FileNotFoundError:
            raise FormatError(f"{self.path}: no such file or directory") from None
        except ValueError:  # an empty file cannot be mapped
            raise FormatError(f"{self.path} is empty (not a CTranslate2 model)") from None
        except OSError as e:
            raise FormatError(f"{self.path}: cannot read: {e.strerror or e}") from None
        self._parse()

    # -- parsing ---------------------------------------------------------------------------

    def _parse(self) -> None:
        data = self._map
        assert data is not None
        size = len(data)
        pos = 0

        def take(n: int, what: str) -> bytes:
            nonlocal pos
            if pos + n > size:
                raise FormatError(
                    f"{self.path} is truncated: {what} needs bytes {pos}..{pos + n}, the file "
                    f"has {size}"
                )
            out = bytes(data[pos : pos + n])
            pos += n
            return out

        def u32(what: str) -> int:
            return int(struct.unpack("<I", take(4, what))[0])

        def string(what: str) -> str:
            (n,) = struct.unpack("<H", take(2, what))
            if n == 0:
                raise FormatError(f"{self.path}: {what} has length 0 (no NUL)")
            raw = take(n, what)
            if raw[-1] != 0:
                raise FormatError(f"{self.path}: {what} is not NUL-terminated")
            try:
                return raw[:-1].decode("utf-8")
            except UnicodeDecodeError:
                raise FormatError(f"{self.path}: {what} is not UTF-8") from None

        self.version = u32("the binary version")
        if self.version not in SUPPORTED_VERSIONS:
            raise FormatError(
                f"{self.path}: CTranslate2 binary version {self.version} is not supported "
                f"(supported: {', '.join(map(str, SUPPORTED_VERSIONS))}; not a CTranslate2 "
                "model, or convert it again with CTranslate2 >= 3)"
            )
        self.spec = string("the spec name")
        self.revision = u32("the spec revision")
        count = u32("the variable count")
        if count > size // 8:  # every variable takes at least 8 bytes
            raise FormatError(f"{self.path}: {count:,} variables cannot fit in {size:,} bytes")
        for i in range(count):
            name = string(f"variable {i}'s name")
            (rank,) = struct.unpack("<B", take(1, f"{name}'s rank"))
            if rank > _MAX_RANK:
                raise FormatError(f"{self.path}: variable {name} has rank {rank}")
            shape = struct.unpack(f"<{rank}I", take(4 * rank, f"{name}'s shape"))
            (dtype_id,) = struct.unpack("<B", take(1, f"{name}'s dtype"))
            if dtype_id not in DTYPES:
                raise FormatError(f"{self.path}: variable {name} has unknown dtype id {dtype_id}")
            dtype, np_dtype = DTYPES[dtype_id]
            nbytes = u32(f"{name}'s byte count")
            expected = int(np.prod(shape, dtype=np.int64)) * np_dtype.itemsize
            if nbytes != expected:
                raise FormatError(
                    f"{self.path}: variable {name} has {nbytes} bytes, its shape "
                    f"{list(shape)} of {dtype} needs {expected}"
                )
            if pos + nbytes > size:
                raise FormatError(
                    f"{self.path} is truncated: variable {name} needs bytes "
                    f"{pos}..{pos + nbytes}, the file has {size}"
                )
            if name in self.variables:
                raise FormatError(f"{self.path}: variable {name} appears twice")
            self.variables[name] = Variable(name, dtype, tuple(shape), pos, pos + nbytes)
            pos += nbytes
        aliases = u32("the alias count")
        for i in range(aliases):
            alias = string(f"alias {i}")
            target = string(f"alias {alias}'s target")
            if target not in self.variables:
                raise FormatError(f"{self.path}: alias {alias} names a missing variable {target}")
            self.aliases[alias] = target
        if pos != size:
            raise FormatError(f"{self.path}: {size - pos} bytes follow the last alias")

    # -- access ----------------------------------------------------------------------------

    def resolve(self, name: str) -> str:
        return self.aliases.get(name, name)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.resolve(name) in self.variables

    def __iter__(self) -> Iterator[str]:
        return iter(self.variables)

    def variable(self, name: str) -> Variable:
        try:
            return self.variables[self.resolve(name)]
        except KeyError:
            raise FormatError(f"{self.path} has no variable {name}") from None

    def raw(self, name: str) -> np.ndarray:
        """A zero-copy view of variable `name` in its stored dtype."""
        var = self.variable(name)
        np_dtype = next(d for n, d in DTYPES.values() if n == var.dtype)
        assert self._map is not None
        if var.end == var.start:
            return np.zeros(var.shape, dtype=np_dtype)
        return self._map[var.start : var.end].view(np_dtype).reshape(var.shape)

    def scalar(self, name: str) -> int:
        value = self.raw(name)
        if value.size != 1:
            raise FormatError(f"{self.path}: variable {name} is not a scalar")
        return int(value.reshape(()))

    def weight(self, name: str) -> tuple[np.ndarray, str]:
        """Float tensor `name` and its source dtype (F32, F16 or BF16 bits): a view of a float
        variable, or a dequantized float32 copy of a quantized one."""
        var = self.variable(name)
        if var.dtype in FLOAT_NAMES:
            return self.raw(name), FLOAT_NAMES[var.dtype]
        scale_name = f"{name}_scale"
        if var.dtype not in ("int8", "int16") or scale_name not in self:
            raise FormatError(
                f"{self.path}: variable {name} is {var.dtype} without a float scale (only "
                "float32/float16/bfloat16 and int8/int16 weights are supported)"
            )
        q = self.raw(name)
        scale = self.weight(scale_name)[0].astype(np.float32)
        rows = q.shape[0] if q.ndim else 1
        if scale.size == 1:
            w = q.astype(np.float32) / float(scale.reshape(()))
        elif scale.size == rows:
            w = q.reshape(rows, -1).astype(np.float32) / scale.reshape(rows, 1)
        else:
            raise FormatError(
                f"{self.path}: {scale_name} has {scale.size} values for {rows} rows of {name}"
            )
        if not np.all(np.isfinite(w)):
            raise FormatError(f"{self.path}: {name} dequantizes to non-finite values")
        return np.ascontiguousarray(w.reshape(q.shape)), "F32"

    def close(self) -> None:
        self._map = None
