"""HF checkpoint directory or GGUF file -> `.cellm` v2 file (docs/format.md), in pure Python +
numpy. `convert` dispatches on the input; `convert_hf` and `convert_gguf` are the two paths."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Optional, Union

import numpy as np

from ..errors import FormatError, InvalidArgument
from .dtypes import BLOCK_FORMATS, check_format, convert_chunks, float32_chunks
from .gguf import MAGIC as GGUF_MAGIC
from .gguf_convert import convert_gguf
from .hf_config import family_of, load_config, normalise_config
from .interleave import interleaved
from .progress import ProgressBar
from .quantize import Quantization, plan_quantization, quantize_rows
from .safetensors import Checkpoint, open_checkpoint
from .tokenizer_files import TOKENIZER_BLOB, load_tokenizer_files
from .weights import (
    plan_tensors,
    settle_from_weights,
    stored_as_f32,
    tensor_source,
    tensor_transform,
)
from .writer import TensorEntry, read_header, write_cellm

__all__ = ["convert", "convert_gguf", "convert_hf", "is_gguf", "read_header"]

# In automatic mode, only models at least this large get a progress bar: small ones convert
# in well under a second and the bar would be noise.
_AUTO_PROGRESS_BYTES = 64 << 20


def is_gguf(path: Union[str, os.PathLike]) -> bool:
    """Whether `path` is a file that starts with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except (IsADirectoryError, FileNotFoundError, PermissionError):
        return False


def convert(
    input_path: Union[str, os.PathLike],
    output_path: Union[str, os.PathLike],
    dtype: Optional[str] = None,
    progress: Optional[bool] = None,
    quantize: Optional[str] = None,
    group_size: Optional[int] = None,
    embedding: Optional[str] = None,
) -> Path:
    """Convert a HF checkpoint directory or a GGUF file to a `.cellm` file; return its path.

    `dtype` (default f16) applies to HF checkpoints only: GGUF tensors keep their formats
    unless `quantize` (with `group_size` and `embedding`; see `convert_hf`) requantizes them.
    """
    src = Path(input_path)
    if not src.exists():
        raise FormatError(f"{src}: no such file or directory")
    options = {"quantize": quantize, "group_size": group_size, "embedding": embedding}
    if src.is_dir():
        return convert_hf(src, output_path, dtype or "f16", progress=progress, **options)
    if src.suffix.lower() == ".gguf" or is_gguf(src):
        if dtype is not None:
            raise InvalidArgument(
                "--dtype applies to HuggingFace checkpoints only; GGUF tensors keep their "
                "formats (or take --quantize)"
            )
        return convert_gguf(src, output_path, progress=progress, **options)
    raise FormatError(f"{src} is neither a HuggingFace checkpoint directory nor a GGUF file")


def convert_hf(
    input_dir: Union[str, os.PathLike],
    output_path: Union[str, os.PathLike],
    dtype: str = "f16",
    progress: Optional[bool] = None,
    quantize: Optional[str] = None,
    group_size: Optional[int] = None,
    embedding: Optional[str] = None,
) -> Path:
    """Convert a HuggingFace checkpoint directory to a `.cellm` file and return its path.

    `dtype` (f32, f16, bf16) applies to tensors of two or more dimensions; 1-D tensors (norms,
    biases) are always stored as f32. `quantize` stores every matrix whose rows split into its
    units in that format instead: `int8` (per row), `int4` / `int4-affine` (groups of
    `group_size` 32, 64 or 128; default 64), or a GGUF block format (q8_0, q4_0, q4_1, q5_0,
    q4_k).
    `embedding` (a scheme, or f16/f32/bf16) overrides it for the token embedding. `progress`:
    None shows a bar on a terminal for large models, True always shows it on stderr, False
    never.
    """
    check_format(dtype)
    quantization = plan_quantization(quantize, group_size, embedding)
    src = Path(input_dir)
    if not src.exists():
        raise FormatError(f"{src}: no such file or directory")
    if not src.is_dir():
        raise FormatError(f"{src} is not a directory (expected a HuggingFace checkpoint)")
    config = load_config(src)
    config_source = str(src / "config.json")
    # Refuse unsupported architectures before touching the (possibly huge) weights.
    family_of(config, config_source)

    with open_checkpoint(src) as checkpoint:
        embed = "model.embed_tokens.weight"
        embed_dtype = checkpoint.info(embed).dtype if embed in checkpoint else "F32"
        model = normalise_config(config, checkpoint, config_source, embed_dtype)
        settle_from_weights(model, checkpoint)
        plan = plan_tensors(model, checkpoint)
        tok = load_tokenizer_files(src, config)
        entries = [
            interleaved(
                _entry(
                    checkpoint,
                    name,
                    shape,
                    dtype,
                    quantization,
                    tensor_transform(model, name),
                    tensor_source(model, name)[0],
                )
            )
            for name, shape in plan
        ]
        header = {
            "model": model,
            "hf_config": config,
            "tokenizer": tok.tokenizer,
            "generation": tok.generation,
            "source": {
                "kind": "hf",
                "dtype": dtype,
                **(quantization.source_record() if quantization else {}),
            },
        }
        total = sum(e.nbytes for e in entries)
        bar = None
        if progress or (progress is None and total >= _AUTO_PROGRESS_BYTES):
            bar = ProgressBar(total, f"converting {src.name}", force=bool(progress))
        try:
            return write_cellm(
                output_path, header, entries, [(TOKENIZER_BLOB, tok.tokenizer_json)], bar
            )
        finally:
            if bar is not None:
                bar.close()


def _entry(
    checkpoint: Checkpoint,
    name: str,
    shape: tuple[int, ...],
    dtype: str,
    quantization: Optional[Quantization],
    transform: Optional[Callable[[np.ndarray], np.ndarray]] = None,
    source: Optional[str] = None,
) -> TensorEntry:
    """Tensor `name` as stored: made from checkpoint tensor `source` (default: itself),
    rewritten by `transform` (whole, in float32), then converted or quantized."""
    source = source or name
    src_dtype = checkpoint.info(source).dtype

    def f32_chunks() -> Iterator[np.ndarray]:
        if transform is None:
            yield from float32_chunks(checkpoint.view(source), src_dtype)
        else:
            whole = np.concatenate(list(float32_chunks(checkpoint.view(source), src_dtype)))
            yield np.ascontiguousarray(transform(whole).reshape(shape), dtype=np.float32)

    keep_f32 = stored_as_f32(name, shape)
    fmt = "f32" if keep_f32 else dtype
    if quantization is not None and not keep_f32 and len(shape) == 2:
        fmt = quantization.format_for(name, shape[1], dtype)
    if fmt in BLOCK_FORMATS:

        def blocks() -> Iterator[np.ndarray]:
            for chunk in f32_chunks():
                yield quantize_rows(chunk, fmt)

        return TensorEntry(name, fmt, shape, blocks)
    if transform is not None:
        return TensorEntry(
            name,
            fmt,
            shape,
            lambda: (piece for c in f32_chunks() for piece in convert_chunks(c, "F32", fmt)),
        )
    return TensorEntry(
        name, fmt, shape, lambda: convert_chunks(checkpoint.view(source), src_dtype, fmt)
    )
