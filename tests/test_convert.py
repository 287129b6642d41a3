"""Tests of the HF -> .cellm converter (python/cellm/convert) against docs/format.md.

Ground truth comes from independent helpers below (a minimal safetensors reader/writer, raw
byte reads of the .cellm file, re-derivations of HF's RoPE formulas), not from the converter.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cellm.convert import convert_hf, dtypes, read_header
from cellm.convert.hf_config import normalise_config
from cellm.convert.progress import ProgressBar
from cellm.convert.writer import read_tensor, write_cellm
from cellm.errors import FormatError, InvalidArgument, UnsupportedArchitecture

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "hf-tiny"
MODELS = ["llama", "qwen2", "qwen3", "granite", "smollm3"]
DTYPES = ["f32", "f16", "bf16"]
ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2}


# ----------------------------------------------------------------------------- helpers


def load_safetensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (dtype, array); BF16 arrays are returned as their raw uint16 bits."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    np_dtype = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        a, b = entry["data_offsets"]
        raw = data[8 + n + a : 8 + n + b]
        arr = np.frombuffer(raw, dtype=np_dtype[entry["dtype"]]).reshape(entry["shape"])
        out[name] = (entry["dtype"], arr)
    return out


def save_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, pos = [], 0
    for name, (dtype, arr) in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {
            "dtype": dtype,
            "shape": list(arr.shape),
            "data_offsets": [pos, pos + len(raw)],
        }
        blobs.append(raw)
        pos += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def as_f32(dtype: str, arr: np.ndarray) -> np.ndarray:
    if dtype == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32)


def cellm_layout(path: Path) -> tuple[bytes, int, int]:
    """(file bytes, header_len, data_offset), computed from raw bytes per docs/format.md."""
    data = path.read_bytes()
    (header_len,) = struct.unpack("<Q", data[8:16])
    return data, header_len, (16 + header_len + 63) // 64 * 64


def cellm_tensor(path: Path, header: dict[str, Any], name: str) -> tuple[str, np.ndarray]:
    data, _, offset = cellm_layout(path)
    (row,) = [t for t in header["tensors"] if t["name"] == name]
    raw = data[offset + row["offset"] : offset + row["offset"] + row["nbytes"]]
    np_dtype = {"f32": "<f4", "f16": "<f2", "bf16": "<u2"}[row["format"]]
    return row["format"], np.frombuffer(raw, dtype=np_dtype).reshape(row["shape"])


def copy_fixture(model: str, tmp_path: Path) -> Path:
    dst = tmp_path / f"hf-{model}"
    shutil.copytree(FIXTURES / model, dst)
    return dst


def edit_json(path: Path, **changes: Any) -> None:
    doc = json.loads(path.read_text())
    for key, value in changes.items():
        if value is _DELETE:
            doc.pop(key, None)
        else:
            doc[key] = value
    path.write_text(json.dumps(doc, indent=2))


_DELETE = object()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    return subprocess.run(
        [sys.executable, "-m", "cellm.convert", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def assert_cli_error(*args: str) -> str:
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error:")
    assert "Traceback" not in proc.stderr
    return lines[0]


def bf16_reference(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even to bf16, choosing between the two neighbours in float64."""
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    lo_bits = bits >> 16
    lo = (lo_bits << 16).view(np.float32).astype(np.float64)
    # bf16 spacing at x's exponent; past the largest finite bf16 the next value is 2**128.
    exponent = np.maximum((bits >> 23) & 0xFF, 1).astype(np.float64)
    hi = lo + np.copysign(2.0 ** (exponent - 127 - 7), x.astype(np.float64))
    exact = x.astype(np.float64)
    with np.errstate(invalid="ignore"):
        d_lo, d_hi = np.abs(exact - lo), np.abs(hi - exact)
    pick_hi = np.isfinite(x) & ((d_hi < d_lo) | ((d_hi == d_lo) & ((lo_bits & 1) == 1)))
    return np.where(pick_hi, lo_bits + 1, lo_bits).astype(np.uint16)


# ----------------------------------------------------------------- fixture conversions


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", MODELS)
def test_convert_fixture(model: str, dtype: str, tmp_path: Path) -> None:
    src = FIXTURES / model
    out = convert_hf(src, tmp_path / "m.cellm", dtype=dtype)
    assert out == tmp_path / "m.cellm"
    assert [p.name for p in tmp_path.iterdir()] == ["m.cellm"]  # no temporary left behind

    data, header_len, data_offset = cellm_layout(out)
    assert data[:5] == b"CELLM" and data[5] == 2 and data[6:8] == b"\0\0"
    assert all(b == 0 for b in data[16 + header_len : data_offset])
    header = read_header(out)
    assert header == json.loads(data[16 : 16 + header_len].decode("utf-8"))
    assert header["format_version"] == 2
    assert header["data_size"] == len(data) - data_offset
    assert header["source"] == {"kind": "hf", "dtype": dtype}

    config = json.loads((src / "config.json").read_text())
    assert header["hf_config"] == config

    # Every item 64-byte aligned, sized as format x shape, in bounds, no overlap.
    spans = []
    for t in header["tensors"]:
        assert t["offset"] % 64 == 0
        assert t["nbytes"] == math.prod(t["shape"]) * ITEMSIZE[t["format"]]
        assert t["format"] == ("f32" if len(t["shape"]) < 2 else dtype)
        assert t["params"] == {}
        spans.append((t["offset"], t["offset"] + t["nbytes"]))
    (blob,) = header["blobs"]
    assert blob["name"] == "tokenizer.json" and blob["offset"] % 64 == 0
    spans.append((blob["offset"], blob["offset"] + blob["nbytes"]))
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] == header["data_size"]
    tok_bytes = data[data_offset + blob["offset"] : data_offset + spans[-1][1]]
    assert tok_bytes == (src / "tokenizer.json").read_bytes()

    # Tensors: HF names, lm_head dropped (all fixtures are tied), bytes round-trip.
    source = load_safetensors(src / "model.safetensors")
    names = [t["name"] for t in header["tensors"]]
    assert sorted(names) == sorted(n for n in source if n != "lm_head.weight")
    assert names[0] == "model.embed_tokens.weight"
    for name in names:
        src_dtype, src_arr = source[name]
        fmt, arr = cellm_tensor(out, header, name)
        assert arr.shape == src_arr.shape
        x = as_f32(src_dtype, src_arr)
        if fmt == "f32":
            np.testing.assert_array_equal(arr, x)
        elif fmt == "f16":
            np.testing.assert_array_equal(arr, x.astype(np.float16))
        else:
            np.testing.assert_array_equal(arr, bf16_reference(x))
            widened = as_f32("BF16", arr)
            assert np.all(np.abs(widened - x) <= np.abs(x) * 2.0**-8)
        np.testing.assert_array_equal(read_tensor(out, name), as_f32_fmt(fmt, arr))


def as_f32_fmt(fmt: str, arr: np.ndarray) -> np.ndarray:
    return as_f32("BF16", arr) if fmt == "bf16" else arr.astype(np.float32)


EXPECTED_MODEL = {
    "llama": {"head_dim": 16, "attention_bias": False, "qk_norm": False, "rope_type": "llama3"},
    "qwen2": {"head_dim": 16, "attention_bias": True, "qk_norm": False, "rope_type": "default"},
    "qwen3": {"head_dim": 32, "attention_bias": False, "qk_norm": True, "rope_type": "default"},
    "granite": {"head_dim": 16, "attention_bias": False, "qk_norm": False, "rope_type": "default"},
    "smollm3": {"head_dim": 16, "attention_bias": False, "qk_norm": False, "rope_type": "default"},
}


@pytest.mark.parametrize("model", MODELS)
def test_model_description(model: str, tmp_path: Path) -> None:
    src = FIXTURES / model
    header = read_header(convert_hf(src, tmp_path / "m.cellm", dtype="f32"))
    config = json.loads((src / "config.json").read_text())
    m = header["model"]
    want = EXPECTED_MODEL[model]
    assert m["architecture"] == "llama"
    assert m["model_type"] == model
    assert m["vocab_size"] == config["vocab_size"]
    assert m["hidden_size"] == config["hidden_size"]
    assert m["intermediate_size"] == config["intermediate_size"]
    assert m["num_layers"] == config["num_hidden_layers"]
    assert m["num_heads"] == config["num_attention_heads"]
    assert m["num_kv_heads"] == config["num_key_value_heads"]
    assert m["head_dim"] == want["head_dim"]
    assert m["norm_eps"] == config["rms_norm_eps"]
    assert m["max_position_embeddings"] == config["max_position_embeddings"]
    assert m["tie_word_embeddings"] is True
    assert m["hidden_act"] == "silu"
    assert m["attention_bias"] is want["attention_bias"]
    assert m["attention_out_bias"] is False
    assert m["mlp_bias"] is False
    assert m["qk_norm"] is want["qk_norm"]
    rope = m["rope"]
    assert rope["type"] == want["rope_type"]
    assert rope["theta"] == config["rope_parameters"]["rope_theta"]
    assert len(rope["inv_freq"]) == m["head_dim"] // 2
    assert rope["attention_factor"] == 1.0
    expected_rope_layers = [bool(x) for x in config.get("no_rope_layers", [1] * 4)]
    assert m["rope_layers"] == expected_rope_layers
    if model == "smollm3":
        assert m["rope_layers"] == [True, True, True, False]
    if model == "granite":
        assert m["embedding_multiplier"] == config["embedding_multiplier"]
        assert m["residual_multiplier"] == config["residual_multiplier"]
        assert m["attention_scale"] == config["attention_multiplier"]
        assert m["logits_scale"] == 1.0 / config["logits_scaling"]
    else:
        assert m["embedding_multiplier"] == 1.0
        assert m["residual_multiplier"] == 1.0
        assert m["attention_scale"] == m["head_dim"] ** -0.5
        assert m["logits_scale"] == 1.0
    if want["rope_type"] == "default":
        dim, theta = m["head_dim"], config["rope_parameters"]["rope_theta"]
        expected = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        np.testing.assert_allclose(rope["inv_freq"], expected, rtol=1e-6)


@pytest.mark.parametrize("model", MODELS)
def test_tokenizer_and_generation_sections(model: str, tmp_path: Path) -> None:
    src = FIXTURES / model
    header = read_header(convert_hf(src, tmp_path / "m.cellm"))
    tc = json.loads((src / "tokenizer_config.json").read_text())
    gen = json.loads((src / "generation_config.json").read_text())
    tok = header["tokenizer"]
    assert tok["blob"] == "tokenizer.json"
    assert tok["bos_token"] == tc.get("bos_token")
    assert tok["eos_token"] == tc["eos_token"]
    assert tok["pad_token"] == tc["pad_token"]
    assert tok["add_bos_token"] is tc.get("add_bos_token", False)
    assert tok["add_eos_token"] is tc.get("add_eos_token", False)
    assert tok["chat_template"] == (src / "chat_template.jinja").read_text()
    assert "chat_template" not in tok["config"]
    assert "added_tokens_decoder" not in tok["config"]
    assert tok["config"]["eos_token"] == tc["eos_token"]

    g = header["generation"]
    eos_id = {"llama": 9}.get(model, 2)
    assert g["eos_token_ids"] == [eos_id]
    assert g["pad_token_id"] == 5
    assert g["bos_token_id"] == (8 if model == "llama" else None)
    assert "eos_token_id" not in g
    for key, value in gen.items():
        if key not in ("eos_token_id", "bos_token_id", "pad_token_id"):
            assert g[key] == value


def test_eos_ids_union_and_token_dicts(tmp_path: Path) -> None:
    src = copy_fixture("llama", tmp_path)
    edit_json(src / "config.json", eos_token_id=[4, 9])
    edit_json(src / "generation_config.json", eos_token_id=[9, 7, 4])
    edit_json(
        src / "tokenizer_config.json",
        eos_token={"__type": "AddedToken", "content": "<|im_end|>"},
        bos_token={"content": "<|begin_of_text|>"},
        add_bos_token=True,
        chat_template="ignored: chat_template.jinja wins",
    )
    header = read_header(convert_hf(src, tmp_path / "m.cellm"))
    assert header["generation"]["eos_token_ids"] == [4, 9, 7, 2]
    assert header["tokenizer"]["eos_token"] == "<|im_end|>"
    assert header["tokenizer"]["bos_token"] == "<|begin_of_text|>"
    assert header["tokenizer"]["add_bos_token"] is True
    assert header["tokenizer"]["chat_template"].startswith("{{ bos_token }}")


def test_chat_template_from_tokenizer_config(tmp_path: Path) -> None:
    src = copy_fixture("qwen2", tmp_path)
    (src / "chat_template.jinja").unlink()
    edit_json(src / "tokenizer_config.json", chat_template="{{ messages }}")
    header = read_header(convert_hf(src, tmp_path / "a.cellm"))
    assert header["tokenizer"]["chat_template"] == "{{ messages }}"

    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    edit_json(src / "tokenizer_config.json", chat_template=named)
    header = read_header(convert_hf(src, tmp_path / "b.cellm"))
    assert header["tokenizer"]["chat_template"] == "D"

    edit_json(src / "tokenizer_config.json", chat_template=_DELETE)
    (src / "generation_config.json").unlink()
    (src / "tokenizer_config.json").unlink()
    header = read_header(convert_hf(src, tmp_path / "c.cellm"))
    assert header["tokenizer"]["chat_template"] is None
    assert header["tokenizer"]["config"] == {}
    assert header["generation"]["eos_token_ids"] == [2]  # from config.json alone


# ------------------------------------------------------------------------------- RoPE


def hf_llama3_inv_freq(theta, dim, factor, low_ff, high_ff, old_len) -> np.ndarray:
    """transformers' _compute_llama3_parameters, transcribed to numpy float32."""
    f32 = np.float32
    inv_freq = f32(1.0) / (f32(theta) ** (np.arange(0, dim, 2).astype(f32) / f32(dim)))
    low_freq_wavelen = old_len / low_ff
    high_freq_wavelen = old_len / high_ff
    wavelen = f32(2 * math.pi) / inv_freq
    inv_freq_llama = np.where(wavelen > f32(low_freq_wavelen), inv_freq / f32(factor), inv_freq)
    smooth = (f32(old_len) / wavelen - f32(low_ff)) / f32(high_ff - low_ff)
    smoothed = (f32(1) - smooth) * inv_freq_llama / f32(factor) + smooth * inv_freq_llama
    medium = (wavelen >= f32(high_freq_wavelen)) & (wavelen <= f32(low_freq_wavelen))
    return np.where(medium, smoothed, inv_freq_llama)


def test_llama3_inv_freq_matches_hf_formula(tmp_path: Path) -> None:
    header = read_header(convert_hf(FIXTURES / "llama", tmp_path / "m.cellm", dtype="f32"))
    rp = json.loads((FIXTURES / "llama" / "config.json").read_text())["rope_parameters"]
    expected = hf_llama3_inv_freq(
        rp["rope_theta"],
        16,
        rp["factor"],
        rp["low_freq_factor"],
        rp["high_freq_factor"],
        rp["original_max_position_embeddings"],
    )
    got = np.array(header["model"]["rope"]["inv_freq"], dtype=np.float64)
    # float32 values, stored exactly in the JSON
    assert np.array_equal(got.astype(np.float32).astype(np.float64), got)
    np.testing.assert_allclose(got, expected, rtol=2e-7)
    # the fixture's parameters put frequencies in all three llama3 bands
    plain = 1.0 / (rp["rope_theta"] ** (np.arange(0, 16, 2) / 16))
    assert got[0] == pytest.approx(plain[0])
    assert got[-1] == pytest.approx(plain[-1] / rp["factor"], rel=1e-6)
    assert np.any((got < plain * 0.99) & (got > plain / rp["factor"] * 1.01))


@pytest.mark.parametrize("type_key", ["type", "rope_type"])
def test_legacy_rope_spelling(type_key: str, tmp_path: Path) -> None:
    src = copy_fixture("llama", tmp_path)
    config = json.loads((src / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    params[type_key] = params.pop("rope_type")
    config["rope_scaling"] = params
    (src / "config.json").write_text(json.dumps(config))

    new = read_header(convert_hf(src, tmp_path / "legacy.cellm"))["model"]["rope"]
    ref = read_header(convert_hf(FIXTURES / "llama", tmp_path / "ref.cellm"))["model"]["rope"]
    assert new == ref


def _rope_of(tmp_path: Path, name: str, **config_changes: Any) -> dict[str, Any]:
    src = tmp_path / name
    if not src.exists():
        shutil.copytree(FIXTURES / "qwen2", src)
    edit_json(src / "config.json", **config_changes)
    return read_header(convert_hf(src, tmp_path / f"{name}.cellm"))["model"]["rope"]


def test_linear_dynamic_and_legacy_default_rope(tmp_path: Path) -> None:
    theta, dim = 10000.0, 16
    plain = 1.0 / (theta ** (np.arange(0, dim, 2) / dim))
    legacy = _rope_of(tmp_path, "a", rope_parameters=_DELETE, rope_theta=theta)
    assert legacy["type"] == "default" and legacy["theta"] == theta
    np.testing.assert_allclose(legacy["inv_freq"], plain, rtol=1e-6)

    linear = _rope_of(
        tmp_path, "b", rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": theta}
    )
    np.testing.assert_allclose(linear["inv_freq"], plain / 4.0, rtol=1e-6)

    dynamic = _rope_of(
        tmp_path, "c", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": theta}
    )
    assert dynamic["type"] == "dynamic"
    np.testing.assert_allclose(dynamic["inv_freq"], plain, rtol=1e-6)


def test_yarn_rope(tmp_path: Path) -> None:
    theta, dim, factor, orig = 10000.0, 16, 4.0, 512
    rope = _rope_of(
        tmp_path,
        "y",
        rope_parameters={
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": orig,
            "rope_theta": theta,
        },
    )

    # transformers' _compute_yarn_parameters with default beta_fast=32, beta_slow=1.
    def corr(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(corr(32)), 0), min(math.ceil(corr(1)), dim - 1)
    pos = theta ** (np.arange(0, dim, 2) / dim)
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    extra = 1 - ramp
    expected = (1 / (factor * pos)) * (1 - extra) + (1 / pos) * extra
    np.testing.assert_allclose(rope["inv_freq"], expected, rtol=1e-6)
    assert rope["attention_factor"] == pytest.approx(0.1 * math.log(factor) + 1.0)


def test_unsupported_rope_type(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedArchitecture, match="longrope"):
        _rope_of(
            tmp_path,
            "l",
            rope_parameters={
                "rope_type": "longrope",
                "short_factor": [1.0] * 8,
                "long_factor": [1.0] * 8,
            },
        )


def test_smollm3_rope_layers_from_interval(tmp_path: Path) -> None:
    src = copy_fixture("smollm3", tmp_path)
    edit_json(src / "config.json", no_rope_layers=_DELETE, no_rope_layer_interval=2)
    header = read_header(convert_hf(src, tmp_path / "m.cellm"))
    assert header["model"]["rope_layers"] == [True, False, True, False]


# ------------------------------------------------------------------ checkpoint layouts


def test_sharded_checkpoint_converts_identically(tmp_path: Path) -> None:
    src = copy_fixture("qwen3", tmp_path)
    tensors = load_safetensors(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:]), start=1):
        shard = f"model-0000{i}-of-00002.safetensors"
        save_safetensors(src / shard, {n: tensors[n] for n in part})
        weight_map.update({n: shard for n in part})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))

    sharded = convert_hf(src, tmp_path / "sharded.cellm", dtype="bf16")
    single = convert_hf(FIXTURES / "qwen3", tmp_path / "single.cellm", dtype="bf16")
    assert sharded.read_bytes() == single.read_bytes()


def test_sharded_checkpoint_with_missing_shard(tmp_path: Path) -> None:
    src = copy_fixture("llama", tmp_path)
    tensors = load_safetensors(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    save_safetensors(src / "a.safetensors", tensors)
    weight_map = {n: "a.safetensors" for n in tensors}
    weight_map["model.norm.weight"] = "b.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(FormatError, match="b.safetensors"):
        convert_hf(src, tmp_path / "m.cellm")


@pytest.mark.parametrize("src_dtype", ["BF16", "F16"])
def test_half_precision_source(src_dtype: str, tmp_path: Path) -> None:
    src = copy_fixture("granite", tmp_path)
    tensors = load_safetensors(src / "model.safetensors")
    half = {}
    for name, (_, arr) in tensors.items():
        if src_dtype == "BF16":
            half[name] = ("BF16", bf16_reference(arr))
        else:
            half[name] = ("F16", arr.astype("<f2"))
    save_safetensors(src / "model.safetensors", half)

    for dtype in DTYPES:
        out = convert_hf(src, tmp_path / f"{dtype}.cellm", dtype=dtype)
        header = read_header(out)
        for name, (sd, arr) in half.items():
            fmt, got = cellm_tensor(out, header, name)
            wide = as_f32(sd, arr)
            if fmt == "f32":
                np.testing.assert_array_equal(got, wide)
            elif fmt == "f16":
                np.testing.assert_array_equal(got, wide.astype(np.float16))
            else:
                np.testing.assert_array_equal(got, bf16_reference(wide))
            if fmt == dtype and sd.lower() == dtype:  # same format: bits copied verbatim
                assert got.tobytes() == arr.tobytes()


def test_untied_checkpoint_keeps_lm_head(tmp_path: Path) -> None:
    src = copy_fixture("llama", tmp_path)
    tensors = load_safetensors(src / "model.safetensors")
    rng = np.random.default_rng(0)
    lm_head = rng.standard_normal((1000, 64)).astype(np.float32)
    tensors["lm_head.weight"] = ("F32", lm_head)
    save_safetensors(src / "model.safetensors", tensors)
    edit_json(src / "config.json", tie_word_embeddings=False)
    out = convert_hf(src, tmp_path / "m.cellm", dtype="f32")
    header = read_header(out)
    assert header["model"]["tie_word_embeddings"] is False
    assert header["tensors"][-1]["name"] == "lm_head.weight"
    np.testing.assert_array_equal(cellm_tensor(out, header, "lm_head.weight")[1], lm_head)

    # Config says tied: the stored lm_head is the embedding's copy and is skipped.
    edit_json(src / "config.json", tie_word_embeddings=True)
    header = read_header(convert_hf(src, tmp_path / "t.cellm"))
    assert "lm_head.weight" not in [t["name"] for t in header["tensors"]]


def test_chunked_conversion_matches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = convert_hf(FIXTURES / "qwen2", tmp_path / "whole.cellm", dtype="bf16")
    monkeypatch.setattr(dtypes, "CHUNK_BYTES", 1000)  # many row blocks per matrix
    chunked = convert_hf(FIXTURES / "qwen2", tmp_path / "chunked.cellm", dtype="bf16")
    assert whole.read_bytes() == chunked.read_bytes()


def test_normalise_config_directly() -> None:
    config = json.loads((FIXTURES / "qwen3" / "config.json").read_text())
    config["tie_word_embeddings"] = False
    assert normalise_config(config)["tie_word_embeddings"] is False
    assert normalise_config(config, {"lm_head.weight"})["tie_word_embeddings"] is False
    assert normalise_config(config, set())["tie_word_embeddings"] is True
    del config["head_dim"]  # HF's Qwen3Config default, not hidden/heads
    assert normalise_config(config)["head_dim"] == 128
    del config["model_type"]
    with pytest.raises(UnsupportedArchitecture, match="no model_type"):
        normalise_config(config)


def test_untied_config_without_lm_head_is_tied(tmp_path: Path) -> None:
    src = copy_fixture("qwen2", tmp_path)
    edit_json(src / "config.json", tie_word_embeddings=False)
    header = read_header(convert_hf(src, tmp_path / "m.cellm"))
    assert header["model"]["tie_word_embeddings"] is True


# ----------------------------------------------------------------------------- errors


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FormatError, match="no such file or directory"):
        convert_hf(missing, tmp_path / "m.cellm")
    line = assert_cli_error("--input", str(missing), "--output", str(tmp_path / "m.cellm"))
    assert str(missing) in line


def test_dir_without_config(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FormatError, match="has no config.json"):
        convert_hf(empty, tmp_path / "m.cellm")
    line = assert_cli_error("--input", str(empty), "--output", str(tmp_path / "m.cellm"))
    assert "not a HuggingFace checkpoint" in line


def test_unsupported_model_type(tmp_path: Path) -> None:
    src = copy_fixture("llama", tmp_path)
    edit_json(src / "config.json", model_type="gpt2")
    with pytest.raises(UnsupportedArchitecture, match="gpt2.*llama, qwen2, qwen3"):
        convert_hf(src, tmp_path / "m.cellm")
    line = assert_cli_error("-i", str(src), "-o", str(tmp_path / "m.cellm"))
    assert "gpt2" in line
    assert not (tmp_path / "m.cellm").exists()


def test_truncated_safetensors(tmp_path: Path) -> None:
    src = copy_fixture("llama", tmp_path)
    st = src / "model.safetensors"
    size = st.stat().st_size
    with open(st, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(FormatError) as info:
        convert_hf(src, tmp_path / "m.cellm")
    msg = str(info.value)
    assert f"{st} is truncated: tensor " in msg
    assert f"but the file has {size - 100}" in msg
    line = assert_cli_error("-i", str(src), "-o", str(tmp_path / "m.cellm"))
    assert "is truncated" in line
    assert not (tmp_path / "m.cellm").exists()


def test_corrupt_safetensors_header(tmp_path: Path) -> None:
    src = copy_fixture("llama", tmp_path)
    st = src / "model.safetensors"
    data = bytearray(st.read_bytes())
    data[8] = ord("[")  # header JSON no longer an object / valid
    st.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="safetensors header"):
        convert_hf(src, tmp_path / "m.cellm")
    st.write_bytes(b"\x01")
    with pytest.raises(FormatError, match="truncated"):
        convert_hf(src, tmp_path / "m.cellm")


def test_no_safetensors(tmp_path: Path) -> None:
    src = copy_fixture("llama", tmp_path)
    (src / "model.safetensors").unlink()
    with pytest.raises(FormatError, match="no model.safetensors"):
        convert_hf(src, tmp_path / "m.cellm")
    assert_cli_error("-i", str(src), "-o", str(tmp_path / "m.cellm"))


def test_missing_and_misshapen_tensors(tmp_path: Path) -> None:
    src = copy_fixture("qwen3", tmp_path)
    tensors = load_safetensors(src / "model.safetensors")
    del tensors["model.layers.2.self_attn.k_norm.weight"]
    save_safetensors(src / "model.safetensors", tensors)
    with pytest.raises(FormatError, match=r"missing tensor model\.layers\.2\.self_attn\.k_norm"):
        convert_hf(src, tmp_path / "m.cellm")

    tensors = load_safetensors(FIXTURES / "qwen3" / "model.safetensors")
    tensors["model.norm.weight"] = ("F32", np.ones(63, dtype=np.float32))
    save_safetensors(src / "model.safetensors", tensors)
    with pytest.raises(FormatError, match=r"model\.norm\.weight has shape \[63\]"):
        convert_hf(src, tmp_path / "m.cellm")

    # Config and weights disagree about head_dim.
    shutil.copy(FIXTURES / "qwen3" / "model.safetensors", src / "model.safetensors")
    edit_json(src / "config.json", head_dim=16)
    with pytest.raises(FormatError, match="expected"):
        convert_hf(src, tmp_path / "m.cellm")


def test_unexpected_tensor_is_an_error(tmp_path: Path) -> None:
    src = copy_fixture("llama", tmp_path)
    tensors = load_safetensors(src / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.bias"] = ("F32", np.zeros(64, dtype=np.float32))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = ("F32", np.zeros(8, np.float32))
    save_safetensors(src / "model.safetensors", tensors)
    with pytest.raises(FormatError, match=r"does not use: model\.layers\.0\.self_attn\.q_proj"):
        convert_hf(src, tmp_path / "m.cellm")
    # ...and is accepted once the config declares the biases (HF: q/k/v and o_proj).
    for i in range(4):
        for proj, n in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32), ("o_proj", 64)):
            tensors[f"model.layers.{i}.self_attn.{proj}.bias"] = ("F32", np.ones(n, np.float32))
    save_safetensors(src / "model.safetensors", tensors)
    edit_json(src / "config.json", attention_bias=True)
    header = read_header(convert_hf(src, tmp_path / "m.cellm", dtype="bf16"))
    assert header["model"]["attention_bias"] and header["model"]["attention_out_bias"]
    rows = {t["name"]: t for t in header["tensors"]}
    assert rows["model.layers.3.self_attn.o_proj.bias"]["format"] == "f32"


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    src = copy_fixture("qwen2", tmp_path)
    (src / "tokenizer.json").unlink()
    with pytest.raises(FormatError, match="no tokenizer.json"):
        convert_hf(src, tmp_path / "m.cellm")


def test_bad_config_values(tmp_path: Path) -> None:
    src = copy_fixture("llama", tmp_path)
    edit_json(src / "config.json", hidden_size="64")
    with pytest.raises(FormatError, match="hidden_size"):
        convert_hf(src, tmp_path / "m.cellm")
    (src / "config.json").write_text("{not json")
    with pytest.raises(FormatError, match="config.json: invalid JSON"):
        convert_hf(src, tmp_path / "m.cellm")


def test_sliding_window_layers_rejected(tmp_path: Path) -> None:
    src = copy_fixture("qwen2", tmp_path)
    edit_json(src / "config.json", layer_types=["full_attention"] * 3 + ["sliding_attention"])
    with pytest.raises(UnsupportedArchitecture, match="sliding_attention"):
        convert_hf(src, tmp_path / "m.cellm")


def test_bad_dtype(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="q4"):
        convert_hf(FIXTURES / "llama", tmp_path / "m.cellm", dtype="q4")
    line = assert_cli_error("-i", str(FIXTURES / "llama"), "-o", "x.cellm", "--dtype", "q4")
    assert "q4" in line
    assert_cli_error("--input", str(FIXTURES / "llama"))  # --output missing
    assert_cli_error("--bogus")


def test_output_directory_missing(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="output directory"):
        convert_hf(FIXTURES / "llama", tmp_path / "no" / "m.cellm")


def test_cli_success(tmp_path: Path) -> None:
    out = tmp_path / "m.cellm"
    proc = run_cli("--input", str(FIXTURES / "smollm3"), "--output", str(out), "--dtype", "bf16")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # not a terminal: no progress bar
    assert read_header(out)["source"]["dtype"] == "bf16"


# ------------------------------------------------------------------ writer and helpers


def test_writer_round_trip_and_reader_checks(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    a = rng.standard_normal((3, 5)).astype(np.float32)
    b = rng.standard_normal(7).astype(np.float32)
    path = write_cellm(
        tmp_path / "w.cellm",
        {"model": {"x": 1}, "tensors": "ignored"},
        [("a", a, "bf16"), ("b", b, "f32"), ("c", a.astype(np.float16), "f16")],
        [("blob", b"hello")],
    )
    header = read_header(path)
    assert [t["offset"] for t in header["tensors"]] == [0, 64, 128]
    assert header["blobs"] == [{"name": "blob", "offset": 192, "nbytes": 5}]
    assert header["data_size"] == 197
    assert header["model"] == {"x": 1}
    np.testing.assert_array_equal(read_tensor(path, "b"), b)
    np.testing.assert_array_equal(read_tensor(path, "c"), a.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(cellm_tensor(path, header, "a")[1], bf16_reference(a))

    data = path.read_bytes()
    (tmp_path / "short.cellm").write_bytes(data[:-1])
    with pytest.raises(FormatError, match="truncated or padded"):
        read_header(tmp_path / "short.cellm")
    (tmp_path / "v1.cellm").write_bytes(data[:5] + b"\x01" + data[6:])
    with pytest.raises(FormatError, match="version 1"):
        read_header(tmp_path / "v1.cellm")
    with pytest.raises(InvalidArgument, match="duplicate"):
        write_cellm(tmp_path / "d.cellm", {}, [("a", b, "f32"), ("a", b, "f32")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["short.cellm", "v1.cellm", "w.cellm"]


def test_bf16_rounding_edge_cases() -> None:
    values = np.array(
        [
            1.0,
            -2.5,
            0.0,
            -0.0,
            np.inf,
            -np.inf,
            np.float32(1.0) + np.float32(2.0**-8),  # exactly half-way, even below: down
            np.float32(1.0) + np.float32(3 * 2.0**-8),  # half-way, odd below: up
            np.float32(1.0) + np.float32(2.0**-8) + np.float32(2.0**-20),  # above half: up
            3.4028235e38,  # rounds past the largest bf16: inf
            1e-45,  # subnormal
        ],
        dtype=np.float32,
    )
    got = dtypes.f32_to_bf16(values)
    np.testing.assert_array_equal(got, bf16_reference(values))
    assert got[6] == 0x3F80 and got[7] == 0x3F82 and got[8] == 0x3F81
    assert got[9] == 0x7F80
    nan = dtypes.f32_to_bf16(np.array([np.nan, -np.nan], dtype=np.float32))
    assert np.all(np.isnan(as_f32("BF16", nan)))


def test_progress_bar_only_when_forced_or_tty() -> None:
    quiet = io.StringIO()
    with ProgressBar(100, "x", stream=quiet) as bar:
        bar.update(50)
    assert quiet.getvalue() == ""
    loud = io.StringIO()
    with ProgressBar(100, "x", stream=loud, force=True) as bar:
        bar.update(100)
    text = loud.getvalue()
    assert text.startswith("\rx [") and "100.0%" in text and text.endswith("\n")
