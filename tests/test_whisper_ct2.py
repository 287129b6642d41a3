"""Whisper from CTranslate2's `model.bin` (faster-whisper's format), read without ctranslate2
(`cellm.convert.ct2_whisper`). The files under test are written by ctranslate2 itself: the
HF fixture's weights (tests/fixtures/mm/whisper) put into its `WhisperSpec` as its
transformers loader does (q/k/v fused, k's bias zero, the cross-attention's k/v fused, the
projection tied), optimized (its own float16/int8 quantizer) and saved by `spec.save`. The
converted model then runs against the fixture's HF transformers reference.

Tolerances: float32 is the HF path's 1e-3 (measured 4e-6: same weights, same engine). float16
equals the HF checkpoint converted at f16 (the same rounding of the same weights; only its
f32 tensors, which ctranslate2 also rounds to f16, differ); its logits move by up to 2.6e-3
from HF's f32 ones (bound 1e-2). int8 (127 / row max, CTranslate2's scheme, dequantized to f32 here)
moves these random-weight logits by up to 0.05 (measured 0.051): bound 0.15, greedy ids
equal. Then bad files: one line, exit 2.

ctranslate2 comes with faster-whisper (installed by .ci/run); CELLM_REQUIRE_PEER=1 makes its
absence a failure instead of a skip."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cellm
from cellm.convert import convert, convert_ct2_whisper, convert_hf, read_header
from cellm.convert.safetensors import open_checkpoint
from cellm.errors import FormatError, UnsupportedArchitecture

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "mm" / "whisper"
REF = json.loads((FIXTURE / "reference.json").read_text())
ARRAYS = dict(np.load(FIXTURE / "reference.npz"))
IDS = REF["decoder_prefix"] + REF["greedy_ids"][:-1]
PREFIX = len(REF["decoder_prefix"])


@pytest.fixture(scope="module")
def ct2():
    try:
        from ctranslate2.specs import whisper_spec
    except ImportError:
        if os.environ.get("CELLM_REQUIRE_PEER") == "1":
            raise
        pytest.skip("ctranslate2 is not installed (faster-whisper brings it; see .ci/run)")
    return whisper_spec


def write_ct2(whisper_spec, out: Path, quantization: str) -> Path:
    """The fixture as ctranslate2 saves it, in directory `out` (plus tokenizer.json)."""
    cfg = json.loads((FIXTURE / "config.json").read_text())
    ck = open_checkpoint(FIXTURE)

    def g(name: str) -> np.ndarray:
        return np.array(ck.view(name), dtype=np.float32)

    def linear(spec, name: str) -> None:
        spec.weight = g(f"{name}.weight")
        spec.bias = g(f"{name}.bias")

    def norm(spec, name: str) -> None:
        spec.gamma, spec.beta = g(f"{name}.weight"), g(f"{name}.bias")

    def attention(spec, name: str, self_attention: bool) -> None:
        q, k, v = (g(f"{name}.{x}_proj.weight") for x in "qkv")
        qb, vb = g(f"{name}.q_proj.bias"), g(f"{name}.v_proj.bias")
        kb = np.zeros_like(qb)  # ctranslate2's fuse_linear: a missing bias is zeros
        if self_attention:
            spec.linear[0].weight = np.concatenate([q, k, v])
            spec.linear[0].bias = np.concatenate([qb, kb, vb])
        else:
            spec.linear[0].weight, spec.linear[0].bias = q, qb
            spec.linear[1].weight = np.concatenate([k, v])
            spec.linear[1].bias = np.concatenate([kb, vb])
        linear(spec.linear[-1], f"{name}.out_proj")

    def layer(spec, name: str, cross: bool) -> None:
        attention(spec.self_attention, f"{name}.self_attn", True)
        norm(spec.self_attention.layer_norm, f"{name}.self_attn_layer_norm")
        if cross:
            attention(spec.attention, f"{name}.encoder_attn", False)
            norm(spec.attention.layer_norm, f"{name}.encoder_attn_layer_norm")
        linear(spec.ffn.linear_0, f"{name}.fc1")
        linear(spec.ffn.linear_1, f"{name}.fc2")
        norm(spec.ffn.layer_norm, f"{name}.final_layer_norm")

    spec = whisper_spec.WhisperSpec(
        cfg["encoder_layers"],
        cfg["encoder_attention_heads"],
        cfg["decoder_layers"],
        cfg["decoder_attention_heads"],
    )
    enc, dec = spec.encoder, spec.decoder
    linear(enc.conv1, "model.encoder.conv1")
    linear(enc.conv2, "model.encoder.conv2")
    enc.position_encodings.encodings = g("model.encoder.embed_positions.weight")
    norm(enc.layer_norm, "model.encoder.layer_norm")
    for i, spec_layer in enumerate(enc.layer):
        layer(spec_layer, f"model.encoder.layers.{i}", cross=False)
    dec.embeddings.weight = g("model.decoder.embed_tokens.weight")
    dec.position_encodings.encodings = g("model.decoder.embed_positions.weight")
    norm(dec.layer_norm, "model.decoder.layer_norm")
    dec.projection.weight = g("model.decoder.embed_tokens.weight")  # saved as an alias
    for i, spec_layer in enumerate(dec.layer):
        layer(spec_layer, f"model.decoder.layers.{i}", cross=True)
    spec.register_vocabulary([f"t{i}" for i in range(cfg["vocab_size"])])
    spec.config.suppress_ids = [5, 6]
    spec.config.suppress_ids_begin = cfg["begin_suppress_tokens"]
    spec.config.lang_ids = []
    spec.config.alignment_heads = [[1, 0]]
    spec.validate()
    spec.optimize(quantization=quantization)
    out.mkdir(parents=True, exist_ok=True)
    spec.save(str(out))
    ck.close()
    shutil.copy(FIXTURE / "tokenizer.json", out / "tokenizer.json")
    return out


@pytest.fixture(scope="module")
def saved(ct2, tmp_path_factory):
    root = tmp_path_factory.mktemp("ct2")
    cache: dict[str, Path] = {}

    def get(quantization: str) -> Path:
        if quantization not in cache:
            cache[quantization] = write_ct2(ct2, root / quantization, quantization)
        return cache[quantization]

    return get


def _run(path: Path) -> tuple[np.ndarray, np.ndarray]:
    w = cellm.Whisper(path, kv_encoding="f32")
    return w.logits(FIXTURE / "audio.wav", IDS), w.encoder_states(ARRAYS["input_features"])


def test_float32_matches_transformers(saved, tmp_path):
    path = convert_ct2_whisper(saved("float32"), tmp_path / "w.cellm", "f32")
    logits, states = _run(path)
    np.testing.assert_allclose(states, ARRAYS["encoder_states"], rtol=0, atol=1e-3)
    np.testing.assert_allclose(logits, ARRAYS["logits"], rtol=0, atol=1e-3)
    assert logits.argmax(-1)[PREFIX - 1 :].tolist() == REF["greedy_ids"]
    header = read_header(path)
    assert header["source"]["kind"] == "ctranslate2"
    assert header["source"]["ctranslate2"]["spec"] == "WhisperSpec"
    assert header["generation"]["suppress_tokens"] == [5, 6]
    assert header["generation"]["begin_suppress_tokens"] == [220, 50256]
    # The HF path's description, exactly.
    hf = read_header(convert_hf(FIXTURE, tmp_path / "hf.cellm", "f32"))
    assert header["model"] == hf["model"]
    assert [t["name"] for t in header["tensors"]] == [t["name"] for t in hf["tensors"]]


def test_float16_is_the_hf_checkpoint_at_f16(saved, tmp_path):
    """Kept f16 by default: the matrices are the HF checkpoint's at f16, bit for bit; what
    the engine reads as f32 (vectors, position tables), which ctranslate2 rounds to f16
    too, is that rounding of the HF values, widened."""
    from cellm.convert.writer import read_tensor

    path = convert(saved("float16"), tmp_path / "w.cellm")  # the dispatcher finds model.bin
    hf = convert_hf(FIXTURE, tmp_path / "hf.cellm", "f16")
    assert {t["format"] for t in read_header(path)["tensors"]} == {"f16", "f32"}
    for t in read_header(hf)["tensors"]:
        ours, theirs = read_tensor(path, t["name"]), read_tensor(hf, t["name"])
        if theirs.dtype == np.float32:
            theirs = theirs.astype(np.float16).astype(np.float32)
        np.testing.assert_array_equal(ours, theirs)
    # f16 weights move these random-weight logits by up to 2.6e-3 from HF's f32 ones.
    logits, _ = _run(path)
    np.testing.assert_allclose(logits, ARRAYS["logits"], rtol=0, atol=1e-2)
    assert logits.argmax(-1)[PREFIX - 1 :].tolist() == REF["greedy_ids"]


def test_int8_dequantized_and_requantized(saved, tmp_path):
    path = convert_ct2_whisper(saved("int8"), tmp_path / "w.cellm", "f32")
    logits, states = _run(path)
    np.testing.assert_allclose(logits, ARRAYS["logits"], rtol=0, atol=0.15)
    assert logits.argmax(-1)[PREFIX - 1 :].tolist() == REF["greedy_ids"]
    # And quantized again like the text models (cellm's int8 rows): it still runs.
    q = convert_ct2_whisper(saved("int8"), tmp_path / "q.cellm", quantize="int8")
    assert read_header(q)["source"]["quantize"] == "int8"
    logits_q, _ = _run(q)
    assert logits_q.argmax(-1)[PREFIX - 1 :].tolist() == REF["greedy_ids"]


def test_a_model_bin_path_and_whisper_take_the_directory(saved, tmp_path, monkeypatch):
    monkeypatch.setenv("CELLM_CACHE_DIR", str(tmp_path / "cache"))
    a = convert(saved("float32") / "model.bin", tmp_path / "a.cellm", "f32")
    assert read_header(a)["source"]["kind"] == "ctranslate2"
    w = cellm.Whisper(saved("float32"))  # converted once into the cache
    assert w.logits(FIXTURE / "audio.wav", IDS).shape == ARRAYS["logits"].shape


# --- bad files ---------------------------------------------------------------------------


def _string(s: str) -> bytes:
    raw = s.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def _model_dir(tmp_path: Path, data: bytes) -> Path:
    d = tmp_path / "ct2"
    d.mkdir(exist_ok=True)
    (d / "model.bin").write_bytes(data)
    shutil.copy(FIXTURE / "tokenizer.json", d / "tokenizer.json")
    return d


def _header(spec: str = "WhisperSpec", version: int = 6) -> bytes:
    return struct.pack("<I", version) + _string(spec) + struct.pack("<I", 3)


BAD = {
    "truncated": (_header() + struct.pack("<I", 1) + _string("x"), FormatError, "truncated"),
    "old-version": (_header(version=2) + b"\0" * 16, FormatError, "binary version 2"),
    "other-spec": (_header("TransformerSpec") + b"\0" * 8, UnsupportedArchitecture, "WhisperSpec"),
    "bad-size": (
        _header() + struct.pack("<I", 1) + _string("a") + struct.pack("<BIBI", 1, 4, 0, 3),
        FormatError,
        "needs 16",
    ),
    "trailing": (_header() + struct.pack("<II", 0, 0) + b"xx", FormatError, "follow"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_model_bin(case, tmp_path):
    data, error, needle = BAD[case]
    with pytest.raises(error, match=needle):
        convert_ct2_whisper(_model_dir(tmp_path, data), tmp_path / "out.cellm")
    assert not (tmp_path / "out.cellm").exists()


def test_bad_model_bin_on_the_cli(tmp_path):
    d = _model_dir(tmp_path, _header() + struct.pack("<I", 1) + _string("x"))
    r = subprocess.run(
        [sys.executable, "-m", "cellm.convert", "-i", str(d), "-o", str(tmp_path / "o.cellm")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1
    assert "truncated" in r.stderr
