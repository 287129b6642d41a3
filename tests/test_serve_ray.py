"""The server as a Ray Serve deployment (cellm.serve_ray, the `ray` extra): a local Ray
instance runs two replicas of the tiny fixture model, and the official `openai` client talks to
them through Serve's HTTP proxy on 127.0.0.1. Answers equal the same request run alone (greedy),
streams join to the same text, and both replicas answer."""

from __future__ import annotations

import json
import os
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
ray = pytest.importorskip(
    "ray", reason='Ray is not installed (the optional `ray` extra: pip install "cellm[ray]")'
)
serve = pytest.importorskip("ray.serve", reason="Ray is installed without Serve (ray[serve])")

from cellm import LLM  # noqa: E402
from cellm.serve_ray import application  # noqa: E402
from serve_helpers import free_port  # noqa: E402

MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def deployed(converted):
    path = str(converted("llama", "f32"))
    config = {
        "model": path,
        "model_name": "tiny",
        "max_sessions": 4,
        "llm": {"kv_encoding": "f32", "threads": 1},
    }
    port = free_port()
    # A local instance of its own (not a cluster the machine may run), nothing else started.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        num_cpus=2, include_dashboard=False, log_to_driver=False, address="local", namespace="t"
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # Two replicas on the one local node (in production, one per node).
        app = application(config, replicas=2, replicas_per_node=None, cpus_per_replica=0.5)
        serve.run(app, name="cellm", route_prefix="/")
        yield f"http://127.0.0.1:{port}", LLM(path, kv_encoding="f32", threads=1)
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def client(deployed):
    url, _ = deployed
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_two_replicas_serve_the_openai_routes(deployed, client):
    url, llm = deployed
    status = serve.status().applications["cellm"].deployments["cellm"]
    assert status.replica_states.get("RUNNING") == 2, status
    assert [m.id for m in client.models.list()] == ["tiny"]
    pids = set()
    for _ in range(40):
        with urllib.request.urlopen(url + "/health", timeout=60) as r:
            pids.add(json.loads(r.read())["pid"])
        if len(pids) == 2:
            break
    assert len(pids) == 2, "every request went to one replica"


def test_answers_equal_the_request_run_alone(deployed, client):
    _, llm = deployed
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == llm.chat(MESSAGES, max_tokens=8).text
    prompt = [5, 17, 300, 42]
    c = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
    assert c.choices[0].text == llm.generate(prompt, max_tokens=10).text


def test_streams_through_serve_join_to_the_same_text(deployed, client):
    _, llm = deployed
    chunks = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == llm.chat(MESSAGES, max_tokens=8).text


def test_bad_requests_get_openai_errors_through_serve(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[], max_tokens=4)
    assert e.value.status_code == 400
