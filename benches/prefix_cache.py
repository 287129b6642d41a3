"""Time to first token with a cached prompt prefix against a cold prefill, one engine.

usage: python benches/prefix_cache.py --model PATH_OR_NAME [--threads 2] [--prefix 1024]
           [--suffix 32] [--runs 7]

Every request is `--prefix` ids then `--suffix` ids of its own (random, seeded), generated
with `max_tokens=1` through `LLM.generate` (session, prefix lookup, prefill, one sampled
token: what a client waits for). Warm requests share one prefix, prefilled once beforehand, so
they prefill only their suffix (plus the prefix's partial last page); cold ones each have a
prefix never seen, so they prefill it all. Warm and cold alternate, so the shared machine's
drift reaches both alike; prints the medians and their ratio.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from cellm import LLM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--suffix", type=int, default=32)
    p.add_argument("--runs", type=int, default=7)
    args = p.parse_args()
    llm = LLM(args.model, threads=args.threads)
    rng = random.Random(0)
    vocab = llm.tokenizer.vocab_size

    def ids(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    def ttft(prompt: list[int]) -> float:
        t0 = time.perf_counter()
        llm.generate(prompt, max_tokens=1, ignore_eos=True)
        return time.perf_counter() - t0

    shared = ids(args.prefix)
    ttft(shared + ids(args.suffix))  # primes the cache (and warms the engine)
    hits0 = llm.kv_stats().prefix_hit_tokens
    cold, warm = [], []
    for _ in range(args.runs):
        cold.append(ttft(ids(args.prefix) + ids(args.suffix)))
        warm.append(ttft(shared + ids(args.suffix)))
    hit = (llm.kv_stats().prefix_hit_tokens - hits0) // args.runs
    c, w = statistics.median(cold), statistics.median(warm)
    print(f"{args.model}, {args.threads} threads: prefix {args.prefix} + suffix {args.suffix}")
    print(f"cold TTFT median {c * 1e3:.1f} ms (runs: {', '.join(f'{x * 1e3:.0f}' for x in cold)})")
    print(f"warm TTFT median {w * 1e3:.1f} ms (runs: {', '.join(f'{x * 1e3:.0f}' for x in warm)})")
    print(f"reused {hit} positions per warm request; cold/warm = {c / w:.1f}x")


if __name__ == "__main__":
    main()
