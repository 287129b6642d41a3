"""Print max |dlogit| (f32 weights, f32 KV) and argmax agreement (f16 weights, f16 KV) of cellm
against the HF transformers reference logits of every fixture in tests/fixtures/hf-tiny.

usage: python tools/fixture_parity.py
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

from cellm import LLM
from cellm.convert import convert_hf

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf-tiny"


def main() -> None:
    print("| fixture | positions | max abs dlogit (f32) | argmax agreement (f16 + f16 KV) |")
    print("|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for d in sorted(p for p in FIXTURES.iterdir() if (p / "reference.json").exists()):
            ref = json.loads((d / "reference.json").read_text())
            logits = np.load(d / "logits.npz")
            f32 = LLM(convert_hf(d, Path(tmp) / f"{d.name}-f32.cellm", "f32"), kv_encoding="f32")
            f16 = LLM(convert_hf(d, Path(tmp) / f"{d.name}-f16.cellm", "f16"), kv_encoding="f16")
            err, agree, total = 0.0, 0, 0
            for i, p in enumerate(ref["prompts"]):
                ids = p["input_ids"] + p["greedy_ids"][:-1]
                want = logits[f"logits_{i}"]
                err = max(err, float(np.abs(f32.logits(ids) - want).max()))
                agree += int((f16.logits(ids).argmax(-1) == want.argmax(-1)).sum())
                total += len(ids)
            print(f"| {d.name} | {total} | {err:.2e} | {agree / total:.2%} |")


if __name__ == "__main__":
    main()
