"""Quantizing at conversion (--quantize, --group-size, --embedding).

GGUF blocks are compared byte for byte with llama.cpp's own Python quantizer (gguf-py, an
independent implementation of ggml's reference rounding). cellm's int8/int4/int3/int2 formats
are read back by a numpy decoder written from docs/format.md, which the engine's decoder must
match exactly and which bounds the rounding error. Quantized models run against HF's reference
logits (8-bit) or against the same weights dequantized into an f32 file (2- to 5-bit)."""

from __future__ import annotations

import numpy as np
import pytest

from cellm import LLM, InvalidArgument, _core
from cellm.convert import convert, convert_hf, read_header
from cellm.convert.interleave import SOURCE, deinterleave_rows
from cellm.convert.quantize import plan_quantization, quantize_rows, stored_format
from cellm.convert.writer import data_offset, write_cellm
from conftest import FIXTURES, ROOT, Reference
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


@pytest.mark.parametrize("fmt", GGML)
def test_blocks_match_llama_cpp_quantizer(fmt):
    x = adversarial_rows()
    np.testing.assert_array_equal(quantize_rows(x, fmt), gguf_quantize(x, GGML[fmt]))


def test_rows_must_split_into_blocks():
    with pytest.raises(InvalidArgument, match="q8_0 units"):
        quantize_rows(np.zeros((2, 40), np.float32), "q8_0")
    with pytest.raises(InvalidArgument, match="i4_g128 units"):
        quantize_rows(np.zeros((2, 192), np.float32), "i4_g128")


# -- cellm's int8 / int4 formats, decoded from their definition in docs/format.md -----------

CELLM_FORMATS = ["i8_row", "i4_g64", "i4_g128", "i4a_g64", "i4a_g128"]
LOW_BIT_FORMATS = ["i3a_g64", "i3a_g128", "i2a_g64", "i2a_g128"]


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view("<f2").astype(np.float32)


def decode_reference(fmt: str, data: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Row bytes of a cellm format -> float32, written from the format's definition."""
    data = data.reshape(rows, -1)
    if fmt == "i8_row":
        scale = data[:, :4].copy().view("<f4")
        return data[:, 4:].view(np.int8).astype(np.float32) * scale
    group = int(fmt.rsplit("_g", 1)[1])
    if fmt in LOW_BIT_FORMATS:
        return decode_low_bit(fmt, data, group).reshape(rows, cols)
    affine = fmt.startswith("i4a")
    head = 4 if affine else 2
    groups = data.reshape(-1, head + group // 2)
    d = _f16(groups[:, 0:2])
    m = _f16(groups[:, 2:4]) if affine else np.zeros_like(d)
    packed = groups[:, head:].reshape(-1, 16)  # 32-value sub-blocks: low nibbles first
    q = np.concatenate([packed & 0xF, packed >> 4], axis=1).astype(np.float32)
    q = q.reshape(len(groups), group)
    w = d * q + m if affine else d * (q - 8)
    return w.reshape(rows, cols)


def decode_low_bit(fmt: str, data: np.ndarray, group: int) -> np.ndarray:
    """int3 / int2 affine groups: `d`, `m`, then per 32 values 8 bytes whose byte j holds
    values j, j + 8, j + 16, j + 24 two bits each from bit 0 up, and (int3) 4 bytes whose bit
    i is value i's third bit; `w = d * q + m`."""
    three = fmt.startswith("i3")
    sub = 12 if three else 8
    groups = data.reshape(-1, 4 + group // 32 * sub)
    d, m = _f16(groups[:, 0:2]), _f16(groups[:, 2:4])
    subs = groups[:, 4:].reshape(-1, sub)
    q = np.concatenate([(subs[:, :8] >> (2 * k)) & 3 for k in range(4)], axis=1)
    if three:
        q = q | (np.unpackbits(subs[:, 8:], axis=1, bitorder="little") << 2)
    return d * q.reshape(len(groups), group).astype(np.float32) + m


@pytest.mark.parametrize("fmt", CELLM_FORMATS + LOW_BIT_FORMATS)
def test_cellm_formats_round_trip_within_half_a_step(fmt):
    """Each value is within half a quantization step of its source (plus the f16 rounding of
    the stored scale and bias), and the engine decodes the bytes exactly as specified."""
    x = adversarial_rows()[:, :256]
    x[3, ::32] = 50.0  # spikes within f16 range of their group's scale
    data = quantize_rows(x, fmt)
    got = decode_reference(fmt, data, *x.shape)
    engine = _core.dequantize(fmt, data.tobytes(), *x.shape)
    np.testing.assert_array_equal(engine, got)
    if fmt == "i8_row":
        step = np.abs(x).max(axis=1, keepdims=True) / 127
        assert (np.abs(got - x) <= step * 0.5001 + 1e-30).all()
        return
    group = int(fmt.rsplit("_g", 1)[1])
    g, w = x.reshape(-1, group), got.reshape(-1, group)
    half_steps = np.full(g.shape, 0.5)
    levels = {"i4a": 15, "i3a": 7, "i2a": 3}.get(fmt[:3])
    if levels:
        step = (g.max(axis=1, keepdims=True) - g.min(axis=1, keepdims=True)) / levels
    else:
        # The largest magnitude maps to -8; values of the other sign beyond 7.5 steps clip to
        # +7, a full step away at most (as in q4_0).
        extreme = np.take_along_axis(g, np.abs(g).argmax(axis=1)[:, None], axis=1)
        step = np.abs(extreme) / 8
        clipped = g * np.sign(extreme) < -7.5 * step
        half_steps[clipped] = 1.0
    # f16 scale/bias rounding adds at most ~1e-3 relative of the group's range.
    bound = step * half_steps + np.abs(g).max(axis=1, keepdims=True) * 2e-3 + 1e-30
    assert (np.abs(w - g) <= bound).all(), float((np.abs(w - g) - bound).max())


@pytest.mark.parametrize("fmt", CELLM_FORMATS + LOW_BIT_FORMATS)
def test_engine_matmul_on_cellm_formats(fmt):
    """The engine's integer kernels (int8 activations) against numpy on the decoded weights:
    int8 activations keep each product within ~1% of the row's magnitude."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((24, 256)).astype(np.float32)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    data = quantize_rows(w, fmt)
    want = x @ decode_reference(fmt, data, *w.shape).T
    got = _core.matmul(fmt, data.tobytes(), *w.shape, x)
    scale = np.abs(x) @ np.abs(decode_reference(fmt, data, *w.shape)).T
    assert (np.abs(got - want) <= 0.01 * scale).all()


@pytest.mark.parametrize(
    "scheme,group,want",
    [
        ("int8", None, "i8_row"),
        ("int4", None, "i4_g64"),
        ("int4", 32, "q4_0"),
        ("int4", 128, "i4_g128"),
        ("int4-affine", 32, "q4_1"),
        ("int4-affine", 64, "i4a_g64"),
        ("q5_0", None, "q5_0"),
        ("int3", None, "i3a_g64"),
        ("int2", 128, "i2a_g128"),
        ("q1_0", None, "q1_0"),
    ],
)
def test_schemes_name_their_stored_format(scheme, group, want):
    assert stored_format(scheme, group) == want


def test_embedding_stays_8_bit_below_8_bits():
    assert plan_quantization("int4", 64).embedding == "i8_row"
    assert plan_quantization("q4_0").embedding == "i8_row"
    assert plan_quantization("q8_0").embedding == "q8_0"
    assert plan_quantization("int4", 64, "int4").embedding == "i4_g64"
    assert plan_quantization("int8", None, "f16").embedding == "f16"


def test_bad_scheme_options():
    with pytest.raises(InvalidArgument, match="--group-size"):
        stored_format("int8", 64)
    with pytest.raises(InvalidArgument, match="--group-size"):
        stored_format("int4", 48)
    with pytest.raises(InvalidArgument, match="int5"):
        stored_format("int5")
    with pytest.raises(InvalidArgument, match="--group-size for int2"):
        stored_format("int2", 32)


def assert_close_where_clear(got: np.ndarray, want: np.ndarray) -> None:
    """Logits within 0.25, and the same argmax wherever the top two are further apart."""
    assert float(np.abs(got - want).max()) < 0.25
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.25
    assert clear.sum() >= 100, clear.sum()
    assert (got.argmax(-1) == want.argmax(-1))[clear].all()


@pytest.mark.parametrize("scheme,stored", [("q8_0", "q8_0x8"), ("int8", "i8_row")])
def test_8_bit_models_against_hf_reference(scheme, stored, tmp_path):
    """8-bit weights keep each value within half a step of 1/127 of its block's (q8_0) or
    row's (int8) max; on this 4-layer model the logits move by at most ~0.2 (p99 ~0.08)."""
    ref = Reference("qwen3")
    path = convert_hf(FIXTURES / "qwen3", tmp_path / "q.cellm", "f32", quantize=scheme)
    formats = {t["name"]: t["format"] for t in read_header(path)["tensors"]}
    assert formats["model.layers.0.mlp.down_proj.weight"] == stored
    assert formats["model.embed_tokens.weight"] == stored
    assert formats["model.norm.weight"] == "f32"
    got = LLM(path, kv_encoding="f32").logits(ref.sequence(1))
    assert_close_where_clear(got, ref.logits[1])


@pytest.mark.parametrize(
    "scheme,group",
    [
        ("q4_0", None),
        ("q4_1", None),
        ("q5_0", None),
        ("int4", 64),
        ("int4-affine", 128),
        ("int3", 64),
        ("int2", 64),
    ],
)
def test_2_to_5_bit_models_run_their_blocks(scheme, group, tmp_path):
    """2- to 5-bit blocks of random Gaussian weights lose too much to compare with HF, so the
    quantized model is judged against the same blocks dequantized independently (gguf-py for
    GGUF formats, this file's decoder for cellm's) into an f32 file: only the engine's int8
    activations separate the two (logits within 0.25, as in test_gguf_convert's q8_0 model)."""
    ref = Reference("qwen3")
    path = convert_hf(
        FIXTURES / "qwen3", tmp_path / "q.cellm", "f32", quantize=scheme, group_size=group
    )
    header, raw, offset = read_header(path), path.read_bytes(), data_offset(path)
    tensors = []
    for t in header["tensors"]:
        data = np.frombuffer(raw, np.uint8, t["nbytes"], offset + t["offset"])
        rows, cols = t["shape"][0], t["shape"][-1]
        if t["format"] == "f32":
            tensors.append((t["name"], data.view(np.float32).reshape(t["shape"]), "f32"))
        elif t["format"] in GGML or t["format"] in SOURCE:
            blocks, fmt = data.reshape(rows, -1), t["format"]
            if fmt in SOURCE:  # interleaved: back to the GGUF blocks first
                blocks, fmt = deinterleave_rows(blocks, fmt), SOURCE[fmt]
            tensors.append((t["name"], gguf_dequantize(blocks, GGML[fmt]), "f32"))
        else:
            tensors.append((t["name"], decode_reference(t["format"], data, rows, cols), "f32"))
    blobs = [(b["name"], raw[offset + b["offset"] :][: b["nbytes"]]) for b in header["blobs"]]
    reference = write_cellm(tmp_path / "f32.cellm", header, tensors, blobs)
    ids = ref.sequence(1)
    got = LLM(path, kv_encoding="f32").logits(ids)
    assert_close_where_clear(got, LLM(reference, kv_encoding="f32").logits(ids))


def test_cli_quantizes_and_rejects_unknown_formats(tmp_path):
    out = tmp_path / "m.cellm"
    args = ["cellm.convert", "--input", str(FIXTURES / "llama"), "--output", str(out)]
    proc = cli(*args, "--quantize", "q4_1")
    assert proc.returncode == 0, proc.stderr
    assert read_header(out)["source"]["quantize"] == "q4_1"
    assert_one_line_error(cli(*args, "--quantize", "int5"), "--quantize")


def test_cli_group_size_and_embedding(tmp_path):
    out = tmp_path / "m.cellm"
    args = ["cellm.convert", "--input", str(FIXTURES / "gemma3"), "--output", str(out)]
    proc = cli(*args, "--quantize", "int4", "--group-size", "128", "--embedding", "f16")
    assert proc.returncode == 0, proc.stderr
    header = read_header(out)
    formats = {t["name"]: t["format"] for t in header["tensors"]}
    assert formats["model.layers.0.mlp.down_proj.weight"] == "i4_g128"  # rows of 128
    # Rows of 64 values hold no whole group of 128: they keep the float dtype.
    assert formats["model.layers.0.self_attn.q_proj.weight"] == "f16"
    assert formats["model.embed_tokens.weight"] == "f16"
    assert header["source"]["group_size"] == 128
    assert_one_line_error(cli(*args, "--quantize", "int8", "--group-size", "64"), "group-size")
    assert_one_line_error(cli(*args, "--embedding", "int8"), "--quantize")


def test_dtype_applies_to_hf_checkpoints_only(tmp_path):
    gguf_file = tmp_path / "x.gguf"
    gguf_file.write_bytes(b"GGUF" + b"\0" * 60)
    with pytest.raises(InvalidArgument, match="--dtype"):
        convert(gguf_file, tmp_path / "o.cellm", dtype="f16")


@pytest.fixture(scope="module")
def llama_cpp_quantized(tmp_path_factory):
    """A random-weight llama GGUF (rows of 256) at F16 and llama.cpp's own Q4_K_S of it."""
    import importlib.util
    import os
    import sys

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
    out = tmp_path_factory.mktemp("q4k")
    shape = random_gguf.Shape("llama", 512, 256, 512, 2, 4, 2, 10000.0)
    random_gguf.write_gguf(out / "f16.gguf", shape, "f16")
    random_gguf.quantize_with_llama_cpp(out / "f16.gguf", out / "q4_k_s.gguf", "Q4_K_S")
    return out / "f16.gguf", out / "q4_k_s.gguf"


def test_q4_k_matches_llama_cpp_quantizer(llama_cpp_quantized):
    """ggml's quantize_row_q4_K_ref (its weighted least-squares search over 21 grids),
    reproduced byte for byte: every q4_k tensor llama.cpp's Q4_K_S recipe writes."""
    from cellm.convert.gguf import GGUFFile

    f16, q4 = (GGUFFile(p) for p in llama_cpp_quantized)
    checked = 0
    for name, t in q4.tensors.items():
        if t.format != "q4_k":
            continue
        x = np.frombuffer(f16.data(name), "<f2").astype(np.float32).reshape(t.shape)
        theirs = np.frombuffer(q4.data(name), np.uint8).reshape(t.shape[0], -1)
        np.testing.assert_array_equal(quantize_rows(x, "q4_k"), theirs, err_msg=name)
        checked += 1
    assert checked >= 10, checked
