"""GGUF file -> `.cellm` v2 file (docs/format.md) for the GGUF architectures the families declare.

The GGUF metadata is translated into the HF config keys it was made from, so the model
description comes from the same `normalise_config` as the HF path. Tensors keep their stored
format: quantized ones are copied block for block, 1-D ones (norms, biases) become f32. With
`quantize`, matrices are instead decoded (by the engine's own row kernels) and requantized.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from ..errors import FormatError, TemplateError, UnsupportedArchitecture
from ..families import by_gguf_architecture
from ..families.base import GGUFArch
from .dtypes import BLOCK_FORMATS, CHUNK_BYTES, storage_dtype
from .dtypes import convert as convert_float
from .gguf import GGUFFile, GGUFTensor
from .hf_config import normalise_config
from .progress import conversion_bar
from .quantize import Quantization, plan_quantization, quantize_rows
from .safetensors import to_f32
from .tokenizer_files import TOKENIZER_BLOB
from .weights import expected_tensors, layers_present
from .writer import TensorEntry, check_output_is_not_input, write_cellm

__all__ = ["convert_gguf", "gguf_to_hf_config", "hf_tensor_name"]


_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# The GGUF metadata key (after `ARCH.`) each HF config key is read from, for error messages.
_GGUF_KEYS = {
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "max_position_embeddings": "context_length",
    "sliding_window": "attention.sliding_window",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
    "norm_eps": "attention.layer_norm_rms_epsilon",
    "conv_L_cache": "shortconv.l_cache",
    "attention_multiplier": "attention.scale",
    "embedding_multiplier": "embedding_scale",
    "residual_multiplier": "residual_scale",
    "logits_scaling": "logit_scale",
}
# A layer tensor's short name may hold dots (lfm2's `shortconv.in_proj`).
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.([\w.]+)\.(weight|bias)$")
# Tensors consumed by conversion itself rather than copied.
_ROPE_FREQS = "rope_freqs.weight"
_FLOAT_FORMATS = ("f32", "f16", "bf16")


def _layer_names(arch: Optional[GGUFArch]) -> Mapping[str, str]:
    return {**_LAYER_NAMES, **arch.layer_names} if arch else _LAYER_NAMES


def _global_names(arch: Optional[GGUFArch]) -> Mapping[str, str]:
    return {**_GLOBAL_NAMES, **arch.global_names} if arch else _GLOBAL_NAMES


def hf_tensor_name(name: str, arch: Optional[GGUFArch] = None) -> Optional[str]:
    """The HF name of a GGUF tensor name, or None for names outside the table."""
    global_names = _global_names(arch)
    if name in global_names:
        return global_names[name]
    m = _LAYER_TENSOR.match(name)
    names = _layer_names(arch)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    return None


def convert_gguf(
    input_path: Union[str, os.PathLike[str]],
    output_path: Union[str, os.PathLike[str]],
    progress: Optional[bool] = None,
    quantize: Optional[str] = None,
    group_size: Optional[int] = None,
    embedding: Optional[str] = None,
) -> Path:
    """Convert a GGUF file (an architecture a family declares) to a `.cellm` file; return its path.

    Tensors keep their GGUF formats (f32, f16, bf16 or ggml blocks such as q8_0, q4_k);
    1-D tensors are stored as f32. `quantize`, `group_size` and `embedding` requantize the
    matrices as for `convert_hf`. `progress` as for `convert_hf`.
    """
    quantization = plan_quantization(quantize, group_size, embedding)
    src = Path(input_path)
    if src.is_dir():
        raise FormatError(f"{src} is a directory, not a GGUF file")
    check_output_is_not_input(output_path, src)
    gg = GGUFFile(src)
    try:
        md = gg.metadata
        arch_name = md.get("general.architecture")
        arch = by_gguf_architecture(arch_name, str(src))
        config = gguf_to_hf_config(md, gg.tensors, str(arch_name), arch, str(src))
        _check_block_count(config.get("num_hidden_layers"), gg, str(arch_name))
        labels = {hf: f"{arch_name}.{key}" for hf, key in _GGUF_KEYS.items()}
        model = normalise_config(config, None, str(src), labels=labels)
        if _ROPE_FREQS in gg.tensors:
            model["rope"] = _with_freq_factors(model["rope"], _float_vector(gg, _ROPE_FREQS))
        entries = _plan(gg, model, arch, quantization)
        tokens = md.get("tokenizer.ggml.tokens")
        if tokens is not None and len(tokens) > model["vocab_size"]:
            raise FormatError(
                f"{src}: the tokenizer has {len(tokens)} tokens but token_embd.weight only "
                f"{model['vocab_size']} rows"
            )
        from .gguf_tokenizer import tokenizer_from_gguf  # only the GGUF path needs it

        tok = tokenizer_from_gguf(md)
        header = {
            "model": model,
            "hf_config": None,
            "tokenizer": _tokenizer_section(tok, md, str(src)),
            "generation": _generation_section(tok, md),
            "source": {
                "kind": "gguf",
                "path": src.name,
                "general.name": md.get("general.name"),
                "file_type": _plain(md.get("general.file_type")),
                **(quantization.source_record() if quantization else {}),
            },
        }
        total = sum(e.nbytes for e in entries)
        with conversion_bar(total, f"converting {src.name}", progress) as bar:
            blobs = [(TOKENIZER_BLOB, tok.json.encode("utf-8"))]
            return write_cellm(output_path, header, entries, blobs, bar)
    finally:
        _close_quietly(gg)


def _close_quietly(gg: GGUFFile) -> None:
    """Close the mmap unless numpy views of it are still alive (metadata arrays, or tensor
    chunks held by an exception's traceback): then it closes when they are collected, and the
    original exception, if any, is not replaced by a BufferError."""
    try:
        gg.close()
    except BufferError:
        pass


# -- model description -------------------------------------------------------------------


def gguf_to_hf_config(
    md: Mapping[str, Any],
    tensors: Mapping[str, GGUFTensor],
    arch_name: str,
    arch: GGUFArch,
    source: str,
) -> dict[str, Any]:
    """The HF config.json keys that the GGUF metadata encodes (absent ones left out, so the
    family defaults apply as they would for a config.json without them)."""

    def get(key: str, required: bool = False) -> Any:
        value = md.get(f"{arch_name}.{key}")
        if value is None and required:
            raise FormatError(f"{source}: GGUF metadata lacks {arch_name}.{key}")
        return _plain(value)

    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise FormatError(f"{source}: GGUF file has no token_embd.weight tensor")
    heads = get("attention.head_count", required=True)
    config: dict[str, Any] = {
        "model_type": arch.model_type,
        "vocab_size": embed.shape[0],
        "hidden_size": get("embedding_length", required=True),
        "intermediate_size": _uniform(
            get("feed_forward_length", required=True), "feed_forward_length", source
        ),
        "num_hidden_layers": get("block_count", required=True),
        "num_attention_heads": _uniform(heads, "attention.head_count", source),
        # Per-layer counts (lfm2's are 0 on its convolution layers) are the family's to read.
        "num_key_value_heads": get("attention.head_count_kv"),
        "head_dim": get("attention.key_length"),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": get("context_length"),
        "rope_theta": get("rope.freq_base"),
        # llama.cpp ties the output projection by leaving out output.weight.
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_gate.bias" in tensors,
    }
    value_length = get("attention.value_length")
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config["head_dim"] or _maybe_div(hidden, heads)
    if value_length is not None and value_length != head_dim:
        raise UnsupportedArchitecture(
            f"{source}: attention.value_length {value_length} differs from key_length {head_dim}"
        )
    rope_dim = get("rope.dimension_count")
    if rope_dim is not None and (isinstance(rope_dim, bool) or not isinstance(rope_dim, int)):
        raise FormatError(
            f"{source}: {arch_name}.rope.dimension_count must be an integer, got {rope_dim!r}"
        )
    if rope_dim is not None and head_dim and rope_dim != head_dim:
        # normalise_config rejects partial rotary embeddings with a clear message.
        config["partial_rotary_factor"] = rope_dim / head_dim
    if arch.config_keys is not None:
        # The family's keys may depend on the head width the metadata implies.
        config.update(arch.config_keys(get, {**config, "head_dim": head_dim}))
    config["num_key_value_heads"] = _uniform(
        config["num_key_value_heads"], "attention.head_count_kv", source
    )
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {
            "rope_type": scaling,
            "factor": get("rope.scaling.factor"),
            "original_max_position_embeddings": get("rope.scaling.original_context_length"),
            "beta_fast": get("rope.scaling.yarn_beta_fast"),
            "beta_slow": get("rope.scaling.yarn_beta_slow"),
        }
        config["rope_scaling"] = {k: v for k, v in config["rope_scaling"].items() if v is not None}
    return {k: v for k, v in config.items() if v is not None}


_BLOCK = re.compile(r"^blk\.(\d+)\.")


def _check_block_count(declared: Any, gg: GGUFFile, arch_name: str) -> None:
    """`block_count` must match the `blk.N.` tensors present, checked before any per-layer
    work: a corrupted count (10^8) would otherwise take minutes and gigabytes to refuse."""
    if isinstance(declared, bool) or not isinstance(declared, int):
        return  # normalise_config names the problem
    present = layers_present(gg.tensors, _BLOCK)
    if declared != present:
        raise FormatError(
            f"{gg.path}: {arch_name}.block_count is {declared:,} but the file has tensors for "
            f"{present} blocks"
        )


def _with_freq_factors(rope: dict[str, Any], factors: np.ndarray) -> dict[str, Any]:
    """Apply llama3-style `rope_freqs` (per-frequency divisors, as llama.cpp does)."""
    inv = np.asarray(rope["inv_freq"], dtype=np.float32)
    if factors.shape != inv.shape:
        raise FormatError(
            f"rope_freqs.weight has {factors.size} values, expected head_dim/2 = {inv.size}"
        )
    # llama.cpp writes these factors only for llama3 rope scaling, on default frequencies.
    rope_type = "llama3" if rope["type"] == "default" else rope["type"]
    return {**rope, "type": rope_type, "inv_freq": [float(x) for x in inv / factors]}


def _plain(value: Any) -> Any:
    """GGUF scalars as JSON-friendly Python values; f32 floats by their shortest repr, so
    1e-5 stored as f32 reads back as 1e-05 like the config.json it came from."""
    if isinstance(value, float):
        with np.errstate(over="ignore"):  # a double past f32's range reads as inf (refused)
            return float(str(np.float32(value)))
    if isinstance(value, np.ndarray):
        return [_plain(v.item()) for v in value]
    return value


def _uniform(value: Any, key: str, source: str) -> Any:
    """Per-layer arrays (some GGUFs store head counts per layer) must hold one value."""
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise UnsupportedArchitecture(f"{source}: per-layer {key} {value} is not supported")
        return value[0]
    return value


def _maybe_div(a: Any, b: Any) -> Optional[int]:
    if isinstance(a, int) and isinstance(b, int) and b > 0 and a % b == 0:
        return a // b
    return None


# -- tensors ---------------------------------------------------------------------------------


def _plan(
    gg: GGUFFile,
    model: Mapping[str, Any],
    arch: GGUFArch,
    quantization: Optional[Quantization] = None,
) -> list[TensorEntry]:
    """One entry per tensor the engine reads, in its order, checked against the GGUF file."""
    by_hf = {hf_tensor_name(name, arch): name for name in gg.tensors}
    plan = expected_tensors(model)
    for tensor in plan:
        if tensor.name not in by_hf:
            raise FormatError(
                f"{gg.path} is missing tensor {_gguf_name(tensor.name, arch)} ({tensor.name})"
            )
    wanted = {tensor.name for tensor in plan}
    extra = sorted(
        n for n in gg.tensors if n != _ROPE_FREQS and hf_tensor_name(n, arch) not in wanted
    )
    if extra:
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        raise FormatError(
            f"{gg.path} has tensors a {model['model_type']} model does not use: "
            f"{', '.join(extra[:3])}{more}"
        )
    entries = []
    for tensor in plan:
        hf = tensor.name
        name = by_hf[hf]
        t = gg.tensors[name]
        if t.shape != tensor.shape:
            raise FormatError(
                f"{gg.path}: tensor {name} has shape {list(t.shape)}, expected "
                f"{list(tensor.shape)} from the GGUF metadata"
            )
        heads = None
        if arch.permuted_qk and hf.endswith(("q_proj.weight", "q_proj.bias")):
            heads = model["num_heads"]
        elif arch.permuted_qk and hf.endswith(("k_proj.weight", "k_proj.bias")):
            heads = model["num_kv_heads"]
        entry = _entry(gg, t, hf, heads)
        fmt = entry.format
        if quantization is not None and len(t.shape) == 2:
            fmt = quantization.format_for(hf, t.shape[1], t.format)
        fmt = tensor.stored_format(fmt)
        if fmt != entry.format:
            entry = _requantized(entry, fmt)
        entries.append(tensor.finished(entry))
    return entries


def _requantized(entry: TensorEntry, fmt: str) -> TensorEntry:
    """`entry` decoded to float32 by the engine's row kernels and stored as `fmt`."""
    from .. import _core  # the engine's decoders read every GGUF format

    rows, cols = entry.shape
    row_bytes = entry.nbytes // rows

    def chunks() -> Iterator[np.ndarray]:
        for raw in entry.chunks():
            data = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
            n = len(data) // row_bytes
            if entry.format in _FLOAT_FORMATS:
                values = to_f32(data.view(storage_dtype(entry.format)), entry.format.upper())
                values = np.asarray(values, dtype=np.float32).reshape(n, cols)
            else:
                values = _core.dequantize(entry.format, data.tobytes(), n, cols)
            if fmt in BLOCK_FORMATS:
                yield quantize_rows(values, fmt)
            else:
                yield convert_float(values, "F32", fmt)

    return TensorEntry(entry.name, fmt, entry.shape, chunks)


def _gguf_name(hf: str, arch: GGUFArch) -> str:
    for gguf_name, name in _global_names(arch).items():
        if name == hf:
            return gguf_name
    m = re.match(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$", hf)
    if m:
        for short, long in _layer_names(arch).items():
            if long == m.group(2):
                return f"blk.{m.group(1)}.{short}.{m.group(3)}"
    return hf


def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation: within each head, GGUF stores row
    (i, j) of HF's (2, half) rotary layout at position (j, i) of a (half, 2) layout."""
    if rows % (2 * heads):
        raise FormatError(f"{rows} q/k rows do not split into {heads} heads of rotary pairs")
    half = rows // heads // 2
    order: np.ndarray = np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(-1)
    return order


def _entry(gg: GGUFFile, t: GGUFTensor, hf: str, heads: Optional[int]) -> TensorEntry:
    order = unpermute_rows(t.shape[0], heads) if heads is not None else None
    if len(t.shape) == 1:

        def vector() -> Iterator[np.ndarray]:
            v = _float_vector(gg, t.name)
            yield v if order is None else v[order]

        return TensorEntry(hf, "f32", t.shape, vector)

    # Rows are contiguous and whole blocks (gguf.py checks), so any row order is a byte copy.
    fmt = t.format
    n_rows = t.shape[0]
    row_bytes = t.nbytes // n_rows
    dtype = storage_dtype(fmt)

    def chunks() -> Iterator[np.ndarray]:
        raw = np.frombuffer(gg.data(t.name), dtype=np.uint8).reshape(n_rows, row_bytes)
        step = max(1, CHUNK_BYTES // max(1, row_bytes))
        for start in range(0, n_rows, step):
            sel = raw[start : start + step] if order is None else raw[order[start : start + step]]
            yield np.ascontiguousarray(sel).view(dtype)

    return TensorEntry(hf, fmt, t.shape, chunks)


def _float_vector(gg: GGUFFile, name: str) -> np.ndarray:
    t = gg.tensors[name]
    if t.format not in _FLOAT_FORMATS or len(t.shape) != 1:
        raise FormatError(f"{gg.path}: tensor {name} must be a 1-D f32/f16/bf16 vector")
    raw = np.frombuffer(gg.data(name), dtype=storage_dtype(t.format))
    return np.asarray(to_f32(raw, t.format.upper()), dtype=np.float32)


# -- tokenizer and generation ------------------------------------------------------------------


def _tokenizer_section(tok: Any, md: Mapping[str, Any], source: str) -> dict[str, Any]:
    template = tok.chat_template
    if template is None:
        template = md.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise TemplateError(
            f"{source}: GGUF metadata tokenizer.chat_template must be a string, got "
            f"{type(template).__name__}"
        )
    return {
        "blob": TOKENIZER_BLOB,
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "pad_token": _token_text(md, "tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(tok.add_bos_token),
        "add_eos_token": bool(tok.add_eos_token),
        "chat_template": template,
        "config": {},
    }


def _generation_section(tok: Any, md: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "eos_token_ids": [int(i) for i in tok.end_of_turn_ids],
        "bos_token_id": _token_id(md, "tokenizer.ggml.bos_token_id"),
        "pad_token_id": _token_id(md, "tokenizer.ggml.padding_token_id"),
    }


def _token_id(md: Mapping[str, Any], key: str) -> Optional[int]:
    value = md.get(key)
    if value is None:
        return None
    tokens = md.get("tokenizer.ggml.tokens")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise FormatError(f"GGUF metadata {key} must be a token id, got {value!r}")
    if tokens is not None and value >= len(tokens):
        return None  # some files carry ids past the vocabulary; treat them as absent
    return int(value)


def _token_text(md: Mapping[str, Any], key: str) -> Optional[str]:
    token_id = _token_id(md, key)
    tokens = md.get("tokenizer.ggml.tokens")
    if token_id is None or tokens is None:
        return None
    return str(tokens[token_id])
