"""cellm's GPU backend on GGUF files: agreement with the CPU, then speed, one JSON line per model.

usage: python benches/gpu_bench.py --models a.gguf,b.gguf [--backend vulkan] [--check-only]
       [--speed-only] [--prefill-only] [--check-dequantized DIR] [--runs 3]

Check: the logits of a 64-token prompt (every position) and 16 greedy tokens, GPU against
the CPU backend on the same file, both with f32 KV. For float weights this is the same math
in another summation order; for block formats the CPU multiplies by int8 activations and the
GPU by float ones, so there the difference is the CPU's own activation rounding (reported
as the largest difference over the logits' scale, and how many positions' argmax agree).

Speed (f16 KV, as the CPU default): prefill of 512 tokens in one step (pp512), and decode of
64 tokens one step each after a 128-token and after a 2048-token prompt (tg64@128,
tg64@2048), each step returning its logits to the host as generation does. Medians over
`--runs`, after one untimed warm-up. Set CELLM_GPU_INFO=1 to have the backend print its
adapter and dispatches per step. The file is converted once (the model cache:
CELLM_CACHE_DIR).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def _ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    """Deterministic in-vocabulary ids away from the special tokens."""
    return [int(i) for i in np.random.default_rng(seed).integers(100, min(vocab, 20000), n)]


def _greedy(engine: Any, prompt: list[int], n: int) -> list[int]:
    """`n` greedy ids after `prompt`, one step each (no sampler, no stop tokens)."""
    s = engine.create_session()
    row = np.asarray(engine.step([(s, prompt)]))[-1]
    out = []
    for _ in range(n):
        out.append(int(row.argmax()))
        row = np.asarray(engine.step([(s, [out[-1]])]))[-1]
    engine.free_session(s)
    return out


def check(path: str, backend: str) -> dict[str, Any]:
    from cellm import LLM

    cpu = LLM(path, kv_encoding="f32")
    dev = LLM(path, kv_encoding="f32", backend=backend)
    ids = _ids(64, int(cpu.header["model"]["vocab_size"]))
    out: dict[str, Any] = {}
    e = cpu._engine
    s = e.create_session()
    want = np.asarray(e.step([(s, ids)], all_logits=True))
    e.free_session(s)
    g = dev._engine
    s = g.create_session()
    got = np.asarray(g.step([(s, ids)], all_logits=True))
    g.free_session(s)
    scale = float(np.abs(want).max())
    out["max_abs_diff"] = float(np.abs(got - want).max())
    out["logit_scale"] = scale
    out["rel_diff"] = out["max_abs_diff"] / scale
    out["argmax_agree"] = f"{int((got.argmax(-1) == want.argmax(-1)).sum())}/{len(ids)}"
    a, b = _greedy(e, ids[:16], 16), _greedy(g, ids[:16], 16)
    out["greedy_prefix_agree"] = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), 16)
    return out


def check_dequantized(path: str, backend: str, work: Path) -> dict[str, Any]:
    """The GPU on `path` against the CPU on the same weights decoded to f32 (every matrix
    through the engine's own decoders): the same float math in another order."""
    from cellm import LLM
    from cellm.convert import gguf_convert
    from cellm.convert.quantize import Quantization

    stem = Path(path).stem
    stored = gguf_convert.convert_gguf(path, work / f"{stem}.stored.cellm", progress=False)
    plan = gguf_convert.plan_quantization
    gguf_convert.plan_quantization = lambda *a: Quantization("f32", None, "f32", "f32")
    try:
        f32 = gguf_convert.convert_gguf(path, work / f"{stem}.f32.cellm", progress=False)
    finally:
        gguf_convert.plan_quantization = plan
    ids = _ids(64, 20000)
    rows, steps = [], []
    for engine in (
        LLM(f32, kv_encoding="f32")._engine,
        LLM(stored, kv_encoding="f32", backend=backend)._engine,
    ):
        s = engine.create_session()
        rows.append(np.asarray(engine.step([(s, ids)], all_logits=True)))
        engine.free_session(s)
        # And the first 24 tokens one a step (the one-token matvec builds only).
        s = engine.create_session()
        steps.append(np.stack([np.asarray(engine.step([(s, [t])]))[-1] for t in ids[:24]]))
        engine.free_session(s)
    f32.unlink()
    diff, scale = float(np.abs(rows[0] - rows[1]).max()), float(np.abs(rows[0]).max())
    agree = int((rows[0].argmax(-1) == rows[1].argmax(-1)).sum())
    d1 = float(np.abs(steps[0] - steps[1]).max()) / float(np.abs(steps[0]).max())
    a1 = int((steps[0].argmax(-1) == steps[1].argmax(-1)).sum())
    return {
        "max_abs_diff": diff,
        "rel_diff": diff / scale,
        "argmax_agree": f"{agree}/64",
        "one_token_rel_diff": d1,
        "one_token_argmax_agree": f"{a1}/24",
    }


def speed(path: str, backend: str, runs: int, prefill_only: bool = False) -> dict[str, Any]:
    from cellm import LLM

    eng = LLM(path, backend=backend, context_length=4096)._engine
    ids = _ids(2048 + 64, 20000, seed=1)

    def prefill(n: int) -> tuple[Any, float]:
        s = eng.create_session()
        t0 = time.perf_counter()
        eng.step([(s, ids[:n])])
        return s, time.perf_counter() - t0

    def decode(s: Any, start: int, n: int) -> float:
        t0 = time.perf_counter()
        for t in ids[start : start + n]:
            eng.step([(s, [t])])
        return time.perf_counter() - t0

    s, _ = prefill(32)  # warm-up: pipelines, buffers, the first submissions
    decode(s, 32, 8)
    eng.free_session(s)
    samples: dict[str, list[float]] = {"pp512": [], "tg64@128": [], "tg64@2048": []}
    for _ in range(runs):
        s, dt = prefill(512)
        samples["pp512"].append(512 / dt)
        eng.free_session(s)
        for ctx in () if prefill_only else (128, 2048):
            s, _ = prefill(ctx)
            samples[f"tg64@{ctx}"].append(64 / decode(s, ctx, 64))
            eng.free_session(s)
    return {k: statistics.median(v) for k, v in samples.items() if v}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", required=True, help="comma-separated GGUF (or .cellm) paths")
    p.add_argument("--backend", default="vulkan", choices=("vulkan", "metal", "gpu"))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--speed-only", action="store_true")
    p.add_argument("--prefill-only", action="store_true", help="speed: pp512 alone")
    p.add_argument(
        "--check-dequantized",
        metavar="DIR",
        help="only compare against the CPU on the weights decoded to f32 (written to DIR)",
    )
    args = p.parse_args()
    for m in args.models.split(","):
        row: dict[str, Any] = {"model": Path(m).stem, "backend": args.backend}
        try:
            if args.check_dequantized:
                work = Path(args.check_dequantized)
                row["check_dequantized"] = check_dequantized(m, args.backend, work)
                print(json.dumps(row), flush=True)
                continue
            if not args.speed_only:
                row["check"] = check(m, args.backend)
            if not args.check_only:
                row["speed"] = speed(m, args.backend, args.runs, args.prefill_only)
        except Exception as e:  # report and go on with the next model
            row["error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
