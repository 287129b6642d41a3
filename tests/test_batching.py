"""Continuous batching (cellm.scheduler) and the APIs over it: results equal each request run
alone (greedy, and sampled with the same seed), prompts prefill in chunks beside running
decodes, cancelled requests free their pages, and a full pool or queue behaves as documented."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cellm import LLM, SamplingParams
from cellm._core import Engine
from cellm.errors import Busy, ContextOverflow
from cellm.scheduler import Request, Scheduler, _chunk_length

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * k for k in (1, 2, 3, 5)] + [[3]]


@pytest.fixture(scope="module", params=["llama", "lfm2"])  # attention only; recurrent state
def llm(request, converted):
    return LLM(converted(request.param, "f32"), kv_encoding="f32", threads=1)


def alone(llm, prompts, **kw):
    return [llm.generate(p, **kw) for p in prompts]


def test_batch_equals_each_prompt_alone(llm):
    want = alone(llm, PROMPTS, max_tokens=12, ignore_eos=True)
    got = llm.generate_batch(PROMPTS, max_tokens=12, ignore_eos=True)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.text for r in got] == [r.text for r in want]
    assert all(r.finish_reason == "length" and r.timings.decode_tokens == 11 for r in got)


def test_sampled_requests_keep_their_own_seeds(llm):
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=10, ignore_eos=True) for s in (1, 2)
    ]
    want = [llm.generate(PROMPTS[1], params=p).token_ids for p in params]
    scheduler = Scheduler(llm)
    requests = [scheduler.submit(Request(PROMPTS[1], p)) for p in params]
    scheduler.run_until_idle()
    got = [drain(r.stream()).token_ids for r in requests]
    assert got == want and got[0] != got[1]


def test_prompts_prefill_in_chunks_beside_running_decodes(llm):
    """A 40-token prompt under a budget of 7 tokens a step takes several steps, while the
    other request keeps decoding one token a step, and both still equal their solo runs."""
    scheduler = Scheduler(llm, token_budget=7)
    short = scheduler.submit(Request([3], SamplingParams(max_tokens=8, ignore_eos=True)))
    scheduler.step()  # the short prompt is now decoding
    long_ = scheduler.submit(Request(PROMPTS[3], SamplingParams(max_tokens=4, ignore_eos=True)))
    steps = 1
    while scheduler.step():
        steps += 1
    assert steps >= len(PROMPTS[3]) // 6
    solo = alone(llm, [[3], PROMPTS[3]], max_tokens=8, ignore_eos=True)
    assert drain(short.stream()).token_ids == solo[0].token_ids
    assert drain(long_.stream()).token_ids == solo[1].token_ids[:4]


def test_chat_batch_equals_chat(llm):
    conversations = [[{"role": "user", "content": q}] for q in ("hello", "how are you", "x")]
    want = [llm.chat(c, max_tokens=8) for c in conversations]
    got = llm.chat_batch(conversations, max_tokens=8)
    assert [r.text for r in got] == [r.text for r in want]


def test_async_callers_share_batches_and_get_their_own_results(llm):
    want = alone(llm, PROMPTS, max_tokens=6, ignore_eos=True)

    async def run():
        async def stream(p):
            pieces = [piece async for piece in llm.astream(p, max_tokens=6, ignore_eos=True)]
            return "".join(pieces)

        results = await asyncio.gather(
            *(llm.agenerate(p, max_tokens=6, ignore_eos=True) for p in PROMPTS)
        )
        texts = await asyncio.gather(*(stream(p) for p in PROMPTS))
        return results, texts

    results, texts = asyncio.run(run())
    assert [r.token_ids for r in results] == [r.token_ids for r in want]
    assert texts == [r.text for r in want]


def test_cancelled_requests_free_their_pages(llm):
    baseline = llm.kv_stats()[0]
    scheduler = Scheduler(llm)
    kept = scheduler.submit(Request(PROMPTS[2], SamplingParams(max_tokens=20, ignore_eos=True)))
    dropped = scheduler.submit(Request(PROMPTS[3], SamplingParams(max_tokens=20, ignore_eos=True)))
    for _ in range(3):
        scheduler.step()
    assert llm.kv_stats()[0] > baseline
    scheduler.cancel(dropped)
    scheduler.run_until_idle()
    assert drain(dropped.stream()).finish_reason == "cancelled"
    assert drain(kept.stream()).finish_reason == "length"
    assert llm.kv_stats()[0] == baseline


def test_async_stream_left_early_cancels_its_request(llm):
    baseline = llm.kv_stats()[0]

    async def run():
        async for _ in llm.astream(PROMPTS[3], max_tokens=50, ignore_eos=True):
            break
        for _ in range(100):  # the scheduler thread frees the pages at its next step
            if llm.kv_stats()[0] == baseline:
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(run())


def test_full_pool_makes_requests_wait_and_a_full_queue_is_busy(converted):
    # Room for one request's worst case (prompt 8 + 8 new -> one 16-token page) at a time.
    llm = LLM(converted("llama", "f32"), kv_encoding="f32", threads=1, kv_capacity_tokens=16)
    scheduler = Scheduler(llm, max_queue=2)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    first, second = (scheduler.submit(Request(PROMPTS[0], params)) for _ in range(2))
    with pytest.raises(Busy, match="busy"):
        scheduler.submit(Request(PROMPTS[0], params))
    scheduler.step()
    assert len(scheduler.running) == 1 and len(scheduler.waiting) == 1  # waits for room
    scheduler.run_until_idle()
    a, b = drain(first.stream()), drain(second.stream())
    # The running request used all it reserved while the pool was full and another waited:
    # nothing preempted it or cut it short.
    assert a.finish_reason == "length" and len(a.token_ids) == 8
    assert a.token_ids == b.token_ids
    with pytest.raises(ContextOverflow, match="the pool holds 16"):
        scheduler.submit(Request(PROMPTS[1], params))


def drain(events):
    while True:
        try:
            next(events)
        except StopIteration as done:
            return done.value


@pytest.mark.parametrize(
    "prompt,done,budget,want",
    [
        (300, 0, 400, 300),  # it fits: all of it
        (300, 0, 250, 240),  # up to the last multiple of 16 within the budget
        (300, 240, 50, 48),  # from 240: up to 288, leaving 12
        (300, 288, 10, 0),  # no multiple of 16 within reach: wait for more room
        (20, 0, 16, 20),  # 16 would leave 4 (< 8 rows): all 20
        (40, 0, 7, 0),  # likewise (the step's first prompt then takes the budget: _batch)
    ],
)
def test_prefill_chunks_end_on_aligned_positions(prompt, done, budget, want):
    """Chunks end on multiples of 16 positions and leave no tail under 8 rows, so that a prompt
    prefilled in chunks gets the logits it gets in one step (see scheduler.CHUNK_ALIGN)."""
    request = Request(list(range(prompt)), SamplingParams())
    request.pending = request.ids[done:]
    assert _chunk_length(request, budget) == want


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """`quantized(scheme)` -> the llama fixture converted with `--quantize scheme` (cached)."""
    from cellm.convert import convert_hf
    from conftest import FIXTURES

    root = tmp_path_factory.mktemp("quantized")
    cache: dict[str, object] = {}

    def get(scheme: str):
        if scheme not in cache:
            cache[scheme] = convert_hf(
                FIXTURES / "llama", root / f"llama-{scheme}.cellm", "f32", quantize=scheme
            )
        return cache[scheme]

    return get


@pytest.mark.parametrize(
    "scheme,kv",
    [
        ("q4_1", "f16"),
        ("q8_0", "int8"),
        ("int8", "int4"),
        ("f32", "f32"),
        ("f16", "f16"),
        ("bf16", "f16"),
    ],
)
def test_a_decode_step_ignores_the_rest_of_the_batch(quantized, converted, scheme, kv):
    """Greedy results under load equal the request run alone only if a session's logits do
    not depend on which other sessions share its decode steps. Session A (a context of several
    KV pages) decodes 6 tokens alone, then again beside sessions of other lengths, in other
    batch positions: its logits must be bitwise equal (quantized weights with int8
    activations, compressed KV pages; 2 threads, so attention splits contexts), and with float
    weights (which the engine sums in one order for every decode step, whatever its size, and
    whose decoding sessions run apart from prompt chunks in a step that has both). The last
    company is a session decoding beside a 40-token prompt chunk in every step."""
    floats = ("f32", "f16", "bf16")
    path = converted("llama", scheme) if scheme in floats else quantized(scheme)
    engine = Engine(str(path), threads=2, kv_encoding=kv, prefix_cache=False)
    prompt = [(7 * i) % 250 + 3 for i in range(70)]
    others = [[(5 * i) % 200 + 3 for i in range(n)] for n in (9, 130, 33, 1)]

    def decode(company: list[list[int]], at: int, chunk: int = 0) -> list[np.ndarray]:
        a = engine.create_session()
        engine.step([(a, prompt)])
        rest = []
        for p in company:
            s = engine.create_session()
            engine.step([(s, p)])
            rest.append(s)
        token, out = 11, []
        for i in range(6):
            step_len = [chunk if j == 0 and chunk else 1 for j in range(len(rest))]
            batch = [
                (s, [3 + (i + j + k) % 50 for k in range(n)])
                for j, (s, n) in enumerate(zip(rest, step_len))
            ]
            batch.insert(at, (a, [token]))
            logits = engine.step(batch)[at]
            out.append(logits.copy())
            token = int(np.argmax(logits))
        for s in [a, *rest]:
            engine.free_session(s)
        return out

    alone = decode([], 0)
    for company, at, chunk in [(others[:1], 1, 0), (others, 0, 0), (others[1:3], 2, 0)] + [
        (others[:2], 1, 40)
    ]:
        got = decode(company, at, chunk)
        assert all(np.array_equal(g, w) for g, w in zip(got, alone)), (company, at, chunk)
