"""The cost of constrained decoding: decode tok/s of one request with and without a JSON
schema, on the same model, prompt and threads, in one run.

usage: python benches/structured.py [--model smollm2-135m-instruct] [--threads 2]
           [--rounds 3] [--items 24]

Each round runs the constrained request (greedy, a schema asking for an array of exactly
`--items` small objects, so that the answer is a few hundred tokens long) and the same prompt
unconstrained for as many tokens (end-of-turn ids ignored), the order alternating from round
to round so that a busy machine slows both alike; one constrained run first warms up. The
rate is `Timings.decode_tps`: tokens after the first over the decode time, sampling, masking
and detokenizing included. Prints a markdown row: model,
tokens, tok/s with and without the schema (medians), and their ratio.
"""

from __future__ import annotations

import argparse
import statistics

from cellm import LLM

SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "name": {"type": "string", "maxLength": 12},
            "ok": {"type": "boolean"},
            "kind": {"enum": ["fruit", "tool", "animal"]},
        },
        "required": ["id", "name", "ok", "kind"],
        "additionalProperties": False,
    },
}
PROMPT = "List things as JSON objects with an id, a name, a flag and a kind."


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--items", type=int, default=24)
    args = p.parse_args()
    llm = LLM(args.model, threads=args.threads)
    schema = {**SCHEMA, "minItems": args.items, "maxItems": args.items}
    fmt = {"type": "json_schema", "json_schema": {"name": "things", "schema": schema}}
    messages = [{"role": "user", "content": PROMPT}]
    with_schema, without = [], []
    tokens = 0
    tokens = len(llm.chat(messages, response_format=fmt, max_tokens=4096).token_ids)  # warm-up
    for i in range(args.rounds):
        # Alternating which runs first, so that neither always follows the other.
        for constrained in (True, False) if i % 2 == 0 else (False, True):
            if constrained:
                r = llm.chat(messages, response_format=fmt, max_tokens=4096)
                tokens = len(r.token_ids)
                with_schema.append(r.timings.decode_tps)
            else:
                free = llm.chat(messages, max_tokens=tokens, ignore_eos=True)
                without.append(free.timings.decode_tps)
    a, b = statistics.median(with_schema), statistics.median(without)
    print("| model | tokens | tok/s with schema | tok/s without | ratio |")
    print("|---|---|---|---|---|")
    print(f"| {args.model} | {tokens} | {a:.1f} | {b:.1f} | {a / b:.3f} |")


if __name__ == "__main__":
    main()
