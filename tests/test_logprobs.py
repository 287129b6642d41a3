"""Log-probabilities and OpenAI's sampling knobs (presence/frequency penalties, logit_bias, n)
on the llama fixture, checked against a float64 numpy transcription written here over the
logits `LLM.logits` returns for the same positions (a full prefill, not the decode steps that
produced the tokens)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cellm import LLM, InvalidArgument, SamplingParams

# The decode path (one token per step over the KV cache) and a full prefill sum in different
# orders; on the f32 fixture their logits differ by ~1e-6, far below this.
ATOL = 1e-4
PROMPT = [1, 5, 9, 200, 31, 7]


@pytest.fixture(scope="module")
def llm(converted):
    return LLM(converted("llama", "f32"), kv_encoding="f32", threads=1)


def reference_log_softmax(row: np.ndarray) -> np.ndarray:
    x = row.astype(np.float64)
    return x - np.logaddexp.reduce(x)


def reference_rows(llm, result, adjust=lambda row, generated: row):
    """log_softmax of the logits at each generated position, after `adjust` (given the
    tokens generated before it)."""
    ids = PROMPT + result.token_ids[:-1]
    logits = llm.logits(ids)[len(PROMPT) - 1 :, : llm.tokenizer.vocab_size]
    return [
        reference_log_softmax(adjust(logits[i], result.token_ids[:i]))
        for i in range(len(result.token_ids))
    ]


def check(result, rows, k):
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
    for entry, token, ref in zip(result.logprobs, result.token_ids, rows):
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(ref[token], abs=ATOL)
        assert len(entry.top_logprobs) == k
        values = [lp for _, lp in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        # The k best of the reference, by value (ids may swap only within a near-tie).
        np.testing.assert_allclose(values, np.sort(ref)[::-1][:k], atol=ATOL)
        for alt, lp in entry.top_logprobs:
            assert lp == pytest.approx(ref[alt], abs=ATOL)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_are_log_softmax_of_the_logits(llm, temperature):
    # Before temperature and truncation: the same numbers whatever those are.
    r = llm.generate(
        PROMPT,
        temperature=temperature,
        top_k=3,
        seed=0,
        max_tokens=8,
        ignore_eos=True,
        logprobs=True,
        top_logprobs=5,
    )
    check(r, reference_rows(llm, r), 5)


def test_logprobs_follow_the_penalties_and_logit_bias(llm):
    presence, frequency, bias = 0.7, 0.4, {11: 3.0, 40: -2.5}

    def adjust(row, generated):
        out = row.astype(np.float64).copy()
        for token in set(generated):
            out[token] -= presence + frequency * generated.count(token)
        for token, b in bias.items():
            out[token] += b
        return out

    r = llm.generate(
        PROMPT,
        temperature=1.0,
        seed=3,
        max_tokens=12,
        ignore_eos=True,
        presence_penalty=presence,
        frequency_penalty=frequency,
        logit_bias=bias,
        logprobs=True,
        top_logprobs=2,
    )
    check(r, reference_rows(llm, r, adjust), 2)


def test_frequency_penalty_breaks_greedy_repetition(llm):
    plain = llm.generate(PROMPT, max_tokens=24, ignore_eos=True)
    penalised = llm.generate(PROMPT, max_tokens=24, ignore_eos=True, frequency_penalty=2.0)
    assert max(np.bincount(penalised.token_ids)) <= max(np.bincount(plain.token_ids))
    rows = reference_rows(
        llm,
        penalised,
        lambda row, gen: row - 2.0 * np.bincount(gen, minlength=row.size)[: row.size],
    )
    # Each greedy pick is the argmax of the penalised distribution.
    assert [int(np.argmax(r)) for r in rows] == penalised.token_ids


def test_logit_bias_forces_and_bans(llm):
    forced = llm.generate(PROMPT, max_tokens=5, ignore_eos=True, logit_bias={77: 100})
    assert forced.token_ids == [77] * 5
    greedy = llm.generate(PROMPT, max_tokens=1)
    banned = llm.generate(PROMPT, max_tokens=1, logit_bias={greedy.token_ids[0]: -100})
    assert banned.token_ids != greedy.token_ids


def test_streamed_pieces_carry_their_tokens_logprobs(llm):
    stream = llm.stream(PROMPT, max_tokens=10, ignore_eos=True, logprobs=True)
    carried = []
    try:
        while True:
            carried.extend(next(stream).logprobs)
    except StopIteration as done:
        result = done.value
    assert carried == result.logprobs


@pytest.mark.parametrize(
    "settings",
    [
        {"presence_penalty": 2.5},
        {"frequency_penalty": "1"},
        {"logit_bias": {-1: 5}},
        {"logit_bias": {3: 101}},
        {"logit_bias": {10**6: 1}},  # outside the vocabulary
        {"top_logprobs": 2},  # without logprobs
        {"logprobs": True, "top_logprobs": 21},
    ],
)
def test_bad_knobs_fail_before_any_step(llm, settings):
    pages = llm.kv_stats()[1]
    with pytest.raises(InvalidArgument):
        llm.generate(PROMPT, **settings)
    assert llm.kv_stats()[1] == pages


# -- the server ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def http(llm):
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from cellm.scheduler import Scheduler
    from cellm.serve import build_app

    scheduler = Scheduler(llm, max_running=8)
    scheduler.start()
    yield TestClient(build_app(llm, "tiny", scheduler))
    scheduler.close()


def test_server_logprobs_are_the_library_s(llm, http):
    want = llm.generate(PROMPT, max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=3)
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 3}
    got = http.post("/v1/completions", json=body).json()
    lp = got["choices"][0]["logprobs"]
    n = len(lp["token_logprobs"])
    assert lp["token_logprobs"] == pytest.approx([e.logprob for e in want.logprobs[:n]])
    assert [len(t) for t in lp["top_logprobs"]] == [3] * n
    # Every token is listed, special ones too (the text skips those).
    assert "".join(lp["tokens"]) == llm.tokenizer.decode(want.token_ids[:n], False)
    assert lp["text_offset"][0] == 0

    messages = [{"role": "user", "content": "hi"}]
    chat = {"messages": messages, "max_tokens": 6, "temperature": 0}
    want = llm.chat(messages, max_tokens=6, logprobs=True, top_logprobs=2)
    got = http.post(
        "/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 2}
    ).json()
    content = got["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == pytest.approx([e.logprob for e in want.logprobs])
    assert bytes(sum((c["bytes"] for c in content), [])).decode() == want.text
    assert all(len(c["top_logprobs"]) == 2 for c in content)
    # Streamed: the same entries, spread over the chunks.
    streamed = []
    with http.stream(
        "POST", "/v1/chat/completions", json={**chat, "logprobs": True, "stream": True}
    ) as events:
        for line in events.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    streamed += (choice.get("logprobs") or {}).get("content") or []
    assert [c["logprob"] for c in streamed] == pytest.approx([e.logprob for e in want.logprobs])


def test_server_n_choices_are_seeded_runs(llm, http):
    body = {"prompt": "hello", "max_tokens": 6, "temperature": 1.0, "seed": 5, "n": 3}
    got = http.post("/v1/completions", json=body).json()
    texts = [c["text"] for c in sorted(got["choices"], key=lambda c: c["index"])]
    want = [llm.generate("hello", max_tokens=6, temperature=1.0, seed=5 + i).text for i in range(3)]
    assert texts == want
    assert got["usage"]["completion_tokens"] == sum(
        len(llm.generate("hello", max_tokens=6, temperature=1.0, seed=5 + i).token_ids)
        for i in range(3)
    )
    joined = ["", ""]
    with http.stream("POST", "/v1/completions", json={**body, "n": 2, "stream": True}) as events:
        for line in events.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    joined[choice["index"]] += choice["text"]
    assert joined == want[:2]


def test_server_penalties_match_the_library(llm, http):
    knobs = {"presence_penalty": 1.5, "frequency_penalty": 0.5, "logit_bias": {"77": 4}}
    got = http.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **knobs}
    ).json()
    want = llm.generate(
        PROMPT,
        max_tokens=8,
        presence_penalty=1.5,
        frequency_penalty=0.5,
        logit_bias={77: 4},
        params=SamplingParams(),
    )
    assert got["choices"][0]["text"] == want.text
