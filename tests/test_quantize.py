"""Quantizing HF float checkpoints into GGUF block formats at conversion (--quantize).

The blocks are compared byte for byte with llama.cpp's own Python quantizer (gguf-py, an
independent implementation of ggml's reference rounding), then the quantized model is run
against HF's reference logits."""

from __future__ import annotations

import numpy as np
import pytest

from cellm import LLM, InvalidArgument
from cellm.convert import convert, convert_hf, read_header
from cellm.convert.quantize import QUANTIZERS, quantize_rows
from cellm.convert.writer import data_offset, write_cellm
from conftest import FIXTURES, Reference
from test_bad_input import assert_one_line_error, cli

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

GGML = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q5_0": Q.Q5_0}


def adversarial_rows() -> np.ndarray:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((16, 256)).astype(np.float32)
    x[0] = 0.0  # all-zero blocks
    x[1] = 1e-30  # scales that underflow f16
    x[2] = np.linspace(-5, 5, 256)  # a ramp: every rounding boundary
    x[3, ::32] = 1e4  # one spike per block
    x[4] = -(x[4] ** 2)  # all-negative blocks (q4_1's min)
    x[5] = np.round(x[5] * 4) / 4  # exact halves: tie rounding
    return x


@pytest.mark.parametrize("fmt", QUANTIZERS)
def test_blocks_match_llama_cpp_quantizer(fmt):
    x = adversarial_rows()
    np.testing.assert_array_equal(quantize_rows(x, fmt), gguf_quantize(x, GGML[fmt]))


def test_rows_must_split_into_blocks():
    with pytest.raises(InvalidArgument, match="32-value blocks"):
        quantize_rows(np.zeros((2, 40), np.float32), "q8_0")


def test_q8_0_model_against_hf_reference(tmp_path):
    """q8_0 keeps each weight within half a step of 1/127 of its block's max; on this 4-layer
    model the logits move by at most ~0.2 (p99 ~0.08). Argmax judged where the reference's top
    two logits are further apart than that."""
    ref = Reference("qwen3")
    path = convert_hf(FIXTURES / "qwen3", tmp_path / "q.cellm", "f32", quantize="q8_0")
    formats = {t["name"]: t["format"] for t in read_header(path)["tensors"]}
    assert formats["model.layers.0.mlp.down_proj.weight"] == "q8_0"
    assert formats["model.embed_tokens.weight"] == "q8_0"
    assert formats["model.norm.weight"] == "f32"
    got = LLM(path, kv_encoding="f32").logits(ref.sequence(1))
    want = ref.logits[1]
    assert float(np.abs(got - want).max()) < 0.25
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.25
    assert clear.sum() >= 100, clear.sum()
    assert (got.argmax(-1) == want.argmax(-1))[clear].all()


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q5_0"])
def test_4_and_5_bit_models_run_their_blocks(fmt, tmp_path):
    """4-bit blocks of random Gaussian weights lose too much to compare with HF, so the
    quantized model is judged against the same blocks dequantized by gguf-py into an f32 file:
    only the engine's int8 activations separate the two (logits within 0.25, as in
    test_gguf_convert's q8_0 model)."""
    ref = Reference("qwen3")
    path = convert_hf(FIXTURES / "qwen3", tmp_path / "q.cellm", "f32", quantize=fmt)
    header, raw, offset = read_header(path), path.read_bytes(), data_offset(path)
    tensors = []
    for t in header["tensors"]:
        data = np.frombuffer(raw, np.uint8, t["nbytes"], offset + t["offset"])
        if t["format"] == "f32":
            tensors.append((t["name"], data.view(np.float32).reshape(t["shape"]), "f32"))
        else:
            blocks = data.reshape(t["shape"][0], -1)
            tensors.append((t["name"], gguf_dequantize(blocks, GGML[fmt]), "f32"))
    blobs = [(b["name"], raw[offset + b["offset"] :][: b["nbytes"]]) for b in header["blobs"]]
    reference = write_cellm(tmp_path / "f32.cellm", header, tensors, blobs)
    ids = ref.sequence(1)
    got = LLM(path, kv_encoding="f32").logits(ids)
    want = LLM(reference, kv_encoding="f32").logits(ids)
    assert float(np.abs(got - want).max()) < 0.25
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.25
    assert clear.sum() >= 100, clear.sum()
    assert (got.argmax(-1) == want.argmax(-1))[clear].all()


def test_cli_quantizes_and_rejects_unknown_formats(tmp_path):
    out = tmp_path / "m.cellm"
    args = ["cellm.convert", "--input", str(FIXTURES / "llama"), "--output", str(out)]
    proc = cli(*args, "--quantize", "q4_1")
    assert proc.returncode == 0, proc.stderr
    assert read_header(out)["source"]["quantize"] == "q4_1"
    assert_one_line_error(cli(*args, "--quantize", "int3"), "--quantize")


def test_quantize_applies_to_hf_checkpoints_only(tmp_path):
    gguf_file = tmp_path / "x.gguf"
    gguf_file.write_bytes(b"GGUF" + b"\0" * 60)
    with pytest.raises(InvalidArgument, match="--quantize"):
        convert(gguf_file, tmp_path / "o.cellm", quantize="q8_0")
