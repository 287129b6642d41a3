"""How much a prompt's last logits depend on how its prefill is split into chunks (the
scheduler's chunked prefill splits prompts by its token budget), and whether a decode step
depends on what else shares its batch. Not a timing: the max |logit difference| against the
same prompt prefilled in one step.

usage: python benches/chunk_invariance.py [--model smollm2-135m-instruct] [--kv-encoding f16]
           [--prompt 300]
"""

from __future__ import annotations

import argparse
import random

import numpy as np

from cellm import LLM
from cellm.fetch import fetch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--kv-encoding", default="f16")
    p.add_argument("--prompt", type=int, default=300)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    path = args.model if args.model.endswith(".cellm") else fetch(args.model)
    llm = LLM(path, threads=args.threads, kv_encoding=args.kv_encoding)
    engine, rng = llm._engine, random.Random(1)
    n = args.prompt
    ids = [rng.randrange(llm.vocab_size) for _ in range(n)]

    def last_logits(chunks: list[int], others: int = 0) -> np.ndarray:
        s = engine.create_session()
        extra = [engine.create_session() for _ in range(others)]
        pos, out = 0, None
        try:
            for c in chunks:
                batch = [(s, ids[pos : pos + c])]
                batch += [(x, [rng.randrange(llm.vocab_size)]) for x in extra]
                out = engine.step(batch)
                pos += c
        finally:
            for x in [s, *extra]:
                engine.free_session(x)
        return np.asarray(out)[0]

    whole = last_logits([n])
    print(f"{args.model}, kv {args.kv_encoding}: {n} prompt tokens; max |logit - one step|")
    print(f"(largest |logit| {float(np.abs(whole).max()):.2f})")
    splits = [[256, n - 256], [n // 2, n - n // 2], [n - 8, 8], [n - 3, 3], [n - 1, 1]]
    for chunks in splits:
        diff = np.abs(last_logits(chunks) - whole).max()
        print(f"  chunks {'+'.join(map(str, chunks))}: {diff:.3g}")
    alone = last_logits([n - 1, 1])
    for others in (1, 7, 15):
        got = last_logits([n - 1, 1], others)
        print(f"  decode step beside {others} 1-token sessions: {np.abs(got - alone).max():.3g}")
    # A decode step of this prompt beside other sessions that hold longer contexts.
    for contexts in ([50], [1000, 1000], [448, 336, 137]):
        s = engine.create_session()
        engine.step([(s, ids[:-1])])
        xs = [engine.create_session() for _ in contexts]
        for x, c in zip(xs, contexts):
            engine.step([(x, [rng.randrange(llm.vocab_size) for _ in range(c)])])
        got = np.asarray(
            engine.step([(x, [rng.randrange(llm.vocab_size)]) for x in xs] + [(s, ids[-1:])])
        )[-1]
        for x in [s, *xs]:
            engine.free_session(x)
        diff = np.abs(got - alone).max()
        print(f"  decode step beside sessions of {contexts} tokens: {diff:.3g}")


if __name__ == "__main__":
    main()
