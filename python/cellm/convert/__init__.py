"""HF checkpoint directory, GGUF file or `.cellm` v1 file -> `.cellm` v2 file (docs/format.md),
in pure Python + numpy. `convert` dispatches on the input; `convert_hf` (hf_convert.py),
`convert_gguf` (gguf_convert.py) and `convert_v1` (cellm_v1.py) are the paths."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

from ..errors import FormatError, InvalidArgument
from .cellm_v1 import convert_v1, is_cellm_v1
from .ct2 import is_ct2_model
from .ct2_whisper import convert_ct2_whisper, is_ct2_whisper_dir
from .gguf import MAGIC as GGUF_MAGIC
from .gguf_convert import convert_gguf
from .hf_convert import convert_hf
from .writer import read_header

__all__ = [
    "convert",
    "convert_ct2_whisper",
    "convert_gguf",
    "convert_hf",
    "convert_v1",
    "is_ct2_whisper_dir",
    "is_gguf",
    "read_header",
]


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
    """Convert a HF checkpoint directory, a GGUF file, a `.cellm` v1 file or a CTranslate2
    Whisper directory (faster-whisper's models) to a `.cellm` v2 file; return its path.

    `dtype` (default f16) applies to HF checkpoints and v1 files' float tensors: GGUF tensors
    keep their formats unless `quantize` (with `group_size` and `embedding`; see
    `convert_hf`) requantizes them.
    """
    src = Path(input_path)
    if not src.exists():
        raise FormatError(f"{src}: no such file or directory")
    if not src.is_dir() and not src.is_file():  # a named pipe or device: open() could block
        raise FormatError(f"{src} is not a regular file or a directory")
    if _is_ct2(src):
        if vision_quantize is not None:
            raise InvalidArgument("--vision-quantize applies to HuggingFace checkpoints only")
        return convert_ct2_whisper(
            src, output_path, dtype or "f16", progress, quantize, group_size, embedding
        )
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
    if is_cellm_v1(src):
        if vision_quantize is not None:
            raise InvalidArgument("--vision-quantize applies to HuggingFace checkpoints only")
        return convert_v1(
            src, output_path, dtype or "f16", progress, quantize, group_size, embedding
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
    raise FormatError(
        f"{src} is neither a HuggingFace checkpoint directory, a GGUF file, a .cellm v1 file"
        " nor a CTranslate2 model"
    )


def _is_ct2(src: Path) -> bool:
    """A CTranslate2 directory (a model.bin and no safetensors) or its model.bin."""
    if src.is_dir():
        return is_ct2_whisper_dir(src) and not any(src.glob("*.safetensors*"))
    return src.name == "model.bin" and is_ct2_model(src)
