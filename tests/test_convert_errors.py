"""Bad input to the HF -> .cellm converter: missing or corrupt checkpoints, unsupported
architectures, bad config values and arguments. Each raises a cellm error naming the problem and
the CLI exits 2 with a one-line message and no output file; plus one successful CLI run.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from cellm.convert import convert_hf, read_header
from cellm.errors import FormatError, InvalidArgument, UnsupportedArchitecture
from convert_helpers import (
    FIXTURES,
    assert_cli_error,
    copy_fixture,
    edit_json,
    load_safetensors,
    run_cli,
    save_safetensors,
)


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
    with pytest.raises(UnsupportedArchitecture, match=r"gpt2.*supported: .*llama.*qwen2.*qwen3"):
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
