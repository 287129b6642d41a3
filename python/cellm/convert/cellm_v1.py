"""`.cellm` version 1 files (the earlier cellm engine's published builds) -> `.cellm` v2.

Layout (docs/format.md, "Version 1 files"): `CELLM`, a version byte 1, a u32 little-endian
header length, a JSON header (model config fields and `tensors`: name, dtype, shape,
`offset_bytes` from the start of the file, `nbytes`), tensors 64-byte aligned. Names are HF
names; int8 / int4 / int2 matrices carry their per-row f16 scales in a `NAME.qscale` tensor.
Version 1 embeds no tokenizer: `tokenizer.json` (and optionally `tokenizer_config.json`) must
sit next to the file.

Conversion goes through the HF path (`hf_convert.convert_loaded`) with the header turned into
the HF config it came from. Tensors whose v1 encoding is exactly a v2 format are kept as they
are unless `--quantize` asks for another: int8 rows become `i8_row`, int4 rows `q4_0` (the row
scale in every block), `q1_0_g128` blocks `q1_0`; the rest are decoded to float32 (int2 rows
exactly) and stored in `--dtype`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import numpy as np

from ..errors import FormatError, UnsupportedArchitecture
from .dtypes import check_format
from .hf_convert import Converting, convert_loaded
from .quantize import plan_quantization
from .writer import check_output_is_not_input

MAGIC = b"CELLM\x01"
_PREAMBLE = 10  # magic, version byte, u32 header length
# v1 dtype -> bytes of one row of `cols` values (excluding any sidecar).
_ROW_BYTES: dict[str, Callable[[int], int]] = {
    "f32": lambda c: 4 * c,
    "f16": lambda c: 2 * c,
    "bf16": lambda c: 2 * c,
    "i8": lambda c: c,
    "i4": lambda c: (c + 1) // 2,
    "i2": lambda c: (c + 3) // 4,
    "q1_0_g128": lambda c: 18 * ((c + 127) // 128),
}
_FLOAT = {"f32": "F32", "f16": "F16", "bf16": "BF16"}
_NUMPY = {"f32": "<f4", "f16": "<f2", "bf16": "<u2"}
_SCALED = ("i8", "i4", "i2")
# The model types whose HF config a v1 header fully determines.
_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def is_cellm_v1(path: Union[str, os.PathLike[str]]) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except (IsADirectoryError, FileNotFoundError, PermissionError):
        return False


@dataclass(frozen=True)
class V1Tensor:
    name: str
    dtype: str  # as the v1 header names it
    shape: tuple[int, ...]
    start: int
    nbytes: int

    @property
    def rows_cols(self) -> tuple[int, int]:
        cols = self.shape[-1] if self.shape else 1
        return math.prod(self.shape[:-1]), cols


@dataclass(frozen=True)
class V1Info:
    """What conversion asks of a tensor (the HF checkpoint's `TensorInfo` fields it reads):
    quantized tensors are offered as float32, decoded."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: Path


class V1File:
    """A parsed and checked v1 file, its data mapped read-only."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.source = path
        self.data = np.memmap(path, dtype=np.uint8, mode="r")
        size = len(self.data)
        if size < _PREAMBLE or bytes(self.data[:6]) != MAGIC:
            raise FormatError(f"{path} is not a version 1 .cellm file")
        header_len = int.from_bytes(bytes(self.data[6:10]), "little")
        if _PREAMBLE + header_len > size:
            raise FormatError(f"{path}: header of {header_len:,} bytes runs past the file end")
        try:
            header = json.loads(bytes(self.data[_PREAMBLE : _PREAMBLE + header_len]))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FormatError(f"{path}: the v1 header is not valid JSON ({e})") from None
        if not isinstance(header, dict) or not isinstance(header.get("tensors"), list):
            raise FormatError(f"{path}: the v1 header has no tensors list")
        self.header: dict[str, Any] = header
        self.tensors = {t.name: t for t in (self._tensor(e, size) for e in header["tensors"])}
        self._check_sidecars()

    def _tensor(self, entry: Any, size: int) -> V1Tensor:
        try:
            name, dtype = entry["name"], entry["dtype"]
            shape, start, nbytes = entry["shape"], entry["offset_bytes"], entry["nbytes"]
        except (TypeError, KeyError) as e:
            raise FormatError(f"{self.path}: a v1 tensor entry lacks {e}") from None
        ints = [start, nbytes, *shape] if isinstance(shape, list) else None
        if not isinstance(name, str) or ints is None or not all(_is_count(v) for v in ints):
            raise FormatError(f"{self.path}: bad v1 tensor entry {entry!r}"[:300])
        if dtype not in _ROW_BYTES:
            known = ", ".join(_ROW_BYTES)
            raise FormatError(f"{self.path}: tensor {name} has v1 dtype {dtype!r} ({known} read)")
        t = V1Tensor(name, dtype, tuple(shape), start, nbytes)
        rows, cols = t.rows_cols
        if nbytes != rows * _ROW_BYTES[dtype](cols):
            raise FormatError(
                f"{self.path}: tensor {name} ({dtype} {list(shape)}) should take "
                f"{rows * _ROW_BYTES[dtype](cols):,} bytes, the header says {nbytes:,}"
            )
        if start < _PREAMBLE or start + nbytes > size:
            raise FormatError(f"{self.path}: tensor {name} lies outside the file")
        return t

    def _check_sidecars(self) -> None:
        for t in self.tensors.values():
            if t.dtype not in _SCALED:
                continue
            scale = self.tensors.get(f"{t.name}.qscale")
            if scale is None or scale.dtype != "f16" or scale.shape != (t.rows_cols[0],):
                raise FormatError(
                    f"{self.path}: {t.dtype} tensor {t.name} needs an f16 {t.name}.qscale of "
                    f"{t.rows_cols[0]} values"
                )

    def raw(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        rows, _ = t.rows_cols
        return self.data[t.start : t.start + t.nbytes].reshape(rows, -1)

    def scales(self, name: str) -> np.ndarray:
        return np.asarray(self.raw(f"{name}.qscale")).view("<f2").reshape(-1, 1)


class V1Checkpoint:
    """A v1 file as conversion reads a checkpoint: weights by HF name (the `.qscale` sidecars
    belong to their weights), float tensors as stored, quantized ones decoded to float32."""

    def __init__(self, file: V1File) -> None:
        self.file = file
        self.source = file.path
        self.names = [n for n in file.tensors if not _is_sidecar(n, file)]

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def info(self, name: str) -> V1Info:
        t = self.file.tensors[name]
        return V1Info(name, _FLOAT.get(t.dtype, "F32"), t.shape, self.file.path)

    def view(self, name: str) -> np.ndarray:
        t = self.file.tensors[name]
        raw = self.file.raw(name)
        if t.dtype in _FLOAT:
            return np.asarray(raw).view(_NUMPY[t.dtype]).reshape(t.shape)
        values = _decode(t, raw, self.file.scales(name) if t.dtype in _SCALED else None)
        return values.reshape(t.shape)

    def stored(self, name: str) -> Optional[tuple[str, Callable[[], Iterator[np.ndarray]]]]:
        """`name` re-encoded without loss in a v2 format, where one holds its v1 encoding."""
        t = self.file.tensors.get(name)
        if t is None or len(t.shape) != 2:
            return None
        cols = t.shape[1]
        if t.dtype == "i8" and cols % 32 == 0:
            return "i8_row", lambda: iter([_i8_row(self.file.raw(name), self.file.scales(name))])
        if t.dtype == "i4" and cols % 32 == 0:
            return "q4_0", lambda: iter([_q4_0(self.file.raw(name), self.file.scales(name))])
        if t.dtype == "q1_0_g128" and cols % 128 == 0:
            return "q1_0", lambda: iter([np.asarray(self.file.raw(name))])
        return None


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**62


def _is_sidecar(name: str, file: V1File) -> bool:
    base = name.removesuffix(".qscale")
    return base != name and base in file.tensors


def _unpack(raw: np.ndarray, bits: int, cols: int) -> np.ndarray:
    """Per row, `8 / bits` values per byte from the lowest bits up; the first `cols` kept."""
    shifts = np.arange(0, 8, bits, dtype=np.uint8)
    values: np.ndarray = (raw[:, :, None] >> shifts) & ((1 << bits) - 1)
    return values.reshape(len(raw), -1)[:, :cols]


def _decode(t: V1Tensor, raw: np.ndarray, scale: Optional[np.ndarray]) -> np.ndarray:
    """A quantized v1 tensor as float32 (rows x cols): int8 `q * s`, int4 `(n - 8) * s`, int2
    `(q - 1.5) * s`, q1_0_g128 `+-d` per block of 128."""
    rows, cols = t.rows_cols
    raw = np.asarray(raw)
    if t.dtype == "q1_0_g128":
        blocks = raw.reshape(-1, 18)
        d = blocks[:, :2].copy().view("<f2").astype(np.float32)
        bits = np.unpackbits(blocks[:, 2:], axis=1, bitorder="little").astype(np.float32)
        signs: np.ndarray = (d * (2 * bits - 1)).reshape(rows, -1)
        return signs[:, :cols]
    assert scale is not None
    s = scale.astype(np.float32)
    if t.dtype == "i8":
        return raw.view(np.int8).astype(np.float32) * s
    if t.dtype == "i4":
        return (_unpack(raw, 4, cols).astype(np.float32) - 8) * s
    return (_unpack(raw, 2, cols).astype(np.float32) - np.float32(1.5)) * s


def _i8_row(raw: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """v1 int8 rows and f16 scales -> `i8_row` (the scale widened to f32, exactly)."""
    s = scale.astype("<f4").view(np.uint8)
    return np.concatenate([s, np.asarray(raw)], axis=1)


def _q4_0(raw: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """v1 int4 rows (value `2i` in the low nibble of byte `i`, `2i + 1` in the high one, both
    `n - 8`) -> q4_0 blocks holding the same nibbles with the row's f16 scale as every `d`."""
    rows = len(raw)
    n = _unpack(np.asarray(raw), 4, 2 * raw.shape[1]).reshape(-1, 32)
    packed = n[:, :16] | (n[:, 16:] << 4)
    d = np.repeat(scale.view(np.uint8).reshape(rows, 2), n.shape[0] // rows, axis=0)
    return np.concatenate([d, packed], axis=1).reshape(rows, -1)


def v1_config(header: dict[str, Any], checkpoint: V1Checkpoint, source: str) -> dict[str, Any]:
    """The HF config a v1 header's model fields stand for. Refused where the header cannot
    say everything the model needs (other families' layer patterns, rope scaling)."""
    model_type = header.get("model_type")
    if header.get("vision_tensor_prefix") or header.get("text_tensor_prefix"):
        raise UnsupportedArchitecture(f"{source}: v1 vision-language files are not supported")
    if model_type not in _MODEL_TYPES:
        raise UnsupportedArchitecture(
            f"{source}: v1 model_type {model_type!r} is not supported (supported: "
            f"{', '.join(_MODEL_TYPES)}; convert other models from their HF checkpoint)"
        )
    max_pos = header.get("max_position_embeddings")
    if model_type == "llama" and isinstance(max_pos, int) and max_pos > 8192:
        # Llama 3.x: its llama3 rope scaling is not in the v1 header.
        raise UnsupportedArchitecture(
            f"{source}: a v1 llama file with a {max_pos:,}-token context needs rope scaling "
            "its header does not record; convert it from the HF checkpoint"
        )
    config: dict[str, Any] = {
        "model_type": model_type,
        "vocab_size": header.get("vocab_size"),
        "hidden_size": header.get("hidden_dim"),
        "intermediate_size": header.get("intermediate_size"),
        "num_hidden_layers": header.get("num_layers"),
        "num_attention_heads": header.get("num_heads"),
        "num_key_value_heads": header.get("num_kv_heads"),
        "rms_norm_eps": header.get("rms_norm_eps"),
        "rope_theta": header.get("rope_theta"),
        "bos_token_id": header.get("bos_token_id"),
        "eos_token_id": header.get("eos_token_id"),
        "max_position_embeddings": max_pos,
        "tie_word_embeddings": bool(header.get("tie_word_embeddings"))
        or "lm_head.weight" not in checkpoint,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in checkpoint,
    }
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    heads = config["num_attention_heads"]
    if q_proj in checkpoint and isinstance(heads, int) and heads > 0:
        config["head_dim"] = checkpoint.info(q_proj).shape[0] // heads
    return {k: v for k, v in config.items() if v is not None}


def convert_v1(
    input_path: Union[str, os.PathLike[str]],
    output_path: Union[str, os.PathLike[str]],
    dtype: str = "f16",
    progress: Optional[bool] = None,
    quantize: Optional[str] = None,
    group_size: Optional[int] = None,
    embedding: Optional[str] = None,
) -> Path:
    """Convert a `.cellm` v1 file to v2 and return its path. `tokenizer.json` must sit next
    to it. Options as for `convert_hf` (no vision models in v1 files this reads)."""
    check_format(dtype)
    quantization = plan_quantization(quantize, group_size, embedding)
    src = Path(input_path)
    check_output_is_not_input(output_path, src)
    checkpoint = V1Checkpoint(V1File(src))
    config = v1_config(checkpoint.file.header, checkpoint, str(src))
    how = Converting(src.parent, f"{src} (v1 header)", dtype, quantization, None)
    return convert_loaded(
        checkpoint,
        config,
        output_path,
        how,
        {"kind": "cellm-v1", "path": src.name, "dtype": dtype},
        progress,
        checkpoint.stored,
    )
