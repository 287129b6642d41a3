"""One thread's speed on a float-weight model, this build against another, per CPU-second.

usage: python benches/float_ab.py MODEL.cellm --base DIR [--rounds 4]

DIR holds another build's `cellm` package (e.g. a copy of an older checkout's `python/cellm`
with its compiled `_core`). Each round runs one process on this build and one on DIR's,
alternating, each on one engine thread, timing by that thread's CPU time (`time.thread_time`),
which a machine shared with other work disturbs much less than the wall clock: prefill of
256, 32 and 2 tokens (medians of repeats), one session decoding 48 tokens, and 8 sessions
decoding 16 steps. Prints per measure the medians and the median of the rounds' ratios.
A float model to time: `python benches/random_gguf.py --shapes smollm2-135m --formats f16`,
then `python -m cellm.convert -i DIR/smollm2-135m-f16.gguf -o smol-f16.cellm`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

MEASURES = ["prefill256", "prefill32", "prefill2", "decode1", "decode8"]


def child(model: str) -> None:
    from cellm._core import Engine

    e = Engine(model, threads=1, prefix_cache=False)
    rng = random.Random(0)
    clock = time.thread_time
    out = {}
    warm = e.create_session()
    e.step([(warm, list(range(3, 40)))])
    e.free_session(warm)
    prompt = [rng.randrange(1000) + 3 for _ in range(256)]

    def prefill(n: int, reps: int) -> float:
        times = []
        for k in range(reps):
            s = e.create_session()
            t0 = clock()
            e.step([(s, prompt[k : k + n])])
            times.append(clock() - t0)
            e.free_session(s)
        return n / statistics.median(times)

    out["prefill256"] = prefill(256, 1)
    out["prefill32"] = prefill(32, 6)
    out["prefill2"] = prefill(2, 10)
    s = e.create_session()
    e.step([(s, prompt)])
    t0 = clock()
    for i in range(48):
        e.step([(s, [5 + i])])
    out["decode1"] = 48 / (clock() - t0)
    e.free_session(s)
    sessions = [e.create_session() for _ in range(8)]
    e.step([(x, [rng.randrange(1000) + 3 for _ in range(16)]) for x in sessions])
    t0 = clock()
    for i in range(16):
        e.step([(x, [5 + i]) for x in sessions])
    out["decode8"] = 8 * 16 / (clock() - t0)
    print(json.dumps(out))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        return child(sys.argv[2])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--base", required=True, help="directory holding the other build's cellm")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    envs = {"this": {}, "base": {"PYTHONPATH": args.base}}
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in envs}
    for _ in range(args.rounds):
        for name, extra in envs.items():
            cmd = [sys.executable, __file__, "--child", args.model]
            done = subprocess.run(
                cmd, env=dict(os.environ, **extra), capture_output=True, text=True, check=True
            )
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print("tokens per CPU-second, one thread; ratio: median of the rounds' this / base")
    for m in MEASURES:
        a = [r[m] for r in runs["this"]]
        b = [r[m] for r in runs["base"]]
        ratios = [x / y for x, y in zip(a, b)]
        print(
            f"{m}: this {statistics.median(a):.1f}, base {statistics.median(b):.1f}, "
            f"ratio {statistics.median(ratios):.3f} ({', '.join(f'{r:.2f}' for r in ratios)})"
        )


if __name__ == "__main__":
    main()
