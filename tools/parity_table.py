"""Print the cellm vs llama.cpp parity table for the registry's real models.

usage: python tools/parity_table.py [NAME ...]    (needs llama-cpp-python; see .ci/run)
"""

from __future__ import annotations

import sys

from cellm import LLM
from cellm.fetch import fetch, fetch_gguf
from cellm.parity import REAL_MODELS, LlamaCpp, run


def main(names: list[str]) -> None:
    print(
        "| model | positions | argmax agreement | mean KL | max KL "
        "| llama.cpp vs itself (agreement, KL, max top-logit change) | greedy (5 x 64) |"
    )
    print("|---|---:|---:|---:|---:|---|---|")
    for name in names:
        llm = LLM(fetch(name, keep_gguf=True), threads=2)
        r = run(llm, LlamaCpp(fetch_gguf(name), threads=2))
        lg, fl = r["logits"], r["floor"]
        floor = (
            f"{fl.logits.argmax_agreement:.2%}, {fl.logits.mean_kl:.5f}, "
            f"{fl.max_top_logit_change:.3f}"
        )
        greedy = ", ".join(
            "same" if g.identical else f"@{g.diverged_at} gap {g.gap:.3f}" for g in r["greedy"]
        )
        print(
            f"| {name} | {lg.positions} | {lg.argmax_agreement:.2%} | {lg.mean_kl:.5f} "
            f"| {lg.max_kl:.4f} | {floor} | {greedy} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:] or REAL_MODELS)
