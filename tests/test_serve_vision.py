"""Images through the OpenAI-compatible server (cellm.serve) on the Idefics3 fixture, with the
official `openai` client: `image_url` parts holding data: URLs give the answer of the same chat
run alone (itself checked against HF in test_vision_api.py); local files are read only under
`--image-root`, and every other image source is a 400 with one clear message."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from starlette.testclient import TestClient  # noqa: E402

from cellm import LLM  # noqa: E402
from cellm.convert import convert_hf  # noqa: E402
from cellm.scheduler import Scheduler  # noqa: E402
from cellm.serve import build_app  # noqa: E402
from serve_helpers import serving  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures"
IMAGES = FIXTURES / "images"
BIRD = IMAGES / "bird.jpg"
DATA_URL = "data:image/jpeg;base64," + base64.b64encode(BIRD.read_bytes()).decode()


def ask(url: str, text: str = "What is in this image?") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = convert_hf(FIXTURES / "mm" / "idefics3", tmp_path_factory.mktemp("vlm") / "m.cellm")
    llm = LLM(path, kv_encoding="f32", threads=1)
    scheduler = Scheduler(llm, max_running=4)
    scheduler.start()
    with serving(build_app(llm, "vlm", scheduler)) as (url, _):
        yield SimpleNamespace(url=url, llm=llm, scheduler=scheduler)
    scheduler.close()


def test_image_url_data_urls_answer_as_the_chat_alone(vlm):
    client = openai.OpenAI(base_url=vlm.url, api_key="none", max_retries=0, timeout=60)
    want = vlm.llm.chat(ask(DATA_URL), max_tokens=8)
    r = client.chat.completions.create(
        model="vlm", messages=ask(DATA_URL), max_tokens=8, temperature=0
    )
    assert r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == want.prompt_tokens
    ref = json.loads((FIXTURES / "mm" / "idefics3" / "reference.json").read_text())
    assert want.prompt_tokens == len(ref["input_ids"])  # the image's tokens are in the prompt
    chunks = client.chat.completions.create(
        model="vlm", messages=ask(DATA_URL), max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text


def test_concurrent_image_and_text_requests_each_get_their_own_answer(vlm):
    import asyncio

    aclient = openai.AsyncOpenAI(base_url=vlm.url, api_key="none", max_retries=0, timeout=60)
    conversations = [ask(DATA_URL), [{"role": "user", "content": "Hello there"}]] * 2

    async def one(messages):
        r = await aclient.chat.completions.create(
            model="vlm", messages=messages, max_tokens=6, temperature=0
        )
        return r.choices[0].message.content

    async def run():
        return await asyncio.gather(*(one(m) for m in conversations))

    texts = asyncio.run(run())
    assert texts == [vlm.llm.chat(m, max_tokens=6).text for m in conversations]


@pytest.mark.parametrize(
    "url, message",
    [
        (str(BIRD), "must be sent as data: URLs"),
        ("file://" + str(BIRD), "must be sent as data: URLs"),
        ("https://example.invalid/bird.jpg", "only data: URLs and file paths"),
        ("data:image/jpeg;base64,%%%", "invalid base64"),
        ("data:image/jpeg;base64," + base64.b64encode(b"not an image").decode(), "not an image"),
    ],
)
def test_other_image_sources_are_400s(vlm, url, message):
    http = TestClient(build_app(vlm.llm, "vlm", vlm.scheduler))
    r = http.post("/v1/chat/completions", json={"messages": ask(url), "max_tokens": 2})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.json()
    plain = {"role": "user", "content": [{"type": "image", "image": str(BIRD)}]}
    r = http.post("/v1/chat/completions", json={"messages": [plain], "max_tokens": 2})
    assert r.status_code == 400 and "data: URLs" in r.json()["error"]["message"]


def test_an_image_root_allows_the_files_under_it_only(vlm, tmp_path):
    outside = tmp_path / "secret.jpg"
    outside.write_bytes(BIRD.read_bytes())
    http = TestClient(build_app(vlm.llm, "vlm", vlm.scheduler, image_root=str(IMAGES)))
    want = vlm.llm.chat(ask(DATA_URL), max_tokens=4).text
    for url in ["bird.jpg", str(BIRD), "file://" + str(BIRD)]:
        r = http.post(
            "/v1/chat/completions", json={"messages": ask(url), "max_tokens": 4, "temperature": 0}
        )
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want
    for url in [str(outside), "../mm/idefics3/config.json", "/etc/hostname"]:
        r = http.post(
            "/v1/chat/completions", json={"messages": ask(url), "max_tokens": 4, "temperature": 0}
        )
        assert r.status_code == 400, r.json()
        assert "outside the server's image root" in r.json()["error"]["message"]


def test_a_text_model_answers_an_image_with_400(converted):
    llm = LLM(converted("llama", "f32"), threads=1)
    scheduler = Scheduler(llm)
    http = TestClient(build_app(llm, "tiny", scheduler))
    r = http.post("/v1/chat/completions", json={"messages": ask(DATA_URL), "max_tokens": 2})
    assert r.status_code == 400 and "text-only model" in r.json()["error"]["message"]


def test_an_image_root_that_is_not_a_directory_is_exit_2(capsys):
    from cellm.serve import main

    with pytest.raises(SystemExit) as e:
        main(["--model", "unused", "--image-root", "/no/such/dir"])
    assert e.value.code == 2
    assert "--image-root /no/such/dir: not a directory" in capsys.readouterr().err
