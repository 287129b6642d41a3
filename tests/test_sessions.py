"""Sessions share one KV page pool without seeing each other."""

from __future__ import annotations

import numpy as np
import pytest

from cellm import LLM, ContextOverflow, InvalidArgument
from conftest import MODEL_FIXTURES, Reference


@pytest.fixture(scope="module")
def llm(converted):
    return LLM(converted("qwen2", "f32"), kv_encoding="f32", context_length=512)


def alone(llm, ids):
    return llm.logits(ids)


@pytest.mark.parametrize("name", MODEL_FIXTURES)
def test_interleaved_sessions_match_each_alone(name, converted):
    """Per-session state (KV pages, and conv/recurrent state where a family has it) stays
    apart. 1e-4: a different batch split only reorders f32 sums; for Qwen3.5 (and its VLM
    wrapper) it also moves DeltaNet chunk boundaries, up to 1.5e-4 on its ill-conditioned
    fixture (see test_parity.ATOL_BY_FIXTURE), so 1e-3 there. Gemma 4's attention is unscaled
    (q/k-normed, scaling 1), so a reordered f32 score sum moves its peaked softmax more: a
    different split measured up to 1.3e-4 (its HF parity is 4.7e-4), so 5e-4 there. State
    leaking between sessions moves logits by far more than any of these."""
    llm = LLM(converted(name, "f32"), kv_encoding="f32", context_length=1024)
    ref = Reference(name)
    a_ids, b_ids = ref.sequence(0), ref.sequence(1)
    want_a, want_b = alone(llm, a_ids), alone(llm, b_ids)
    e = llm._engine
    a, b = e.create_session(), e.create_session()
    # Prefill a chunk of each, then decode both in one batched step per token, with the
    # rest of b's prompt going in as a multi-token chunk beside a's single tokens.
    got_a = [e.step([(a, a_ids[:5])], all_logits=True)]
    got_b = [e.step([(b, b_ids[:7])], all_logits=True)]
    pos_a, pos_b = 5, 7
    while pos_a < len(a_ids) or pos_b < len(b_ids):
        batch = []
        if pos_a < len(a_ids):
            batch.append((a, a_ids[pos_a : pos_a + 1]))
        if pos_b < len(b_ids):
            batch.append((b, b_ids[pos_b : pos_b + 50]))
        rows = e.step(batch, all_logits=True)
        offset = 0
        for sid, toks in batch:
            chunk = rows[offset : offset + len(toks)]
            offset += len(toks)
            (got_a if sid == a else got_b).append(chunk)
        pos_a += 1
        pos_b += 50
    tol = 1e-3 if name.startswith("qwen3_5") else 5e-4 if name.startswith("gemma4") else 1e-4
    assert np.abs(np.concatenate(got_a) - want_a).max() < tol
    assert np.abs(np.concatenate(got_b) - want_b).max() < tol
    e.free_session(a)
    e.free_session(b)


def test_truncate_rewinds_a_session(llm):
    ids = Reference("qwen2").sequence(1)[:40]
    e = llm._engine
    s = e.create_session()
    e.step([(s, ids)])
    e.truncate_session(s, 20)
    assert e.session_len(s) == 20
    again = e.step([(s, ids[20:])], all_logits=True)
    e.free_session(s)
    assert np.abs(again - alone(llm, ids)[20:]).max() < 1e-5


def test_pages_return_to_the_pool(llm):
    e = llm._engine
    in_use_before = e.kv_stats()[0]
    s = e.create_session()
    e.step([(s, list(range(100)))])
    assert e.kv_stats()[0] > in_use_before
    e.free_session(s)
    assert e.kv_stats()[0] == in_use_before


def test_bad_steps_change_nothing(llm):
    e = llm._engine
    s = e.create_session()
    e.step([(s, [1, 2, 3])])
    with pytest.raises(ContextOverflow, match="context length of 512"):
        e.step([(s, [1] * 510)])
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        e.step([(s, [llm.vocab_size])])
    with pytest.raises(InvalidArgument, match="no session"):
        e.step([(s + 1000, [1])])
    with pytest.raises(InvalidArgument, match="twice"):
        e.step([(s, [1]), (s, [2])])
    assert e.session_len(s) == 3
    e.free_session(s)


@pytest.fixture(scope="module")
def gemma(converted):
    return LLM(converted("gemma3", "f16"), context_length=2048)


def test_sliding_layers_keep_memory_bounded(gemma):
    """A generation ten times the sliding window: the 4 sliding layers hold only the pages
    their window touches, so only the 2 full layers grow with the sequence."""
    e = gemma._engine
    cfg = gemma.header["model"]
    window, n_layers = cfg["sliding_window"], cfg["num_layers"]
    sliding = cfg["layer_types"].count("sliding_attention")
    page = 16
    s = e.create_session()
    e.step([(s, [3, 10, 11])])
    token = 12
    peak = 0
    for _ in range(10 * window):
        token = int(e.step([(s, [token])])[0].argmax())
        peak = max(peak, e.kv_stats()[0])
    length = e.session_len(s)
    full_pages = -(-length // page) * (n_layers - sliding)
    assert peak <= full_pages + sliding * (window // page + 2)
    assert peak < -(-length // page) * n_layers * 0.5, "sliding layers still hold everything"
    e.free_session(s)
    assert e.kv_stats()[0] == 0


def test_sliding_session_cannot_rewind_out_of_its_window(gemma):
    e = gemma._engine
    ids = Reference("gemma3").sequence(1)[:200]
    s = e.create_session()
    e.step([(s, ids)])
    e.truncate_session(s, 195)  # its window (164..195) is still held
    with pytest.raises(InvalidArgument, match="sliding window"):
        e.truncate_session(s, 100)
    assert e.session_len(s) == 195, "a refused truncation changes nothing"
    e.truncate_session(s, 0)
    want = gemma.logits(ids[:50])
    assert np.abs(e.step([(s, ids[:50])], all_logits=True) - want).max() < 1e-4
    e.free_session(s)


# Families whose layers keep recurrent state (conv inputs, DeltaNet matrices) per session.
RECURRENT = ["lfm2", "qwen3_5"]


@pytest.mark.parametrize("name", RECURRENT)
def test_recurrent_state_resets_and_refuses_rewinds(name, converted):
    llm = LLM(converted(name, "f32"), kv_encoding="f32")
    e = llm._engine
    ids = Reference(name).sequence(1)[:60]
    want = llm.logits(ids[:30])
    s = e.create_session()
    e.step([(s, ids)])
    with pytest.raises(InvalidArgument, match="recurrent state"):
        e.truncate_session(s, 30)
    assert e.session_len(s) == 60, "a refused truncation changes nothing"
    e.truncate_session(s, 0)
    got = e.step([(s, ids[:30])], all_logits=True)
    assert np.abs(got - want).max() < 1e-4, "reset left state behind"
    e.free_session(s)


def test_mla_caches_the_compressed_latent(converted):
    """DeepSeek's KV pages hold one `kv_lora_rank + rope` row per token (shared by keys and
    values), not per-head keys and values."""
    llm = LLM(converted("deepseek_v3", "f16"), kv_encoding="f16")
    mla = llm.header["model"]["mla"]
    page_tokens, f16 = 16, 2
    assert llm._engine.kv_stats()[2] == page_tokens * (mla["kv_lora_rank"] + mla["rope_dim"]) * f16
