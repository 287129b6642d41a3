"""Bad input: one clear line and exit code 2 from the CLIs, a typed exception from the API."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cellm import LLM, ContextOverflow, FormatError, InvalidArgument, UnsupportedArchitecture
from conftest import FIXTURES, ROOT

QWEN2 = FIXTURES / "qwen2"


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=env)


def assert_one_line_error(proc: subprocess.CompletedProcess, needle: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert needle in lines[0], lines[0]
    assert "Traceback" not in proc.stderr and "panicked" not in proc.stderr


def copy_fixture(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(QWEN2, d)
    return d


@pytest.fixture
def cellm_file(tmp_path, converted) -> Path:
    p = tmp_path / "m.cellm"
    shutil.copy(converted("qwen2", "f16"), p)
    return p


def test_missing_path(tmp_path):
    missing = tmp_path / "nope.cellm"
    with pytest.raises(FormatError, match="no such file"):
        LLM(missing)
    assert_one_line_error(cli("cellm.infer", "--model", str(missing), "--prompt", "x"), "no such")
    out = tmp_path / "o.cellm"
    assert_one_line_error(
        cli("cellm.convert", "--input", str(missing), "--output", str(out)), "no such"
    )


def test_missing_tokenizer_file(cellm_file, tmp_path):
    missing = tmp_path / "tokenizer.json"
    with pytest.raises(FormatError, match="no such file"):
        LLM(cellm_file, tokenizer=missing)
    args = ["--model", str(cellm_file), "--tokenizer", str(missing), "--prompt", "x"]
    proc = cli("cellm.infer", *args)
    assert_one_line_error(proc, "no such file")


def test_directory_without_config(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    with pytest.raises(FormatError, match="config.json"):
        LLM(d)
    assert_one_line_error(cli("cellm.infer", "--model", str(d), "--prompt", "x"), "config.json")


def test_unsupported_model_type(tmp_path):
    d = copy_fixture(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt_bigcode"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitecture, match="gpt_bigcode"):
        LLM(d)
    assert_one_line_error(cli("cellm.infer", "--model", str(d), "--prompt", "x"), "gpt_bigcode")


def test_truncated_safetensors(tmp_path):
    d = copy_fixture(tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(FormatError, match="truncated"):
        LLM(d)
    out = tmp_path / "o.cellm"
    assert_one_line_error(
        cli("cellm.convert", "--input", str(d), "--output", str(out)), "truncated"
    )


def test_truncated_cellm(cellm_file):
    cellm_file.write_bytes(cellm_file.read_bytes()[:-100])
    with pytest.raises(FormatError, match="truncated"):
        LLM(cellm_file)
    assert_one_line_error(
        cli("cellm.infer", "--model", str(cellm_file), "--prompt", "x"), "truncated"
    )


@pytest.mark.parametrize("where", ["magic", "header", "tensor_table"])
def test_corrupted_cellm(cellm_file, where):
    data = bytearray(cellm_file.read_bytes())
    if where == "magic":
        data[0:5] = b"XXXXX"
    elif where == "header":
        data[20:40] = b"\xff" * 20
    else:  # a tensor's size no longer matches its shape
        text = data.decode("latin-1")
        i = text.index('"nbytes":')
        data[i + 9] = ord("9") if data[i + 9] != ord("9") else ord("8")
    cellm_file.write_bytes(bytes(data))
    with pytest.raises(FormatError):
        LLM(cellm_file)
    proc = cli("cellm.infer", "--model", str(cellm_file), "--prompt", "x")
    assert_one_line_error(proc, str(cellm_file))


@pytest.mark.parametrize(
    "flag",
    [
        ["--temperature", "-1"],
        ["--top-p", "1.5"],
        ["--gen", "0"],
        ["--threads", "0"],
        ["--top-k", "x"],
        ["--kv-encoding", "q3"],
        ["--stop-tokens", "<no_such_token>"],
    ],
)
def test_out_of_range_flags(cellm_file, flag):
    proc = cli("cellm.infer", "--model", str(cellm_file), "--prompt", "x", *flag)
    assert_one_line_error(proc, flag[0])


def test_bad_api_arguments(cellm_file):
    with pytest.raises(InvalidArgument):
        LLM(cellm_file, kv_encoding="q3")
    with pytest.raises(InvalidArgument):
        LLM(cellm_file, threads=0)
    with pytest.raises(InvalidArgument):
        LLM(cellm_file, backend="cuda")
    llm = LLM(cellm_file)
    with pytest.raises(InvalidArgument):
        llm.generate("hi", temperature=-1)
    with pytest.raises(InvalidArgument):
        llm.generate("hi", max_tokens=0)


def test_prompt_longer_than_context(cellm_file):
    llm = LLM(cellm_file, context_length=32)
    with pytest.raises(ContextOverflow, match="context length"):
        llm.generate("the quick brown fox " * 20)
    proc = cli(
        "cellm.infer",
        "--model",
        str(cellm_file),
        "--context-length",
        "32",
        "--prompt",
        "the quick brown fox " * 20,
    )
    assert_one_line_error(proc, "context length")
    # The model is still usable afterwards: nothing was left half-done.
    assert llm.generate("hello", max_tokens=3).token_ids


def test_bench_bad_models_and_paths(tmp_path):
    # Each fails before the bandwidth probe and any run, in one line.
    assert_one_line_error(cli("cellm.bench", "--models", str(tmp_path / "x.gguf")), "no such")
    assert_one_line_error(cli("cellm.bench", "--models", "no-such-model"), "unknown model")
    out = tmp_path / "missing" / "b.md"
    assert_one_line_error(cli("cellm.bench", "--out", str(out)), "no such directory")
    assert_one_line_error(cli("cellm.bench", "--runs", "0"), "--runs")
