"""Hostile and malformed input (issue 18, the Python side): chat templates that never end or
grow without bound, conversions that would destroy their input, readers fed overlapping or
shifted layouts, config values of the wrong type or range, token ids that are not integers,
one LLM shared by threads, and named pipes. Each gives one typed cellm error naming the file
and field at fault (exit code 2 on the CLI): never a traceback, a hang or lost data."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cellm
from cellm import LLM, FormatError, InvalidArgument, TemplateError, chat
from cellm.chat import render_chat_template
from cellm.convert import convert, convert_gguf, convert_hf
from cellm.convert.gguf import GGUFFile
from cellm.convert.safetensors import SafetensorsFile
from cellm.convert.writer import PREFIX_LEN, align_up, write_cellm
from conftest import ROOT
from convert_helpers import assert_cli_error, copy_fixture, edit_json
from gguf_helpers import GGML_F32, T_ARRAY, T_F32, T_STRING, T_U32, write_gguf

HI = [{"role": "user", "content": "hi"}]


def _render(template: str) -> tuple[str | None, str | None, float]:
    """(output, error message, seconds) of rendering `template`."""
    t0 = time.monotonic()
    try:
        return render_chat_template(template, HI), None, time.monotonic() - t0
    except TemplateError as e:
        return None, str(e), time.monotonic() - t0


# -- 1. chat templates under limits ------------------------------------------------------


def test_template_nested_loops_stop_at_the_budget() -> None:
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    out, error, seconds = _render(loops)
    assert error is not None and "loop iterations" in error, out
    # Loops over anything, not only range(), are counted.
    strings = "{% for a in 'x' * 5000 %}{% for b in 'y' * 5000 %}{% endfor %}{% endfor %}"
    out, error2, seconds2 = _render(strings)
    assert error2 is not None and "loop iterations" in error2, out
    assert seconds + seconds2 < 5


def test_template_output_stops_at_the_size_limit() -> None:
    # 10^9 characters, a piece at a time: stopped once the output passes the limit.
    out, error, seconds = _render("{% for i in range(100000) %}{{ 'x' * 10000 }}{% endfor %}")
    assert error is not None and "output passed" in error and seconds < 2, out


@pytest.mark.parametrize(
    ("template", "words"),
    [
        ("{{ 'x' * 1000000000 }}", "string of 1,000,000,000 characters"),
        ("{{ [0] * 1000000000 }}", "list of 1,000,000,000 items"),
        (
            "{% set ns = namespace(s='xx') %}{% for i in range(64) %}"
            "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
            "string of",
        ),
        (
            "{% set ns = namespace(s='xx') %}{% for i in range(64) %}"
            "{% set ns.s = ns.s + ns.s %}{% endfor %}",
            "string of",
        ),
        ("{{ 10 ** 1000000000 }}", "bits"),
        (
            "{% set ns = namespace(n=7 ** 5000) %}{% for i in range(40) %}"
            "{% set ns.n = ns.n * ns.n %}{% endfor %}",
            "bits",
        ),  # fmt: skip
    ],
)
def test_template_values_stop_at_the_size_limit(template: str, words: str) -> None:
    """Values past the limits are refused as they are built (repetition and powers before),
    so the process never holds gigabytes for a template."""
    out, error, seconds = _render(template)
    assert error is not None and words in error and seconds < 2, out


def test_template_time_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat, "TEMPLATE_TIME_LIMIT_S", 0.2)
    monkeypatch.setattr(chat, "TEMPLATE_MAX_LOOP_STEPS", 10**15)
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    out, error, seconds = _render(loops)
    assert error is not None and "took more than 0.2 s" in error and seconds < 2, out


def test_template_limits_leave_ordinary_templates_alone() -> None:
    template = (
        "{% for m in messages %}{{ loop.index }}/{{ loop.length }} {{ m.content | upper }}"
        "{% if loop.last %}!{% endif %}{% endfor %}"
        "{% for m in messages if m.role == 'system' %}x{% else %} none{% endfor %}"
        "{% filter upper %} block{% endfilter %}{% set b | trim %} set {% endset %}{{ b }}"
        "{% macro wrap() %}[{{ caller() }}]{% endmacro %}{% call wrap() %}called{% endcall %}"
        "{% generation %} gen{% endgeneration %}"
        "{% for n in [[1, [2]], [3]] recursive %}{% if n is iterable %}{{ loop(n) }}"
        "{% else %}{{ n }}{% endif %}{% endfor %}"
        "{{ (range(3) | list) * 2 }}{{ 2 ** 10 }}{{ '%s-%s' % ('a', 'b') }}"
    )
    assert render_chat_template(template, HI) == (
        "1/1 HI! none BLOCKset[called] gen123[0, 1, 2, 0, 1, 2]1024a-b"
    )


def test_template_output_never_reaches_the_tokenizer(
    converted: Callable[[str, str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(converted("llama", "f32"))
    monkeypatch.setattr(
        llm, "chat_template", "{% for i in range(100000) %}{{ 'x' * 10000 }}{% endfor %}"
    )

    def encode(*args: Any, **kwargs: Any) -> list[int]:
        raise AssertionError("the tokenizer was reached")

    monkeypatch.setattr(llm.tokenizer, "encode", encode)
    with pytest.raises(TemplateError, match="output passed"):
        llm.chat(HI, max_tokens=1)


def test_non_string_chat_template_in_tokenizer_config(tmp_path: Path) -> None:
    d = copy_fixture("llama", tmp_path)
    (d / "chat_template.jinja").unlink()
    edit_json(d / "tokenizer_config.json", chat_template={"text": "x"})
    with pytest.raises(TemplateError, match=r"tokenizer_config\.json: chat_template must be"):
        convert_hf(d, tmp_path / "o.cellm")
    line = assert_cli_error("--input", str(d), "--output", str(tmp_path / "o.cellm"))
    assert "tokenizer_config.json: chat_template" in line
    edit_json(d / "tokenizer_config.json", chat_template=[{"name": "default", "template": 5}])
    with pytest.raises(TemplateError, match="'default' template must be a string, got int"):
        convert_hf(d, tmp_path / "o.cellm")


def _rewrite_header(src: Path, dst: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of .cellm file `src` whose JSON header `edit` changed (data moved along)."""
    data = src.read_bytes()
    (n,) = struct.unpack("<Q", data[8:16])
    header = json.loads(data[PREFIX_LEN : PREFIX_LEN + n])
    edit(header)
    raw = json.dumps(header).encode()
    offset = align_up(PREFIX_LEN + len(raw))
    out = data[:8] + struct.pack("<Q", len(raw)) + raw
    dst.write_bytes(out + bytes(offset - len(out)) + data[align_up(PREFIX_LEN + n) :])
    return dst


def test_non_string_chat_template_in_header(
    converted: Callable[[str, str], Path], tmp_path: Path
) -> None:
    def edit(header: dict[str, Any]) -> None:
        header["tokenizer"]["chat_template"] = ["not", "text"]

    path = _rewrite_header(converted("llama", "f32"), tmp_path / "m.cellm", edit)
    llm = LLM(path)
    assert llm.generate([1, 2], max_tokens=2).token_ids  # plain generation needs no template
    with pytest.raises(TemplateError, match=r"m\.cellm: the header's tokenizer\.chat_template"):
        llm.chat(HI, max_tokens=1)
    assert llm.chat(HI, max_tokens=1, chat_format="chatml").prompt_tokens > 0
    with pytest.raises(TemplateError, match="must be a string, got int"):
        render_chat_template(5, HI)  # type: ignore[arg-type]


# -- 2. convert never destroys its input ---------------------------------------------------


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def gguf_file(from_gguf: Callable[..., Path], gguf_dir: Path, tmp_path: Path) -> Path:
    from_gguf("qwen2")
    return Path(shutil.copy(gguf_dir / "qwen2.gguf", tmp_path / "model.gguf"))


def test_convert_refuses_output_equal_to_input(gguf_file: Path, tmp_path: Path) -> None:
    before = _digest(gguf_file)
    with pytest.raises(InvalidArgument, match="is the conversion's input"):
        convert(gguf_file, gguf_file)
    os.link(gguf_file, tmp_path / "hard.gguf")
    (tmp_path / "sym.cellm").symlink_to(gguf_file)
    for alias in (tmp_path / "hard.gguf", tmp_path / "sym.cellm", tmp_path / "." / "model.gguf"):
        with pytest.raises(InvalidArgument, match="is the conversion's input"):
            convert_gguf(gguf_file, alias)
    line = assert_cli_error("--input", str(gguf_file), "--output", str(gguf_file))
    assert "is the conversion's input" in line
    assert _digest(gguf_file) == before

    d = copy_fixture("llama", tmp_path)
    before = {p.name: _digest(p) for p in d.iterdir()}
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        with pytest.raises(InvalidArgument, match=f"is the conversion's input .*{name}"):
            convert(d, d / name)
    line = assert_cli_error("--input", str(d), "--output", str(d / "model.safetensors"))
    assert "model.safetensors" in line
    assert {p.name: _digest(p) for p in d.iterdir()} == before
    # A new file in the checkpoint folder, and rewriting it later, are fine.
    convert_hf(d, d / "model.cellm")
    convert_hf(d, d / "model.cellm")
    assert not list(d.glob(".*tmp*"))


def test_convert_refuses_output_that_is_not_a_regular_file(gguf_file: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    (tmp_path / "folder").mkdir()
    with pytest.raises(
        InvalidArgument, match="exists and is not a regular file \\(a named pipe\\)"
    ):
        convert(gguf_file, fifo)
    with pytest.raises(InvalidArgument, match="is a directory"):
        convert(gguf_file, tmp_path / "folder")
    assert fifo.exists() and not fifo.is_file()
    assert "not a regular file" in assert_cli_error(
        "--input", str(gguf_file), "--output", str(fifo)
    )


_SLOW_WRITE = """
import sys, time
from pathlib import Path
import numpy as np
from cellm.convert.writer import TensorEntry, write_cellm

def chunks():
    yield np.zeros(1024, dtype=np.float32)
    Path(sys.argv[2]).write_text("writing")
    time.sleep(60)
    yield np.zeros(1024, dtype=np.float32)

write_cellm(sys.argv[1], {}, [TensorEntry("t", "f32", (2048,), chunks)])
"""


def test_convert_removes_its_temporary_file_on_sigterm(tmp_path: Path) -> None:
    out, marker = tmp_path / "out.cellm", tmp_path / "started"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_WRITE, str(out), str(marker)],
        env=env,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert marker.exists(), proc.stderr.read() if proc.stderr else ""
        assert list(tmp_path.glob(".out.cellm.tmp-*"))  # the write is under way
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM, stderr
    assert b"Traceback" not in stderr
    assert not out.exists() and not list(tmp_path.glob(".out.cellm.tmp-*"))


def test_convert_restores_the_sigterm_handler(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    write_cellm(tmp_path / "a.cellm", {}, [("t", np.zeros(4, np.float32), "f32")])
    assert signal.getsignal(signal.SIGTERM) is before


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


def test_convert_removes_stale_temporary_files(tmp_path: Path) -> None:
    """What a SIGKILLed conversion left behind goes on the next write of the same file; a
    live process's write in progress stays."""
    dead = tmp_path / f".out.cellm.tmp-{_dead_pid()}"
    live = tmp_path / f".out.cellm.tmp-{os.getppid()}"
    other = tmp_path / f".other.cellm.tmp-{_dead_pid()}"
    for p in (dead, live, other):
        p.write_bytes(b"half a model")
    write_cellm(tmp_path / "out.cellm", {}, [("t", np.zeros(4, np.float32), "f32")])
    assert not dead.exists() and live.exists() and other.exists()


# -- 3. readers check layouts ---------------------------------------------------------------


def _two_tensor_gguf(path: Path, metadata: dict[str, Any] | None = None) -> Path:
    data = np.arange(32, dtype=np.float32).tobytes()
    tensors = [("a", GGML_F32, (4, 8), data), ("b", GGML_F32, (4, 8), data)]
    return write_gguf(path, {"general.architecture": "llama", **(metadata or {})}, tensors)


def _patch_tensor_offset(path: Path, name: str, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    key = struct.pack("<Q", len(name)) + name.encode()
    at = raw.index(key) + len(key)
    (n_dims,) = struct.unpack("<I", raw[at : at + 4])
    at += 4 + 8 * n_dims + 4
    raw[at : at + 8] = struct.pack("<Q", offset)
    path.write_bytes(bytes(raw))


def test_gguf_overlapping_tensors_are_refused(tmp_path: Path) -> None:
    path = _two_tensor_gguf(tmp_path / "m.gguf")
    GGUFFile(path).close()
    _patch_tensor_offset(path, "b", 64)  # b's data now starts inside a's 128 bytes
    with pytest.raises(FormatError, match="the data of tensors a and b overlap"):
        GGUFFile(path)
    _patch_tensor_offset(path, "b", 0)
    with pytest.raises(FormatError, match="overlap"):
        GGUFFile(path)
    _patch_tensor_offset(path, "b", 132)
    with pytest.raises(FormatError, match="tensor b is not aligned"):
        GGUFFile(path)
    _patch_tensor_offset(path, "b", 2**63)
    with pytest.raises(FormatError, match="truncated"):
        GGUFFile(path)


def _metadata_gguf(path: Path, key: str, vtype: int, raw: bytes) -> Path:
    """A GGUF file with no tensors and one metadata value given as raw bytes."""
    name = struct.pack("<Q", len(key)) + key.encode()
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + name + struct.pack("<I", vtype) + raw)
    return path


def test_gguf_nested_arrays_are_refused(tmp_path: Path) -> None:
    nested = struct.pack("<IQ", T_ARRAY, 1) * 1000 + struct.pack("<IQ", T_U32, 0)
    path = _metadata_gguf(tmp_path / "m.gguf", "deep.key", T_ARRAY, nested)
    with pytest.raises(FormatError, match="metadata deep.key nests arrays more than 4 deep"):
        GGUFFile(path)
    line = assert_cli_error("--input", str(path), "--output", str(tmp_path / "o.cellm"))
    assert "deep.key" in line


@pytest.mark.parametrize("value", ["abc", math.nan, 0, 3, -32, [32]])
def test_gguf_alignment_must_be_a_positive_power_of_two(tmp_path: Path, value: Any) -> None:
    path = _two_tensor_gguf(tmp_path / "m.gguf", {"general.alignment": value})
    with pytest.raises(FormatError, match="general.alignment must be a positive power of two"):
        GGUFFile(path)


def test_gguf_absurd_counts_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2**60) + bytes(64))
    with pytest.raises(FormatError, match="metadata count claims 1,152,921,504,606,846,976"):
        GGUFFile(path)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**40, 0) + bytes(64))
    with pytest.raises(FormatError, match="tensor count claims"):
        GGUFFile(path)
    for item in (T_STRING, T_F32):
        arr = struct.pack("<IQ", item, 2**62) + bytes(64)
        with pytest.raises(FormatError, match="array big.array claims"):
            GGUFFile(_metadata_gguf(path, "big.array", T_ARRAY, arr))
    dims = tmp_path / "dims.gguf"
    _two_tensor_gguf(dims)
    raw = bytearray(dims.read_bytes())
    at = raw.index(struct.pack("<Q", 1) + b"a") + 9
    raw[at : at + 4] = struct.pack("<I", 2**31)
    dims.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="tensor a has 2147483648 dimensions"):
        GGUFFile(dims)


def test_gguf_block_count_must_match_the_tensors(gguf_file: Path, tmp_path: Path) -> None:
    raw = bytearray(gguf_file.read_bytes())
    key = b"qwen2.block_count"
    at = raw.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    assert struct.unpack("<I", raw[at : at + 4]) == (T_U32,)
    raw[at + 4 : at + 8] = struct.pack("<I", 100_000_000)
    gguf_file.write_bytes(bytes(raw))
    t0 = time.monotonic()
    with pytest.raises(FormatError, match="qwen2.block_count is 100,000,000 but the file has"):
        convert_gguf(gguf_file, tmp_path / "o.cellm")
    assert time.monotonic() - t0 < 2


def _patch_metadata(path: Path, key: str, vtype: int, value: bytes) -> None:
    """Replace the 4-byte scalar metadata value of `key` with one of another type."""
    raw = path.read_bytes()
    name = struct.pack("<Q", len(key)) + key.encode()
    at = raw.index(name) + len(name)
    path.write_bytes(raw[:at] + struct.pack("<I", vtype) + value + raw[at + 8 :])


@pytest.mark.parametrize(
    ("key", "vtype", "value", "words"),
    [
        ("qwen2.block_count", T_STRING, b"\3\0\0\0\0\0\0\0abc", "qwen2.block_count "
         "(num_hidden_layers) must be an integer >= 1, got 'abc'"),
        ("qwen2.attention.layer_norm_rms_epsilon", 12, struct.pack("<d", 1e300),
         "layer_norm_rms_epsilon (rms_norm_eps) must be a finite number, got inf"),
        ("qwen2.attention.layer_norm_rms_epsilon", T_F32, struct.pack("<f", -1.0),
         "layer_norm_rms_epsilon (rms_norm_eps) must be a number > 0, got -1.0"),
        ("qwen2.rope.freq_base", T_F32, struct.pack("<f", math.nan),
         "rope parameter rope_theta must be a finite number"),
    ],
)  # fmt: skip
def test_gguf_bad_metadata_values_name_the_key(
    gguf_file: Path, tmp_path: Path, key: str, vtype: int, value: bytes, words: str
) -> None:
    _patch_metadata(gguf_file, key, vtype, value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a double past f32's range: no overflow warning
        with pytest.raises(FormatError, match=re.escape(words)):
            convert_gguf(gguf_file, tmp_path / "o.cellm")


def test_hf_layer_count_past_the_tensors_is_refused(tmp_path: Path) -> None:
    d = copy_fixture("llama", tmp_path)
    edit_json(d / "config.json", num_hidden_layers=100_000_000)
    t0 = time.monotonic()
    with pytest.raises(FormatError, match="num_hidden_layers is 100,000,000 but .* for 4 layers"):
        convert_hf(d, tmp_path / "o.cellm")
    assert time.monotonic() - t0 < 2


def _safetensors(path: Path, offsets: list[tuple[int, int]], data_len: int, shift: int = 0) -> Path:
    """Tensors t0, t1... of 4 f32 each at `offsets`; the stored header length is `shift` off
    (the header is padded with spaces, so it still parses)."""
    header = {
        f"t{i}": {"dtype": "F32", "shape": [4], "data_offsets": [a, b]}
        for i, (a, b) in enumerate(offsets)
    }
    text = json.dumps(header).encode() + b"        "
    path.write_bytes(struct.pack("<Q", len(text) + shift) + text + bytes(data_len))
    return path


def test_safetensors_header_one_byte_short_is_refused(tmp_path: Path) -> None:
    good = _safetensors(tmp_path / "good.safetensors", [(0, 16), (16, 32)], 32)
    SafetensorsFile(good)
    path = _safetensors(tmp_path / "m.safetensors", [(0, 16), (16, 32)], 32, shift=-1)
    with pytest.raises(FormatError, match="data_offsets end at 32 but the data section has 33"):
        SafetensorsFile(path)
    # The same, in a checkpoint: one line from the CLI.
    d = copy_fixture("llama", tmp_path)
    raw = bytearray((d / "model.safetensors").read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    assert raw[8 + n - 1 : 8 + n] == b" "  # the header is padded, so n - 1 still parses
    raw[:8] = struct.pack("<Q", n - 1)
    (d / "model.safetensors").write_bytes(bytes(raw))
    line = assert_cli_error("--input", str(d), "--output", str(tmp_path / "o.cellm"))
    assert "model.safetensors" in line and "data section" in line


@pytest.mark.parametrize(
    ("offsets", "data_len", "words"),
    [
        ([(0, 16), (8, 24)], 24, "tensor t1 overlaps another tensor"),
        ([(0, 16), (20, 36)], 36, "tensor t1 leaves a gap"),
        ([(4, 20), (20, 36)], 36, "tensor t0 leaves a gap"),
        ([(0, 16), (16, 32)], 40, "data section has 40 bytes"),
    ],
)
def test_safetensors_offsets_must_tile_the_data(
    tmp_path: Path, offsets: list[tuple[int, int]], data_len: int, words: str
) -> None:
    with pytest.raises(FormatError, match=words):
        SafetensorsFile(_safetensors(tmp_path / "m.safetensors", offsets, data_len))


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "tokenizer.json"])
def test_deeply_nested_json_is_refused(tmp_path: Path, name: str) -> None:
    d = copy_fixture("llama", tmp_path)
    doc = json.loads((d / name).read_text())
    for depth, key in ((1000, "deep"), (100_000, "deeper")):
        (d / name).write_text(
            json.dumps(doc)[:-1] + f', "{key}": ' + "[" * depth + "]" * depth + "}"
        )
        with pytest.raises(FormatError, match=f"{name}: .*nested"):
            convert_hf(d, tmp_path / "o.cellm")
    line = assert_cli_error("--input", str(d), "--output", str(tmp_path / "o.cellm"))
    assert name in line and "nested" in line


# -- 4. config values ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "key", "value", "words"),
    [
        ("llama", "hidden_act", ["silu"], "hidden_act must be a string"),
        ("llama", "rms_norm_eps", -1e-6, "rms_norm_eps must be a number > 0"),
        ("llama", "rms_norm_eps", math.nan, "rms_norm_eps must be a finite number"),
        ("llama", "rms_norm_eps", 10**400, "rms_norm_eps must be a finite number"),
        ("llama", "head_dim", 10**12, "head_dim is 1,000,000,000,000, more than 65,536"),
        ("gemma3", "query_pre_attn_scalar", 0, "query_pre_attn_scalar must be a number > 0"),
        ("gemma3", "final_logit_softcapping", -30.0, "final_logit_softcapping must be a number"),
        ("gemma3", "attn_logit_softcapping", math.inf, "attn_logit_softcapping must be a finite"),
        ("gemma3", "sliding_window_pattern", "six", "sliding_window_pattern must be an integer"),
        ("gemma3", "hidden_activation", {"a": 1}, "hidden_activation must be a string"),
        ("granite", "embedding_multiplier", -12.0, "embedding_multiplier must be a number > 0"),
        ("granite", "residual_multiplier", math.nan, "residual_multiplier must be a finite"),
        ("granite", "logits_scaling", 0, "logits_scaling must be a number > 0"),
        ("qwen2", "max_window_layers", "28", "max_window_layers must be an integer"),
        ("qwen3_5", "full_attention_interval", 0, "full_attention_interval must be an integer"),
        ("lfm2", "full_attn_idxs", 3, "full_attn_idxs must be a list"),
        ("deepseek_v3", "routed_scaling_factor", -2.5, "routed_scaling_factor must be a number"),
        ("deepseek_v3", "n_routed_experts", 10**8, "n_routed_experts is 100,000,000"),
    ],
)
def test_bad_config_value_is_refused_naming_the_key(
    tmp_path: Path, model: str, key: str, value: Any, words: str
) -> None:
    d = copy_fixture(model, tmp_path)
    if key in ("sliding_window_pattern", "max_window_layers", "full_attention_interval",
               "full_attn_idxs"):  # fmt: skip
        edit_json(d / "config.json", layer_types=None)  # read by the layer-type rules
    if key == "sliding_window_pattern":
        edit_json(d / "config.json", _sliding_window_pattern=None)
    if key == "max_window_layers":
        edit_json(d / "config.json", use_sliding_window=True, sliding_window=16)
    edit_json(d / "config.json", **{key: value})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no numpy RuntimeWarning on the way to the error
        with pytest.raises(FormatError, match=words):
            convert_hf(d, tmp_path / "o.cellm")
    assert not (tmp_path / "o.cellm").exists()


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"rope_theta": -500000.0}, "rope parameter rope_theta must be > 0"),
        ({"rope_theta": "big"}, "rope parameter rope_theta must be a finite number"),
        ({"factor": math.nan}, "rope parameter factor must be a finite number"),
        ({"factor": 1e-45}, "give inverse frequencies that are not finite"),  # 1 / 1e-45
        ({"rope_type": "yarn", "factor": 1e-300}, "inverse frequencies that are not finite"),
    ],
)
def test_bad_rope_parameters_are_refused_without_warnings(
    tmp_path: Path, params: dict[str, Any], words: str
) -> None:
    d = copy_fixture("llama", tmp_path)
    rope = json.loads((d / "config.json").read_text())["rope_parameters"]
    edit_json(d / "config.json", rope_parameters={**rope, **params})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(FormatError, match=words):
            convert_hf(d, tmp_path / "o.cellm")


def test_degenerate_rope_parameters_convert_without_warnings(tmp_path: Path) -> None:
    # low_freq_factor == high_freq_factor divides 0 by 0 in a band llama3 then leaves
    # empty (as HF computes it): the result is valid, and numpy must not print a warning.
    d = copy_fixture("llama", tmp_path)
    rope = json.loads((d / "config.json").read_text())["rope_parameters"]
    edit_json(d / "config.json", rope_parameters={**rope, "low_freq_factor": 4.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_hf(d, tmp_path / "o.cellm")


def test_bad_config_value_gives_one_cli_line(tmp_path: Path) -> None:
    d = copy_fixture("gemma3", tmp_path)
    edit_json(d / "config.json", query_pre_attn_scalar=0)
    proc = subprocess.run(
        [sys.executable, "-m", "cellm.convert", "--input", str(d), "--output", str(d / "o.cellm")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "python")},
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {d / 'config.json'}: query_pre_attn_scalar must be a number > 0, got 0"
    ]


# -- 5. API input ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(converted: Callable[[str, str], Path]) -> LLM:
    return LLM(converted("llama", "f32"), kv_encoding="f32")


def test_generate_refuses_bytes(llm: LLM) -> None:
    for prompt in (b"hi", bytearray(b"hi"), memoryview(b"hi"), 5, None):
        with pytest.raises(InvalidArgument, match="a prompt must be text .* got"):
            llm.generate(prompt, max_tokens=1)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="got bytes"):
        llm.logits(b"hi")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("ids", "words"),
    [
        ([1, 1.7], "item 1 is 1.7 (float)"),
        (["1", "2"], "item 0 is '1' (str)"),
        ([True, 2], "item 0 is True (bool)"),
        ([math.nan], "item 0 is nan (float)"),
        ([3, math.inf], "item 1 is inf (float)"),
        (np.array([1.0, 2.0]), "item 0 is np.float64(1.0)"),
        ([[1, 2]], "item 0 is [1, 2] (list)"),
    ],
)
def test_token_ids_must_be_integers(llm: LLM, ids: Any, words: str) -> None:
    with pytest.raises(
        InvalidArgument, match=f"token ids must be integers, but {re.escape(words)}"
    ):
        llm.generate(ids, max_tokens=1)
    with pytest.raises(InvalidArgument, match="token ids must be integers"):
        llm.logits(ids)


def test_numpy_integer_token_ids_are_fine(llm: LLM) -> None:
    ids = [1, 2, 3]
    want = llm.generate(ids, max_tokens=3, ignore_eos=True).token_ids
    for array in (np.array(ids, dtype=np.int32), np.array(ids, dtype=np.uint16), tuple(ids)):
        assert llm.generate(array, max_tokens=3, ignore_eos=True).token_ids == want
    assert llm.logits(np.array(ids, dtype=np.int64)).shape == (3, llm.vocab_size)
    with pytest.raises(InvalidArgument, match="not text"):
        llm.logits("abc")  # type: ignore[arg-type]


# -- 6. threads --------------------------------------------------------------------------------


def test_llm_shared_by_8_threads(llm: LLM) -> None:
    prompts = [[1 + i, 2 + i, 3 + i] for i in range(8)]
    want = [llm.generate(p, max_tokens=6, ignore_eos=True).token_ids for p in prompts]
    want_logits = llm.logits(prompts[0])
    results: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def work(i: int) -> None:
        try:
            start.wait()
            got = []
            for _ in range(3):
                got.append(llm.generate(prompts[i], max_tokens=6, ignore_eos=True).token_ids)
                np.testing.assert_array_equal(llm.logits(prompts[0]), want_logits)
            results[i] = got
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert results == {i: [want[i]] * 3 for i in range(8)}
    assert llm._engine.kv_stats()[0] == 0  # every session was freed


def test_streams_interleave_their_steps(llm: LLM) -> None:
    """Two streams advanced alternately in one thread: each keeps its own session."""
    a = llm.stream([5, 6, 7], max_tokens=5, ignore_eos=True)
    b = llm.stream([8, 9, 10], max_tokens=5, ignore_eos=True)
    for _ in range(3):
        next(a)
        next(b)
    a.close()
    b.close()
    assert llm._engine.kv_stats()[0] == 0


# -- 7. named pipes -------------------------------------------------------------------------


@contextmanager
def _pipe(path: Path) -> Iterator[Path]:
    """A named pipe at `path`. Should the code under test block opening it, a writer opens
    it after a few seconds so the test fails instead of hanging."""
    os.mkfifo(path)
    done = threading.Event()

    def rescue() -> None:
        if not done.wait(5):
            os.close(os.open(path, os.O_RDWR))  # Linux: opens a pipe without blocking

    rescuer = threading.Thread(target=rescue, daemon=True)
    rescuer.start()
    t0 = time.monotonic()
    try:
        yield path
    finally:
        done.set()
        rescuer.join()
    assert time.monotonic() - t0 < 4, "blocked on the named pipe"


def test_llm_refuses_a_named_pipe(tmp_path: Path) -> None:
    for name in ("model.cellm", "model.gguf"):
        with _pipe(tmp_path / name) as fifo, pytest.raises(FormatError, match="is not a regular"):
            cellm.LLM(fifo)


def test_convert_refuses_a_named_pipe(tmp_path: Path) -> None:
    with _pipe(tmp_path / "model.gguf") as fifo:
        with pytest.raises(FormatError, match="is not a regular file"):
            convert(fifo, tmp_path / "o.cellm")
        with pytest.raises(FormatError, match="is not a regular file"):
            convert_gguf(fifo, tmp_path / "o.cellm")
        with pytest.raises(FormatError, match="is not a regular file"):
            GGUFFile(fifo)
        with pytest.raises(FormatError, match="is not a regular file"):
            SafetensorsFile(fifo)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        d = copy_fixture("llama", tmp_path / name)
        (d / name).unlink()
        with _pipe(d / name), pytest.raises(FormatError, match=f"{name} is not a regular file"):
            convert_hf(d, tmp_path / "o.cellm")
