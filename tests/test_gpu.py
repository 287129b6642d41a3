"""The GPU backend (crates/cellm-gpu, wgpu on Vulkan; lavapipe in CI) against independent
references: HF transformers' logits in the fixtures, and the CPU backend where the two compute
the same float math. Skipped, with the reason, where no Vulkan adapter exists, unless
CELLM_REQUIRE_GPU is set (CI sets it and installs lavapipe).

Tolerances: at f32 weights and KV the GPU computes the same math as the reference in the same
precision, only in another summation order (~1e-5 here), so test_parity's 1e-3 applies. With
f16/bf16 weights and f16 KV both backends round the same values the same way (f16 KV rounds to
nearest even on both), so GPU and CPU stay within the same 1e-3. Block formats: the GPU multiplies
the decoded weights by float activations; the CPU by int8 activations, which moves these logits
by up to ~0.25 (test_gguf_convert's bound), so against the CPU the bound is 0.25 plus argmax
agreement wherever the top two logits are clearly apart, and against the same weights dequantized
to f32 (exact float math again) it is 1e-3.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from cellm import LLM, InvalidArgument, UnsupportedArchitecture, _core
from cellm.errors import DeviceError
from conftest import FIXTURES, Reference

ATOL = 1e-3
# The families the GPU runs (llama-like and gemma3); the rest must say they are CPU-only.
GPU_FIXTURES = ["gemma3", "granite", "llama", "qwen2", "qwen3", "smollm3"]
CPU_ONLY_FIXTURES = ["deepseek_v3", "lfm2", "qwen3_5"]
INT8_ACTIVATIONS_ATOL = 0.25


@pytest.fixture(scope="module")
def gpu(converted) -> None:
    """Skips the module where no Vulkan adapter can be opened (fails instead under
    CELLM_REQUIRE_GPU)."""
    try:
        _core.Engine(str(converted("llama", "f32")), backend="vulkan")
    except DeviceError as e:
        if os.environ.get("CELLM_REQUIRE_GPU"):
            raise
        pytest.skip(f"no Vulkan adapter: {e}")


def max_err(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max())


@pytest.mark.parametrize("name", GPU_FIXTURES)
def test_f32_logits_and_greedy_ids_match_reference(gpu, converted, name):
    ref = Reference(name)
    llm = LLM(converted(name, "f32"), kv_encoding="f32", backend="vulkan")
    engine = llm._engine
    for i, p in enumerate(ref.prompts):
        seq, n = ref.sequence(i), len(p["input_ids"])
        assert max_err(llm.logits(seq), ref.logits[i]) < ATOL, f"prompt {i}, one step"
        session = engine.create_session()
        rows = [engine.step([(session, seq[:n])], False)[0]]
        rows += [engine.step([(session, [t])], False)[0] for t in seq[n:]]
        engine.free_session(session)
        assert max_err(np.stack(rows), ref.logits[i][n - 1 :]) < ATOL, f"prompt {i}, decode"
        out = llm.generate(p["input_ids"], max_tokens=len(p["greedy_ids"]), ignore_eos=True)
        assert out.token_ids == p["greedy_ids"]


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("name", ["gemma3", "qwen3"])
def test_half_weights_and_f16_kv_match_cpu(gpu, converted, name, dtype):
    ref = Reference(name)
    path = converted(name, dtype)
    cpu = LLM(path, kv_encoding="f16")
    dev = LLM(path, kv_encoding="f16", backend="vulkan")
    for i in range(len(ref.prompts)):
        seq = ref.sequence(i)
        assert max_err(dev.logits(seq), cpu.logits(seq)) < ATOL, f"prompt {i}"


def test_q8_0_matches_its_weights_dequantized(gpu, from_gguf):
    """q8_0 (stored 8 rows interleaved) on the GPU against the CPU running the same rounded
    weights as f32: the same float math."""
    ref = Reference("llama")
    want = LLM(from_gguf("llama", dequantized=True), kv_encoding="f32").logits(ref.sequence(1))
    got = LLM(from_gguf("llama", quant=True), kv_encoding="f32", backend="vulkan")
    assert max_err(got.logits(ref.sequence(1)), want) < ATOL


@pytest.mark.parametrize("scheme", ["q8_0", "q4_0"])
def test_block_formats_match_cpu(gpu, tmp_path, scheme):
    from cellm.convert.hf_convert import convert_hf

    ref = Reference("qwen2")
    path = convert_hf(FIXTURES / "qwen2", tmp_path / f"{scheme}.cellm", "f32", quantize=scheme)
    want = LLM(path, kv_encoding="f32").logits(ref.sequence(0))
    got = LLM(path, kv_encoding="f32", backend="vulkan").logits(ref.sequence(0))
    assert max_err(got, want) < INT8_ACTIVATIONS_ATOL
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.1
    assert clear.sum() >= len(want) // 2, clear.sum()
    assert (got.argmax(-1) == want.argmax(-1))[clear].all()


def test_batched_sessions_match_cpu(gpu, converted):
    """Several sessions of different lengths in one step (their own page tables)."""
    ref = Reference("qwen3")
    path = converted("qwen3", "f32")
    results = []
    for backend in ("cpu", "vulkan"):
        engine = LLM(path, kv_encoding="f32", backend=backend)._engine
        seqs = [ref.sequence(i) for i in range(len(ref.prompts))]
        sessions = [engine.create_session() for _ in seqs]
        rows = [engine.step([(s, q[:-3]) for s, q in zip(sessions, seqs)], False)]
        for k in (3, 2, 1):
            rows.append(engine.step([(s, [q[-k]]) for s, q in zip(sessions, seqs)], False))
        results.append(np.concatenate(rows))
    assert len(ref.prompts) >= 2
    assert max_err(results[1], results[0]) < ATOL


def test_long_prompt_sliding_window_and_split_weights(gpu, converted):
    """Gemma 3's sliding layers (window 32) over 600 positions, a prefill longer than one
    submission (512 tokens), and every matrix split into several bindings."""
    path = converted("gemma3", "f32")
    ids = list(np.random.default_rng(0).integers(0, 1200, 600))
    want = LLM(path, kv_encoding="f32").logits(ids)
    got = LLM(path, kv_encoding="f32", backend="vulkan")._engine
    split = _core.Engine(str(path), kv_encoding="f32", backend="vulkan", gpu_max_binding=4096)
    for engine in (got, split):
        session = engine.create_session()
        logits = engine.step([(session, ids)], True)
        assert max_err(logits, want) < ATOL


@pytest.mark.parametrize("name", CPU_ONLY_FIXTURES)
def test_other_families_say_they_are_cpu_only(gpu, converted, name):
    with pytest.raises(UnsupportedArchitecture, match="CPU only"):
        LLM(converted(name, "f32"), backend="vulkan")


def test_unknown_backend_is_refused(converted):
    with pytest.raises(InvalidArgument, match="backend"):
        LLM(converted("llama", "f32"), backend="cuda")
    with pytest.raises(InvalidArgument, match="backend"):
        _core.Engine(str(converted("llama", "f32")), backend="cuda")


def test_no_adapter_is_one_clear_error(converted, tmp_path):
    """No Vulkan driver at all: DeviceError naming the backend, and a CLI exits 2."""
    env = dict(os.environ, VK_DRIVER_FILES=str(tmp_path / "none.json"))
    env["VK_ICD_FILENAMES"] = env["VK_DRIVER_FILES"]
    code = (
        "from cellm import LLM\nfrom cellm.errors import DeviceError\n"
        f"try:\n    LLM({str(converted('llama', 'f32'))!r}, backend='vulkan')\n"
        "except DeviceError as e:\n    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert "ERR no Vulkan adapter found" in out.stdout, out.stdout + out.stderr


def test_infer_cli_runs_on_the_gpu(gpu, converted):
    path = str(converted("llama", "f32"))
    args = [sys.executable, "-m", "cellm.infer", "--model", path, "--prompt", "hello"]
    args += ["--gen", "4", "--kv-encoding", "f32"]
    cpu = subprocess.run(args, capture_output=True, text=True)
    dev = subprocess.run(args + ["--backend", "vulkan"], capture_output=True, text=True)
    assert dev.returncode == 0, dev.stderr
    assert dev.stdout == cpu.stdout
    bad = subprocess.run(args + ["--backend", "cuda"], capture_output=True, text=True)
    assert bad.returncode == 2 and "backend" in bad.stderr
