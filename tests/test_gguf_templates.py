"""Real chat templates (llama.cpp's models/templates/*.jinja) render through cellm's renderer.

The templates come from the pinned llama-cpp-python sdist, fetched once into the cache by
tools/fetch_llama_cpp_vectors.py; the tests skip only if that download fails.

Templates that need something other than the standard conversation:
* google-gemma-2-2b-it: refuses a system message by design (raise_exception), so it gets
  user/assistant/user.
* *-tool_use (Cohere command-r-plus, Hermes 2 Pro, Hermes 3): iterate ``tools`` unconditionally
  (transformers fails the same way without tools), so they are rendered with tools only.
* fireworks-ai-llama-3-firefunction-v2: reads its function list from a ``functions`` variable
  (a JSON string) and the date from ``datetime``, passed as extra variables.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from functools import lru_cache
from pathlib import Path

import pytest

from cellm.chat import render_chat_template
from cellm.errors import TemplateError

TOOLS = Path(__file__).resolve().parent.parent / "tools"

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
CONVERSATION = [
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi there. How can I help?"},
    {"role": "user", "content": "What is the weather in Paris?"},
]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name"}},
            "required": ["city"],
        },
    },
}

NO_SYSTEM_ROLE = {"google-gemma-2-2b-it"}
TOOLS_REQUIRED = {
    "CohereForAI-c4ai-command-r-plus-tool_use",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
}
EXTRA = {
    "fireworks-ai-llama-3-firefunction-v2": {
        "functions": json.dumps([WEATHER_TOOL["function"]]),
        "datetime": "2025-01-01",
    },
}


def _fetch_tool():
    name = "fetch_llama_cpp_vectors"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@lru_cache(maxsize=1)
def _templates() -> list[Path] | str:
    try:
        root = _fetch_tool().fetch()
    except Exception as e:  # no network, proxy, disk full...
        return f"llama.cpp chat templates could not be downloaded: {type(e).__name__}: {e}"
    return sorted((root / "models" / "templates").glob("*.jinja"))


def _params(with_tools: bool) -> list:
    found = _templates()
    if isinstance(found, str):
        return [pytest.param(None, marks=pytest.mark.skip(reason=found), id="no-templates")]
    return [
        pytest.param(p, id=p.stem)
        for p in found
        if not with_tools or re.search(r"\btools\b", p.read_text(encoding="utf-8"))
    ]


def _messages(name: str) -> list[dict[str, str]]:
    return list(CONVERSATION) if name in NO_SYSTEM_ROLE else [SYSTEM, *CONVERSATION]


def _render(path: Path, tools: list | None) -> str:
    return render_chat_template(
        path.read_text(encoding="utf-8"),
        _messages(path.stem),
        add_generation_prompt=True,
        bos_token="<s>",
        eos_token="</s>",
        tools=tools,
        extra=EXTRA.get(path.stem),
    )


def test_enough_templates():
    found = _templates()
    if isinstance(found, str):
        pytest.skip(found)
    assert len(found) >= 50


@pytest.mark.parametrize("path", _params(with_tools=False))
def test_template_renders(path: Path):
    tools = [WEATHER_TOOL] if path.stem in TOOLS_REQUIRED else None
    out = _render(path, tools)
    for message in _messages(path.stem):
        assert message["content"] in out


@pytest.mark.parametrize("path", _params(with_tools=True))
def test_template_renders_tools(path: Path):
    out = _render(path, [WEATHER_TOOL])
    assert "get_weather" in out
    assert CONVERSATION[-1]["content"] in out


def test_gemma2_refuses_a_system_message():
    found = _templates()
    if isinstance(found, str):
        pytest.skip(found)
    (path,) = [p for p in found if p.stem == "google-gemma-2-2b-it"]
    with pytest.raises(TemplateError, match="System role not supported"):
        render_chat_template(path.read_text(encoding="utf-8"), [SYSTEM, *CONVERSATION])


# -- the two renderer features these templates needed (python/cellm/chat.py) ----------------


def test_generation_block_renders_its_body():
    # transformers' {% generation %} tag (assistant-token masks): rendering, just the body.
    template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
        "{{ m.content }}{% endgeneration %}{% else %}[{{ m.content }}]{% endif %}{% endfor %}"
    )
    out = render_chat_template(template, CONVERSATION, add_generation_prompt=False)
    assert out == "[Hello!]Hi there. How can I help?[What is the weather in Paris?]"


def test_tojson_accepts_filter_generators():
    out = render_chat_template(
        "{{ tools | map(attribute='function') | map(attribute='name') | tojson }}",
        CONVERSATION,
        tools=[WEATHER_TOOL],
    )
    assert out == '["get_weather"]'
