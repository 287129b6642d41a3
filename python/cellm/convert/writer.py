"""Writer (and a small debugging reader) for the `.cellm` v2 container; see docs/format.md.

Layout: `CELLM`, version byte 2, two zero bytes, u64 LE header length, the JSON header, zero
padding up to `data_offset = align_up(16 + header_len, 64)`, then every tensor and blob at a
64-byte aligned offset relative to `data_offset`.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import signal
import stat
import struct
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

import numpy as np

from ..errors import FormatError, InvalidArgument
from .dtypes import (
    BLOCK_FORMATS,
    FORMAT_DTYPE,
    check_block_format,
    check_format,
    convert_chunks,
    format_nbytes,
    numpy_format,
    storage_dtype,
)
from .jsonfiles import parse_json_object
from .progress import ProgressBar
from .safetensors import to_f32

MAGIC = b"CELLM"
VERSION = 2
ALIGN = 64
PREFIX_LEN = 16
# Keys the writer owns; everything else in the header comes from the caller.
_WRITER_KEYS = ("format_version", "tensors", "blobs", "data_size")


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


@dataclass
class TensorEntry:
    """A tensor to write: its layout up front, its data produced lazily chunk by chunk.

    Offsets go in the header, which precedes the data, so the layout of every tensor must be
    known before the first byte of data is produced; `chunks` is only called while writing.
    """

    name: str
    format: str
    shape: tuple[int, ...]
    # Yields the tensor's elements in row-major order, already in `format`'s dtype (block
    # formats: the raw blocks as uint8).
    chunks: Callable[[], Iterable[np.ndarray]]
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return format_nbytes(self.format, self.shape)

    @classmethod
    def from_array(cls, name: str, array: np.ndarray, fmt: str) -> TensorEntry:
        """Wrap an in-memory array (float32/float16, or uint16 bf16 bits), converted to `fmt`."""
        check_format(fmt)
        src = numpy_format(array)
        return cls(name, fmt, tuple(array.shape), lambda: convert_chunks(array, src, fmt))


TensorLike = Union[TensorEntry, "tuple[str, np.ndarray, str]"]


def write_cellm(
    path: Union[str, os.PathLike[str]],
    header: Mapping[str, Any],
    tensors: Iterable[TensorLike],
    blobs: Iterable[tuple[str, bytes]] = (),
    progress: Optional[ProgressBar] = None,
) -> Path:
    """Write a `.cellm` v2 file atomically (temporary file, then rename) and return its path.

    `header` holds the descriptive sections (model, hf_config, tokenizer, generation, source);
    the writer adds `format_version`, `tensors`, `blobs` and `data_size`. `tensors` are
    `TensorEntry`s or `(name, array, format)` tuples; data is streamed tensor by tensor.
    """
    path = Path(path)
    entries = [t if isinstance(t, TensorEntry) else TensorEntry.from_array(*t) for t in tensors]
    blob_list = [(name, bytes(data)) for name, data in blobs]
    _check_names(entries, blob_list)

    tensor_table, blob_table, data_size = _layout(entries, blob_list)
    full: dict[str, Any] = {"format_version": VERSION}
    full.update((k, v) for k, v in header.items() if k not in _WRITER_KEYS)
    full.update(tensors=tensor_table, blobs=blob_table, data_size=data_size)
    header_bytes = _encode_header(full)
    data_offset = align_up(PREFIX_LEN + len(header_bytes))

    _check_output(path)
    _remove_stale_temporaries(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with _sigterm_raises():
        _write(path, tmp, header_bytes, data_offset, entries, tensor_table, blob_list, blob_table,
               progress)  # fmt: skip
    return path


def _write(
    path: Path,
    tmp: Path,
    header_bytes: bytes,
    data_offset: int,
    entries: Sequence[TensorEntry],
    tensor_table: Sequence[Mapping[str, Any]],
    blob_list: Sequence[tuple[str, bytes]],
    blob_table: Sequence[Mapping[str, Any]],
    progress: Optional[ProgressBar],
) -> None:
    """Write the file as `tmp`, then rename it to `path`; `tmp` never outlives a failure."""
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + bytes([VERSION, 0, 0]) + struct.pack("<Q", len(header_bytes)))
            f.write(header_bytes)
            f.write(bytes(data_offset - PREFIX_LEN - len(header_bytes)))
            pos = 0
            for entry, row in zip(entries, tensor_table):
                f.write(bytes(row["offset"] - pos))
                _write_tensor(f, entry, progress)
                pos = row["offset"] + row["nbytes"]
            for (_, data), row in zip(blob_list, blob_table):
                f.write(bytes(row["offset"] - pos))
                f.write(data)
                pos = row["offset"] + row["nbytes"]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # Never leave a half-written file behind, whatever interrupted us (Ctrl-C, SIGTERM).
        tmp.unlink(missing_ok=True)
        raise


class _Terminated(BaseException):
    """SIGTERM arrived while writing (raised so that the temporary file is removed)."""


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """While writing, SIGTERM raises (so the `except` above removes the temporary file) and
    then terminates the process as SIGTERM would have. Only where SIGTERM has its default
    action and in the main thread (a handler the program set is left alone)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise _Terminated()

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)  # the default action: the process ends here
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)$")


def _remove_stale_temporaries(path: Path) -> None:
    """Delete `.NAME.tmp-PID` files that earlier writes of `path` left behind when they were
    killed (SIGKILL, a power cut): those whose process is gone. A live process's file is its
    write in progress and stays."""
    try:
        candidates = list(path.parent.glob(f".{glob.escape(path.name)}.tmp-*"))
    except OSError:
        return
    for candidate in candidates:
        m = _TEMPORARY.match(candidate.name)
        if m is None or m.group("name") != path.name or _alive(int(m.group("pid"))):
            continue
        with contextlib.suppress(OSError):
            if candidate.is_file() and not candidate.is_symlink():
                candidate.unlink()


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own earlier, interrupted write
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # another user's process, or a number we cannot check: keep the file
    return True


def _check_names(entries: Sequence[TensorEntry], blobs: Sequence[tuple[str, bytes]]) -> None:
    for kind, names in (("tensor", [e.name for e in entries]), ("blob", [b[0] for b in blobs])):
        seen: set[str] = set()
        for name in names:
            if not isinstance(name, str) or not name:
                raise InvalidArgument(f"{kind} names must be non-empty strings, got {name!r}")
            if name in seen:
                raise InvalidArgument(f"duplicate {kind} name {name!r}")
            seen.add(name)


def _layout(
    entries: Sequence[TensorEntry], blobs: Sequence[tuple[str, bytes]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """Assign each tensor, then each blob, the next 64-byte aligned offset."""
    pos = 0
    tensor_table = []
    for e in entries:
        if e.format in BLOCK_FORMATS:
            check_block_format(e.format, e.shape)
        else:
            check_format(e.format)
        offset = align_up(pos)
        tensor_table.append(
            {
                "name": e.name,
                "format": e.format,
                "shape": [int(d) for d in e.shape],
                "offset": offset,
                "nbytes": e.nbytes,
                "params": dict(e.params),
            }
        )
        pos = offset + e.nbytes
    blob_table = []
    for name, data in blobs:
        offset = align_up(pos)
        blob_table.append({"name": name, "offset": offset, "nbytes": len(data)})
        pos = offset + len(data)
    # data_size ends at the last byte of the last item: no trailing padding (docs/format.md).
    return tensor_table, blob_table, pos


def _encode_header(header: Mapping[str, Any]) -> bytes:
    try:
        text = json.dumps(header, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return text.encode("utf-8")
    except ValueError as e:
        # Non-finite floats or lone surrogates cannot be represented in strict UTF-8 JSON.
        raise FormatError(f"cannot encode the .cellm header as JSON: {e}") from None


def _check_output(path: Path) -> None:
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:
        raise InvalidArgument(f"{path}: cannot use it as the output: {e.strerror or e}") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise InvalidArgument(f"{path} is a directory; expected an output file path")
    if mode is not None and not stat.S_ISREG(mode):
        # Replacing a device node or a named pipe with a regular file destroys it.
        raise InvalidArgument(
            f"{path} exists and is not a regular file ({_kind(mode)}); refusing to replace it"
        )
    if not path.parent.is_dir():
        raise InvalidArgument(f"{path.parent}: output directory does not exist")


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a file"


def check_output_is_not_input(output: Union[str, os.PathLike[str]], source: Path) -> None:
    """Refuse an output that would replace the conversion's input: the GGUF file itself, or
    any file of the HF checkpoint directory `source` (model.safetensors, config.json...; an
    earlier .cellm output there is fine). Paths are compared resolved and by inode (hard
    links, the Hub cache's symlinks). Also refuses outputs that are not regular files."""
    out = Path(output)
    _check_output(out)
    if not out.exists():
        return
    inputs = [p for p in source.iterdir() if p.is_file()] if source.is_dir() else [source]
    out_resolved = out.resolve()
    for p in inputs:
        same = p.resolve() == out_resolved
        with contextlib.suppress(OSError):
            same = same or os.path.samefile(p, out)
        if same and not (source.is_dir() and _is_cellm(p)):
            raise InvalidArgument(
                f"output {out} is the conversion's input {p}: writing it would destroy the "
                "input; choose another output path"
            )


def _is_cellm(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def _write_tensor(f: Any, entry: TensorEntry, progress: Optional[ProgressBar]) -> None:
    expected_dtype = storage_dtype(entry.format)
    written = 0
    for chunk in entry.chunks():
        if chunk.dtype != expected_dtype:
            raise InvalidArgument(
                f"tensor {entry.name}: chunk has dtype {chunk.dtype}, expected {expected_dtype}"
            )
        data = np.ascontiguousarray(chunk).reshape(-1).view(np.uint8)
        f.write(data)
        written += data.nbytes
        if progress is not None:
            progress.update(data.nbytes)
    if written != entry.nbytes:
        raise InvalidArgument(
            f"tensor {entry.name}: produced {written} bytes, expected {entry.nbytes} "
            f"for {entry.format} {list(entry.shape)}"
        )


def read_header(path: Union[str, os.PathLike[str]]) -> dict[str, Any]:
    """Read and check a `.cellm` file's prefix and header (for tests and debugging).

    The returned dict is the JSON header; tensor offsets are relative to
    `align_up(16 + header_len)`, which `data_offset(path)` returns.
    """
    header, _ = _read_prefix_and_header(Path(path))
    return header


def data_offset(path: Union[str, os.PathLike[str]]) -> int:
    """Absolute file offset of the data section of a `.cellm` file."""
    _, offset = _read_prefix_and_header(Path(path))
    return offset


def read_tensor(path: Union[str, os.PathLike[str]], name: str) -> np.ndarray:
    """Load one tensor of a `.cellm` file as float32 (debugging helper, not zero-copy)."""
    path = Path(path)
    header, offset = _read_prefix_and_header(path)
    for row in header.get("tensors", []):
        if row.get("name") == name:
            fmt = row["format"]
            dtype = FORMAT_DTYPE[fmt]
            count = row["nbytes"] // dtype.itemsize
            raw = np.fromfile(path, dtype=dtype, count=count, offset=offset + row["offset"])
            raw = raw.reshape(row["shape"])
            return to_f32(raw, "BF16") if fmt == "bf16" else raw.astype(np.float32)
    raise FormatError(f"{path} has no tensor {name}")


def _read_prefix_and_header(path: Path) -> tuple[dict[str, Any], int]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(PREFIX_LEN)
            if len(prefix) < PREFIX_LEN or prefix[:5] != MAGIC:
                raise FormatError(f"{path} is not a .cellm file (bad magic)")
            version = prefix[5]
            if version == 1:
                raise FormatError(
                    f"{path} is a version 1 .cellm file from an earlier engine; "
                    "re-convert the model with `python -m cellm.convert`"
                )
            if version != VERSION:
                raise FormatError(f"{path} has unsupported .cellm format version {version}")
            if prefix[6:8] != b"\0\0":
                raise FormatError(f"{path}: reserved header bytes 6..8 are not zero")
            (header_len,) = struct.unpack("<Q", prefix[8:16])
            if PREFIX_LEN + header_len > size:
                raise FormatError(
                    f"{path} is truncated: the header needs {PREFIX_LEN + header_len} bytes "
                    f"but the file has {size}"
                )
            raw = f.read(header_len)
    except FileNotFoundError:
        raise FormatError(f"{path}: no such file or directory") from None
    header = parse_json_object(raw, f"{path} (header)")
    offset = align_up(PREFIX_LEN + header_len)
    data_size = header.get("data_size")
    if not isinstance(data_size, int) or offset + data_size != size:
        raise FormatError(
            f"{path} has {size} bytes but its header implies {offset} + {data_size} "
            "(truncated or padded file)"
        )
    return header, offset
