"""Prefill variants of cellm's GPU backend side by side: one engine per variant in one process,
pp512 steps alternated engine by engine, each variant's logits at every position checked
against the fused f32-sum kernels with the f32 prefill attention. One JSON line per variant.

usage: python benches/gpu_prefill_ab.py MODEL VARIANTS [ROUNDS]
  MODEL     a GGUF (or .cellm) path
  VARIANTS  comma-separated name=KNOB:value+KNOB:value[@KNOB:value+...] (name= alone: the
            defaults). Knobs before @ are set while the variant loads (most CELLM_GPU_*
            knobs are read then); knobs after @ are set around each of its steps (those read
            at each step: CELLM_GPU_PREFILL_SPLIT). E.g.
            base=,split128=@CELLM_GPU_PREFILL_SPLIT:128,trial=CELLM_GPU_SPIRV_DIR:/abs/dir
            (the last: coopmat2 kernels compiled elsewhere, the files of that directory
            named as tools/compile_spirv.sh names its outputs replacing the embedded ones)
  ROUNDS    alternating rounds (default 12), after 3 warm-up steps per engine

Reported: the median pp512 without the fastest and slowest round, every round's tok/s, the
largest logit difference over the reference's scale, and the positions whose argmax agrees.
Every CELLM_GPU_* variable of the caller's environment is cleared first.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

IDS = [int(i) for i in np.random.default_rng(1).integers(100, 20000, 512)]
REFERENCE = "CELLM_GPU_SPLIT:0+CELLM_GPU_NO_COOP_ATTN:1"


def knobs(spec: str) -> dict[str, str]:
    return dict(kv.split(":", 1) for kv in filter(None, spec.split("+")))


@contextmanager
def env(values: dict[str, str]) -> Iterator[None]:
    for k in [k for k in os.environ if k.startswith("CELLM_GPU_")]:
        del os.environ[k]
    os.environ.update(values)
    try:
        yield
    finally:
        for k in values:
            os.environ.pop(k, None)


def load(path: str, spec: str) -> Any:
    from cellm import LLM

    with env(knobs(spec)):
        return LLM(path, backend="vulkan", context_length=4096)._engine


def step(engine: Any, step_env: dict[str, str], all_logits: bool = False) -> tuple[float, Any]:
    with env(step_env):
        s = engine.create_session()
        t0 = time.perf_counter()
        out = engine.step([(s, IDS)], all_logits=all_logits)
        dt = time.perf_counter() - t0
        engine.free_session(s)
    return len(IDS) / dt, out


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    path = sys.argv[1]
    variants = [v.split("=", 1) for v in sys.argv[2].split(",")]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 12
    reference = load(path, REFERENCE)
    want = np.asarray(step(reference, {}, all_logits=True)[1])
    del reference
    scale = float(np.abs(want).max())
    engines, step_envs, checks = {}, {}, {}
    for name, spec in variants:
        at_load, _, per_step = spec.partition("@")
        engines[name], step_envs[name] = load(path, at_load), knobs(per_step)
        got = np.asarray(step(engines[name], step_envs[name], all_logits=True)[1])
        err = float(np.abs(got - want).max()) / scale
        checks[name] = (err, int((got.argmax(-1) == want.argmax(-1)).sum()))
        for _ in range(3):
            step(engines[name], step_envs[name])
    samples: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name in order:
            samples[name].append(step(engines[name], step_envs[name])[0])
    for name, got in samples.items():
        kept = sorted(got)[1:-1] or got
        err, agree = checks[name]
        print(
            json.dumps(
                {
                    "model": os.path.basename(path),
                    "variant": name,
                    "pp512": round(statistics.median(kept)),
                    "all": [round(x) for x in got],
                    "err_over_scale": f"{err:.3e}",
                    "argmax_agree": f"{agree}/{len(IDS)}",
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
