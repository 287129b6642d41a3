"""HF fixtures (tests/fixtures/hf-tiny) written as GGUF files by llama.cpp's own Python writer,
gguf-py: its `GGUFWriter`, its metadata key names and its HF -> GGUF tensor name table, with
the per-architecture choices llama.cpp's convert_hf_to_gguf.py makes for qwen3, lfm2 and granite.
Nothing of cellm's GGUF reader or name tables is used, so a converted file that reproduces the
HF reference logits checks cellm's mapping against llama.cpp's.

Not a test module: imported as `from gguf_py_fixtures import ...`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import gguf
import numpy as np

from cellm.convert.safetensors import open_checkpoint
from conftest import FIXTURES
from gguf_helpers import llama_cpp_permute, tokenizer_metadata

# A 2-D tensor's float32 values -> (stored array, ggml type) for `GGUFWriter.add_tensor`.
Packer = Callable[[np.ndarray], "tuple[np.ndarray, gguf.GGMLQuantizationType]"]
ARCHITECTURES = {"qwen3": gguf.MODEL_ARCH.QWEN3, "lfm2": gguf.MODEL_ARCH.LFM2}
ARCHITECTURES["granite"] = gguf.MODEL_ARCH.GRANITE


def _add_value(w: gguf.GGUFWriter, key: str, value: object) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, list(value))  # type: ignore[call-overload]


def _hyperparameters(w: gguf.GGUFWriter, arch: str, config: dict) -> None:
    """What convert_hf_to_gguf.py's TextModel.set_gguf_parameters and each model's override
    write for this config."""
    layers = config["num_hidden_layers"]
    kv_heads = config["num_key_value_heads"]
    w.add_block_count(layers)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_rope_freq_base(float(config["rope_parameters"]["rope_theta"]))
    w.add_vocab_size(config["vocab_size"])
    if "head_dim" in config:
        w.add_key_length(config["head_dim"])
        w.add_value_length(config["head_dim"])
    if arch == "lfm2":
        # LFM2Model: KV heads per layer, 0 on convolution layers; the adjusted FFN width.
        kinds = config["layer_types"]
        w.add_head_count_kv([kv_heads if k == "full_attention" else 0 for k in kinds])
        w.add_shortconv_l_cache(config["conv_L_cache"])
        w.add_layer_norm_rms_eps(float(config["norm_eps"]))
        ff = int(2 * config["intermediate_size"] / 3 * config["block_ffn_dim_multiplier"])
        multiple = config["block_multiple_of"]
        w.add_feed_forward_length(multiple * ((ff + multiple - 1) // multiple))
        return
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    w.add_feed_forward_length(config["intermediate_size"])
    if arch == "granite":
        w.add_attention_scale(float(config["attention_multiplier"]))
        w.add_embedding_scale(float(config["embedding_multiplier"]))
        w.add_residual_scale(float(config["residual_multiplier"]))
        w.add_logit_scale(float(config["logits_scaling"]))


def _stored(hf: str, w: np.ndarray, arch: str, config: dict) -> np.ndarray:
    """convert_hf_to_gguf.py's modify_tensors: llama's q/k permutation (granite inherits it),
    lfm2's Conv1d kernel squeezed to 2-D."""
    if arch == "granite" and ".q_proj." in hf:
        return llama_cpp_permute(w, config["num_attention_heads"])
    if arch == "granite" and ".k_proj." in hf:
        return llama_cpp_permute(w, config["num_key_value_heads"])
    if arch == "lfm2" and ".conv.conv." in hf:
        return w.squeeze(1)
    return w


def write_gguf_py(name: str, path: Path, pack: Optional[Packer] = None) -> Path:
    """Fixture `name` (a qwen3, lfm2 or granite checkpoint) as a GGUF file at `path`: vectors
    and convolution kernels as f32, matrices as f32 or, with `pack`, in the format it returns."""
    d = FIXTURES / name
    config = json.loads((d / "config.json").read_text())
    arch = config["model_type"]
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[ARCHITECTURES[arch]])
    w.add_name(f"tiny {name}")
    _hyperparameters(w, arch, config)
    for key, value in tokenizer_metadata(d, config, add_bos=False).items():
        _add_value(w, key, value)
    names = gguf.get_tensor_name_map(ARCHITECTURES[arch], config["num_hidden_layers"])
    with open_checkpoint(d) as ck:
        for hf in ck:
            gname = names.get_name(hf, try_suffixes=(".weight", ".bias"))
            assert gname is not None, hf
            values = _stored(hf, np.asarray(ck.view(hf), dtype=np.float32), arch, config)
            # lfm2's 3-tap convolution kernels stay f32, as llama.cpp's converter keeps them.
            if values.ndim == 2 and pack is not None and ".conv.conv." not in hf:
                data, qtype = pack(values)
                w.add_tensor(gname, data, raw_shape=values.shape, raw_dtype=qtype)
            else:
                w.add_tensor(gname, np.ascontiguousarray(values))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
