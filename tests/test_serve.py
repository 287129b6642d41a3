"""The OpenAI-compatible server (cellm.serve), driven by the official `openai` client against a
server this test starts on 127.0.0.1: answers equal the same request run alone, streams join
to the same text, bad requests get OpenAI error objects with 4xx codes, and 32 concurrent
streaming clients (some disconnecting) leave no pages behind."""

from __future__ import annotations

import asyncio
import random
import resource
import time
from types import SimpleNamespace

import numpy as np
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from starlette.testclient import TestClient  # noqa: E402

from cellm import LLM  # noqa: E402
from cellm.generation import GenerationResult  # noqa: E402
from cellm.scheduler import Scheduler  # noqa: E402
from cellm.serve import Server, build_app  # noqa: E402
from serve_helpers import serving  # noqa: E402


@pytest.fixture(scope="module")
def server(converted):
    llm = LLM(converted("llama", "f32"), kv_encoding="f32", threads=1)
    scheduler = Scheduler(llm, max_running=8)
    scheduler.start()
    with serving(build_app(llm, "tiny", scheduler)) as (url, port):
        yield SimpleNamespace(url=url, llm=llm, scheduler=scheduler, port=port)
    scheduler.close()


@pytest.fixture(scope="module")
def q4_1_server(tmp_path_factory):
    """The same server on the llama fixture quantized to q4_1 (int8 activations, f16 KV) on 2
    threads: a batched decode step there must give each session what it gets alone too."""
    from cellm.convert import convert_hf
    from conftest import FIXTURES

    path = convert_hf(
        FIXTURES / "llama", tmp_path_factory.mktemp("q4_1") / "q.cellm", "f32", quantize="q4_1"
    )
    llm = LLM(path, threads=2)
    scheduler = Scheduler(llm, max_running=8)
    scheduler.start()
    with serving(build_app(llm, "tiny", scheduler)) as (url, port):
        yield SimpleNamespace(url=url, llm=llm, scheduler=scheduler, port=port)
    scheduler.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=60)


MESSAGES = [{"role": "user", "content": "hello there"}]


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list()] == ["tiny"]
    health = TestClient(build_app(server.llm, "tiny", server.scheduler)).get("/health").json()
    assert health["status"] == "ok" and "kv_pages_in_use" in health


def test_chat_completion_equals_the_request_run_alone(client, server):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    want = server.llm.chat(MESSAGES, max_tokens=8)
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")
    assert r.usage.prompt_tokens == want.prompt_tokens
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.total_tokens == want.prompt_tokens + len(want.token_ids)


def test_streamed_chat_joins_to_the_same_text(client, server):
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == server.llm.chat(MESSAGES, max_tokens=8).text
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    # OpenAI's usage chunk: the last one, with no choices.
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_completions_with_stop_and_seed(client, server):
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=10, temperature=0)
    assert r.choices[0].text == server.llm.generate("hello", max_tokens=10).text
    streamed = client.completions.create(
        model="tiny", prompt="hello", max_tokens=10, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
    seeded = [
        client.completions.create(model="tiny", prompt="hello", max_tokens=10, seed=7)
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]
    stop = r.choices[0].text[3:6]
    if stop.strip():
        cut = client.completions.create(
            model="tiny", prompt="hello", max_tokens=10, temperature=0, stop=[stop]
        )
        assert cut.choices[0].text == r.choices[0].text[: r.choices[0].text.index(stop)]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": MESSAGES, "temperature": 5}, "temperature"),
        ({"messages": []}, "messages"),
        ({"messages": MESSAGES, "n": 0}, "n"),
        ({"messages": MESSAGES, "logit_bias": {"x": 1}}, "logit_bias"),
        ({"messages": MESSAGES, "logit_bias": {"5": 101}}, "logit_bias"),
        ({"messages": MESSAGES, "presence_penalty": 2.5}, "presence_penalty"),
        ({"messages": MESSAGES, "top_logprobs": 3}, "top_logprobs"),
        ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
        ({"messages": MESSAGES, "stop": 3}, "stop"),
        ({"messages": MESSAGES, "tools": [{"function": {"name": "a"}}] * 2}, "tools"),
        ({"messages": MESSAGES, "response_format": {"type": "yaml"}}, "response_format"),
        (
            {
                "messages": MESSAGES,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strin"}},
                },
            },
            "response_format",
        ),
    ],
)
def test_bad_requests_get_openai_errors(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", **body)
    assert e.value.status_code == 400 and e.value.body["param"] == param


def test_response_format_constrains_chats_and_streams(client):
    import json

    import jsonschema

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "n": {"enum": [1, 2, 3]}},
        "required": ["city", "n"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    for seed in range(3):
        answer = client.chat.completions.create(
            model="tiny", messages=MESSAGES, seed=seed, max_tokens=100, response_format=fmt
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
    chunks = client.chat.completions.create(
        model="tiny", messages=MESSAGES, seed=7, response_format=fmt, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)


def test_malformed_json_too_long_prompts_and_a_full_queue(server):
    http = TestClient(build_app(server.llm, "tiny", server.scheduler))
    bad = http.post("/v1/chat/completions", content=b"{nope")
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    long = http.post("/v1/completions", json={"prompt": list(range(5)) * 1000})
    assert long.status_code == 400 and "context length" in long.json()["error"]["message"]
    assert http.get("/v1/nothing").status_code == 404
    full = Scheduler(server.llm, max_queue=0)  # never started: its queue is always full
    busy = TestClient(build_app(server.llm, "tiny", full)).post(
        "/v1/completions", json={"prompt": "hi"}
    )
    assert busy.status_code == 429 and busy.json()["error"]["type"] == "server_busy"


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    from cellm import Embedder
    from cellm.convert import convert_hf
    from conftest import ROOT

    bert = ROOT / "tests" / "fixtures" / "mm" / "bert"
    return Embedder(convert_hf(bert, tmp_path_factory.mktemp("bert") / "b.cellm", "f32"))


def test_embeddings_equal_the_embedder_in_both_encodings(server, embedder):
    """/v1/embeddings through the openai client (which asks for base64) and as float lists:
    the same float32 values Embedder.embed gives, in input order, with token usage."""
    texts = ["The cat sat on the mat.", "Zürich, é, 東", "cook"]
    app = build_app(server.llm, "tiny", server.scheduler, None, embedder, "bert")
    want = embedder.embed(texts)
    with serving(app) as (url, _):
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        got = client.embeddings.create(model="bert", input=texts)
        assert [d.index for d in got.data] == [0, 1, 2] and got.model == "bert"
        assert np.array_equal(np.array([d.embedding for d in got.data], np.float32), want)
        n_tokens = sum(len(x) for x in embedder.token_ids(texts))
        assert got.usage.prompt_tokens == got.usage.total_tokens == n_tokens
        one = client.embeddings.create(model="bert", input="cook", encoding_format="float")
        alone = embedder.embed(["cook"])[0]  # a batch of one: sums in another order
        assert np.array_equal(np.array(one.data[0].embedding, np.float32), alone)
        assert [m.id for m in client.models.list().data] == ["tiny", "bert"]


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"input": ""}, "input", "input 0 is empty"),
        ({"input": ["a", "  "]}, "input", "input 1 is empty"),
        ({"input": []}, "input", "non-empty list of strings"),
        ({"input": [1, 2]}, "input", "non-empty list of strings"),
        ({"input": " ".join(["cat"] * 100)}, "input", "102 tokens, more than the model's 64"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format", "float or base64"),
        ({"input": "a", "dimensions": 8}, "dimensions", "32 dimensions"),
    ],
)
def test_bad_embedding_requests_get_400(server, embedder, body, param, words):
    http = TestClient(build_app(server.llm, "tiny", server.scheduler, None, embedder, "bert"))
    r = http.post("/v1/embeddings", json=body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and words in error["message"]


def test_embeddings_without_an_embedding_model_are_404(server):
    r = TestClient(build_app(server.llm, "tiny", server.scheduler)).post(
        "/v1/embeddings", json={"input": "a"}
    )
    assert r.status_code == 404 and "--embedding-model" in r.json()["error"]["message"]


def test_tool_calls_come_back_in_openai_form(server):
    from cellm.families import by_architecture
    from cellm.tool_formats import FORMATS

    gemma_like = SimpleNamespace(
        split_tool_calls=lambda r: FORMATS[by_architecture("gemma3").tool_call_format].parse(
            r.text, None
        )
    )
    answer = (
        "ok <start_function_call>call:get_weather{city:<escape>Accra<escape>}<end_function_call>"
    )
    choice = Server(gemma_like, "tiny", server.scheduler)._choice(  # type: ignore[arg-type]
        GenerationResult(answer, [1], "stop", 3), chat=True, with_tools=True
    )
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "ok"
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert call["function"]["arguments"] == '{"city": "Accra"}'


@pytest.mark.parametrize("which", ["server", "q4_1_server"])
def test_32_concurrent_streaming_clients_with_disconnects(which, request):
    """Random prompt lengths, a quarter of the clients leave mid-stream: every completed answer
    equals the request alone, nothing fails, the pool returns to its baseline and RSS stays
    bounded. On the f32 fixture and on its q4_1 quantization."""
    server = request.getfixturevalue(which)
    rng = random.Random(0)
    jobs = [
        ([rng.randrange(3, 900) for _ in range(rng.randrange(1, 60))], rng.random() < 0.25)
        for _ in range(32)
    ]
    baseline = server.llm.kv_stats()[0]
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    aclient = openai.AsyncOpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)

    async def one(prompt, leave):
        stream = await aclient.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
        pieces = []
        async for chunk in stream:
            pieces.append(chunk.choices[0].text)
            if leave and len(pieces) >= 2:
                await stream.close()
                return None
        return "".join(pieces)

    async def run():
        return await asyncio.wait_for(asyncio.gather(*(one(p, leave) for p, leave in jobs)), 240)

    texts = asyncio.run(run())
    for (prompt, leave), text in zip(jobs, texts):
        if not leave:
            assert text == server.llm.generate(prompt, max_tokens=12).text
    deadline = time.monotonic() + 10
    while server.llm.kv_stats()[0] != baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.llm.kv_stats()[0] == baseline
    assert not server.scheduler.running and not server.scheduler.waiting
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert grown_mib < 200, grown_mib
