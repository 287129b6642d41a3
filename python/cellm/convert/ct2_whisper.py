"""CTranslate2 Whisper directory (faster-whisper's models: `model.bin`, `config.json`,
`tokenizer.json`) -> `.cellm`, read with `cellm.convert.ct2` (no ctranslate2 import).

CTranslate2's `WhisperSpec` keeps Whisper's tensors under its own names, with the attention
projections fused: the self-attention's q, k and v in one `linear_0` (k's bias stored as
zeros: Whisper's k projection has none), the cross-attention's k and v in one `linear_1`.
They are split back into HF's names and shapes, the model's shape is read from the tensors,
and the rest of the conversion is the HF path's (`hf_convert.convert_loaded`): same
description, same tensor names, f16 kept (or f32, bf16, or quantized like the text models).
int8/int16 CTranslate2 weights are dequantized (`q / scale`) first.

The directory's `config.json` gives the suppress lists (`suppress_ids`,
`suppress_ids_begin`); `tokenizer.json` is HF's Whisper tokenizer, embedded as is."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from ..errors import FormatError, UnsupportedArchitecture
from .ct2 import FLOAT_NAMES, Ct2Model, is_ct2_model
from .dtypes import check_format
from .jsonfiles import parse_json_object, read_bytes, read_json
from .quantize import plan_quantization
from .safetensors import TensorInfo
from .tokenizer_files import TOKENIZER_BLOB, TokenizerFiles
from .writer import check_output_is_not_input

MODEL_BIN = "model.bin"
SPEC = "WhisperSpec"
MAX_REVISION = 3
# CTranslate2's Activation enum -> HF's activation_function.
_ACTIVATIONS = {3: "gelu", 1: "gelu_pytorch_tanh"}
_LAYER = re.compile(r"^(encoder|decoder)/layer_(\d+)/ffn/linear_0/weight$")


def is_ct2_whisper_dir(path: Union[str, os.PathLike[str]]) -> bool:
    """Whether `path` is a directory holding a CTranslate2 `model.bin`."""
    p = Path(path)
    return p.is_dir() and is_ct2_model(p / MODEL_BIN)


@dataclass(frozen=True)
class _Source:
    variable: str
    rows: Optional[tuple[int, int]] = None  # a row range of a fused projection


class Ct2WhisperCheckpoint:
    """A CTranslate2 Whisper model seen under HF's tensor names (the `Checkpoint` interface
    `hf_convert.convert_loaded` reads)."""

    def __init__(self, model: Ct2Model) -> None:
        if model.spec != SPEC:
            raise UnsupportedArchitecture(
                f"{model.path}: a CTranslate2 {model.spec or 'unnamed'} model; only {SPEC} "
                "(Whisper) converts"
            )
        if model.revision > MAX_REVISION:
            raise UnsupportedArchitecture(
                f"{model.path}: {SPEC} revision {model.revision} is newer than this reader's "
                f"({MAX_REVISION})"
            )
        self.model = model
        self.source = model.path
        self.sources: dict[str, _Source] = {}
        self._cache: dict[str, tuple[np.ndarray, str]] = {}
        d = model.variable("decoder/embeddings/weight").shape[1]
        self._map_top()
        for side, i in _layers(model):
            self._map_layer(side, i, d)

    def _add(self, name: str, variable: str, rows: Optional[tuple[int, int]] = None) -> None:
        if variable not in self.model:
            raise FormatError(f"{self.model.path} has no variable {variable} (for {name})")
        self.sources[name] = _Source(variable, rows)

    def _norm(self, name: str, variable: str) -> None:
        self._add(f"{name}.weight", f"{variable}/gamma")
        self._add(f"{name}.bias", f"{variable}/beta")

    def _linear(self, name: str, variable: str, rows: Optional[tuple[int, int]] = None) -> None:
        self._add(f"{name}.weight", f"{variable}/weight", rows)
        self._add(f"{name}.bias", f"{variable}/bias", rows)

    def _map_top(self) -> None:
        for n in (1, 2):
            self._linear(f"model.encoder.conv{n}", f"encoder/conv{n}")
        self._add("model.encoder.embed_positions.weight", "encoder/position_encodings/encodings")
        self._norm("model.encoder.layer_norm", "encoder/layer_norm")
        self._add("model.decoder.embed_tokens.weight", "decoder/embeddings/weight")
        self._add("model.decoder.embed_positions.weight", "decoder/position_encodings/encodings")
        self._norm("model.decoder.layer_norm", "decoder/layer_norm")

    def _map_layer(self, side: str, i: int, d: int) -> None:
        hf = f"model.{side}.layers.{i}"
        ct = f"{side}/layer_{i}"
        qkv = f"{ct}/self_attention/linear_0"
        self._linear(f"{hf}.self_attn.q_proj", qkv, (0, d))
        self._add(f"{hf}.self_attn.k_proj.weight", f"{qkv}/weight", (d, 2 * d))
        self._linear(f"{hf}.self_attn.v_proj", qkv, (2 * d, 3 * d))
        self._linear(f"{hf}.self_attn.out_proj", f"{ct}/self_attention/linear_1")
        self._norm(f"{hf}.self_attn_layer_norm", f"{ct}/self_attention/layer_norm")
        if side == "decoder":
            cross = f"{ct}/attention"
            self._linear(f"{hf}.encoder_attn.q_proj", f"{cross}/linear_0")
            self._add(f"{hf}.encoder_attn.k_proj.weight", f"{cross}/linear_1/weight", (0, d))
            self._linear(f"{hf}.encoder_attn.v_proj", f"{cross}/linear_1", (d, 2 * d))
            self._linear(f"{hf}.encoder_attn.out_proj", f"{cross}/linear_2")
            self._norm(f"{hf}.encoder_attn_layer_norm", f"{cross}/layer_norm")
        self._norm(f"{hf}.final_layer_norm", f"{ct}/ffn/layer_norm")
        self._linear(f"{hf}.fc1", f"{ct}/ffn/linear_0")
        self._linear(f"{hf}.fc2", f"{ct}/ffn/linear_1")

    # -- the Checkpoint interface ------------------------------------------------------------

    def __contains__(self, name: object) -> bool:
        return name in self.sources

    def __iter__(self) -> Iterator[str]:
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)

    def _whole(self, variable: str) -> tuple[np.ndarray, str]:
        if variable not in self._cache:
            self._cache.clear()  # the fused projections are read in order: keep one
            self._cache[variable] = self.model.weight(variable)
        return self._cache[variable]

    def view(self, name: str) -> np.ndarray:
        src = self.sources[name]
        array, _ = self._whole(src.variable)
        if src.rows is not None:
            lo, hi = src.rows
            if array.shape[0] < hi:
                raise FormatError(
                    f"{self.model.path}: {src.variable} has {array.shape[0]} rows, "
                    f"{name} needs rows {lo}..{hi}"
                )
            array = array[lo:hi]
        return array

    def info(self, name: str) -> TensorInfo:
        src = self.sources[name]
        var = self.model.variable(src.variable)
        shape = var.shape
        if src.rows is not None:
            shape = (src.rows[1] - src.rows[0], *shape[1:])
        # Quantized variables are dequantized to float32.
        stored = FLOAT_NAMES.get(var.dtype, "F32")
        return TensorInfo(name, stored, shape, self.model.path, var.start, var.end)

    def close(self) -> None:
        self._cache.clear()
        self.model.close()

    def __enter__(self) -> Ct2WhisperCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _layers(model: Ct2Model) -> list[tuple[str, int]]:
    found = [(m.group(1), int(m.group(2))) for n in model if (m := _LAYER.match(n))]
    return sorted(found)


def _count(model: Ct2Model, side: str) -> int:
    indices = sorted(i for s, i in _layers(model) if s == side)
    if indices != list(range(len(indices))) or not indices:
        raise FormatError(f"{model.path}: the {side} layers are not numbered 0..n-1")
    return len(indices)


def whisper_config(model: Ct2Model, ct2_config: dict[str, Any]) -> dict[str, Any]:
    """The HF `WhisperConfig` that matches `model`, read off its tensors and scalars."""
    path = model.path
    checks = {
        "decoder/pre_norm": 1,
        "decoder/scale_embeddings": 0,
        "decoder/alibi": 0,
        "decoder/start_from_zero_embedding": 0,
    }
    for name, want in checks.items():
        if name in model and model.scalar(name) != want:
            raise UnsupportedArchitecture(f"{path}: {name} is {model.scalar(name)}, not {want}")
    act_id = model.scalar("decoder/activation") if "decoder/activation" in model else 3
    if act_id not in _ACTIVATIONS:
        raise UnsupportedArchitecture(f"{path}: decoder activation {act_id} is not supported")
    projection = "decoder/projection/weight"
    if projection in model and model.resolve(projection) != "decoder/embeddings/weight":
        same = np.array_equal(model.raw(projection), model.raw("decoder/embeddings/weight"))
        if not same:
            raise UnsupportedArchitecture(
                f"{path}: the output projection is not the token embedding (untied Whisper "
                "models are not supported)"
            )
    vocab, d = model.variable("decoder/embeddings/weight").shape
    conv1 = model.variable("encoder/conv1/weight").shape
    if len(conv1) != 3 or conv1[0] != d:
        raise FormatError(f"{path}: encoder/conv1/weight has shape {list(conv1)}")
    enc_ffn = model.variable("encoder/layer_0/ffn/linear_0/weight").shape[0]
    dec_ffn = model.variable("decoder/layer_0/ffn/linear_0/weight").shape[0]
    config = {
        "model_type": "whisper",
        "architectures": ["WhisperForConditionalGeneration"],
        "vocab_size": vocab,
        "d_model": d,
        "num_mel_bins": conv1[1],
        "encoder_layers": _count(model, "encoder"),
        "decoder_layers": _count(model, "decoder"),
        "encoder_attention_heads": model.scalar("encoder/num_heads"),
        "decoder_attention_heads": model.scalar("decoder/num_heads"),
        "encoder_ffn_dim": enc_ffn,
        "decoder_ffn_dim": dec_ffn,
        "max_source_positions": model.variable("encoder/position_encodings/encodings").shape[0],
        "max_target_positions": model.variable("decoder/position_encodings/encodings").shape[0],
        "activation_function": _ACTIVATIONS[act_id],
        "scale_embedding": False,
        "tie_word_embeddings": True,
    }
    if "suppress_ids" in ct2_config:
        config["suppress_tokens"] = _int_list(ct2_config["suppress_ids"], "suppress_ids", path)
    if "suppress_ids_begin" in ct2_config:
        config["begin_suppress_tokens"] = _int_list(
            ct2_config["suppress_ids_begin"], "suppress_ids_begin", path
        )
    return config


def _int_list(value: Any, key: str, path: Path) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise FormatError(f"{path.parent / 'config.json'}: {key} must be a list of token ids")
    return [int(v) for v in value]


def _tokenizer_files(src: Path, config: dict[str, Any]) -> TokenizerFiles:
    tok_path = src / "tokenizer.json"
    if not tok_path.is_file():
        raise FormatError(f"{src} has no tokenizer.json (the Whisper tokenizer is needed)")
    tok_bytes = read_bytes(tok_path)
    tok = parse_json_object(tok_bytes, str(tok_path))
    added = {t.get("content"): t.get("id") for t in tok.get("added_tokens", [])}
    eot = added.get("<|endoftext|>")
    if not isinstance(eot, int):
        raise FormatError(f"{tok_path} has no <|endoftext|> token (not a Whisper tokenizer)")
    tokenizer = {
        "blob": TOKENIZER_BLOB,
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": None,
        "config": {},
    }
    generation: dict[str, Any] = {
        "eos_token_ids": [eot],
        "bos_token_id": eot,
        "pad_token_id": eot,
        "decoder_start_token_id": added.get("<|startoftranscript|>"),
    }
    for key in ("suppress_tokens", "begin_suppress_tokens"):
        if key in config:
            generation[key] = config[key]
    return TokenizerFiles(tokenizer, generation, tok_bytes)


def convert_ct2_whisper(
    input_path: Union[str, os.PathLike[str]],
    output_path: Union[str, os.PathLike[str]],
    dtype: str = "f16",
    progress: Optional[bool] = None,
    quantize: Optional[str] = None,
    group_size: Optional[int] = None,
    embedding: Optional[str] = None,
) -> Path:
    """Convert a CTranslate2 Whisper directory (or its `model.bin`, with `config.json` and
    `tokenizer.json` beside it) to a `.cellm` file; return its path. `dtype` and the
    quantization options are `convert_hf`'s."""
    from .hf_convert import Converting, convert_loaded

    check_format(dtype)
    quantization = plan_quantization(quantize, group_size, embedding)
    src = Path(input_path)
    if src.is_file():
        src = src.parent
    if not (src / MODEL_BIN).exists():
        raise FormatError(f"{src} has no {MODEL_BIN} (not a CTranslate2 model directory)")
    check_output_is_not_input(output_path, src)
    ct2_config = read_json(src / "config.json", required=False) or {}
    with Ct2WhisperCheckpoint(Ct2Model(src / MODEL_BIN)) as checkpoint:
        model = checkpoint.model
        config = whisper_config(model, ct2_config)
        record = {
            "kind": "ctranslate2",
            "dtype": dtype,
            "ctranslate2": {
                "binary_version": model.version,
                "spec": model.spec,
                "revision": model.revision,
                "weights": model.variable("decoder/embeddings/weight").dtype,
            },
        }
        how = Converting(
            src,
            str(src / MODEL_BIN),
            dtype,
            quantization,
            None,
            tokenizer_files=lambda: _tokenizer_files(src, config),
        )
        return convert_loaded(
            checkpoint,  # the TensorSource interface, duck-typed
            config,
            output_path,
            how,
            record,
            progress,
        )
