"""The engine's decoding of GGUF block formats against llama.cpp's own Python implementation
(`gguf.quants`, an independent reference). Random blocks cover every code path; the scales are
set to finite values so the comparison is exact up to float32 rounding."""

from __future__ import annotations

import numpy as np
import pytest

from cellm import InvalidArgument, _core
from cellm.convert.interleave import deinterleave_rows, interleave_rows

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

# cellm format -> (ggml type, byte offsets of the f16 scales inside one block)
FORMATS = {
    "q8_0": (Q.Q8_0, [0]),
    "q4_0": (Q.Q4_0, [0]),
    "q4_1": (Q.Q4_1, [0, 2]),
    "q5_0": (Q.Q5_0, [0]),
    "q4_k": (Q.Q4_K, [0, 2]),
    "q5_k": (Q.Q5_K, [0, 2]),
    "q6_k": (Q.Q6_K, [208]),
}


def random_blocks(qtype, scale_offsets, rows, cols, rng):
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block
    data = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for at in scale_offsets:
        scales = rng.uniform(-0.05, 0.05, size=n_blocks).astype(np.float16)
        data[:, at : at + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return data.reshape(rows, -1)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("isa", _core.available_isas())
def test_decode_matches_gguf_reference(fmt, isa):
    qtype, scale_offsets = FORMATS[fmt]
    rng = np.random.default_rng(sum(map(ord, fmt)))
    rows, cols = 3, 512
    data = random_blocks(qtype, scale_offsets, rows, cols, rng)
    want = dequantize(data, qtype).astype(np.float32)
    before = _core.selected_isa()
    try:
        _core.set_isa(isa)
        got = _core.dequantize(fmt, data.tobytes(), rows, cols)
    finally:
        _core.set_isa(before)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_dequantize_rejects_bad_sizes():
    with pytest.raises(InvalidArgument):
        _core.dequantize("q4_k", b"\0" * 10, 1, 256)
    with pytest.raises(InvalidArgument):
        _core.dequantize("q8_0", b"\0" * 34, 1, 31)


# -- interleaved layouts ---------------------------------------------------------------------

X8 = {fmt: f"{fmt}x8" for fmt in ("q8_0", "q4_0", "q4_1", "q5_0", "q4_k", "q6_k")}


@pytest.mark.parametrize("fmt", X8)
def test_interleaving_is_a_permutation_of_the_blocks(fmt):
    qtype, offsets = FORMATS[fmt]
    data = random_blocks(qtype, offsets, 24, 512, np.random.default_rng(3))
    x8 = interleave_rows(data, fmt)
    assert x8.shape == data.shape and not np.array_equal(x8, data)
    np.testing.assert_array_equal(np.sort(x8, axis=None), np.sort(data, axis=None))
    np.testing.assert_array_equal(deinterleave_rows(x8, X8[fmt]), data)


@pytest.mark.parametrize("fmt", X8)
@pytest.mark.parametrize("isa", _core.available_isas())
def test_interleaved_layout_decodes_and_multiplies_as_gguf(fmt, isa):
    """The engine reads an x8 tensor as llama.cpp's reference decodes its source blocks, and
    its group kernels multiply it as numpy does the decoded matrix (int8 activations: within
    1% of the products' magnitude)."""
    qtype, offsets = FORMATS[fmt]
    rng = np.random.default_rng(sum(map(ord, fmt)) + 1)
    rows, cols = 40, 256
    data = random_blocks(qtype, offsets, rows, cols, rng)
    x8 = interleave_rows(data, fmt).tobytes()
    w = dequantize(data, qtype).astype(np.float32)
    x = rng.standard_normal((6, cols)).astype(np.float32)
    before = _core.selected_isa()
    try:
        _core.set_isa(isa)
        decoded = _core.dequantize(X8[fmt], x8, rows, cols)
        got = _core.matmul(X8[fmt], x8, rows, cols, x)
    finally:
        _core.set_isa(before)
    np.testing.assert_allclose(decoded, w, rtol=1e-6, atol=1e-6)
    assert (np.abs(got - x @ w.T) <= 0.01 * (np.abs(x) @ np.abs(w).T)).all()


def test_interleaved_layout_needs_whole_groups():
    with pytest.raises(InvalidArgument):
        _core.dequantize("q4_0x8", b"\0" * 18 * 4, 4, 32)
