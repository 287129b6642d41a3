"""The server under load (issue 21, item 6): concurrent streaming clients with random prompt
lengths and random disconnects against `cellm.serve` on 127.0.0.1, through the official
`openai` client. Reports requests, completions, cancellations, errors (5xx), time to first
token p50/p99, aggregate tok/s, KV pages and RSS before and after, and checks that every
completed answer equals the same request run alone (greedy).

usage: python benches/load.py [--model smollm2-135m-instruct] [--clients 32] [--threads 2]
           [--max-sessions 16] [--min-prompt 16] [--max-prompt 512] [--new 32]
           [--leave 0.25] [--seed 0]

Each client sends one streaming /v1/completions request (a prompt of random token ids, its
length uniform in [min, max], temperature 0, `--new` tokens, end-of-text ignored is not asked:
a model may stop early), all at once; a `--leave` share of them closes its stream after a random
number (1-8) of pieces. Time to first token: from sending the request to the first piece of
text, as the client sees it (queueing, prefill and the first step included). Pages: the KV
pool's pages in use (`kv_stats`) before the clients and once the server is idle again; RSS:
this process's (the server runs in it, on a thread) resident set before and after, and its
peak.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import resource
import statistics
import threading
import time
from typing import Any, Optional

import openai
import uvicorn

from cellm import LLM
from cellm.fetch import fetch
from cellm.scheduler import Scheduler
from cellm.serve import build_app


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-sessions", type=int, default=16)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--leave", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8765)
    args = p.parse_args()

    llm = LLM(fetch(args.model), threads=args.threads)
    rng = random.Random(args.seed)
    vocab = llm.vocab_size
    jobs = []
    for _ in range(args.clients):
        n = rng.randint(args.min_prompt, args.max_prompt)
        leave_after = rng.randint(1, 8) if rng.random() < args.leave else None
        jobs.append(([rng.randrange(vocab) for _ in range(n)], leave_after))

    scheduler = Scheduler(llm, max_running=args.max_sessions)
    scheduler.start()
    config = uvicorn.Config(
        build_app(llm, "m", scheduler), host="127.0.0.1", port=args.port, log_level="warning"
    )
    http = uvicorn.Server(config)
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    while not http.started:
        time.sleep(0.05)

    pages_before = llm.kv_stats()
    rss_before = rss_mib()
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{args.port}/v1", api_key="none", max_retries=0, timeout=600
    )

    async def one(prompt: list[int], leave_after: Optional[int]) -> dict[str, Any]:
        t0 = time.perf_counter()
        ttft = None
        pieces: list[str] = []
        try:
            stream = await client.completions.create(
                model="m", prompt=prompt, max_tokens=args.new, temperature=0, stream=True
            )
            async for chunk in stream:
                if not chunk.choices or not chunk.choices[0].text:
                    continue
                if ttft is None:
                    ttft = time.perf_counter() - t0
                pieces.append(chunk.choices[0].text)
                if leave_after is not None and len(pieces) >= leave_after:
                    await stream.close()
                    return {"ttft": ttft, "left": True, "text": None, "status": 200}
        except openai.APIStatusError as e:
            return {"ttft": ttft, "left": False, "text": None, "status": e.status_code}
        return {"ttft": ttft, "left": False, "text": "".join(pieces), "status": 200}

    async def run_all() -> list[dict[str, Any]]:
        return await asyncio.wait_for(asyncio.gather(*(one(*j) for j in jobs)), 1800)

    t0 = time.perf_counter()
    results = asyncio.run(run_all())
    wall = time.perf_counter() - t0

    deadline = time.monotonic() + 30
    while (scheduler.running or scheduler.waiting) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    pages_after = llm.kv_stats()
    rss_after = rss_mib()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    http.should_exit = True
    thread.join(timeout=10)
    scheduler.close()

    # Every completed answer against the same request run alone (greedy).
    # Where one differs: the first token whose text leaves the served answer, and the alone
    # run's gap (nats) between its best and second-best token there (a near tie that the
    # batch's different rounding can flip, or not).
    mismatches = 0
    tokens = 0
    gaps = []
    for (prompt, _), r in zip(jobs, results):
        if r["text"] is not None:
            alone = llm.generate(prompt, max_tokens=args.new, logprobs=True, top_logprobs=2)
            tokens += len(alone.token_ids)
            if r["text"] != alone.text:
                mismatches += 1
                for k in range(len(alone.token_ids)):
                    if not r["text"].startswith(llm.tokenizer.decode(alone.token_ids[: k + 1])):
                        top = (alone.logprobs or [])[k].top_logprobs
                        gaps.append((k, top[0][1] - top[1][1]))
                        break
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    completed = sum(r["text"] is not None for r in results)
    left = sum(r["left"] for r in results)
    errors_5xx = sum(r["status"] >= 500 for r in results)
    errors_4xx = sum(400 <= r["status"] < 500 for r in results)
    lengths = [len(prompt) for prompt, _ in jobs]

    print(
        f"{args.model}, {args.threads} threads, --max-sessions {args.max_sessions}: "
        f"{args.clients} concurrent streaming clients, prompts of {min(lengths)}-{max(lengths)} "
        f"token ids (mean {statistics.mean(lengths):.0f}), up to {args.new} new tokens, greedy\n"
    )
    print("| figure | value |")
    print("|---|---:|")
    print(f"| requests | {len(results)} |")
    print(f"| completed | {completed} |")
    print(f"| cancelled (client disconnected mid-stream) | {left} |")
    print(f"| 5xx / 4xx responses | {errors_5xx} / {errors_4xx} |")
    print(f"| completed answers equal to the request run alone | {completed - mismatches} |")
    if gaps:
        where = ", ".join(f"{k}" for k, _ in gaps)
        print(f"| first differing token (index) of each other answer | {where} |")
        print(
            "| alone run's top-2 logprob gap there (nats), largest | "
            f"{max(g for _, g in gaps):.4f} |"
        )
    print(
        f"| time to first token p50 / p99 (s) | {statistics.median(ttfts):.2f} / "
        f"{percentile(ttfts, 0.99):.2f} |"
    )
    print(f"| wall time (s) | {wall:.1f} |")
    print(f"| completed tokens / wall time (tok/s) | {tokens / wall:.1f} |")
    print(f"| KV pages in use before / after | {pages_before[0]} / {pages_after[0]} |")
    print(
        f"| KV pages allocated before / after (high-water) | {pages_before[1]} / {pages_after[1]} |"
    )
    print(f"| RSS before / after / peak (MiB) | {rss_before:.0f} / {rss_after:.0f} / {peak:.0f} |")


if __name__ == "__main__":
    main()
