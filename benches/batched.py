"""Aggregate decode speed with many sessions at once: cellm's continuous batching against
llama.cpp's `llama-batched-bench`, on the same GGUF file and threads, in one run.

usage: python benches/batched.py --gguf FILE --batched-bench PATH/llama-batched-bench
           [--threads 2] [--sessions 1,2,4,8,16] [--prompt 128] [--new 64]

cellm side: N prompts of `--prompt` random token ids go through `cellm.scheduler` (prefilled
in one step, then decoded together, greedy, `--new` tokens each, end-of-turn ids ignored); the
rate is the tokens decoded after the first ones over the decode time, Python sampling and
detokenizing included (what `generate_batch` and the server see). llama.cpp side: its
`S_TG t/s` column for the same prompt and generation lengths (`-npp`, `-ntg`, `-npl`).
Prints a markdown table: sessions, cellm tok/s, llama.cpp tok/s, ratio, and each side's
speed-up over one session.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import time

from cellm import LLM, SamplingParams
from cellm.scheduler import Request, Scheduler


def cellm_rates(llm: LLM, sessions: list[int], prompt: int, new: int) -> dict[int, float]:
    rng = random.Random(0)
    vocab = llm.tokenizer.vocab_size
    rates = {}
    for n in sessions:
        prompts = [[rng.randrange(vocab) for _ in range(prompt)] for _ in range(n)]
        params = SamplingParams(max_tokens=new, ignore_eos=True)
        scheduler = Scheduler(llm, max_running=n, token_budget=n * prompt)
        requests = [scheduler.submit(Request(ids, params)) for ids in prompts]
        scheduler.step()  # every prompt prefilled, first tokens sampled
        assert all(not r.prefilling for r in requests)
        t0 = time.perf_counter()
        scheduler.run_until_idle()
        rates[n] = n * (new - 1) / (time.perf_counter() - t0)
    return rates


def llama_cpp_rates(
    binary: str, gguf: str, threads: int, sessions: list[int], prompt: int, new: int
) -> dict[int, float]:
    context = max(sessions) * (prompt + new) + 64
    cmd = [binary, "-m", gguf, "-t", str(threads), "-c", str(context), "-b", "2048"]
    cmd += ["-ub", "512", "-npp", str(prompt), "-ntg", str(new)]
    cmd += ["-npl", ",".join(map(str, sessions))]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rates = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        # |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s | ...
        if len(cells) >= 8 and cells[2].isdigit():
            rates[int(cells[2])] = float(cells[7])
    return rates


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--batched-bench", required=True, help="path of llama-batched-bench")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sessions", default="1,2,4,8,16")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    args = p.parse_args()
    sessions = [int(x) for x in args.sessions.split(",")]
    peer = llama_cpp_rates(
        args.batched_bench, args.gguf, args.threads, sessions, args.prompt, args.new
    )
    llm = LLM(args.gguf, threads=args.threads, kv_capacity_tokens=max(sessions) * 2048)
    ours = cellm_rates(llm, sessions, args.prompt, args.new)
    print(f"{args.gguf}, {args.threads} threads, prompt {args.prompt}, {args.new} new tokens\n")
    print(
        "| sessions | cellm tok/s | llama.cpp tok/s | cellm / llama.cpp "
        "| speed-up cellm | speed-up llama.cpp |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    one_ours, one_peer = ours[sessions[0]], peer.get(sessions[0], float("nan"))
    for n in sessions:
        mine, theirs = ours[n], peer.get(n, float("nan"))
        print(
            f"| {n} | {mine:.1f} | {theirs:.1f} | {mine / theirs:.2f}x "
            f"| {mine / one_ours:.2f}x | {theirs / one_peer:.2f}x |"
        )


if __name__ == "__main__":
    main()
