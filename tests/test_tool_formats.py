"""Tool calls in each family's format (cellm.tool_formats).

Parsing is checked on what the models' real chat templates write (tests/fixtures/chat_templates:
Qwen2.5, Qwen3 and Llama 3.3 render an assistant's `tool_calls` themselves: the parser must give
back the calls the template was given) and on the formats' documented examples (Granite's and
LFM2's templates only describe theirs). The format is chosen from the template's markers, else
the family. `tool_choice` grammars are checked by sampling at temperature 1 from random-weight
fixtures: every output parses into a call whose arguments validate (jsonschema) against the
tool's parameters."""

from __future__ import annotations

import json
import shutil

import jsonschema
import pytest

from cellm import LLM, InvalidArgument
from cellm.chat import render_chat_template
from cellm.structured import TokenConstraint, grammar_for
from cellm.tool_formats import FORMATS, format_for
from conftest import FIXTURES, ROOT

TEMPLATES = ROOT / "tests" / "fixtures" / "chat_templates"


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


@pytest.mark.parametrize(
    "name, expected",
    [
        ("qwen2.5-coder-0.5b-instruct", "hermes"),
        ("qwen3-0.6b", "hermes"),
        ("llama-3.3-70b-instruct", "llama3"),
        ("granite-3.3-2b-instruct", "granite"),
        ("lfm2-350m", "lfm2"),
    ],
)
def test_the_format_comes_from_the_template(name, expected):
    assert format_for(template(name), None).name == expected
    # A template's markers win over the family's default.
    assert format_for(template(name), "functiongemma").name == expected


def test_without_markers_the_family_decides(converted):
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert format_for(plain, "lfm2").name == "lfm2" and format_for(plain, None) is None
    assert LLM(converted("lfm2", "f32")).tool_format.name == "lfm2"
    assert LLM(converted("gemma3", "f32")).tool_format.name == "functiongemma"
    assert LLM(converted("llama", "f32")).tool_format is None


WEATHER = {"city": "Accra", "days": 3, "units": "metric", "hourly": False}
LOOKUP = {"query": 'tallest "building", in Ghana', "limit": 5}


def rendered_answer(text: str, start: str, end: str) -> str:
    """The last assistant turn a template wrote: from `start` to `end`."""
    head = text.rindex(start) + len(start)
    return text[head : text.index(end, head)]


def tool_call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-instruct", "qwen3-0.6b"])
def test_qwen_templates_calls_parse_back(name):
    messages = [
        {"role": "user", "content": "Weather in Accra, and the tallest building?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [tool_call("get_weather", WEATHER), tool_call("lookup", LOOKUP)],
        },
    ]
    text = render_chat_template(template(name), messages, add_generation_prompt=False)
    answer = rendered_answer(text, "<|im_start|>assistant\n", "<|im_end|>")
    content, calls = format_for(template(name), None).parse(answer, None)
    assert calls == [
        {"name": "get_weather", "arguments": WEATHER},
        {"name": "lookup", "arguments": LOOKUP},
    ]
    # Qwen3's template writes an (empty) reasoning block first: that is text, not a call.
    assert content.split("</think>")[-1].strip() == "Let me look."


@pytest.mark.parametrize("builtin", [False, True])
def test_llama3_templates_calls_parse_back(builtin):
    tpl = template("llama-3.3-70b-instruct")
    name, arguments = (
        ("brave_search", {"query": "Accra weather"}) if builtin else ("get_weather", WEATHER)
    )
    messages = [
        {"role": "user", "content": "Weather in Accra?"},
        {"role": "assistant", "content": "", "tool_calls": [tool_call(name, arguments)]},
    ]
    extra = {"builtin_tools": ["brave_search"]} if builtin else {}
    text = render_chat_template(tpl, messages, add_generation_prompt=False, extra=extra)
    end = "<|eom_id|>" if builtin else "<|eot_id|>"
    answer = rendered_answer(text, "<|start_header_id|>assistant<|end_header_id|>\n\n", end)
    assert answer.startswith("<|python_tag|>") == builtin
    assert format_for(tpl, None).parse(answer, None) == (
        "",
        [{"name": name, "arguments": arguments}],
    )


def test_llama3_calls_separated_by_semicolons_and_plain_answers():
    parse = FORMATS["llama3"].parse
    text = '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    assert parse(text, None) == (
        "",
        [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}],
    )
    # An answer that merely contains JSON, or a JSON value that is not a call, is text.
    for answer in ['The call {"name": "a", "parameters": {}} is it.', '{"x": 1}', "[1, 2]"]:
        assert parse(answer, None) == (answer, [])


def test_granite_documented_format():
    # Granite's template: "respond only with <|tool_call|> followed by a JSON list of tools".
    parse = format_for(template("granite-3.3-2b-instruct"), None).parse
    text = (
        '<|tool_call|>[{"name": "get_weather", "arguments": '
        + json.dumps(WEATHER)
        + "}, "
        + ('{"name": "lookup", "arguments": ' + json.dumps(LOOKUP) + "}]")
    )
    assert parse(text, None) == (
        "",
        [{"name": "get_weather", "arguments": WEATHER}, {"name": "lookup", "arguments": LOOKUP}],
    )
    assert parse("<|tool_call|>[{oops", None) == ("<|tool_call|>[{oops", [])


def test_lfm2_model_card_example():
    # The example conversation of LFM2's model card, its assistant turn verbatim.
    answer = (
        '<|tool_call_start|>[get_candidate_status(candidate_id="12345")]<|tool_call_end|>'
        "Checking the current status of candidate ID 12345."
    )
    parse = format_for(template("lfm2-350m"), None).parse
    assert parse(answer, None) == (
        "Checking the current status of candidate ID 12345.",
        [{"name": "get_candidate_status", "arguments": {"candidate_id": "12345"}}],
    )
    several = (
        "<|tool_call_start|>[get_weather(city='Accra', days=3, units=\"metric\", hourly=False), "
        'lookup(query="tallest \\"building\\", in Ghana", limit=5)]<|tool_call_end|>'
    )
    assert parse(several, None)[1] == [
        {"name": "get_weather", "arguments": WEATHER},
        {"name": "lookup", "arguments": LOOKUP},
    ]
    # JSON payloads in the same markers are read too; anything else stays text.
    assert parse(
        '<|tool_call_start|>{"name": "f", "arguments": {"a": [1]}}<|tool_call_end|>', None
    )[1] == [{"name": "f", "arguments": {"a": [1]}}]
    for bad in [
        "<|tool_call_start|>[f(1)]<|tool_call_end|>",
        "<|tool_call_start|>[f(x=y)]<|tool_call_end|>",
    ]:
        assert parse(bad, None) == (bad, [])


def test_hermes_malformed_blocks_stay_text():
    parse = FORMATS["hermes"].parse
    text = 'a <tool_call>\n{"name": "f", "arguments": {\n</tool_call> b'
    assert parse(text, None) == (text, [])
    # A last block cut before its closing tag (max_tokens, a stop) still counts when whole.
    assert parse('<tool_call>\n{"name": "f", "arguments": {"k": "v"}}\n', None) == (
        "",
        [{"name": "f", "arguments": {"k": "v"}}],
    )


# -- tool_choice: the grammar forces a well-formed call ------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 10},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    "metric": {"type": "boolean"},
                },
                "required": ["city", "days"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "set_alarm",
            "parameters": {
                "type": "object",
                "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
                "required": ["hour"],
            },
        },
    },
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module", params=["qwen2", "gemma3"])
def tiny(request, converted):
    return LLM(converted(request.param, "f32"), kv_encoding="f32", threads=1)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_forced_calls_parse_and_validate(tiny, fmt):
    fmt = FORMATS[fmt]
    # One call: a random model never chooses to stop adding parallel calls.
    grammar = fmt.grammar(TOOLS, tiny.tokenizer, False)
    for seed in range(4):
        r = tiny.generate("Call:", grammar=grammar, temperature=1.0, seed=seed, max_tokens=150)
        assert r.finish_reason == "stop", r.text
        _, calls = fmt.parse(r.text, None)
        assert calls, r.text
        for call in calls:
            jsonschema.validate(call["arguments"], PARAMS[call["name"]])


@pytest.fixture(scope="module")
def qwen_templated(tmp_path_factory):
    """The qwen2 fixture's weights under Qwen2.5's real chat template."""
    from cellm.convert import convert_hf

    work = tmp_path_factory.mktemp("qwen-templated")
    source = work / "checkpoint"
    shutil.copytree(FIXTURES / "qwen2", source)
    shutil.copy(TEMPLATES / "qwen2.5-coder-0.5b-instruct.jinja", source / "chat_template.jinja")
    config = json.loads((source / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (source / "tokenizer_config.json").write_text(json.dumps(config))
    return LLM(convert_hf(source, work / "model.cellm", "f32"), kv_encoding="f32", threads=1)


def test_chat_tool_choice_required_and_named(qwen_templated):
    llm = qwen_templated
    assert llm.tool_format.name == "hermes"
    messages = [{"role": "user", "content": "Weather in Accra?"}]
    for seed, choice in enumerate(
        ["required", "set_alarm", {"type": "function", "function": {"name": "get_weather"}}]
    ):
        r = llm.chat(messages, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=seed)
        assert r.tool_calls and r.text == ""
        for call in r.tool_calls:
            jsonschema.validate(call["arguments"], PARAMS[call["name"]])
        if choice != "required":
            wanted = choice if isinstance(choice, str) else choice["function"]["name"]
            assert {c["name"] for c in r.tool_calls} == {wanted}
    streamed = llm.stream_chat(
        messages, tools=TOOLS, tool_choice="required", seed=1, temperature=1.0
    )
    try:
        while True:
            next(streamed)
    except StopIteration as done:
        assert done.value.tool_calls


@pytest.mark.parametrize(
    "tools, tool_choice, message",
    [
        (TOOLS + TOOLS[:1], "auto", "unique; repeated: get_weather"),
        ([{"type": "function", "function": {}}], "auto", "no function name"),
        ("get_weather", "auto", "list of objects"),
        (TOOLS, "nope", "tool_choice must be"),
        (TOOLS, {"type": "function", "function": {"name": "other"}}, "tool_choice must be"),
        (None, "required", "needs tools"),
    ],
)
def test_bad_tool_lists_fail_before_any_step(qwen_templated, tools, tool_choice, message):
    pages = qwen_templated.kv_stats()[1]
    with pytest.raises(InvalidArgument, match=message):
        qwen_templated.chat(
            [{"role": "user", "content": "x"}], tools=tools, tool_choice=tool_choice
        )
    assert qwen_templated.kv_stats()[1] == pages


def test_a_model_without_a_format_cannot_be_forced(converted):
    llm = LLM(converted("llama", "f32"), threads=1)
    with pytest.raises(InvalidArgument, match="no known tool-call format"):
        llm.chat([{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="required")


def test_server_tool_choice_returns_openai_tool_calls(qwen_templated):
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from cellm.scheduler import Scheduler
    from cellm.serve import build_app

    scheduler = Scheduler(qwen_templated)
    scheduler.start()
    try:
        http = TestClient(build_app(qwen_templated, "tiny", scheduler))
        body = {
            "messages": [{"role": "user", "content": "Weather?"}],
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "seed": 3,
        }
        choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS["get_weather"])
        bad = http.post("/v1/chat/completions", json={**body, "tools": TOOLS + TOOLS})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"
    finally:
        scheduler.close()


def test_the_parallel_grammar_accepts_what_the_template_writes(converted):
    llm = LLM(converted("qwen2", "f32"), threads=1)
    types = {str: "string", int: "integer", bool: "boolean"}

    def tool(name, example):
        props = {k: {"type": types[type(v)]} for k, v in example.items()}
        params = {"type": "object", "properties": props, "required": list(example)}
        return {"type": "function", "function": {"name": name, "parameters": params}}

    tools = [tool("get_weather", WEATHER), tool("lookup", LOOKUP)]
    messages = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [tool_call("get_weather", WEATHER), tool_call("lookup", LOOKUP)],
        },
    ]
    tpl = template("qwen2.5-coder-0.5b-instruct")
    text = render_chat_template(tpl, messages, add_generation_prompt=False)
    answer = rendered_answer(text, "<|im_start|>assistant\n", "<|im_end|>")
    grammar = grammar_for(grammar=FORMATS["hermes"].grammar(tools, llm.tokenizer, True))
    constraint = TokenConstraint(grammar, llm.tokenizer, llm.eos_token_ids)
    for token in llm.tokenizer.encode(answer, add_special_tokens=False):
        assert token in constraint.allowed()
        constraint.accept(token)
    assert constraint.finished or llm.tokenizer.eos_token_id in constraint.allowed()
