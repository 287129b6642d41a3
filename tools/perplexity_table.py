"""Perplexity of the registry's real models on python/cellm/data/perplexity.txt (>= 2k tokens,
windows of 512), in cellm and in llama.cpp on the same GGUF file.

usage: python tools/perplexity_table.py [NAME ...]    (needs llama-cpp-python; see .ci/run)
"""

from __future__ import annotations

import sys

from cellm import LLM
from cellm.fetch import fetch, fetch_gguf
from cellm.parity import REAL_MODELS, LlamaCpp, perplexity, perplexity_text_ids


def main(names: list[str]) -> None:
    print("| model | tokens | cellm | llama.cpp | difference |")
    print("|---|---:|---:|---:|---:|")
    for name in names:
        llm = LLM(fetch(name), threads=2)
        peer = LlamaCpp(fetch_gguf(name), threads=2)
        ids = perplexity_text_ids(llm)
        ours, theirs = perplexity(llm.logits, ids), perplexity(peer.logits, ids)
        print(f"| {name} | {len(ids)} | {ours:.4f} | {theirs:.4f} | {ours / theirs - 1:+.3%} |")


if __name__ == "__main__":
    main(sys.argv[1:] or REAL_MODELS)
