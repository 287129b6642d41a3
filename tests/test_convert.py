"""Tests of the HF -> .cellm converter (python/cellm/convert) against docs/format.md: every
fixture converted at every dtype (layout, tensors, model description, tokenizer and generation
sections) and the checkpoint layouts it reads (sharded, half-precision, untied, chunked).

RoPE is tested in test_convert_rope.py, bad input in test_convert_errors.py and the .cellm
writer in test_writer.py. Ground truth comes from independent helpers (tests/convert_helpers.py),
not from the converter.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from cellm.convert import convert_hf, dtypes, read_header
from cellm.convert.hf_config import normalise_config
from cellm.convert.writer import read_tensor
from cellm.errors import FormatError, UnsupportedArchitecture
from convert_helpers import (
    DELETE,
    DTYPES,
    FIXTURES,
    ITEMSIZE,
    MODELS,
    as_f32,
    bf16_reference,
    cellm_layout,
    cellm_tensor,
    copy_fixture,
    edit_json,
    load_safetensors,
    save_safetensors,
)

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

    edit_json(src / "tokenizer_config.json", chat_template=DELETE)
    (src / "generation_config.json").unlink()
    (src / "tokenizer_config.json").unlink()
    header = read_header(convert_hf(src, tmp_path / "c.cellm"))
    assert header["tokenizer"]["chat_template"] is None
    assert header["tokenizer"]["config"] == {}
    assert header["generation"]["eos_token_ids"] == [2]  # from config.json alone


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
