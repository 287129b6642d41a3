"""HF checkpoint directory -> `.cellm` file: config normalised, tensors planned by the engine's
declaration, each one rewritten by its family where needed, converted or quantized, written."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, Union

import numpy as np

from ..errors import FormatError, InvalidArgument
from ..families.base import Checkpoint, Transform
from .dtypes import BLOCK_FORMATS, check_format, convert_chunks, float32_chunks
from .hf_config import family_of, load_config, normalise_config
from .processor_files import load_processor_config
from .progress import conversion_bar
from .quantize import Quantization, plan_quantization, quantize_rows
from .safetensors import open_checkpoint
from .tokenizer_files import TOKENIZER_BLOB, TokenizerFiles, load_tokenizer_files
from .weights import PlannedTensor, layers_present, left_out, plan_tensors
from .writer import TensorEntry, check_output_is_not_input, write_cellm

EMBEDDING = "model.embed_tokens.weight"
# The vision tower and connector: float unless asked (their errors compound over every patch).
VISION_PREFIXES = ("vision.", "connector.")


def convert_hf(
    input_dir: Union[str, os.PathLike[str]],
    output_path: Union[str, os.PathLike[str]],
    dtype: str = "f16",
    progress: Optional[bool] = None,
    quantize: Optional[str] = None,
    group_size: Optional[int] = None,
    embedding: Optional[str] = None,
    vision_quantize: Optional[str] = None,
) -> Path:
    """Convert a HuggingFace checkpoint directory to a `.cellm` file and return its path.

    `dtype` (f32, f16, bf16) applies to tensors of two or more dimensions; 1-D tensors (norms,
    biases) are always stored as f32. `quantize` stores every matrix whose rows split into its
    units in that format instead: `int8` (per row), `int4` / `int4-affine` (groups of
    `group_size` 32, 64 or 128; default 64), or a GGUF block format (q8_0, q4_0, q4_1, q5_0,
    q4_k).
    `embedding` (a scheme, or f16/f32/bf16) overrides it for the token embedding. A
    vision-language model's tower and connector stay in `dtype` unless `vision_quantize` (a
    scheme) asks for one. `progress`:
    None shows a bar on a terminal for large models, True always shows it on stderr, False
    never.
    """
    check_format(dtype)
    quantization = plan_quantization(quantize, group_size, embedding)
    vision_quantization = plan_quantization(
        vision_quantize, group_size if vision_quantize else None
    )
    src = Path(input_dir)
    if not src.exists():
        raise FormatError(f"{src}: no such file or directory")
    if not src.is_dir():
        raise FormatError(f"{src} is not a directory (expected a HuggingFace checkpoint)")
    check_output_is_not_input(output_path, src)
    config = load_config(src)
    config_source = str(src / "config.json")
    # Refuse unsupported architectures before touching the (possibly huge) weights.
    family_of(config, config_source)
    with open_checkpoint(src) as checkpoint:
        _check_layer_count(config, checkpoint, config_source)
        return convert_loaded(
            checkpoint,
            config,
            output_path,
            Converting(src, config_source, dtype, quantization, vision_quantization),
            {"kind": "hf", "dtype": dtype},
            progress,
        )


class TensorSource(Checkpoint, Protocol):
    """What conversion reads from a checkpoint: names, their info, and their values."""

    def view(self, name: str) -> np.ndarray: ...


# A tensor the source already holds in a format the engine reads, as (format, chunks): used
# instead of converting it when nothing asks for another format.
Stored = Callable[[str], Optional[tuple[str, Callable[[], Iterator[np.ndarray]]]]]


@dataclass(frozen=True)
class Converting:
    """How one conversion was asked for: the directory of the side files (tokenizer,
    processor), the config's name for messages, and the formats wanted."""

    files: Path
    config_source: str
    dtype: str
    quantization: Optional[Quantization]
    vision_quantization: Optional[Quantization]
    # The tokenizer's files, where they are not HF's in `files` (a CTranslate2 directory).
    tokenizer_files: Optional[Callable[[], TokenizerFiles]] = None


def convert_loaded(
    checkpoint: TensorSource,
    config: dict[str, Any],
    output_path: Union[str, os.PathLike[str]],
    how: Converting,
    source: dict[str, Any],
    progress: Optional[bool],
    stored: Optional[Stored] = None,
) -> Path:
    """Write `checkpoint` (described by HF `config`) as a `.cellm` file; `source` starts the
    header's `source` section."""
    family = family_of(config, how.config_source)
    # Where the family keeps it (a published multimodal checkpoint nests the text model).
    embedding = family.checkpoint_name({"model_type": config.get("model_type")}, EMBEDDING)
    embed_dtype = checkpoint.info(embedding).dtype if embedding in checkpoint else "F32"
    model = normalise_config(config, checkpoint, how.config_source, embed_dtype)
    family.settle_from_weights(model, checkpoint)
    if how.vision_quantization is not None and "vision" not in model:
        raise InvalidArgument(f"--vision-quantize: {checkpoint.source} has no vision tower")
    entries = []
    for tensor in plan_tensors(model, family, checkpoint):
        tensor_source = family.tensor_source(model, tensor.name) or (
            family.checkpoint_name(model, tensor.name),
            tensor.shape,
        )
        transform = family.tensor_transform(model, tensor.name)
        vision = tensor.name.startswith(VISION_PREFIXES)
        scheme = how.vision_quantization if vision else how.quantization
        kept = stored(tensor_source[0]) if stored and scheme is None and not transform else None
        if kept is not None and tensor.stored_format(kept[0]) == kept[0]:
            entry = TensorEntry(tensor.name, kept[0], tensor.shape, kept[1])
        else:
            entry = _entry(checkpoint, tensor, how.dtype, scheme, transform, tensor_source)
        entries.append(tensor.finished(entry))
    tok = how.tokenizer_files() if how.tokenizer_files else load_tokenizer_files(how.files, config)
    # A vision-language model keeps its image processing settings.
    processor = {"processor": load_processor_config(how.files)} if "vision" in model else {}
    vision_scheme = how.vision_quantization.scheme if how.vision_quantization else None
    header = {
        "model": model,
        "hf_config": config,
        "tokenizer": tok.tokenizer,
        "generation": tok.generation,
        **processor,
        "source": {
            **source,
            **(how.quantization.source_record() if how.quantization else {}),
            **({"vision_quantize": vision_scheme} if vision_scheme else {}),
            # Checkpoint tensors left out on purpose: {reason: count}.
            **({"left_out": unused} if (unused := left_out(model, family, checkpoint)) else {}),
        },
    }
    total = sum(e.nbytes for e in entries)
    name = Path(str(checkpoint.source)).name
    with conversion_bar(total, f"converting {name}", progress) as bar:
        blobs = [(TOKENIZER_BLOB, tok.tokenizer_json)]
        return write_cellm(output_path, header, entries, blobs, bar)


# Decoders' layers, and BERT's.
_LAYER = re.compile(r"^(?:model\.layers|encoder\.layer)\.(\d+)\.")


def _check_layer_count(config: dict[str, Any], checkpoint: TensorSource, source: str) -> None:
    """More layers than the checkpoint holds tensors for is refused before any per-layer
    work (a corrupted count would take minutes and gigabytes to refuse later)."""
    declared = config.get("num_hidden_layers")
    if isinstance(declared, bool) or not isinstance(declared, int):
        return  # normalise_config names the problem
    present = layers_present(checkpoint, _LAYER)
    if declared > present:
        raise FormatError(
            f"{source}: num_hidden_layers is {declared:,} but {checkpoint.source} has tensors "
            f"for {present} layers"
        )


def _entry(
    checkpoint: TensorSource,
    tensor: PlannedTensor,
    dtype: str,
    quantization: Optional[Quantization],
    transform: Optional[Transform],
    source: Optional[tuple[str, tuple[int, ...]]],
) -> TensorEntry:
    """`tensor` as stored: made from checkpoint tensor `source` (default: itself), rewritten
    by `transform` (whole, in float32), then converted or quantized to a format the engine
    accepts for it."""
    name, shape = tensor.name, tensor.shape
    source_name = source[0] if source else name
    src_dtype = checkpoint.info(source_name).dtype

    def f32_chunks() -> Iterator[np.ndarray]:
        if transform is None:
            yield from float32_chunks(checkpoint.view(source_name), src_dtype)
        else:
            whole = np.concatenate(list(float32_chunks(checkpoint.view(source_name), src_dtype)))
            yield np.ascontiguousarray(transform(whole).reshape(shape), dtype=np.float32)

    fmt = dtype
    if quantization is not None and len(shape) == 2:
        fmt = quantization.format_for(name, shape[1], dtype)
    fmt = tensor.stored_format(fmt)
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
        name, fmt, shape, lambda: convert_chunks(checkpoint.view(source_name), src_dtype, fmt)
    )
