"""GGUF's 1-bit `q1_0` (PrismML's Q1_0_g128, Bonsai's format): decoding against a numpy
transcription of ggml's definition, `--quantize q1_0` against llama.cpp's own quantizer byte for
byte, and a model of llama.cpp-written q1_0 blocks against llama.cpp itself on the same file.

The llama.cpp tests need llama-cpp-python (built by .ci/run; CELLM_REQUIRE_PEER=1 makes its
absence a failure); the random-weight model is benches/random_gguf.py's, quantized by llama.cpp.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest

from cellm import LLM, _core
from cellm.convert import convert_gguf, read_header
from cellm.convert.gguf import GGUFFile
from cellm.convert.quantize import quantize_rows
from cellm.convert.writer import data_offset
from cellm.parity import LlamaCpp, compare_logits
from conftest import ROOT
from test_quantize import adversarial_rows


def decode_q1_0(data: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """ggml's dequantize_row_q1_0: per 128 values an f16 `d`, then bit `i % 8` of byte
    `i / 8` gives `+d` (set) or `-d`."""
    blocks = data.reshape(-1, 18)
    d = blocks[:, :2].copy().view("<f2").astype(np.float32)
    bits = np.unpackbits(blocks[:, 2:], axis=1, bitorder="little").astype(np.float32)
    return (d * (2 * bits - 1)).reshape(rows, cols)


@pytest.mark.parametrize("isa", _core.available_isas())
def test_decode_and_matmul_match_definition(isa):
    rng = np.random.default_rng(41)
    rows, cols = 6, 512
    data = rng.integers(0, 256, size=(rows * cols // 128, 18), dtype=np.uint8)
    scales = rng.uniform(-0.05, 0.05, size=len(data)).astype(np.float16)
    data[:, :2] = scales.view(np.uint8).reshape(-1, 2)
    want = decode_q1_0(data, rows, cols)
    x = rng.standard_normal((5, cols)).astype(np.float32)
    before = _core.selected_isa()
    try:
        _core.set_isa(isa)
        got = _core.dequantize("q1_0", data.tobytes(), rows, cols)
        product = _core.matmul("q1_0", data.tobytes(), rows, cols, x)
    finally:
        _core.set_isa(before)
    np.testing.assert_array_equal(got, want)
    # int8 activations (absmax per 32): each product within 1% of the row's magnitude.
    scale = np.abs(x) @ np.abs(want).T
    assert (np.abs(product - x @ want.T) <= 0.01 * scale).all()


def test_quantizer_round_trip():
    """Every value decodes to its block's mean magnitude with its own sign (zero counts as
    positive, as in ggml), the mean rounded to f16 (one f16 step, ~1e-3, apart from numpy's
    own mean, which sums in another order)."""
    x = adversarial_rows()[:, :256]
    x[3, ::32] = 50.0
    got = decode_q1_0(quantize_rows(x, "q1_0"), *x.shape)
    blocks = x.reshape(-1, 128)
    mean = np.abs(blocks).mean(axis=1, keepdims=True).astype(np.float16).astype(np.float32)
    np.testing.assert_allclose(got.reshape(-1, 128), np.where(blocks >= 0, mean, -mean), rtol=1e-3)


@pytest.fixture(scope="module")
def llama_cpp_q1_0(tmp_path_factory):
    """A random-weight llama GGUF (rows of 256 and 512) at F16 and llama.cpp's Q1_0 of it."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        if os.environ.get("CELLM_REQUIRE_PEER") == "1":
            raise
        pytest.skip("llama-cpp-python is not installed (see .ci/run)")
    spec = importlib.util.spec_from_file_location("random_gguf", ROOT / "benches/random_gguf.py")
    random_gguf = importlib.util.module_from_spec(spec)
    sys.modules["random_gguf"] = random_gguf  # dataclasses look their module up
    spec.loader.exec_module(random_gguf)
    out = tmp_path_factory.mktemp("q1_0")
    shape = random_gguf.Shape("llama", 512, 256, 512, 2, 4, 2, 10000.0)
    random_gguf.write_gguf(out / "f16.gguf", shape, "f16")
    random_gguf.quantize_with_llama_cpp(out / "f16.gguf", out / "q1_0.gguf", "Q1_0")
    return out / "f16.gguf", out / "q1_0.gguf"


def test_quantizer_matches_llama_cpp(llama_cpp_q1_0):
    """ggml's quantize_row_q1_0_ref, byte for byte, on every q1_0 tensor llama.cpp writes."""
    f16, q1 = (GGUFFile(p) for p in llama_cpp_q1_0)
    checked = 0
    for name, t in q1.tensors.items():
        if t.format != "q1_0":
            continue
        x = np.frombuffer(f16.data(name), "<f2").astype(np.float32).reshape(t.shape)
        theirs = np.frombuffer(q1.data(name), np.uint8).reshape(t.shape[0], -1)
        np.testing.assert_array_equal(quantize_rows(x, "q1_0"), theirs, err_msg=name)
        checked += 1
    assert checked == 14, checked  # 7 matrices per layer


def _q1_0_tensors(path) -> dict:
    header, raw, offset = read_header(path), path.read_bytes(), data_offset(path)
    return {
        t["name"]: raw[offset + t["offset"] :][: t["nbytes"]]
        for t in header["tensors"]
        if t["format"] == "q1_0"
    }


def test_q1_0_gguf_matches_llama_cpp(llama_cpp_q1_0, tmp_path):
    """llama.cpp's Q1_0 file converted with its blocks kept runs as llama.cpp runs it. Both
    engines multiply q1_0 by int8 (q8_0) activations, whose roundings flip with any change of
    summation order: on this model each engine is ~0.014 (KL ~5e-6) from the same weights
    run in f32, llama.cpp is 0.010 from itself token by token, and the two engines are 0.017
    (0.4% of the logits' spread, KL 6.5e-6) apart. Bounds: 1% of the spread, KL 2e-5; a
    wrong bit order or scale moves logits by their whole spread. The F16 file requantized by
    `--quantize q1_0` holds the very same q1_0 blocks."""
    f16, q1 = llama_cpp_q1_0
    kept = convert_gguf(q1, tmp_path / "kept.cellm", progress=False)
    blocks = _q1_0_tensors(kept)
    assert len(blocks) == 14 and "model.layers.1.mlp.down_proj.weight" in blocks
    ids = [int(i) for i in np.random.default_rng(0).integers(3, 512, size=96)]
    theirs = LlamaCpp(q1, threads=2).logits(ids)
    ours = LLM(kept, kv_encoding="f16").logits(ids)
    assert compare_logits(theirs, ours).mean_kl < 2e-5
    assert float(np.abs(theirs - ours).max()) < 1e-2 * float(np.ptp(theirs))
    requantized = convert_gguf(f16, tmp_path / "r.cellm", progress=False, quantize="q1_0")
    assert _q1_0_tensors(requantized) == blocks
