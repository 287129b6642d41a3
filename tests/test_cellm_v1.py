"""`.cellm` v1 files (the earlier engine's published format) converted to v2.

The v1 files are written here from the layout docs/format.md documents ("Version 1 files"), not
by cellm's reader: `CELLM`, version byte 1, u32 header length, the JSON header with model fields
and a tensor table of absolute 64-byte aligned offsets, HF tensor names, per-row f16 `.qscale`
sidecars for int8/int4/int2. The values each encoding stands for are decoded by this file's own
numpy, and the converted models are checked against HF's reference logits (f16) or against the
same weights stored as f32 (quantized encodings).
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from cellm import LLM, _core
from cellm.convert import convert, read_header
from cellm.convert.cellm_v1 import V1Checkpoint, V1File
from cellm.convert.interleave import SOURCE, deinterleave_rows
from cellm.convert.safetensors import open_checkpoint
from cellm.convert.writer import data_offset
from conftest import FIXTURES, Reference
from test_bad_input import assert_one_line_error, cli
from test_quantize import assert_close_where_clear

NAME = "qwen3"


def write_v1(path: Path, fields: dict, tensors: list[tuple[str, str, tuple, bytes]]) -> Path:
    """A v1 file: `tensors` as (name, dtype, shape, payload), each at a 64-byte boundary."""

    def header(start: int) -> bytes:
        table, at = [], start
        for name, dtype, shape, data in tensors:
            at = -(-at // 64) * 64
            table.append(
                {
                    "name": name,
                    "dtype": dtype,
                    "shape": list(shape),
                    "offset_bytes": at,
                    "nbytes": len(data),
                }  # fmt: skip
            )
            at += len(data)
        return json.dumps({**fields, "tensors": table}).encode()

    # Offsets depend on the header's length and the length on the offsets: iterate to a fixpoint.
    raw = header(0)
    while len(raw) != len(header(-(-(10 + len(raw)) // 64) * 64)):
        raw = header(-(-(10 + len(raw)) // 64) * 64)
    raw = header(-(-(10 + len(raw)) // 64) * 64)
    out = bytearray(b"CELLM\x01" + struct.pack("<I", len(raw)) + raw)
    for entry, (_, _, _, data) in zip(json.loads(raw)["tensors"], tensors):
        out += bytes(entry["offset_bytes"] - len(out)) + data
    path.write_bytes(bytes(out))
    return path


def header_fields(config: dict) -> dict:
    """The v1 header's model fields (the earlier engine's names) for an HF config."""
    return {
        "model_type": config["model_type"],
        "vocab_size": config["vocab_size"],
        "hidden_dim": config["hidden_size"],
        "intermediate_size": config["intermediate_size"],
        "num_layers": config["num_hidden_layers"],
        "num_heads": config["num_attention_heads"],
        "num_kv_heads": config["num_key_value_heads"],
        "rms_norm_eps": config["rms_norm_eps"],
        "rope_theta": config["rope_parameters"]["rope_theta"],
        "bos_token_id": config.get("bos_token_id"),
        "eos_token_id": config.get("eos_token_id"),
        "max_position_embeddings": config["max_position_embeddings"],
        "tie_word_embeddings": config["tie_word_embeddings"],
    }


def encode(w: np.ndarray, dtype: str) -> list[tuple[str, np.ndarray]]:
    """(suffix, payload) of a float32 matrix in a v1 encoding; per-row symmetric scales as the
    earlier engine chose them (max |w| / 127, / 7, / 1.5), q1_0_g128 as ggml's Q1_0."""
    if dtype in ("f16", "f32"):
        return [("", w.astype("<f2" if dtype == "f16" else "<f4"))]
    if dtype == "q1_0_g128":
        blocks = w.reshape(-1, 128)
        d = np.abs(blocks).mean(axis=1, keepdims=True).astype("<f2")
        bits = np.packbits(blocks > 0, axis=1, bitorder="little")
        return [("", np.concatenate([d.view(np.uint8), bits], axis=1))]
    top = {"i8": 127, "i4": 7, "i2": 1.5}[dtype]
    scale = (np.abs(w).max(axis=1, keepdims=True) / top).astype("<f2")
    x = w / scale.astype(np.float32)
    if dtype == "i8":
        q = np.clip(np.round(x), -127, 127).astype(np.int8)
    elif dtype == "i4":
        n = (np.clip(np.round(x), -7, 7) + 8).astype(np.uint8)
        q = n[:, 0::2] | (n[:, 1::2] << 4)
    else:
        c = np.digitize(x, [-1.0, 0.0, 1.0]).astype(np.uint8)  # centroids -1.5 .. 1.5
        q = c[:, 0::4] | (c[:, 1::4] << 2) | (c[:, 2::4] << 4) | (c[:, 3::4] << 6)
    return [("", q), (".qscale", scale.reshape(-1))]


def decode(payload: list[tuple[str, np.ndarray]], dtype: str, shape: tuple) -> np.ndarray:
    """The float32 values a v1 encoding stands for, from the documented layout."""
    q = payload[0][1]
    if dtype in ("f16", "f32"):
        return q.astype(np.float32)
    if dtype == "q1_0_g128":
        d = q[:, :2].copy().view("<f2").astype(np.float32)
        bits = np.unpackbits(q[:, 2:], axis=1, bitorder="little").astype(np.float32)
        return (d * (2 * bits - 1)).reshape(shape)
    s = payload[1][1].astype(np.float32)[:, None]
    if dtype == "i8":
        return q.view(np.int8).astype(np.float32) * s
    per = {"i4": 2, "i2": 4}[dtype]
    bits = 8 // per
    v = np.stack([(q >> (bits * k)) & ((1 << bits) - 1) for k in range(per)], axis=2)
    v = v.reshape(q.shape[0], -1)[:, : shape[1]].astype(np.float32)
    return (v - 8) * s if dtype == "i4" else (v - 1.5) * s


def v1_fixture(tmp_path: Path, dtype: str, replace: dict | None = None) -> tuple[Path, dict]:
    """The qwen3 fixture as a v1 file (matrices in `dtype`, vectors f16, as the earlier
    converter wrote them), its tokenizer files beside it; and each matrix's float32 values.
    `replace`: float32 values to write instead of the fixture's matrices."""
    d = FIXTURES / NAME
    config = json.loads((d / "config.json").read_text())
    tensors, values = [], {}
    with open_checkpoint(d) as ck:
        for name in ck:
            w = np.asarray(ck.view(name), dtype=np.float32)
            if w.ndim == 1:
                tensors.append((name, "f16", w.shape, w.astype("<f2").tobytes()))
                continue
            payload = encode(replace[name] if replace else w, dtype)
            values[name] = decode(payload, dtype, w.shape)
            tensors.append((name, dtype, w.shape, payload[0][1].tobytes()))
            if len(payload) > 1:
                scale = payload[1][1]
                tensors.append((name + ".qscale", "f16", scale.shape, scale.tobytes()))
    out = tmp_path / "v1"
    out.mkdir(exist_ok=True)
    for side in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(d / side, out / side)
    tag = f"{dtype}-replaced" if replace else dtype
    return write_v1(out / f"model-{tag}.cellm", header_fields(config), tensors), values


def stored_values(path: Path, name: str) -> np.ndarray:
    """A converted tensor as float32, decoded by the engine from whatever format it holds."""
    header = read_header(path)
    row = next(t for t in header["tensors"] if t["name"] == name)
    raw = path.read_bytes()[data_offset(path) + row["offset"] :][: row["nbytes"]]
    rows, cols = row["shape"][0], row["shape"][-1]
    if row["format"] in ("f32", "f16"):
        return np.frombuffer(raw, "<f4" if row["format"] == "f32" else "<f2").astype(np.float32)
    fmt, blocks = row["format"], np.frombuffer(raw, np.uint8).reshape(rows, -1)
    if fmt in SOURCE:  # 8 rows interleaved: back to plain blocks
        blocks, fmt = deinterleave_rows(blocks, fmt), SOURCE[fmt]
    assert fmt in ("i8_row", "q4_0"), fmt
    return _core.dequantize(fmt, blocks.tobytes(), rows, cols)


def test_f16_file_converts_to_the_hf_model(tmp_path, converted):
    """The v1 f16 file holds the fixture rounded to f16 (its norms too, as the earlier
    converter wrote them): the HF path's f16 description, and logits within 1e-2 of that
    conversion's (whose norms stay f32; f16 norms move these logits by up to ~5e-3) and
    close to HF's."""
    path, _ = v1_fixture(tmp_path, "f16")
    out = tmp_path / "v2.cellm"
    proc = cli("cellm.convert", "--input", str(path), "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    header = read_header(out)
    assert header["source"]["kind"] == "cellm-v1"
    assert header["model"] == read_header(converted(NAME, "f16"))["model"]
    ref = Reference(NAME)
    ids = ref.sequence(1)
    got = LLM(out, kv_encoding="f32").logits(ids)
    want = LLM(converted(NAME, "f16"), kv_encoding="f32").logits(ids)
    np.testing.assert_allclose(got, want, atol=1e-2)
    assert_close_where_clear(got, ref.logits[1])


@pytest.mark.parametrize("dtype,kept", [("i8", "i8_row"), ("i4", "q4_0"), ("i2", "f32")])
def test_quantized_files_keep_their_values(dtype, kept, tmp_path):
    """int8 and int4 rows are kept as `i8_row` / `q4_0` holding exactly the values the v1
    encoding stands for; int2 has no such v2 format and is decoded to float (exactly, in f32).
    The model runs as the same weights stored as float32 do, up to int8 activations."""
    path, values = v1_fixture(tmp_path, dtype)
    out = convert(path, tmp_path / "v2.cellm", dtype="f32")
    formats = {t["name"]: t["format"] for t in read_header(out)["tensors"]}
    for name, want in values.items():
        assert formats[name].removesuffix("x8") == kept, name
        got = stored_values(out, name).reshape(want.shape)
        np.testing.assert_array_equal(got, want, err_msg=name)
    same, _ = v1_fixture(tmp_path, "f32", replace=values)
    ids = Reference(NAME).sequence(1)
    got = LLM(out, kv_encoding="f32").logits(ids)
    want = LLM(convert(same, tmp_path / "same.cellm", dtype="f32"), kv_encoding="f32").logits(ids)
    assert_close_where_clear(got, want)


def test_q1_0_g128_blocks_are_kept_as_q1_0(tmp_path):
    """A 1-bit v1 matrix whose rows are whole blocks of 128 is offered as q1_0, byte for byte;
    one with a partial last block is decoded (its padding bits dropped)."""
    rng = np.random.default_rng(2)
    whole, partial = rng.standard_normal((4, 256)), rng.standard_normal((3, 192))
    tensors = []
    for name, w in (("a.weight", whole), ("b.weight", partial)):
        padded = np.pad(w, ((0, 0), (0, -w.shape[1] % 128))).astype(np.float32)
        payload = encode(padded, "q1_0_g128")[0][1]
        tensors.append((name, "q1_0_g128", w.shape, payload.tobytes()))
    v1 = V1Checkpoint(V1File(write_v1(tmp_path / "q1.cellm", {"model_type": "qwen3"}, tensors)))
    fmt, chunks = v1.stored("a.weight")
    assert fmt == "q1_0" and b"".join(c.tobytes() for c in chunks()) == tensors[0][3]
    want = decode(
        [("", np.frombuffer(tensors[0][3], np.uint8).reshape(-1, 18))], "q1_0_g128", (4, 256)
    )
    np.testing.assert_array_equal(_core.dequantize("q1_0", tensors[0][3], 4, 256), want)
    assert v1.stored("b.weight") is None
    blocks = np.frombuffer(tensors[1][3], np.uint8).reshape(-1, 18)
    want = decode([("", blocks)], "q1_0_g128", (3, 256))[:, :192]
    np.testing.assert_array_equal(v1.view("b.weight"), want)


def test_llm_opens_a_v1_file(tmp_path, monkeypatch):
    monkeypatch.setenv("CELLM_CACHE_DIR", str(tmp_path / "cache"))
    path, _ = v1_fixture(tmp_path, "f16")
    llm = LLM(path)
    assert llm.path.parent == tmp_path / "cache" / "converted"
    assert read_header(llm.path)["source"]["path"] == path.name


def _bad_inputs(tmp_path: Path) -> dict:
    path, _ = v1_fixture(tmp_path, "i8")
    raw = path.read_bytes()
    header_len = struct.unpack("<I", raw[6:10])[0]
    fields = json.loads(raw[10 : 10 + header_len])
    cases = {}
    cut = tmp_path / "v1" / "cut.cellm"
    cut.write_bytes(raw[: len(raw) - 100])
    cases["truncated"] = (cut, "outside the file")
    gone = "model.layers.0.mlp.up_proj.weight.qscale"
    no_scale = dict(fields, tensors=[t for t in fields["tensors"] if t["name"] != gone])
    cases["sidecar"] = (_rewrite(tmp_path, "scale", no_scale, raw, header_len), ".qscale")
    other = dict(fields, model_type="gemma3_text")
    cases["arch"] = (_rewrite(tmp_path, "arch", other, raw, header_len), "gemma3_text")
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    cases["tokenizer"] = (shutil.copy(path, lonely / "m.cellm"), "tokenizer.json")
    return cases


def _rewrite(tmp_path: Path, tag: str, fields: dict, raw: bytes, header_len: int) -> Path:
    """The same data with another header of the same length (compact JSON, spaces after)."""
    text = json.dumps(fields, separators=(",", ":")).encode()
    assert len(text) <= header_len
    out = tmp_path / "v1" / f"{tag}.cellm"
    out.write_bytes(raw[:10] + text.ljust(header_len) + raw[10 + header_len :])
    return out


@pytest.mark.parametrize("case", ["truncated", "sidecar", "arch", "tokenizer"])
def test_bad_v1_files_fail_with_one_line(case, tmp_path):
    path, words = _bad_inputs(tmp_path)[case]
    proc = cli("cellm.convert", "--input", str(path), "--output", str(tmp_path / "o.cellm"))
    assert_one_line_error(proc, words)
    assert not (tmp_path / "o.cellm").exists()
