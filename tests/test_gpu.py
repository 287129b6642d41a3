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
REAL_REL = 1e-4
HINT = "(is a GPU driver, or Mesa's lavapipe, installed?)"


@pytest.fixture(scope="module")
def gpu(converted):
    """Skips the module where no Vulkan adapter can be opened (fails instead under
    CELLM_REQUIRE_GPU). The exact-math tolerances here hold for the f32 GEMM, so where the
    adapter has cooperative matrices (whose prefill GEMM rounds its inputs to f16) the module
    turns them off; test_coop_gemm_within_f16_rounding covers that path."""
    try:
        _core.Engine(str(converted("llama", "f32")), backend="vulkan")
    except DeviceError as e:
        if os.environ.get("CELLM_REQUIRE_GPU"):
            raise
        pytest.skip(f"no Vulkan adapter: {e}")
    with pytest.MonkeyPatch.context() as m:
        m.setenv("CELLM_GPU_NO_COOPMAT", "1")
        yield


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
        rows = [engine.step([(session, seq[:n])])[0]]
        rows += [engine.step([(session, [t])])[0] for t in seq[n:]]
        engine.free_session(session)
        assert max_err(np.stack(rows), ref.logits[i][n - 1 :]) < ATOL, f"prompt {i}, decode"
        out = llm.generate(p["input_ids"], max_tokens=len(p["greedy_ids"]), ignore_eos=True)
        assert out.token_ids == p["greedy_ids"]


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("name", ["gemma3", "qwen3"])
def test_half_weights_match_cpu(gpu, converted, name, dtype):
    """f16/bf16 weights: at f32 KV the same float math as the CPU (1e-3). At f16 KV both round
    K and V to f16 from values ~1e-6 apart (another summation order), and where a value sits
    near a rounding tie the two pick neighbouring halves: on gemma3's peaked attention that
    moved logits by up to 1.6e-2 while f16 KV itself moves them 7e-2 from f32 KV. So at f16 KV
    the bound is 1e-3 plus half of what f16 KV does to the CPU's own logits (worst seen: 0.22
    of it)."""
    ref = Reference(name)
    path = converted(name, dtype)
    cpu = {kv: LLM(path, kv_encoding=kv) for kv in ("f32", "f16")}
    dev = {kv: LLM(path, kv_encoding=kv, backend="vulkan") for kv in ("f32", "f16")}
    for i in range(len(ref.prompts)):
        seq = ref.sequence(i)
        want = {kv: llm.logits(seq) for kv, llm in cpu.items()}
        got = {kv: llm.logits(seq) for kv, llm in dev.items()}
        assert max_err(got["f32"], want["f32"]) < ATOL, f"prompt {i}, f32 KV"
        rounding = max_err(want["f16"], want["f32"])
        bound = ATOL + 0.5 * rounding
        assert max_err(got["f16"], want["f16"]) < bound, f"prompt {i}, f16 KV ({rounding:.3g})"


def test_q8_0_matches_its_weights_dequantized(gpu, from_gguf):
    """q8_0 (stored 8 rows interleaved) on the GPU against the CPU running the same rounded
    weights as f32: the same float math."""
    ref = Reference("llama")
    want = LLM(from_gguf("llama", dequantized=True), kv_encoding="f32").logits(ref.sequence(1))
    got = LLM(from_gguf("llama", quant=True), kv_encoding="f32", backend="vulkan")
    assert max_err(got.logits(ref.sequence(1)), want) < ATOL


def test_two_format_qkv_decode_matches_its_weights_dequantized(gpu, from_gguf):
    """q|k in q8_0 and v in f32 (one q|k|v launch over two formats, which also rotates q and
    k and stores k and v in the pool), 5 tokens in one step and then one a step (the matvec
    builds), against the CPU on the same rounded weights as f32: the same float math."""
    ids = Reference("llama").sequence(1)
    want = LLM(from_gguf("llama", dequantized=True), kv_encoding="f32")._engine
    got = LLM(from_gguf("llama", quant=True, v_apart=True), kv_encoding="f32", backend="vulkan")

    def run(engine) -> np.ndarray:
        s = engine.create_session()
        rows = [np.asarray(engine.step([(s, ids[:5])], all_logits=True))]
        rows += [np.asarray(engine.step([(s, [t])])) for t in ids[5:]]
        return np.concatenate(rows)

    assert len(ids) > 8
    assert max_err(run(got._engine), run(want)) < ATOL


@pytest.mark.parametrize("scheme", ["q8_0", "q4_0"])
def test_block_formats_match_cpu(gpu, tmp_path, scheme):
    from cellm.convert.hf_convert import convert_hf

    ref = Reference("qwen2")
    # Below 8 bits the embedding would stay i8_row, a cellm format the GPU does not run yet.
    out = tmp_path / f"{scheme}.cellm"
    path = convert_hf(FIXTURES / "qwen2", out, "f32", quantize=scheme, embedding="q8_0")
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
        rows = [engine.step([(s, q[:-3]) for s, q in zip(sessions, seqs)])]
        for k in (3, 2, 1):
            rows.append(engine.step([(s, [q[-k]]) for s, q in zip(sessions, seqs)]))
        results.append(np.concatenate(rows))
    assert len(ref.prompts) >= 2
    assert max_err(results[1], results[0]) < ATOL


def test_prefill_attention_in_mixed_steps(gpu, converted):
    """The prefill attention kernel (16 or more tokens per session; Qwen3's head_dim 32 has
    it) in steps mixing a continued prompt, a fresh one and decode tokens (blocks of query
    tokens spanning sessions), over f16 KV, against the CPU (same f16 rounding: ATOL)."""
    path = converted("qwen3", "f32")
    rng = np.random.default_rng(1)
    a, b, c = (rng.integers(0, 1000, n).tolist() for n in (70, 45, 5))
    results = []
    for backend in ("cpu", "vulkan"):
        engine = _core.Engine(str(path), kv_encoding="f16", backend=backend)
        sa, sb, sc = (engine.create_session() for _ in range(3))
        rows = [engine.step([(sa, a[:40]), (sc, c[:4])], all_logits=True)]
        rows.append(engine.step([(sa, a[40:]), (sb, b), (sc, c[4:])], all_logits=True))
        results.append(np.concatenate(rows))
    assert results[0].shape[0] == 120
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
        logits = engine.step([(session, ids)], all_logits=True)
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
    model = ["--model", str(converted("llama", "f32"))]
    for cli in (["cellm.infer", "--prompt", "hi"], ["cellm", "chat"], ["cellm", "serve"]):
        for backend, name in (("vulkan", "Vulkan"), ("metal", "Metal"), ("gpu", "Vulkan or Metal")):
            args = [sys.executable, "-m", *cli, *model, "--backend", backend]
            out = subprocess.run(
                args, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL
            )
            lines = [x for x in out.stderr.splitlines() if "XDG_RUNTIME_DIR" not in x]
            assert out.returncode == 2, (cli, backend, out.stderr)
            assert lines == [f"error: no {name} adapter found {HINT}"], (cli, backend, lines)


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


REAL_MODELS = ["smollm2-135m-instruct", "gemma-3-270m", "qwen2.5-coder-0.5b-instruct"]


@pytest.mark.network
@pytest.mark.parametrize("name", REAL_MODELS)
def test_real_models_match_dequantized_weights(gpu, name, network_cache, tmp_path, monkeypatch):
    """The registry's real GGUFs (q4_1 and q8_0; q5_0, q4_k, q6_k and q8_0) on the GPU against
    the CPU running the same rounded weights decoded to f32 by the engine's own decoders
    (checked against gguf-py in test_quant_formats): the same float math in another order, so
    the bound is relative to the logits' scale, 1e-4 of the largest (the same comparison on the
    H200 at these formats and shapes, random weights: at most 1.9e-5; docs/benchmarks.md).
    Greedy ids must agree too."""
    from cellm.convert import gguf_convert
    from cellm.convert.quantize import Quantization
    from cellm.fetch import fetch_gguf

    monkeypatch.setenv("CELLM_CACHE_DIR", network_cache)
    gguf = fetch_gguf(name, progress=False)
    stored = gguf_convert.convert_gguf(gguf, tmp_path / "stored.cellm", progress=False)
    every_matrix_f32 = Quantization("f32", None, "f32", "f32")
    monkeypatch.setattr(gguf_convert, "plan_quantization", lambda *a: every_matrix_f32)
    f32 = gguf_convert.convert_gguf(gguf, tmp_path / "f32.cellm", progress=False)
    cpu = LLM(f32, kv_encoding="f32")
    dev = LLM(stored, kv_encoding="f32", backend="vulkan")
    ids = cpu.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    want, got = cpu.logits(ids), dev.logits(ids)
    scale = float(np.abs(want).max())
    assert max_err(got, want) < REAL_REL * scale, (max_err(got, want), scale)
    a = cpu.generate(ids, max_tokens=8, ignore_eos=True).token_ids
    assert dev.generate(ids, max_tokens=8, ignore_eos=True).token_ids == a


def test_bench_takes_the_backend(gguf_dir, tmp_path):
    """`cellm bench --backend`: an unknown name is a usage error, and a backend without an
    adapter stops the run at its first worker with that worker's one line."""
    from gguf_helpers import hf_fixture_to_gguf

    gguf = hf_fixture_to_gguf("llama", gguf_dir / "bench-llama.gguf")
    env = dict(os.environ, VK_DRIVER_FILES=str(tmp_path / "none.json"))
    env["VK_ICD_FILENAMES"] = env["VK_DRIVER_FILES"]
    args = [sys.executable, "-m", "cellm.bench", "--models", str(gguf), "--runs", "1"]
    bad = subprocess.run(args + ["--backend", "cuda"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "--backend" in bad.stderr
    out = subprocess.run(args + ["--backend", "vulkan"], env=env, capture_output=True, text=True)
    lines = [x for x in out.stderr.splitlines() if "XDG_RUNTIME_DIR" not in x]
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1 and "no Vulkan adapter found" in lines[0], lines


SPAN_SCRIPT = """
import sys
import numpy as np
from cellm import _core
engine = _core.Engine(sys.argv[1], kv_encoding="f32", backend=sys.argv[2])
s = engine.create_session()
ids = [int(t) for t in np.random.default_rng(2).integers(0, 1000, 80)]
rows = [engine.step([(s, ids[:8])])] + [engine.step([(s, [t])]) for t in ids[8:]]
np.save(sys.argv[3], np.concatenate(rows))
"""


def test_spinning_wait_and_span_profile(gpu, converted, tmp_path):
    """The wait that spins on the step's fence (the default on GPUs, forced here on lavapipe by
    CELLM_GPU_SPIN=1) returns each step's own logits, equal to the CPU's (ATOL), over 72
    one-token steps, the first 64 of which the span profile (two timestamps a step, steps
    recorded ahead) reports on."""
    path = str(converted("qwen3", "f32"))
    env = {**os.environ, "CELLM_GPU_SPIN": "1", "CELLM_GPU_PROFILE": "span"}
    runs = {}
    for backend in ("vulkan", "cpu"):
        out = tmp_path / f"{backend}.npy"
        run = subprocess.run(
            [sys.executable, "-c", SPAN_SCRIPT, path, backend, str(out)],
            capture_output=True,
            text=True,
            env=env,
        )
        assert run.returncode == 0, run.stderr
        runs[backend] = (np.load(out), run.stderr)
    report = [line for line in runs["vulkan"][1].splitlines() if "one-token steps" in line]
    assert len(report) == 1, runs["vulkan"][1]
    assert "wait" in report[0] and "read" in report[0], report[0]
    # Lavapipe (CI) and NVIDIA's driver have timestamp queries.
    assert "GPU busy" in report[0] and "idle between steps" in report[0], report[0]
    got, want = runs["vulkan"][0], runs["cpu"][0]
    assert got.shape == want.shape == (73, want.shape[1])
    assert max_err(got, want) < ATOL


COOP_REL = 1e-2


def test_coop_gemm_within_f16_rounding(gpu, converted, monkeypatch):
    """Where the adapter has 16x16x16 f16 cooperative matrices (NVIDIA and AMD on Vulkan; not
    lavapipe, so CI skips this), prefill of 8 or more tokens multiplies W and x rounded to f16
    (relative 2^-11 each) with f32 sums, and prompts of 16 or more tokens a session run their
    attention on them too (q, K, exp(S - max) and V in f16; 2e-3 to 4e-3 of the logits' scale
    from the f32 prefill attention on the H200, docs/benchmarks.md). Before that attention,
    the GEMM alone put every logit of a 64-token prompt within 1.0e-3 to 2.4e-3 of the
    logits' scale of the CPU's f32 math on the H200 (F16 and block-format random-weight
    models of 16 to 28 layers, docs/benchmarks.md); the bound is 1e-2 of the
    scale, and the argmax must agree wherever the reference's top two are further apart than
    twice that."""
    monkeypatch.delenv("CELLM_GPU_NO_COOPMAT", raising=False)
    path = str(converted("llama", "f32"))
    load = f"from cellm import _core; _core.Engine({path!r}, backend='vulkan')"
    info = subprocess.run(
        [sys.executable, "-c", load],
        capture_output=True,
        text=True,
        env={**os.environ, "CELLM_GPU_INFO": "1"},
    )
    if "cooperative matrices" not in info.stderr:
        pytest.skip("no cooperative-matrix GEMM on this adapter")
    ref = Reference("llama")
    dev = LLM(path, kv_encoding="f32", backend="vulkan")
    for i in range(len(ref.prompts)):
        seq = ref.sequence(i)
        assert len(seq) >= 8
        want, got = ref.logits[i], dev.logits(seq)
        scale = float(np.abs(want).max())
        assert max_err(got, want) < COOP_REL * scale, (i, max_err(got, want), scale)
        top2 = np.sort(want, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 2 * COOP_REL * scale
        assert (got.argmax(-1) == want.argmax(-1))[clear].all(), f"prompt {i}"


SPLIT_REL = 1e-2


def split_engine(path, monkeypatch):
    """An engine whose prefill GEMMs of 128 or more tokens run in split_gemm's passes through
    the WGSL f16 GEMM (CELLM_GPU_SPLIT=1), after checking that the plan has such passes."""
    monkeypatch.setenv("CELLM_GPU_SPLIT", "1")
    load = f"from cellm import _core; _core.Engine({str(path)!r}, backend='vulkan')"
    env = {**os.environ, "CELLM_GPU_INFO": "1"}
    info = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, env=env)
    assert "in passes" in info.stderr, info.stderr
    return _core.Engine(str(path), kv_encoding="f32", backend="vulkan")


def check_split(engine, ids, want):
    """One prefill step of `ids`: every position's logits within SPLIT_REL of the logits'
    scale, argmax equal wherever the reference's top two are clearly apart."""
    session = engine.create_session()
    got = np.asarray(engine.step([(session, ids)], all_logits=True))
    scale = float(np.abs(want).max())
    assert max_err(got, want) < SPLIT_REL * scale, (max_err(got, want), scale)
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * SPLIT_REL * scale
    assert clear.sum() > len(want) // 2
    assert (got.argmax(-1) == want.argmax(-1))[clear].all()


@pytest.mark.parametrize(("name", "dtype"), [("llama", "f32"), ("qwen2", "f32"), ("qwen3", "f16")])
def test_split_gemm_passes_within_f16_rounding(gpu, converted, monkeypatch, name, dtype):
    """Prefill's GEMM in passes (split_gemm.rs: inputs to f16 with the norm's gamma, weights
    to f16 or read in place where f16, an f16 GEMM with f32 sums, the fused epilogue: bias on
    qwen2, GLU, residual) against the CPU's f32 math on the same weights. Rounding W and x to
    f16 is relative 2^-11 each: on lavapipe these fixtures land 1e-3 to 2e-3 of the logits'
    scale away, as the cooperative GEMM does on the H200; the bound is 1e-2. 600 tokens: a
    512-token submission in passes, then 88 tokens through the fused kernels."""
    path = converted(name, dtype)
    ids = [int(v) for v in np.random.default_rng(0).integers(0, 900, 600)]
    want = LLM(path, kv_encoding="f32").logits(ids)
    check_split(split_engine(path, monkeypatch), ids, want)


def test_split_gemm_block_formats_match_their_weights_dequantized(gpu, from_gguf, monkeypatch):
    """The passes' dequantize pass (q8_0 q|k, v apart in f32: two formats, stacked on one
    input) against the CPU on the same rounded weights as f32, within the f16 bound above."""
    ids = [int(v) for v in np.random.default_rng(1).integers(0, 900, 300)]
    want = LLM(from_gguf("llama", dequantized=True), kv_encoding="f32").logits(ids)
    check_split(split_engine(from_gguf("llama", quant=True, v_apart=True), monkeypatch), ids, want)


def test_split_gemm_passes_on_gemma3(gpu, converted, monkeypatch):
    """Gemma 3 (GELU, pre- and post-norms around the GLU and o, outputs aside for the norm's
    add) in passes. This fixture's logits move by 0.18 when the CPU itself runs its weights
    rounded to f16; the passes round weights and inputs, so the bound is twice that move."""
    ids = [int(v) for v in np.random.default_rng(2).integers(0, 1100, 300)]
    path = converted("gemma3", "f32")
    want = LLM(path, kv_encoding="f32").logits(ids)
    rounding = max_err(LLM(converted("gemma3", "f16"), kv_encoding="f32").logits(ids), want)
    session = (engine := split_engine(path, monkeypatch)).create_session()
    got = np.asarray(engine.step([(session, ids)], all_logits=True))
    assert 0 < max_err(got, want) < 2 * rounding, (max_err(got, want), rounding)
