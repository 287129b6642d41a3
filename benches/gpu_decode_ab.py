"""Decode variants of cellm's GPU backend side by side: one engine per variant in one process
(each variant's environment knobs set while it loads), tg64 after 128 and after 2048 tokens,
variants alternated round by round; medians, one JSON line per model.

usage: python benches/gpu_decode_ab.py MODELS VARIANTS [ROUNDS]
  MODELS    comma-separated GGUF (or .cellm) paths
  VARIANTS  comma-separated name=KNOB:value+KNOB:value (name= alone: the defaults), e.g.
            base=,noahead=CELLM_GPU_NO_AHEAD:1,steps2=CELLM_GPU_MATVEC_STEPS:2

Knobs (read when a model loads): CELLM_GPU_NO_AHEAD (no recording of the next decode step
ahead), CELLM_GPU_NO_FUSE (RoPE and the KV store in their own launch), CELLM_GPU_MATVEC_STEPS
(the one-token matvec's column steps a pass), CELLM_GPU_NO_IMMEDIATES (parameters from a
uniform buffer), CELLM_GPU_NO_SUBGROUPS, CELLM_GPU_PROFILE, CELLM_GPU_MATVEC_WIDE
(threads,cols,rows of the one-token matvec's wide build, any separator: 64.0.0 for none),
CELLM_GPU_MATVEC_PLAIN (the one-token matvec dequantizes and takes dots instead of the
formats' d8), CELLM_GPU_F16_VEC4 (0: f16 weights 8 bytes a load in the matvec, not 16),
CELLM_GPU_MATVEC_ONE
(rows,threads[,scalar] of the plain and GLU one-token matvec: 1, 2 or 4 rows a workgroup,
32-256 threads, 1 for the scalar reduction of the slots in use; any separator: 2.128.1 is
the default, 4.64.0 the shape before),
CELLM_GPU_MATVEC_ROPE_WG (threads of the q|k|v rope matvec's one-token build),
CELLM_GPU_MATVEC_D16 (0 or 1: q4_k and q6_k take 16 columns a step, both nibbles of a word,
in the one-token matvec), CELLM_GPU_ATTN_FUSE (0 or 1: the decode attention's last split
merges the splits, no combine launch), CELLM_GPU_ATTN_TP (0 or 1: the decode attention
scores a position of short splits with several threads, f16 keys 16 bytes a load),
CELLM_GPU_ATTN_VV (0 or 1: the decode attention reads f16 values 16 bytes a load),
CELLM_GPU_MATVEC_I8 (0 or 1: the one-token d16 matvec takes x as int8 and the q4_k / q6_k
quants by packed integer dots; on by default on Vulkan), CELLM_GPU_MATVEC_T64 (0 or 1: 64
threads for one-token d16 launches whose rows hold more than 128 units of 16 columns, not a
multiple of 128), CELLM_GPU_MATVEC_R4 (columns from which the int8-x one-token build runs 4
rows a workgroup; 2048 is the default, 0 never, as before session 20), CELLM_GPU_ATTN_SPLIT
(workgroups,positions: the decode attention's splits aim at that many workgroups a step,
none shorter than that many positions; any separator; 512.32 is the default, 1024.32 the
one before), CELLM_GPU_SPIN (0: waits for a step block at once instead of spinning on the
fence first; 1: spin on a CPU adapter too).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

KNOBS = [
    "CELLM_GPU_NO_AHEAD",
    "CELLM_GPU_NO_FUSE",
    "CELLM_GPU_MATVEC_STEPS",
    "CELLM_GPU_NO_IMMEDIATES",
    "CELLM_GPU_NO_SUBGROUPS",
    "CELLM_GPU_PROFILE",
    "CELLM_GPU_MATVEC_WIDE",
    "CELLM_GPU_MATVEC_PLAIN",
    "CELLM_GPU_F16_VEC4",
    "CELLM_GPU_MATVEC_ONE",
    "CELLM_GPU_MATVEC_ROPE_WG",
    "CELLM_GPU_MATVEC_D16",
    "CELLM_GPU_ATTN_FUSE",
    "CELLM_GPU_ATTN_TP",
    "CELLM_GPU_ATTN_VV",
    "CELLM_GPU_MATVEC_I8",
    "CELLM_GPU_MATVEC_T64",
    "CELLM_GPU_MATVEC_R4",
    "CELLM_GPU_ATTN_SPLIT",
    "CELLM_GPU_SPIN",
]
IDS = [int(i) for i in np.random.default_rng(1).integers(100, 20000, 2048 + 64)]


def load(path: str, spec: str) -> Any:
    from cellm import LLM

    for k in KNOBS:
        os.environ.pop(k, None)
    for kv in filter(None, spec.split("+")):
        k, v = kv.split(":")
        os.environ[k] = v
    engine = LLM(path, backend="vulkan", context_length=4096)._engine
    for k in KNOBS:
        os.environ.pop(k, None)
    s = engine.create_session()  # warm-up
    engine.step([(s, IDS[:32])])
    for t in IDS[32:40]:
        engine.step([(s, [t])])
    engine.free_session(s)
    return engine


def tg64(engine: Any, ctx: int) -> float:
    s = engine.create_session()
    engine.step([(s, IDS[:ctx])])
    t0 = time.perf_counter()
    for t in IDS[ctx : ctx + 64]:
        engine.step([(s, [t])])
    dt = time.perf_counter() - t0
    engine.free_session(s)
    return 64 / dt


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    variants = [v.split("=", 1) for v in sys.argv[2].split(",")]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    for path in sys.argv[1].split(","):
        engines = {name: load(path, spec) for name, spec in variants}
        got: dict[str, dict[int, list[float]]] = {n: {128: [], 2048: []} for n, _ in variants}
        for _ in range(rounds):
            for name, _ in variants:
                for ctx in (128, 2048):
                    got[name][ctx].append(tg64(engines[name], ctx))
        row: dict[str, Any] = {"model": os.path.basename(path)}
        for name, _ in variants:
            row[name] = {f"tg64@{c}": round(statistics.median(v), 1) for c, v in got[name].items()}
        print(json.dumps(row), flush=True)
        del engines
    return 0


if __name__ == "__main__":
    sys.exit(main())
