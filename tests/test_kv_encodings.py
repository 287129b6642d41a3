"""Compressed KV caches (kv_encoding="int8" / "int4"): the bytes they take, logits against HF
transformers' reference, and the errors for what they cannot store.

Attention over compressed pages is checked exactly in Rust (crates/cellm-kv: dense attention
over the values the pages hold, decoded by the scalar reference). Here the whole model runs on
a compressed cache, against the fixtures' HF logits. Quantizing the cache legitimately moves
logits, by an amount no formula gives for random-weight models, so the bounds are loose
sanity bounds: a cache read at the wrong place, or a rotation not undone, gives KL of nats and
top-1 agreement near chance, far outside them. How close the encodings stay on trained models
is measured by benches/kv_encodings.py (perplexity, docs/benchmarks.md)."""

from __future__ import annotations

import numpy as np
import pytest

from cellm import LLM
from cellm.errors import InvalidArgument
from conftest import Reference

# (fixture, encoding): most KL(reference || cellm) at any position, least top-1 agreement.
# int8 keeps 8 bits per value after the rotation, int4 4 bits a value and a scale byte per
# group of 16 (llama and lfm2 have heads of 16: one group); measured on these fixtures (with
# the earlier groups of 32): int8 KL <= 3e-4 and top-1 >= 98.5%, int4 KL <= 0.05 and top-1
# >= 78%.
BOUNDS = {
    ("llama", "int8"): (2e-3, 0.97),
    ("lfm2", "int8"): (2e-3, 0.97),
    ("qwen3", "int8"): (2e-3, 0.97),
    ("qwen3_5", "int8"): (2e-3, 0.97),
    ("llama", "int4"): (0.2, 0.7),
    ("lfm2", "int4"): (0.2, 0.7),
    ("qwen3", "int4"): (0.2, 0.7),
    ("qwen3_5", "int4"): (0.2, 0.7),
}


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("name,encoding", sorted(BOUNDS))
def test_logits_stay_near_the_reference(converted, name, encoding):
    ref = Reference(name)
    llm = LLM(converted(name, "f32"), kv_encoding=encoding, threads=1)
    most_kl, least_top1 = BOUNDS[(name, encoding)]
    agree = total = 0
    for i in range(len(ref.prompts)):
        # Prefill, then decode token by token: both attention paths read the pages.
        seq, n = ref.sequence(i), len(ref.prompts[i]["input_ids"])
        session = llm._engine.create_session()
        rows = [llm._engine.step([(session, seq[:n])], all_logits=True)]
        rows += [llm._engine.step([(session, [t])]) for t in seq[n:]]
        llm._engine.free_session(session)
        got = np.concatenate(rows)
        p, q = log_softmax(ref.logits[i]), log_softmax(got)
        kl = float((np.exp(p) * (p - q)).sum(-1).max())
        assert kl < most_kl, f"prompt {i}: KL {kl}"
        agree += int((got.argmax(-1) == ref.logits[i].argmax(-1)).sum())
        total += len(got)
    assert agree / total >= least_top1, f"top-1 agreement {agree}/{total}"


def test_bytes_per_token(converted):
    """Per kv head and position: f16 2 bytes a value; int8 one byte a value and an f16 scale;
    int4 half a byte a value and a scale byte per 16 (qwen3: head size 32). Per page and kv
    head a key header: a q4_0 reference key (an f16 scale per 32 and half a byte a channel),
    and for int4 half a byte a channel of scales."""
    path = converted("qwen3", "f32")
    page = {e: LLM(path, kv_encoding=e, threads=1).kv_stats()[2] for e in ("f16", "int8", "int4")}
    hd, page_size = 32, 16
    kv_heads = page["f16"] // (2 * page_size * 2 * hd)
    reference = hd // 2 + 2 * (hd // 32)
    assert page["int8"] == page["f16"] * (hd + 2) // (2 * hd) + kv_heads * reference
    row_part = page["f16"] * (hd // 2 + 2) // (2 * hd)
    assert page["int4"] == row_part + kv_heads * (reference + hd // 2)


def test_unknown_encoding_names_the_choices(converted):
    with pytest.raises(InvalidArgument, match="f16, f32, int8, int4"):
        LLM(converted("llama", "f32"), kv_encoding="int2")
