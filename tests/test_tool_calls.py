"""FunctionGemma tool calls: the parser, chat(tools=...) and infer's --stop-tokens / --tools."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cellm import LLM
from cellm.families import by_architecture
from cellm.llm import GenerationResult
from cellm.tool_calls import (
    CALL_END,
    CALL_START,
    ESCAPE,
    close_call_cut_by_stop,
    parse_tool_calls,
)
from cellm.tool_formats import format_for
from conftest import ROOT

TEMPLATE_WITH_TOOLS = (
    "{% if tools %}{% for t in tools %}[tool:{{ t.function.name }}]{% endfor %}{% endif %}"
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def seed_call(call: str) -> str:
    """A call as the seeds print it (<escape> shown as ") in the model's real markup."""
    return CALL_START + call.replace('"', ESCAPE) + CALL_END


# The FunctionGemma test samples of the seeds (000_*.txt), verbatim but for <escape>.
SEED_SAMPLES = [
    (["call:set_wifi{enabled:true}"], [("set_wifi", {"enabled": True})]),
    (["call:set_wifi{enabled:false}"], [("set_wifi", {"enabled": False})]),
    (
        ['call:get_weather{city:"Accra",unit:"c"}'],
        [("get_weather", {"city": "Accra", "unit": "c"})],
    ),
    (
        ["call:set_wifi{enabled:false}", 'call:get_weather{city:"London",unit:"f"}'],
        [("set_wifi", {"enabled": False}), ("get_weather", {"city": "London", "unit": "f"})],
    ),
    (['call:set_alarm{time:"14:30"}'], [("set_alarm", {"time": "14:30"})]),
    (
        ['call:set_alarm{label:"gym",time:"07:15"}'],
        [("set_alarm", {"label": "gym", "time": "07:15"})],
    ),
    (
        [
            "call:send_message{body:\"I'm sorry, but I'm running late.\","
            'recipient:"person@example.com"}'
        ],
        [
            (
                "send_message",
                {"body": "I'm sorry, but I'm running late.", "recipient": "person@example.com"},
            )
        ],
    ),
    (
        [
            'call:send_message{body:"Happy Birthday Kofi! Happy Birthday Kofi!",'
            'recipient:"Kofi\'s email@example.com"}'
        ],
        [
            (
                "send_message",
                {
                    "body": "Happy Birthday Kofi! Happy Birthday Kofi!",
                    "recipient": "Kofi's email@example.com",
                },
            )
        ],
    ),
    (["call:set_brightness{level:20}"], [("set_brightness", {"level": 20})]),
    (
        ["call:set_brightness{level:90}", "call:set_brightness{level:40}"],
        [("set_brightness", {"level": 90}), ("set_brightness", {"level": 40})],
    ),
    (['call:play_music{query:"Burna Boy song."}'], [("play_music", {"query": "Burna Boy song."})]),
    (
        ["call:set_wifi{enabled:true}", "call:set_brightness{level:50}"],
        [("set_wifi", {"enabled": True}), ("set_brightness", {"level": 50})],
    ),
    (
        ['call:get_weather{city:"Kumasi",unit:"c"}', 'call:set_alarm{time:"05:00"}'],
        [("get_weather", {"city": "Kumasi", "unit": "c"}), ("set_alarm", {"time": "05:00"})],
    ),
    (['call:play_music{query:"cat"}'], [("play_music", {"query": "cat"})]),
]


@pytest.mark.parametrize("calls, want", SEED_SAMPLES)
def test_seed_samples_parse(calls, want):
    content, got = parse_tool_calls("".join(seed_call(c) for c in calls))
    assert content == ""
    assert got == [{"name": n, "arguments": a} for n, a in want]
    # == cannot tell True from 1 or 20 from 20.0: compare the types too.
    got_types = [[type(v) for v in c["arguments"].values()] for c in got]
    assert got_types == [[type(v) for v in a.values()] for _, a in want]


def test_refusal_without_calls_is_unchanged_text():
    text = (
        "I apologize, but I cannot assist with historical inquiries about past\n"
        "presidents of countries."
    )
    assert parse_tool_calls(text) == (text, [])


def test_documented_call_with_comma_in_string():
    text = (
        "<start_function_call>call:get_current_weather{location:<escape>Tokyo, Japan<escape>}"
        "<end_function_call>"
    )
    assert parse_tool_calls(text) == (
        "",
        [{"name": "get_current_weather", "arguments": {"location": "Tokyo, Japan"}}],
    )


def test_text_around_calls_is_the_content_and_calls_keep_their_order():
    text = (
        f"Doing both.\n{seed_call('call:a{x:1}')}\n{seed_call('call:b{y:2}')}"
        f"{seed_call('call:a{x:3}')} Done."
    )
    content, calls = parse_tool_calls(text)
    assert content == "Doing both.\n\n Done."
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("a", {"x": 1}),
        ("b", {"y": 2}),
        ("a", {"x": 3}),
    ]


def test_escaped_strings_are_verbatim_and_never_converted():
    raw = '  {a}, [b] "c" :d\n'
    text = f"{CALL_START}call:f{{s:{ESCAPE}{raw}{ESCAPE},n:{ESCAPE}42{ESCAPE},"
    text += f"b:{ESCAPE}true{ESCAPE},e:{ESCAPE}{ESCAPE}}}{CALL_END}"
    _, calls = parse_tool_calls(text)
    assert calls == [{"name": "f", "arguments": {"s": raw, "n": "42", "b": "true", "e": ""}}]


def test_numbers_booleans_null_and_bare_words():
    _, calls = parse_tool_calls(
        seed_call("call:f{i:-7,z:0,f:2.5,g:-0.25,e:1e3,t:true,no:false,nil:null,w:celsius}")
    )
    args = calls[0]["arguments"]
    assert args == {
        "i": -7,
        "z": 0,
        "f": 2.5,
        "g": -0.25,
        "e": 1000.0,
        "t": True,
        "no": False,
        "nil": None,
        "w": "celsius",
    }
    assert [type(args[k]) for k in ("i", "z", "f", "e", "t")] == [int, int, float, float, bool]


def test_nested_objects_and_lists():
    # The shape of a FunctionGemma tool declaration, used as call arguments.
    description = 'The city and state, e.g. "San Francisco, CA" or "Tokyo, JP"'
    text = (
        f"{CALL_START}call:configure{{parameters:{{properties:{{location:{{description:"
        f"{ESCAPE}{description}{ESCAPE},type:{ESCAPE}STRING{ESCAPE}}}}},"
        f"required:[{ESCAPE}location{ESCAPE}],type:{ESCAPE}OBJECT{ESCAPE}}},"
        f"matrix:[[1,2],[],[{{k:[true,{ESCAPE}x{ESCAPE}]}}]],empty:{{}}}}{CALL_END}"
    )
    _, calls = parse_tool_calls(text)
    assert calls == [
        {
            "name": "configure",
            "arguments": {
                "parameters": {
                    "properties": {"location": {"description": description, "type": "STRING"}},
                    "required": ["location"],
                    "type": "OBJECT",
                },
                "matrix": [[1, 2], [], [{"k": [True, "x"]}]],
                "empty": {},
            },
        }
    ]


def test_call_without_arguments():
    assert parse_tool_calls(seed_call("call:pwd{}")) == ("", [{"name": "pwd", "arguments": {}}])


MALFORMED = {
    "unterminated": f"{CALL_START}call:set_wifi{{enabled:true}}",
    "missing call:": f"{CALL_START}set_wifi{{enabled:true}}{CALL_END}",
    "missing name": f"{CALL_START}call:{{enabled:true}}{CALL_END}",
    "unclosed brace": f"{CALL_START}call:set_wifi{{enabled:true{CALL_END}",
    "extra brace": f"{CALL_START}call:set_wifi{{enabled:true}}}}{CALL_END}",
    "unclosed list": f"{CALL_START}call:f{{xs:[1,2}}{CALL_END}",
    "unclosed nested object": f"{CALL_START}call:f{{o:{{a:1}}{CALL_END}",
    "no arguments braces": f"{CALL_START}call:set_wifi{CALL_END}",
    "missing value": f"{CALL_START}call:f{{a:}}{CALL_END}",
    "unterminated escape": f"{CALL_START}call:f{{city:{ESCAPE}Accra}}{CALL_END}",
}


@pytest.mark.parametrize("kind", MALFORMED)
def test_malformed_call_stays_in_content_without_a_call(kind):
    bad = MALFORMED[kind]
    assert parse_tool_calls(bad) == (bad, [])
    # A well-formed call after it is still found, and the bad text is kept verbatim.
    good = seed_call('call:get_weather{city:"Accra"}')
    content, calls = parse_tool_calls(f"before {bad} after{good}")
    assert content == f"before {bad} after"
    assert calls == [{"name": "get_weather", "arguments": {"city": "Accra"}}]


def test_unterminated_escape_does_not_swallow_the_next_call():
    bad = f"{CALL_START}call:f{{a:{ESCAPE}x}}{CALL_END}"
    good = f"{CALL_START}call:g{{b:{ESCAPE}y{ESCAPE}}}{CALL_END}"
    assert parse_tool_calls(bad + good) == (bad, [{"name": "g", "arguments": {"b": "y"}}])


def test_escaped_string_never_spans_a_call_marker():
    # Both calls lack a closing <escape>; pairing f's opening one with g's would make one
    # "call" f whose argument holds g's markup.
    text = f"{CALL_START}call:f{{a:{ESCAPE}x}}{CALL_END}{CALL_START}call:g{{b:{ESCAPE}}}{CALL_END}"
    assert parse_tool_calls(text) == (text, [])


def test_call_cut_by_end_marker_stop_token_is_closed():
    cut = f"{CALL_START}call:set_wifi{{enabled:true}}"
    closed = close_call_cut_by_stop(cut, CALL_END)
    assert parse_tool_calls(closed)[1] == [{"name": "set_wifi", "arguments": {"enabled": True}}]
    assert close_call_cut_by_stop(cut, "<end_of_turn>") == cut
    assert close_call_cut_by_stop(cut, None) == cut
    done = seed_call("call:f{}")  # nothing open: no stray marker is added
    assert close_call_cut_by_stop(done + " ok", CALL_END) == done + " ok"


# -- LLM.chat(tools=...) ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(converted):
    return LLM(converted("llama", "f32"), kv_encoding="f32", threads=1)


@pytest.fixture
def templated(llm, monkeypatch):
    """The fixture model with a template that lists the tools before the messages, in the
    family whose tool calls are FunctionGemma's (its vocabulary has their markers)."""
    monkeypatch.setattr(llm, "chat_template", TEMPLATE_WITH_TOOLS)
    monkeypatch.setattr(llm, "family", by_architecture("gemma3"))
    monkeypatch.setattr(llm, "tool_format", format_for(None, llm.family.tool_call_format))
    return llm


def test_chat_renders_the_tools_into_the_prompt(templated, monkeypatch):
    seen = {}
    real_generate = templated.generate

    def spy(prompt, **kwargs):
        seen["prompt"], seen["kwargs"] = list(prompt), kwargs
        return real_generate(prompt, **kwargs)

    monkeypatch.setattr(templated, "generate", spy)
    messages = [{"role": "user", "content": "weather in Accra?"}]
    templated.chat(messages, tools=[WEATHER_TOOL], max_tokens=2)
    prompt = templated.tokenizer.decode(seen["prompt"], skip_special_tokens=False)
    assert prompt == "[tool:get_weather]weather in Accra?"
    assert seen["kwargs"]["skip_special_tokens"] is False
    templated.chat(messages, max_tokens=2)
    no_tools = templated.tokenizer.decode(seen["prompt"], skip_special_tokens=False)
    assert no_tools == "weather in Accra?"
    assert "skip_special_tokens" not in seen["kwargs"]


def test_chat_returns_parsed_calls_beside_the_text(templated, monkeypatch):
    answer = "Checking. " + seed_call('call:get_weather{city:"Accra",unit:"c"}')
    canned = GenerationResult(answer, [1, 2], "stop", 3)
    monkeypatch.setattr(templated, "generate", lambda prompt, **kw: canned)
    r = templated.chat([{"role": "user", "content": "x"}], tools=[WEATHER_TOOL])
    assert r.text == "Checking."
    assert r.tool_calls == [{"name": "get_weather", "arguments": {"city": "Accra", "unit": "c"}}]
    assert r.finish_reason == "stop" and r.token_ids == [1, 2]


def test_calls_are_parsed_only_in_the_familys_own_format(templated, monkeypatch):
    """The parser is the model family's: a llama-family answer keeps FunctionGemma markup."""
    answer = "Checking. " + seed_call("call:f{}")
    monkeypatch.setattr(
        templated, "generate", lambda prompt, **kw: GenerationResult(answer, [1], "stop", 3)
    )
    monkeypatch.setattr(templated, "family", by_architecture("llama"))
    monkeypatch.setattr(
        templated, "tool_format", format_for(None, templated.family.tool_call_format)
    )
    r = templated.chat([{"role": "user", "content": "x"}], tools=[WEATHER_TOOL])
    assert (r.text, r.tool_calls) == (answer, [])


def test_chat_closes_a_call_cut_by_the_end_marker_stop_token(templated, monkeypatch):
    end_id = templated.tokenizer.token_to_id(CALL_END)
    assert end_id is not None
    canned = GenerationResult(
        f"{CALL_START}call:set_wifi{{enabled:true}}", [1], "stop", 3, stop_token_id=end_id
    )
    monkeypatch.setattr(templated, "generate", lambda prompt, **kw: canned)
    r = templated.chat([{"role": "user", "content": "x"}], tools=[WEATHER_TOOL])
    assert (r.text, r.tool_calls) == ("", [{"name": "set_wifi", "arguments": {"enabled": True}}])


def test_chat_without_calls_has_no_tool_calls(llm):
    r = llm.chat([{"role": "user", "content": "hi"}], max_tokens=4)
    assert r.tool_calls == []
    assert (
        r.text
        == llm.generate(
            llm.tokenizer.encode(
                llm.apply_chat_template([{"role": "user", "content": "hi"}]),
                add_special_tokens=False,
            ),
            max_tokens=4,
        ).text
    )


def test_special_tokens_are_kept_when_asked(llm):
    # On this fixture "call:" is followed by <end_function_call> (a special token) within 40.
    kept = llm.generate("call:", max_tokens=40, ignore_eos=True, skip_special_tokens=False)
    assert CALL_END in kept.text
    assert kept.text == llm.tokenizer.decode(kept.token_ids, skip_special_tokens=False)
    skipped = llm.generate("call:", max_tokens=40, ignore_eos=True)
    assert skipped.token_ids == kept.token_ids and CALL_END not in skipped.text


def test_generation_records_the_stop_token(llm):
    end_id = llm.tokenizer.token_to_id(CALL_END)
    r = llm.generate("call:", max_tokens=40, ignore_eos=True, stop_token_ids=[end_id])
    assert r.finish_reason == "stop" and r.stop_token_id == end_id
    assert end_id not in r.token_ids
    assert llm.generate("call:", max_tokens=3, ignore_eos=True).stop_token_id is None


# -- python -m cellm.infer --stop-tokens / --tools -----------------------------------------------


def infer(model, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    cmd = [sys.executable, "-m", "cellm.infer", "--model", str(model), "--threads", "1"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, env=env)


def assert_one_line_error(proc, *needles: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize(
    "value, needle",
    [
        ("<no_such_token>", "'<no_such_token>' is not a single token"),
        ("<end_function_call>,<nope>", "'<nope>'"),
        ("5000", "outside the vocabulary"),
        (" , ", "lists no tokens"),
    ],
)
def test_infer_stop_tokens_bad_value(converted, value, needle):
    proc = infer(converted("llama", "f32"), "--prompt", "call:", "--stop-tokens", value)
    assert_one_line_error(proc, "--stop-tokens", needle)
    assert proc.stdout == ""


def test_infer_stop_tokens_by_name_and_id_end_the_turn(converted, llm):
    model = converted("llama", "f32")
    end_id = llm.tokenizer.token_to_id(CALL_END)
    want = llm.generate("call:", max_tokens=40, stop_token_ids=[end_id])
    assert want.finish_reason == "stop"
    for value in (CALL_END, str(end_id), f" {CALL_END} , {end_id} "):
        proc = infer(model, "--prompt", "call:", "--gen", "40", "--stop-tokens", value)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == want.text + "\n"
        assert "finish: stop" in proc.stderr
    proc = infer(model, "--prompt", "call:", "--gen", "40")
    assert "finish: stop" not in proc.stderr  # without the flag it runs on


def test_infer_tools_prints_calls_as_json(converted, tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([WEATHER_TOOL]))
    proc = infer(converted("llama", "f32"), "--prompt", "hi", "--gen", "4", "--tools", str(tools))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == []


@pytest.mark.parametrize(
    "content, needle",
    [(None, "no such file"), ("{not json", "not valid JSON"), ('{"a": 1}', "JSON list")],
)
def test_infer_tools_bad_file(converted, tmp_path, content, needle):
    tools = tmp_path / "tools.json"
    if content is not None:
        tools.write_text(content)
    proc = infer(converted("llama", "f32"), "--prompt", "hi", "--tools", str(tools))
    assert_one_line_error(proc, "--tools", needle)


def test_infer_tools_need_a_text_prompt(converted, tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([WEATHER_TOOL]))
    proc = infer(converted("llama", "f32"), "--tokens", "1,2", "--tools", str(tools))
    assert_one_line_error(proc, "--tools needs a text --prompt")
