"""Perplexity of the registry's real models on python/cellm/data/perplexity.txt (>= 2k tokens,
windows of 512), in cellm and in llama.cpp on the same GGUF file; with --requantize, also in
cellm after requantizing each GGUF to every format cellm writes.

usage: python tools/perplexity_table.py [--requantize [--formats F,...]] [NAME ...]
       (the llama.cpp column needs llama-cpp-python; see .ci/run)
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from cellm import LLM
from cellm.convert import convert_gguf
from cellm.fetch import fetch, fetch_gguf
from cellm.parity import REAL_MODELS, LlamaCpp, perplexity, perplexity_text_ids

# (label, convert_gguf options) of every requantization.
REQUANTIZED = [
    ("int8", {"quantize": "int8"}),
    ("q8_0", {"quantize": "q8_0"}),
    ("q5_0", {"quantize": "q5_0"}),
    ("int4-affine g64", {"quantize": "int4-affine", "group_size": 64}),
    ("int4 g64", {"quantize": "int4", "group_size": 64}),
    ("int4 g128", {"quantize": "int4", "group_size": 128}),
    ("q4_k", {"quantize": "q4_k"}),
    ("q4_1 (int4-affine g32)", {"quantize": "q4_1"}),
    ("q4_0 (int4 g32)", {"quantize": "q4_0"}),
    ("int3 g64", {"quantize": "int3", "group_size": 64}),
    ("int3 g128", {"quantize": "int3", "group_size": 128}),
    ("int2 g64", {"quantize": "int2", "group_size": 64}),
    ("int2 g128", {"quantize": "int2", "group_size": 128}),
    ("q1_0", {"quantize": "q1_0"}),
]


def against_llama_cpp(names: list[str]) -> None:
    print("| model | tokens | cellm | llama.cpp | difference |")
    print("|---|---:|---:|---:|---:|")
    for name in names:
        llm = LLM(fetch(name, keep_gguf=True), threads=2)
        peer = LlamaCpp(fetch_gguf(name), threads=2)
        ids = perplexity_text_ids(llm)
        ours, theirs = perplexity(llm.logits, ids), perplexity(peer.logits, ids)
        print(f"| {name} | {len(ids)} | {ours:.4f} | {theirs:.4f} | {ours / theirs - 1:+.3%} |")


def requantized(names: list[str], formats: list[str]) -> None:
    print("| model | format | file MiB | perplexity | vs the original GGUF |")
    print("|---|---|---:|---:|---:|")
    for name in names:
        original = LLM(fetch(name, keep_gguf=True), threads=2)
        ids = perplexity_text_ids(original)
        base = perplexity(original.logits, ids)
        size = Path(fetch(name)).stat().st_size / 2**20
        print(f"| {name} | original GGUF | {size:.0f} | {base:.4f} | |", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            for label, options in REQUANTIZED:
                if formats and label.split()[0] not in formats:
                    continue
                path = convert_gguf(fetch_gguf(name), Path(tmp) / "m.cellm", **options)
                ppl = perplexity(LLM(path, threads=2).logits, ids)
                size = path.stat().st_size / 2**20
                print(
                    f"| {name} | {label} | {size:.0f} | {ppl:.4f} | {ppl / base - 1:+.2%} |",
                    flush=True,
                )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requantize", action="store_true", help="the requantized-formats table")
    p.add_argument(
        "--formats", default="", help="with --requantize: only these (int8,q8_0,int4,...)"
    )
    p.add_argument("names", nargs="*", default=REAL_MODELS)
    args = p.parse_args()
    if args.requantize:
        requantized(args.names, [f for f in args.formats.split(",") if f])
    else:
        against_llama_cpp(args.names)


if __name__ == "__main__":
    main()
