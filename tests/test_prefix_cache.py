"""The prefix cache: full KV pages shared between sessions by the hash chain of their ids.

The independent reference is HF transformers' logits (conftest.Reference). A session that
starts from another session's cached pages must give the reference's logits for the rest of the
sequence, as a cold session does.

Tolerances. With f32 weights and f32 KV cellm computes the reference's math in the same
precision (tests/test_parity.py: ~1e-5 apart, checked at 1e-3). Reused pages hold the same f32
rows a cold prefill writes (each row of K and V depends only on its own token and position;
the rows were written by a prefill of a different length, whose matmuls may sum in another
order), so the same 1e-3 bar holds. With f16 KV each stored value is rounded to 11 significant
bits; a reused row may differ from a cold run's by one f16 rounding step (a relative 2^-11 ~
4.9e-4 of the value) when the f32 value it was rounded from moved by its last bit. On these
models' logits (magnitudes up to ~5) one such step moves a logit by well under 1e-2; the
warm-vs-cold bar is 1e-2 and the reference is checked through argmax, as test_parity does for
f16 KV.
"""

from __future__ import annotations

import numpy as np
import pytest

from cellm import LLM, _core
from cellm.errors import InvalidArgument
from conftest import FIXTURES, Reference

ATOL = 1e-3  # f32 KV against HF (see the module docstring)
F16_WARM_VS_COLD = 1e-2  # f16 KV: a reused prefix against a cold run of the same engine
COMPRESSED_WARM_VS_COLD = 5e-2  # int8 / int4 KV: the same (see the test)
PAGE = 16  # the engine's page size
# Families whose sessions carry recurrent state besides their KV pages.
RECURRENT = ["lfm2", "qwen3_5", "granitemoehybrid"]
ATTENTION_ONLY = ["llama", "qwen2", "gemma3"]  # gemma3: sliding layers, window 32


def _cold(engine: _core.Engine, seq: list[int], start: int) -> np.ndarray:
    """Logits of every position from `start` on, from a session that prefills it all."""
    s = engine.create_session()
    try:
        return engine.step([(s, seq)], all_logits=True)[start:]
    finally:
        engine.free_session(s)


@pytest.mark.parametrize("name", ATTENTION_ONLY)
@pytest.mark.parametrize("kv", ["f32", "f16", "int8", "int4"])
def test_reused_prefix_matches_reference_and_cold_run(name, kv, converted):
    ref = Reference(name)
    seq, want = ref.sequence(1), ref.logits[1]  # ~450 ids: many pages, past gemma3's window
    engine = _core.Engine(str(converted(name, "f32")), kv_encoding=kv, threads=1)
    assert engine.prefix_cache
    # A first session prefills 200 ids in two steps: 12 full pages go to the cache.
    a = engine.create_session()
    engine.step([(a, seq[:120])])
    engine.step([(a, seq[120:200])])
    b = engine.create_session()
    reused = engine.reuse_prefix(b, seq)
    assert reused == 192 and engine.session_len(b) == 192
    stats = engine.kv_stats()
    assert stats[3] >= 12 and stats[4] == 192
    # The rest, in one step, every position's logits.
    warm = engine.step([(b, seq[reused:])], all_logits=True)
    cold = _cold(engine, seq, reused)
    if kv == "f32":
        assert np.abs(warm - want[reused:]).max() < ATOL
        assert np.abs(cold - want[reused:]).max() < ATOL
    elif kv != "f16":
        # Compressed pages: a reused page holds the bytes a cold prefill writes (an int4
        # page's key header follows from its first key and the previous page alone), up to
        # a value whose f32 input moved by its last bit and rounds to the next level. One
        # such flip moves these models' logits by well under 5e-2 (measured: at most 6e-3
        # over the three families; most runs are bit-equal); a page read through the wrong
        # header or reference moves them by whole units.
        assert np.abs(warm - cold).max() < COMPRESSED_WARM_VS_COLD
        assert (warm.argmax(-1) == cold.argmax(-1)).mean() >= 0.99
    else:
        assert np.abs(warm - cold).max() < F16_WARM_VS_COLD
        agree = (warm.argmax(-1) == want[reused:].argmax(-1)).mean()
        assert agree >= 0.99, f"argmax agreement with HF {agree:.3f}"
    for s in (a, b):
        engine.free_session(s)
    assert engine.kv_stats()[0] == 0, "every page was given back"


@pytest.mark.parametrize("name", ATTENTION_ONLY)
def test_freeing_one_session_keeps_the_others_shared_pages(name, converted):
    ref = Reference(name)
    seq, want = ref.sequence(1), ref.logits[1]
    engine = _core.Engine(str(converted(name, "f32")), kv_encoding="f32", threads=1)
    a = engine.create_session()
    engine.step([(a, seq[:100])])
    b, c = engine.create_session(), engine.create_session()
    assert engine.reuse_prefix(b, seq) == engine.reuse_prefix(c, seq) == 96
    in_use = engine.kv_stats()[0]
    engine.free_session(a)
    # a's full pages stay (b and c hold them); only its partial last page went back.
    assert engine.kv_stats()[0] < in_use
    # b decodes token by token over the shared pages (and its window, for gemma3) ...
    rows = [engine.step([(b, seq[96:97])])[0]]
    rows += [engine.step([(b, [t])])[0] for t in seq[97:180]]
    assert np.abs(np.stack(rows) - want[96:180]).max() < ATOL
    # c cuts back into a page b shares and writes there: into its own copy of it (gemma3's
    # window layers cannot rewind that far, so it continues at 96).
    if name != "gemma3":
        engine.truncate_session(c, 90)
    start = engine.session_len(c)
    got = engine.step([(c, seq[start:200])], all_logits=True)
    assert np.abs(got - want[start:200]).max() < ATOL
    # b's rows were untouched: it still decodes the reference.
    rows = [engine.step([(b, [t])])[0] for t in seq[180:190]]
    assert np.abs(np.stack(rows) - want[180:190]).max() < ATOL
    for s in (b, c):
        engine.free_session(s)
    assert engine.kv_stats()[0] == 0


def test_a_full_pool_evicts_idle_pages_and_leaks_none(converted):
    ref = Reference("qwen2")
    path = converted("qwen2", "f32")
    # 160 tokens: 10 pages a layer, less than the prompts below need all together.
    llm = LLM(path, kv_encoding="f32", threads=1, kv_capacity_tokens=160)
    cold = LLM(path, kv_encoding="f32", threads=1, prefix_cache=False)
    assert llm.prefix_cache and not cold.prefix_cache
    seq = ref.sequence(1)
    prompts = [seq[i * 40 : i * 40 + 70] for i in range(5)] + [seq[:70], seq[40:110]]
    layers = 4
    for p in prompts:
        got = llm.generate(p, max_tokens=8, ignore_eos=True)
        assert got.token_ids == cold.generate(p, max_tokens=8, ignore_eos=True).token_ids
        stats = llm.kv_stats()
        assert stats.pages_in_use == 0, "every session gave its pages back"
        assert stats.cached_pages <= stats.pages_allocated <= 10 * layers
    # The last prompts' prefixes were evicted by the ones between, except the latest ones.
    assert llm.kv_stats().prefix_hit_tokens > 0
    assert cold.kv_stats().prefix_hit_tokens == 0 and cold.kv_stats().cached_pages == 0


def test_greedy_batch_with_shared_system_prompt_equals_runs_alone(converted):
    ref = Reference("llama")
    path = converted("llama", "f16")
    llm = LLM(path, threads=1)
    alone = LLM(path, threads=1, prefix_cache=False)
    system = ref.sequence(1)[:100]
    prompts = [system + ref.sequence(1)[200 + 7 * i : 205 + 7 * i] for i in range(4)]
    want = [alone.generate(p, max_tokens=12, ignore_eos=True).token_ids for p in prompts]
    for _ in range(2):  # the second batch starts from the first's cached system prompt
        got = llm.generate_batch(prompts, max_tokens=12, ignore_eos=True)
        assert [r.token_ids for r in got] == want
    stats = llm.kv_stats()
    assert stats.prefix_hit_tokens >= 4 * 96 and stats.pages_in_use == 0


@pytest.mark.parametrize("name", RECURRENT)
def test_recurrent_families_opt_out(name, converted):
    """Their sessions' state (convolution inputs, linear-attention or Mamba matrices) is not
    in the pages, so pages alone cannot restore a prefix: the cache is off for them."""
    if not (FIXTURES / name).exists():
        pytest.skip(f"no {name} fixture")
    llm = LLM(converted(name, "f32"), kv_encoding="f32", threads=1)
    assert not llm.prefix_cache
    ids = Reference(name).sequence(1)[:80]
    first = llm.generate(ids, max_tokens=4, ignore_eos=True)
    again = llm.generate(ids, max_tokens=4, ignore_eos=True)
    assert first.token_ids == again.token_ids
    assert llm.kv_stats().cached_pages == 0 and llm.kv_stats().prefix_hit_tokens == 0
    s = llm._engine.create_session()
    assert llm._engine.reuse_prefix(s, ids) == 0
    llm._engine.free_session(s)


def test_reuse_prefix_needs_an_empty_session(converted):
    engine = _core.Engine(str(converted("llama", "f32")), threads=1)
    s = engine.create_session()
    engine.step([(s, [1, 2, 3])])
    with pytest.raises(InvalidArgument, match="already holds 3 positions"):
        engine.reuse_prefix(s, [1, 2, 3, 4])


def test_server_reports_hits_and_turns_the_cache_off(converted, monkeypatch):
    pytest.importorskip("uvicorn")
    from starlette.testclient import TestClient

    import cellm.serve as serve
    from cellm.scheduler import Scheduler

    path = converted("llama", "f32")
    llm = LLM(path, kv_encoding="f32", threads=1)
    scheduler = Scheduler(llm)
    scheduler.start()
    try:
        http = TestClient(serve.build_app(llm, "tiny", scheduler))
        prompt = Reference("llama").sequence(1)[:40]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
        texts = [http.post("/v1/completions", json=body).json() for _ in range(2)]
        assert texts[0]["choices"][0]["text"] == texts[1]["choices"][0]["text"]
        health = http.get("/health").json()
        assert health["prefix_hit_tokens"] >= 32 and health["kv_cached_pages"] > 0
    finally:
        scheduler.close()
    # `cellm serve --no-prefix-cache` loads the model without it.
    import uvicorn

    loaded = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: None)
    monkeypatch.setattr(serve, "build_app", lambda llm, *a: loaded.append(llm))
    assert serve.main(["--model", str(path), "--threads", "1", "--no-prefix-cache"]) == 0
    assert not loaded[0].prefix_cache


def test_image_tokens_are_never_taken_from_the_cache(tmp_path):
    """An image token's rows follow from the image: a prompt with the same ids and another
    image reuses at most the pages before its first image token."""
    from PIL import Image

    from cellm.convert import convert_hf

    mm = FIXTURES.parent / "mm" / "idefics3"
    path = convert_hf(mm, tmp_path / "idefics3.cellm", "f32")
    bird = FIXTURES.parent / "images" / "bird.jpg"
    flipped = Image.open(bird).transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    llm = LLM(path, kv_encoding="f32", threads=1)
    fresh = LLM(path, kv_encoding="f32", threads=1, prefix_cache=False)

    def ask(model, picture):
        content = [
            {"type": "text", "text": "Look closely at the picture below, then answer. " * 4},
            {"type": "image", "image": picture},
            {"type": "text", "text": "What is it?"},
        ]
        messages = [{"role": "user", "content": content}]
        out = model.chat(messages, max_tokens=6, logprobs=True)
        return out, [round(t.logprob, 4) for t in out.logprobs], model.prompt_ids(messages)

    ask(llm, bird)
    got, logprobs, ids = ask(llm, flipped)
    want, want_logprobs, _ = ask(fresh, flipped)
    assert got.token_ids == want.token_ids and logprobs == want_logprobs
    first_image = ids.index(llm.vision.image_token_id)
    assert llm.kv_stats().prefix_hit_tokens == first_image - first_image % PAGE > 0
