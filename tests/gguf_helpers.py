"""Shared helpers of the GGUF tests (test_gguf_convert.py, test_gguf_bad_input.py and the
`from_gguf` fixture of conftest.py): a minimal GGUF v3 writer, ggml's reference q8_0, and the HF
fixtures (tests/fixtures/hf-tiny) written as GGUF files the way llama.cpp's convert_hf_to_gguf.py
writes them, q/k row permutation of llama included.

Not a test module: imported as `from gguf_helpers import ...` (tests/ is on sys.path, as for
conftest).
"""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np

from cellm.convert.safetensors import open_checkpoint
from conftest import FIXTURES, ROOT

# -- a minimal GGUF v3 writer -------------------------------------------------------------

GGML_F32, GGML_F16, GGML_Q8_0, GGML_Q2_K = 0, 1, 8, 10
BLOCK_SIZES = {GGML_F32: (1, 4), GGML_F16: (1, 2), GGML_Q8_0: (32, 34), GGML_Q2_K: (256, 84)}
T_U32, T_I32, T_F32, T_BOOL, T_STRING, T_ARRAY = 4, 5, 6, 7, 8, 9


def _gguf_str(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _gguf_value(value) -> tuple[int, bytes]:
    if isinstance(value, bool):
        return T_BOOL, struct.pack("<?", value)
    if isinstance(value, int):
        if value >= 0:
            return T_U32, struct.pack("<I", value)
        return T_I32, struct.pack("<i", value)
    if isinstance(value, float):
        return T_F32, struct.pack("<f", value)
    if isinstance(value, str):
        return T_STRING, _gguf_str(value)
    if isinstance(value, (list, tuple)):
        if all(isinstance(v, str) for v in value):
            items = b"".join(_gguf_str(v) for v in value)
            return T_ARRAY, struct.pack("<IQ", T_STRING, len(value)) + items
        arr = np.asarray(value, dtype="<i4")
        return T_ARRAY, struct.pack("<IQ", T_I32, arr.size) + arr.tobytes()
    raise TypeError(value)


def write_gguf(path: Path, metadata: dict, tensors: list, alignment: int = 32) -> Path:
    """`tensors`: (name, ggml_type, row-major shape, raw bytes)."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata)))
    for key, value in metadata.items():
        vtype, raw = _gguf_value(value)
        out += _gguf_str(key) + struct.pack("<I", vtype) + raw
    offset, datas = 0, []
    for name, gtype, shape, data in tensors:
        block, block_bytes = BLOCK_SIZES[gtype]
        assert len(data) == math.prod(shape) // block * block_bytes, name
        out += _gguf_str(name) + struct.pack("<I", len(shape))
        out += b"".join(struct.pack("<Q", d) for d in reversed(shape))  # innermost first
        out += struct.pack("<IQ", gtype, offset)
        datas.append((offset, data))
        offset = -(-(offset + len(data)) // alignment) * alignment
    out += bytes(-len(out) % alignment)
    start = len(out)
    for rel, data in datas:
        out += bytes(start + rel - len(out)) + data
    path.write_bytes(bytes(out))
    return path


def quantize_q8_0(x: np.ndarray) -> bytes:
    """ggml's reference q8_0: per 32 values an f16 scale d = max|x| / 127 and 32 int8."""
    blocks = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, 32)
    d = np.abs(blocks).max(axis=1) / 127
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    q = np.round(blocks * inv[:, None]).astype(np.int8)
    out = np.empty((blocks.shape[0], 34), dtype=np.uint8)
    out[:, :2] = d.astype("<f2").view(np.uint8).reshape(-1, 2)
    out[:, 2:] = q.view(np.uint8)
    return out.tobytes()


def dequantize_q8_0(raw: bytes, shape: tuple[int, ...]) -> np.ndarray:
    blocks = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 34)
    d = blocks[:, :2].copy().view("<f2").astype(np.float32)
    q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
    return (q * d).reshape(shape)


# -- HF fixture -> GGUF, as llama.cpp's convert_hf_to_gguf.py does it ---------------------------

_HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# llama.cpp's gemma3 names: its "ffn_norm" is the pre-feed-forward norm.
_GEMMA3_TO_GGUF = {
    **_HF_TO_GGUF,
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py `LlamaModel.permute` (HF half-split -> interleaved rotary rows)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama3_rope_factors(config: dict) -> np.ndarray:
    """convert_hf_to_gguf.py's `rope_freqs.weight` for llama3 rope scaling."""
    rope = config["rope_parameters"]
    base, dim = rope["rope_theta"], config["head_dim"]
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def tokenizer_metadata(d: Path, config: dict, add_bos: bool) -> dict:
    tok = json.loads((d / "tokenizer.json").read_text())
    tc = json.loads((d / "tokenizer_config.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [None] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    types = [1] * len(tokens)
    for added in tok["added_tokens"]:
        types[added["id"]] = 3 if added["special"] else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
    }
    for key, value in (
        ("bos_token_id", config.get("bos_token_id")),
        ("eos_token_id", config.get("eos_token_id")),
        ("padding_token_id", vocab.get(tc.get("pad_token"))),
    ):
        if value is not None:
            md[f"tokenizer.ggml.{key}"] = value
    md["tokenizer.ggml.add_bos_token"] = add_bos
    md["tokenizer.chat_template"] = (d / "chat_template.jinja").read_text()
    return md


def hf_fixture_to_gguf(
    name: str,
    path: Path,
    *,
    quant: bool = False,
    dequantized: bool = False,
    vectors_f16: bool = False,
    untie: bool = False,
    v_apart: bool = False,
) -> Path:
    """Write fixture `name` as a GGUF file. `quant`: 2-D tensors as q8_0; `dequantized`: f32
    tensors holding the q8_0-rounded values; `vectors_f16`: 1-D tensors as f16; `untie`: store
    an explicit output.weight (a copy of the embedding); `v_apart` (with `quant`): the value
    projections as f32 holding their q8_0-rounded values (q|k and v in two formats, as
    Q4_K_M files often keep v)."""
    d = FIXTURES / name
    config = json.loads((d / "config.json").read_text())
    arch = config["model_type"].removesuffix("_text")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    md = {
        "general.architecture": arch,
        "general.name": f"tiny {name}",
        "general.file_type": 7 if quant else 0,
        f"{arch}.block_count": config["num_hidden_layers"],
        f"{arch}.context_length": config["max_position_embeddings"],
        f"{arch}.embedding_length": config["hidden_size"],
        f"{arch}.feed_forward_length": config["intermediate_size"],
        f"{arch}.attention.head_count": heads,
        f"{arch}.attention.head_count_kv": kv_heads,
        f"{arch}.rope.freq_base": float(_rope(config)["rope_theta"]),
        f"{arch}.attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
    }
    if "head_dim" in config:
        md[f"{arch}.attention.key_length"] = config["head_dim"]
        md[f"{arch}.attention.value_length"] = config["head_dim"]
    if arch == "llama":
        md[f"{arch}.vocab_size"] = config["vocab_size"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        md[f"{arch}.rope.dimension_count"] = head_dim
    if arch == "gemma3":
        md[f"{arch}.attention.sliding_window"] = config["sliding_window"]
        # This fixture's layer pattern is not llama.cpp's default of 6, so spell it out.
        sliding = [t == "sliding_attention" for t in config["layer_types"]]
        md[f"{arch}.attention.sliding_window_pattern"] = sliding
    md.update(tokenizer_metadata(d, config, add_bos=arch in ("llama", "gemma3")))

    tensors = []
    if _rope(config)["rope_type"] == "llama3":
        factors = llama3_rope_factors(config)
        tensors.append(("rope_freqs.weight", GGML_F32, factors.shape, factors.tobytes()))
    with open_checkpoint(d) as ck:
        names = list(ck)
        if untie:
            names.append("lm_head.weight")
        for hf in names:
            w = np.asarray(ck.view("model.embed_tokens.weight" if hf == "lm_head.weight" else hf))
            w = w.astype(np.float32)
            if arch == "llama" and ".q_proj." in hf:  # qwen2 GGUFs are not permuted
                w = llama_cpp_permute(w, heads)
            elif arch == "llama" and ".k_proj." in hf:
                w = llama_cpp_permute(w, kv_heads)
            if arch == "gemma3" and hf.endswith("norm.weight"):
                w = w + np.float32(1)  # llama.cpp's Gemma3Model stores 1 + w
            gname = _gguf_tensor_name(hf, _GEMMA3_TO_GGUF if arch == "gemma3" else _HF_TO_GGUF)
            if w.ndim == 1:
                if vectors_f16:
                    tensors.append((gname, GGML_F16, w.shape, w.astype("<f2").tobytes()))
                else:
                    tensors.append((gname, GGML_F32, w.shape, w.tobytes()))
            elif (quant and v_apart and ".v_proj." in hf) or dequantized:
                deq = dequantize_q8_0(quantize_q8_0(w), w.shape)
                tensors.append((gname, GGML_F32, w.shape, deq.tobytes()))
            elif quant:
                tensors.append((gname, GGML_Q8_0, w.shape, quantize_q8_0(w)))
            else:
                tensors.append((gname, GGML_F32, w.shape, w.tobytes()))
    return write_gguf(path, md, tensors)


def _rope(config: dict) -> dict:
    """The (full-attention) rope parameters of a transformers 5 config."""
    params = config["rope_parameters"]
    return params.get("full_attention", params)


def _gguf_tensor_name(hf: str, names: dict = _HF_TO_GGUF) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in fixed:
        return fixed[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{names[module]}.{kind}"


def run_convert_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cellm.convert", *args], capture_output=True, text=True, cwd=ROOT
    )
