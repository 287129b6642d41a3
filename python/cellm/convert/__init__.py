"""HF checkpoint directory or GGUF file -> `.cellm` v2 file (docs/format.md), in pure Python +
numpy. `convert` dispatches on the input; `convert_hf` (hf_convert.py) and `convert_gguf`
(gguf_convert.py) are the two paths."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

from ..errors import FormatError, InvalidArgument
from .gguf import MAGIC as GGUF_MAGIC
from .gguf_convert import convert_gguf
from .hf_convert import convert_hf
from .writer import read_header

__all__ = ["convert", "convert_gguf", "convert_hf", "is_gguf", "read_header"]


def is_gguf(path: Union[str, os.PathLike[str]]) -> bool:
    """Whether `path` is a file that starts with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except (IsADirectoryError, FileNotFoundError, PermissionError):
        return False


def convert(
    input_path: Union[str, os.PathLike[str]],
    output_path: Union[str, os.PathLike[str]],
    dtype: Optional[str] = None,
    progress: Optional[bool] = None,
    quantize: Optional[str] = None,
    group_size: Optional[int] = None,
    embedding: Optional[str] = None,
    vision_quantize: Optional[str] = None,
) -> Path:
    """Convert a HF checkpoint directory or a GGUF file to a `.cellm` file; return its path.

    `dtype` (default f16) applies to HF checkpoints only: GGUF tensors keep their formats
    unless `quantize` (with `group_size` and `embedding`; see `convert_hf`) requantizes them.
    """
    src = Path(input_path)
    if not src.exists():
        raise FormatError(f"{src}: no such file or directory")
    if not src.is_dir() and not src.is_file():  # a named pipe or device: open() could block
        raise FormatError(f"{src} is not a regular file or a directory")
    if src.is_dir():
        return convert_hf(
            src,
            output_path,
            dtype or "f16",
            progress,
            quantize,
            group_size,
            embedding,
            vision_quantize,
        )
    if src.suffix.lower() == ".gguf" or is_gguf(src):
        if dtype is not None:
            raise InvalidArgument(
                "--dtype applies to HuggingFace checkpoints only; GGUF tensors keep their "
                "formats (or take --quantize)"
            )
        if vision_quantize is not None:
            raise InvalidArgument("--vision-quantize applies to HuggingFace checkpoints only")
        return convert_gguf(src, output_path, progress, quantize, group_size, embedding)
    raise FormatError(f"{src} is neither a HuggingFace checkpoint directory nor a GGUF file")
