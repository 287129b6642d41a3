"""Compressed KV caches (kv_encoding int8 / int4) against f16 KV on the registry's real models:
bytes per token, perplexity at 2k tokens, and decode speed at 512, 2k and 8k tokens of context.

usage: python benches/kv_encodings.py [--models NAME,...] [--speed-model NAME]
           [--contexts 512,2048,8128] [--rounds 3] [--new 32] [--threads 2] [--skip-ppl]

Bytes per token: the KV pages a session of 2048 tokens holds, times the page's bytes, over
2048 (every layer, keys and values; Gemma 3's sliding-window layers drop pages past their
window, so its figure is below the full-attention one, alike for every encoding).

Perplexity: python/cellm/data/perplexity.txt as one window of 2048 tokens (its first 2048
tokens in the model's tokenizer), prefilled in chunks of 256 so that each chunk attends over
the pages the earlier chunks stored (the engine stores a chunk's keys and values, then attends
over the pool: every read goes through the encoding); the mean NLL of the 2047 predictions.

Decode speed: a session per (encoding, context) is prefilled once with `context` random token
ids (untimed), then in each round, for each context and each encoding in turn (alternating, so
machine noise hits all alike), `--new` single-token steps are timed and the session is truncated
back to `context`. Reported: each encoding's median tok/s and the median over rounds of its
ratio to f16 within the same round.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np

from cellm import LLM
from cellm.fetch import fetch
from cellm.parity import REAL_MODELS, log_softmax, perplexity_text_ids

ENCODINGS = ("f16", "int8", "int4")
WINDOW = 2048
CHUNK = 256


def perplexity_and_bytes(llm: LLM, ids: list[int]) -> tuple[float, float]:
    """(perplexity of `ids` in one window, KV bytes per token with all of them cached)."""
    engine = llm._engine
    session = engine.create_session()
    nll, count = 0.0, 0
    try:
        for start in range(0, len(ids), CHUNK):
            chunk = ids[start : start + CHUNK]
            lp = log_softmax(engine.step([(session, chunk)], all_logits=True))
            targets = ids[start + 1 : start + 1 + len(chunk)]
            rows = np.arange(len(targets))
            nll -= float(lp[rows, targets].sum())
            count += len(targets)
        in_use, _, page_bytes = engine.kv_stats()[:3]
    finally:
        engine.free_session(session)
    return float(np.exp(nll / count)), in_use * page_bytes / len(ids)


def quality_table(names: list[str], threads: int) -> None:
    print("| model | KV | bytes/token | vs f16 | perplexity @2048 | vs f16 |")
    print("|---|---|---:|---:|---:|---:|")
    for name in names:
        path = fetch(name)
        base_ppl = base_bytes = 0.0
        for enc in ENCODINGS:
            llm = LLM(path, kv_encoding=enc, threads=threads, context_length=WINDOW)
            ids = perplexity_text_ids(llm, WINDOW)[:WINDOW]
            ppl, per_token = perplexity_and_bytes(llm, ids)
            if enc == "f16":
                base_ppl, base_bytes = ppl, per_token
            print(
                f"| {name} | {enc} | {per_token:,.0f} | {per_token / base_bytes:.3f}x "
                f"| {ppl:.4f} | {ppl / base_ppl - 1:+.3%} |",
                flush=True,
            )
            llm.close()


def speed_table(name: str, contexts: list[int], rounds: int, new: int, threads: int) -> None:
    path = fetch(name)
    top = max(contexts) + new
    llms = {
        e: LLM(path, kv_encoding=e, threads=threads, context_length=top, kv_capacity_tokens=top)
        for e in ENCODINGS
    }
    rng = random.Random(0)
    vocab = llms["f16"].vocab_size
    rates: dict[tuple[int, str], list[float]] = {}
    ratios: dict[tuple[int, str], list[float]] = {}
    for ctx in contexts:
        ids = [rng.randrange(vocab) for _ in range(ctx)]
        steps = [rng.randrange(vocab) for _ in range(new)]
        sessions = {}
        for enc, llm in llms.items():  # prefill, untimed, in chunks
            sessions[enc] = llm._engine.create_session()
            for start in range(0, ctx, 512):
                llm._engine.step([(sessions[enc], ids[start : start + 512])])
        for _ in range(rounds):
            this_round = {}
            for enc, llm in llms.items():
                engine, s = llm._engine, sessions[enc]
                engine.step([(s, [steps[0]])])  # warm: the first step after a truncate
                t0 = time.perf_counter()
                for t in steps[1:]:
                    engine.step([(s, [t])])
                this_round[enc] = (new - 1) / (time.perf_counter() - t0)
                engine.truncate_session(s, ctx)
            for enc in ENCODINGS:
                rates.setdefault((ctx, enc), []).append(this_round[enc])
                ratios.setdefault((ctx, enc), []).append(this_round[enc] / this_round["f16"])
        for enc, llm in llms.items():
            llm._engine.free_session(sessions[enc])
        print(f"context {ctx}: done", flush=True)
    print(
        f"\n{name}, {threads} threads, {new - 1} timed decode steps after the context, "
        f"{rounds} alternating rounds; tok/s medians (median of the rounds' ratios to f16)\n"
    )
    print("| context | " + " | ".join(ENCODINGS) + " |")
    print("|---:|" + "---:|" * len(ENCODINGS))
    for ctx in contexts:
        cells = [
            f"{statistics.median(rates[(ctx, e)]):.1f} ({statistics.median(ratios[(ctx, e)]):.2f}x)"
            for e in ENCODINGS
        ]
        print(f"| {ctx} | " + " | ".join(cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(REAL_MODELS))
    p.add_argument("--speed-model", default="smollm2-135m-instruct")
    p.add_argument("--contexts", default="512,2048,8128")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new", type=int, default=33)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-ppl", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    args = p.parse_args()
    if not args.skip_ppl:
        quality_table(args.models.split(","), args.threads)
    if not args.skip_speed:
        contexts = [int(c) for c in args.contexts.split(",")]
        speed_table(args.speed_model, contexts, args.rounds, args.new, args.threads)


if __name__ == "__main__":
    main()
