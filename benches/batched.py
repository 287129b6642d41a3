"""Aggregate decode speed with many sessions at once: cellm's continuous batching against
llama.cpp's `llama-batched-bench`, on the same GGUF file and threads, alternating in one run.

usage: python benches/batched.py --gguf FILE --batched-bench PATH/llama-batched-bench
           [--threads 2] [--sessions 1,2,4,8,16] [--prompt 128] [--new 64] [--rounds 3]

Each round runs, for each session count in turn, llama.cpp then cellm's two measures, so that
machine noise (the machine is shared) hits the engines alike; the table gives each cell's
median over the rounds, and each ratio as the median of the rounds' own ratios.

- cellm, scheduler: N prompts of `--prompt` random token ids go through `cellm.scheduler`
  (prefilled in one step, then decoded together, greedy, `--new` tokens each, end-of-turn ids
  ignored); the rate is the tokens decoded after the first ones over the decode time, Python
  sampling and detokenizing included (what `generate_batch` and the server see).
- cellm, engine: the same prompts prefilled in one `Engine.step`, then `--new` steps that each
  feed every session a fixed token id (no sampling), timed after the first: the engine alone.
- cellm, paired steps (`--paired`): one engine holds one session and N sessions, both
  prefilled, and alternates between them in runs of `PAIRED_RUN` decode steps (the one
  session's, then the N sessions', then the other order), `--new` steps each; the ratio of
  the two rates. Each run's first step is not timed: a step right after the other group's
  runs with that group's data in the caches (one session's step alternated step by step
  with 8 sessions' took about 10% longer than back to back, which made that ratio read
  about 10% high). Runs last tens of milliseconds, so the ratio still does not move with
  how busy a shared host was in one measure and not the other (the rounds' ratios above
  move up to 2x on one).
- llama.cpp: a `llama-batched-bench` process per session count (`-npl N -npp PROMPT -ntg NEW
  -kvu`, random token ids, its own warm-up), its `S_TG t/s` column (N * NEW tokens over the
  decode time), its OpenMP threads waiting as `--omp-wait-policy` says: PASSIVE by default (a
  shared machine), ACTIVE (OpenMP's own default, spinning) on a quiet one.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import time

from cellm import LLM, SamplingParams
from cellm.scheduler import Request, Scheduler


def cellm_scheduler_rate(llm: LLM, n: int, prompt: int, new: int, rng: random.Random) -> float:
    vocab = llm.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(prompt)] for _ in range(n)]
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    scheduler = Scheduler(llm, max_running=n, token_budget=n * prompt)
    requests = [scheduler.submit(Request(ids, params)) for ids in prompts]
    scheduler.step()  # every prompt prefilled, first tokens sampled
    assert all(not r.prefilling for r in requests)
    t0 = time.perf_counter()
    scheduler.run_until_idle()
    return n * (new - 1) / (time.perf_counter() - t0)


def cellm_engine_rate(llm: LLM, n: int, prompt: int, new: int, rng: random.Random) -> float:
    engine, vocab = llm._engine, llm.vocab_size
    sessions = [engine.create_session() for _ in range(n)]
    try:
        engine.step([(s, [rng.randrange(vocab) for _ in range(prompt)]) for s in sessions])
        engine.step([(s, [rng.randrange(vocab)]) for s in sessions])
        t0 = time.perf_counter()
        for _ in range(new - 1):
            engine.step([(s, [rng.randrange(vocab)]) for s in sessions])
        return n * (new - 1) / (time.perf_counter() - t0)
    finally:
        for s in sessions:
            engine.free_session(s)


# Steps of one group in a row in the paired measure; the first of each run is not timed.
PAIRED_RUN = 8


def cellm_paired_ratio(llm: LLM, n: int, prompt: int, new: int, rng: random.Random) -> float:
    """N sessions' aggregate decode rate over one session's, in alternating runs of steps."""
    engine, vocab = llm._engine, llm.vocab_size
    one, many = [engine.create_session()], [engine.create_session() for _ in range(n)]
    try:
        for group in (one, many):
            engine.step([(s, [rng.randrange(vocab) for _ in range(prompt)]) for s in group])
        spent = {id(one): 0.0, id(many): 0.0}
        for i in range(max(1, new // PAIRED_RUN)):
            for group in (one, many) if i % 2 == 0 else (many, one):
                for k in range(PAIRED_RUN):
                    feed = [(s, [rng.randrange(vocab)]) for s in group]
                    t0 = time.perf_counter()
                    engine.step(feed)
                    if k > 0:  # the run's first step warms the caches for this group
                        spent[id(group)] += time.perf_counter() - t0
        return n * spent[id(one)] / spent[id(many)]
    finally:
        for s in one + many:
            engine.free_session(s)


def llama_cpp_rate(
    binary: str, gguf: str, threads: int, n: int, prompt: int, new: int, wait_policy: str
) -> float:
    context = n * (prompt + new) + 256
    cmd = [binary, "-m", gguf, "-t", str(threads), "-c", str(context), "-b", "2048"]
    cmd += ["-ub", "512", "-npp", str(prompt), "-ntg", str(new), "-npl", str(n), "-kvu"]
    # Spinning at barriers (OpenMP's default) collapses on a machine shared with other work
    # (0.9 tok/s for one SmolLM2 session under load, 19 passive), while waiting passively
    # costs a quiet machine a wake-up at every barrier.
    env = {**os.environ, "OMP_WAIT_POLICY": wait_policy}
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        # |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s | ...
        if len(cells) >= 8 and cells[2].isdigit() and int(cells[2]) == n:
            return float(cells[7])
    raise RuntimeError(f"no row for {n} sessions in llama-batched-bench's output:\n{out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--batched-bench", required=True, help="path of llama-batched-bench")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sessions", default="1,2,4,8,16")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--paired",
        action="store_true",
        help="also measure each count against one session with their engine steps alternating",
    )
    p.add_argument(
        "--omp-wait-policy",
        default="PASSIVE",
        choices=["PASSIVE", "ACTIVE"],
        help="llama.cpp's OpenMP waits: PASSIVE on a shared machine, ACTIVE on a quiet one",
    )
    args = p.parse_args()
    sessions = [int(x) for x in args.sessions.split(",")]
    llm = LLM(args.gguf, threads=args.threads, kv_capacity_tokens=max(sessions) * 2048)
    rng = random.Random(0)
    rates: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        for n in sessions:
            got = {
                "llama.cpp": llama_cpp_rate(
                    args.batched_bench,
                    args.gguf,
                    args.threads,
                    n,
                    args.prompt,
                    args.new,
                    args.omp_wait_policy,
                ),
                "scheduler": cellm_scheduler_rate(llm, n, args.prompt, args.new, rng),
                "engine": cellm_engine_rate(llm, n, args.prompt, args.new, rng),
            }
            if args.paired and n != 1:
                got["paired"] = cellm_paired_ratio(llm, n, args.prompt, args.new, rng)
            for k, v in got.items():
                rates.setdefault((k, n), []).append(v)
            print(
                f"round {r + 1}, {n} sessions: "
                + ", ".join(f"{k} {v:.{2 if k == 'paired' else 1}f}" for k, v in got.items()),
                flush=True,
            )

    def med(k: str, n: int) -> float:
        return statistics.median(rates[(k, n)])

    def ratio(a: str, na: int, b: str, nb: int) -> float:
        return statistics.median(x / y for x, y in zip(rates[(a, na)], rates[(b, nb)]))

    one = sessions[0]
    print(
        f"\n{args.gguf}, {args.threads} threads, prompt {args.prompt}, {args.new} new tokens, "
        f"{args.rounds} alternating rounds; aggregate decode tok/s, medians (ratios: medians "
        "of the rounds' own ratios)\n"
    )
    print(
        "| sessions | cellm scheduler | cellm engine | llama-batched-bench "
        "| scheduler / llama.cpp | engine / llama.cpp "
        f"| scheduler vs {one} | engine vs {one} | llama.cpp vs {one} |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in sessions:
        print(
            f"| {n} | {med('scheduler', n):.1f} | {med('engine', n):.1f} "
            f"| {med('llama.cpp', n):.1f} "
            f"| {ratio('scheduler', n, 'llama.cpp', n):.2f}x "
            f"| {ratio('engine', n, 'llama.cpp', n):.2f}x "
            f"| {ratio('scheduler', n, 'scheduler', one):.2f}x "
            f"| {ratio('engine', n, 'engine', one):.2f}x "
            f"| {ratio('llama.cpp', n, 'llama.cpp', one):.2f}x |"
        )
    if args.paired:
        print("\nengine, N sessions against one in alternating runs of steps (medians of rounds):")
        for n in sessions:
            if ("paired", n) in rates:
                cells = ", ".join(f"{x:.2f}" for x in rates[("paired", n)])
                print(f"- {n} sessions: {statistics.median(rates[('paired', n)]):.2f}x ({cells})")


if __name__ == "__main__":
    main()
