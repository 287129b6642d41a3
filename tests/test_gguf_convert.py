"""GGUF -> .cellm conversion against the HF path, quantized (q8_0) tensors, dispatch of
`convert` and model resolution of .gguf paths, the CLI, and requantizing GGUF models.

The GGUF files are built from the HF fixtures (tests/fixtures/hf-tiny) by tests/gguf_helpers.py
the way llama.cpp's convert_hf_to_gguf.py writes them, q/k row permutation of llama included,
so converting them back must give the HF description and the HF reference logits (the
`from_gguf` fixture of conftest.py converts each variant once per session).

Tests that run a quantized model need the engine's block-format kernels (marked `quant_engine`
in their names); the rest run on f32 / f16 tensors only. Bad GGUF input is tested in
test_gguf_bad_input.py, the model registry and fetching in test_fetch.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cellm import LLM
from cellm.convert import convert, convert_gguf, convert_hf, read_header
from cellm.convert.gguf_convert import unpermute_rows
from cellm.convert.interleave import deinterleave_rows
from cellm.convert.safetensors import open_checkpoint
from cellm.convert.writer import data_offset, read_tensor
from cellm.errors import FormatError, InvalidArgument
from conftest import FIXTURES, Reference
from gguf_helpers import llama_cpp_permute, quantize_q8_0, run_convert_cli

ATOL = 1e-3


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


def test_cli_converts_gguf(from_gguf, gguf_dir, tmp_path):
    from_gguf("qwen2")
    proc = run_convert_cli(
        "--input", str(gguf_dir / "qwen2.gguf"), "--output", str(tmp_path / "q.cellm")
    )
    assert proc.returncode == 0, proc.stderr
    assert "from GGUF" in proc.stdout
    assert read_header(tmp_path / "q.cellm")["model"]["model_type"] == "qwen2"


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
