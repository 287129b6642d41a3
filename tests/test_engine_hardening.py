"""The engine's side of hardening (issue 18): model descriptions validated at load, more than
64 attention heads, the kernel functions' arguments, Ctrl-C during a step, and a model file
replaced while loaded."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cellm import LLM, FormatError, InvalidArgument, _core
from conftest import FIXTURES, ROOT
from convert_helpers import load_safetensors, save_safetensors

# ---------------------------------------------------------------------------------------------
# Helpers


def read_cellm(path: Path) -> tuple[dict[str, Any], bytes]:
    """A `.cellm` file's header and data section."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[8:16])
    header = json.loads(raw[16 : 16 + n])
    data_offset = -(-(16 + n) // 64) * 64
    return header, raw[data_offset:]


def write_cellm(path: Path, header: dict[str, Any], data: bytes) -> Path:
    text = json.dumps(header).encode()
    pre = b"CELLM\x02\x00\x00" + struct.pack("<Q", len(text)) + text
    path.write_bytes(pre + b"\0" * (-len(pre) % 64) + data)
    return path


def with_model(src: Path, dst: Path, **edits: Any) -> Path:
    """A copy of `src` whose model description has `edits` (`a__b=v` sets `model[a][b]`)."""
    header, data = read_cellm(src)
    for key, value in edits.items():
        *outer, last = key.split("__")
        target = header["model"]
        for k in outer:
            target = target[k]
        target[last] = value
    return write_cellm(dst, header, data)


def hf_variant(name: str, tmp: Path, config: dict[str, Any], tensors: Any = None) -> Path:
    """A copy of fixture `name` with `config` merged into config.json and its tensors passed
    through `tensors(dict) -> dict` when given."""
    d = tmp / f"{name}-variant"
    shutil.copytree(FIXTURES / name, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **config}))
    if tensors is not None:
        st = d / "model.safetensors"
        save_safetensors(st, tensors(load_safetensors(st)))
    return d


# ---------------------------------------------------------------------------------------------
# 1. Model descriptions are validated at load (and at conversion, through expected_tensors)

BAD_DESCRIPTIONS = [
    # (fixture, edits, what the message says). Each used to reach a kernel: a panic ("chunk
    # size must be non-zero", "capacity overflow", a slice out of range), a misleading "KV
    # cache is full", or NaN logits.
    ("llama", {"head_dim": 0}, "head_dim is 0"),
    ("llama", {"num_heads": 1 << 62, "num_kv_heads": 1}, "num_heads is 4611686018427387904"),
    ("llama", {"num_layers": 0}, "num_layers is 0"),
    ("llama", {"vocab_size": 0}, "vocab_size is 0"),
    ("llama", {"hidden_size": 0}, "hidden_size is 0"),
    ("llama", {"max_position_embeddings": 1 << 61}, "max_position_embeddings is"),
    ("llama", {"norm_eps": -1e-5}, "norm_eps is -0.00001 (must be finite and > 0)"),
    ("llama", {"final_logit_softcap": -30.0}, "final_logit_softcap is -30"),
    ("llama", {"attention_scale": -0.25}, "attention_scale is -0.25"),
    ("llama", {"embedding_multiplier": 0.0}, "embedding_multiplier is 0"),
    ("llama", {"rope__attention_factor": -1.0}, "rope.attention_factor is -1"),
    ("lfm2", {"conv__taps": 0}, "conv.taps is 0"),
    ("qwen3_5", {"linear_attention__v_dim": 0}, "linear_attention.v_dim is 0"),
    ("deepseek_v3", {"mla__rope_dim": 6}, "rotary dims > mla.rope_dim 6"),
    ("deepseek_v3", {"moe__groups": 3}, "moe.groups 3 do not split 8 experts"),
]


@pytest.mark.parametrize(
    "name,edits,needle",
    BAD_DESCRIPTIONS,
    ids=[f"{n}-{next(iter(e))}" for n, e, _ in BAD_DESCRIPTIONS],
)
def test_bad_descriptions_are_refused_by_field(name, edits, needle, converted, tmp_path):
    bad = with_model(converted(name, "f32"), tmp_path / "bad.cellm", **edits)
    with pytest.raises(FormatError) as e:
        LLM(bad)
    message = str(e.value)
    assert message.startswith(f"{bad}: bad model description: "), message
    assert needle in message, message
    # The converter plans through the same checks.
    header, _ = read_cellm(bad)
    with pytest.raises(FormatError, match=re.escape(needle)):
        _core.expected_tensors(json.dumps(header["model"]))


def test_context_length_option_is_checked(converted):
    with pytest.raises(InvalidArgument, match="context_length must be 1 to"):
        _core.Engine(str(converted("llama", "f32")), context_length=1 << 61)


# ---------------------------------------------------------------------------------------------
# 2. More than 64 attention heads work


def test_more_than_64_heads(tmp_path):
    """A valid checkpoint with 72 query heads (8 kv heads): decoding token by token (the row
    path, which holds 64 heads a task and so runs two passes) gives the logits of one prefill
    of the same tokens. It used to panic at the first decode ("more than a task holds")."""
    rng = np.random.default_rng(0)
    heads, kv_heads, hd, hidden = 72, 8, 16, 64

    def widen(t: dict) -> dict:
        out = {}
        for name, (dtype, arr) in t.items():
            rows = {"q_proj": heads * hd, "k_proj": kv_heads * hd, "v_proj": kv_heads * hd}
            kind = name.split(".")[-2]
            if kind in rows:
                arr = rng.normal(0, 0.1, (rows[kind], hidden)).astype(np.float32)
            elif kind == "o_proj":
                arr = rng.normal(0, 0.1, (hidden, heads * hd)).astype(np.float32)
            out[name] = (dtype, arr)
        return out

    config = {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": hd}
    src = hf_variant("llama", tmp_path, config, widen)
    from cellm.convert import convert_hf

    llm = LLM(convert_hf(src, tmp_path / "wide.cellm", "f32"), kv_encoding="f32")
    ids = list(range(3, 40))
    want = llm.logits(ids)
    e = llm._engine
    s = e.create_session()
    got = np.concatenate([e.step([(s, [t])]) for t in ids])
    e.free_session(s)
    assert np.abs(got - want).max() < 1e-4
    assert len(llm.generate(ids, max_tokens=8, ignore_eos=True).token_ids) == 8


# ---------------------------------------------------------------------------------------------
# 3. The kernel functions check their arguments


def test_kernel_functions_refuse_empty_shapes():
    x = np.zeros((1, 0), np.float32)
    for call in [
        lambda: _core.dequantize("f32", b"", 1, 0),  # used to panic: "chunk size must be non-zero"
        lambda: _core.dequantize("f32", b"", 0, 1),
        lambda: _core.matmul("f32", b"", 1, 0, x),  # used to panic
        lambda: _core.matmul("f32", b"\0" * 4, 1, 1, np.zeros((0, 1), np.float32)),
        lambda: _core.read_bandwidth(mib=0),
        lambda: _core.read_bandwidth(mib=1 << 40),
        lambda: _core.fma_peak(threads=0),
    ]:
        with pytest.raises(InvalidArgument):
            call()


# ---------------------------------------------------------------------------------------------
# 4. Ctrl-C

LONG_PROMPT = 3000  # tokens; a step over them takes seconds on 2 threads, a layer ~0.1 s


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory) -> Path:
    """The tiny llama fixture stacked to 32 layers (its 4 repeated) with a 16k context: a long
    prefill is many short layers, so a test can land Ctrl-C inside one step and see how soon
    the step stops."""
    from cellm.convert import convert_hf

    tmp = tmp_path_factory.mktemp("deep")
    layers = 32

    def stack(t: dict) -> dict:
        out = {}
        for name, v in t.items():
            m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
            if not m:
                out[name] = v
                continue
            for i in range(int(m[1]), layers, 4):
                out[f"model.layers.{i}.{m[2]}"] = v
        return out

    config = {"num_hidden_layers": layers, "max_position_embeddings": 1 << 14}
    return convert_hf(hf_variant("llama", tmp, config, stack), tmp / "deep.cellm", "f32")


def interrupt_main_after(seconds: float) -> tuple[threading.Timer, list[float]]:
    """Sends SIGINT to the main thread after `seconds`; the list gets the time it was sent."""
    sent: list[float] = []

    def fire() -> None:
        sent.append(time.monotonic())
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    timer = threading.Timer(seconds, fire)
    timer.start()
    return timer, sent


def test_ctrl_c_stops_a_long_prefill_and_the_session_stays_usable(deep_llama):
    """Ctrl-C 0.3 s into a prefill of several seconds raises KeyboardInterrupt within a layer or
    two (it used to wait for the whole step), and the session is as before the step: same
    length, same KV pages, and going on gives the logits of a session never interrupted."""
    llm = LLM(deep_llama, kv_encoding="f32", threads=2)
    e = llm._engine
    ids = [(i * 7) % 1000 for i in range(LONG_PROMPT)]
    s = e.create_session()
    e.step([(s, ids[:16])])
    pages = e.kv_stats()[0]
    timer, sent = interrupt_main_after(0.3)
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            e.step([(s, ids[16:])])
    finally:
        timer.cancel()
    stopped = time.monotonic()
    assert sent, "the step ended before the signal was sent"
    latency = stopped - sent[0]
    print(f"Ctrl-C honoured {latency * 1000:.0f} ms after the signal ({stopped - started:.2f} s)")
    assert latency < 1.0
    assert e.session_len(s) == 16 and e.kv_stats()[0] == pages
    rest = e.step([(s, ids[16:40])], all_logits=True)
    e.free_session(s)
    assert np.abs(rest - llm.logits(ids[:40])[16:]).max() < 1e-4
    assert len(llm.generate(ids[:20], max_tokens=4, ignore_eos=True).token_ids) == 4


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python") + os.pathsep + str(ROOT / "tests")}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout
    )


def test_ctrl_c_during_a_first_step_is_a_keyboard_interrupt_not_a_panic(converted):
    """A process's first step used to end in `PanicException: Failed to access NumPy array
    API capsule: KeyboardInterrupt` when Ctrl-C came during it: building the first array ran
    NumPy's import (Python code) with the signal pending. Here the step cannot stop midway (a
    decode step of a model with recurrent state), so the signal waits for it to return."""
    code = f"""
import signal, threading
from cellm import _core
e = _core.Engine({str(converted("lfm2", "f32"))!r}, threads=2, kv_capacity_tokens=4000 * 16)
sessions = [e.create_session() for _ in range(4000)]
main = threading.main_thread().ident
threading.Timer(0.02, lambda: signal.pthread_kill(main, signal.SIGINT)).start()
try:
    e.step([(s, [1]) for s in sessions])
    while True:  # the handler runs at the next bytecode boundary
        pass
except KeyboardInterrupt:
    print("KeyboardInterrupt")
print(e.step([(sessions[0], [2])]).shape)
"""
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["KeyboardInterrupt", "(1,", "1000)"], proc.stdout
    assert "Panic" not in proc.stderr and "panicked" not in proc.stderr


def test_cli_exits_130_on_ctrl_c(deep_llama):
    """`python -m cellm.infer` interrupted during its prefill: one `error: interrupted` line,
    exit code 130, no traceback, soon after the signal."""
    tokens = ",".join(str((i * 7) % 1000) for i in range(LONG_PROMPT))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    args = ["--model", str(deep_llama), "--tokens", tokens, "--gen", "1", "--threads", "2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "cellm.infer", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    # The engine's worker thread exists once the model is loaded; the step follows at once.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        names = [(p / "comm").read_text().strip() for p in Path(f"/proc/{proc.pid}/task").iterdir()]
        if "cellm-1" in names:
            break
        time.sleep(0.02)
    time.sleep(0.3)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    latency = time.monotonic() - sent
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["error: interrupted"], err
    assert latency < 2.0, latency


# ---------------------------------------------------------------------------------------------
# 5. A model file replaced while loaded


def test_reconverting_a_loaded_model_leaves_it_running(converted, tmp_path):
    """Conversion writes a temporary file and renames it over the output, so the file an
    engine has mapped is never rewritten in place (which would be SIGBUS or silently changed
    weights; docs/format.md, "A file changed while in use"). The loaded model keeps its
    weights; a new load sees the new file."""
    from cellm.convert import convert_hf

    path = shutil.copy(converted("qwen2", "f32"), tmp_path / "m.cellm")
    llm = LLM(path, kv_encoding="f32")
    ids = list(range(5, 30))
    before = llm.logits(ids)
    inode = os.stat(path).st_ino
    convert_hf(FIXTURES / "llama", Path(path), "f16")  # another model, same path
    assert os.stat(path).st_ino != inode
    assert np.array_equal(llm.logits(ids), before)
    assert LLM(path).vocab_size == 1000
