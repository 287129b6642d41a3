"""Chat templates: HF-exact rendering of the fixtures, the jinja environment, the builtins."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from cellm.chat import (
    BUILTIN_TEMPLATES,
    CHAT_FORMATS,
    _compile,
    render_chat_template,
    resolve_template,
)
from cellm.errors import CellmError, InvalidArgument, TemplateError

FIXTURES = Path(__file__).parent / "fixtures" / "hf-tiny"
MODELS = ["llama", "qwen2", "qwen3", "granite", "smollm3"]

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": " hi "},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "bye"},
]


@pytest.mark.parametrize("model", MODELS)
def test_fixture_templates_match_transformers_byte_exactly(model: str) -> None:
    d = FIXTURES / model
    ref = json.loads((d / "reference.json").read_text(encoding="utf-8"))["chat"]
    cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    out = render_chat_template(
        (d / "chat_template.jinja").read_text(encoding="utf-8"),
        ref["messages"],
        add_generation_prompt=True,
        bos_token=cfg.get("bos_token"),
        eos_token=cfg.get("eos_token"),
    )
    assert out == ref["rendered"]


def test_raise_exception_gives_template_error_with_message() -> None:
    tpl = (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('Roles must alternate') }}{% endif %}"
    )
    with pytest.raises(TemplateError) as exc:
        render_chat_template(tpl, [{"role": "assistant", "content": "x"}])
    assert str(exc.value) == "Roles must alternate"
    assert isinstance(exc.value, CellmError)
    assert render_chat_template(tpl, [{"role": "user", "content": "x"}]) == ""


def test_tools_documents_and_extra_are_passed_through() -> None:
    tools = [
        {"type": "function", "function": {"name": "get_weather", "description": "Météo à Zürich"}},
        {"type": "function", "function": {"name": "add", "parameters": {"a": 1}}},
    ]
    tpl = (
        "{% for t in tools %}[{{ t.function.name }}]{{ t | tojson }}\n{% endfor %}"
        "{% for d in documents %}<{{ d.title }}>{% endfor %}"
        "{{ 'T' if enable_thinking else 'F' }}"
    )
    out = render_chat_template(
        tpl,
        CHAT,
        tools=tools,
        documents=[{"title": "a", "text": "x"}],
        extra={"enable_thinking": True},
    )
    line1 = "[get_weather]" + json.dumps(tools[0], ensure_ascii=False)
    line2 = "[add]" + json.dumps(tools[1], ensure_ascii=False)
    assert out == f"{line1}\n{line2}\n<a>T"
    assert "Météo à Zürich" in out  # tojson does not escape non-ASCII (ensure_ascii=False)


def test_tojson_options_like_hf() -> None:
    x = {"b": 1, "a": "<&>"}
    tpl = "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(sort_keys=true) }}"
    want = "|".join(
        [json.dumps(x), json.dumps(x, indent=2), json.dumps(x, sort_keys=True)]
    )  # no HTML escaping, unlike jinja's builtin tojson
    assert render_chat_template(tpl, [], extra={"x": x}) == want


def test_unset_special_tokens_are_undefined_not_none() -> None:
    tpl = "{{ bos_token }}|{{ eos_token }}|{{ bos_token is defined }}"
    assert render_chat_template(tpl, []) == "||False"
    assert render_chat_template(tpl, [], bos_token="<s>", eos_token="</s>") == "<s>|</s>|True"


def test_none_values_are_dropped_and_reasoning_aliased() -> None:
    msgs = [{"role": "assistant", "content": None, "reasoning": "hmm"}]
    tpl = (
        "{% for m in messages %}{{ m.content is defined }}"
        "|{{ m.reasoning_content }}|{{ m.thinking }}{% endfor %}"
    )
    assert render_chat_template(tpl, msgs) == "False|hmm|hmm"
    assert msgs == [{"role": "assistant", "content": None, "reasoning": "hmm"}]  # not mutated


def test_environment_features() -> None:
    # trim_blocks/lstrip_blocks, loopcontrols, namespace, strftime_now, add_generation_prompt
    tpl = (
        "{% set ns = namespace(n=0) %}\n"
        "    {% for m in messages %}\n"
        "{% if loop.index > 2 %}{% break %}{% endif %}\n"
        "{% set ns.n = ns.n + 1 %}\n"
        "{% endfor %}\n"
        "{{ ns.n }} {{ strftime_now('%Y') }} {{ add_generation_prompt }}"
    )
    year = datetime.now().strftime("%Y")
    assert render_chat_template(tpl, CHAT) == f"2 {year} True"
    assert render_chat_template(tpl, CHAT, add_generation_prompt=False).endswith(" False")


@pytest.mark.parametrize(
    "tpl",
    [
        "{% for m in messages %}",  # syntax error
        "{{ ''.__class__.__mro__ }}",  # sandbox: no dunder access
        "{% set x = [] %}{{ x.append(1) }}",  # immutable sandbox
        "{% set ns = namespace() %}{% set ns._x = 1 %}",  # HF's namespace guard
        "{{ messages[0]['content'] + 1 }}",  # a TypeError inside the template
    ],
)
def test_broken_or_unsafe_templates_raise_template_error(tpl: str) -> None:
    with pytest.raises(TemplateError):
        render_chat_template(tpl, CHAT)


def test_bad_arguments_raise_invalid_argument() -> None:
    with pytest.raises(InvalidArgument):
        render_chat_template("x", "not a list")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        render_chat_template("x", ["not a dict"])  # type: ignore[list-item]
    with pytest.raises(InvalidArgument):
        render_chat_template("x", CHAT, tools=["not a dict"])  # type: ignore[list-item]
    with pytest.raises(InvalidArgument):
        render_chat_template("x", CHAT, extra={"messages": []})


def test_compiled_templates_are_cached() -> None:
    tpl = "{{ messages | length }} cached"
    render_chat_template(tpl, CHAT)
    hits = _compile.cache_info().hits
    assert render_chat_template(tpl, CHAT) == "4 cached"
    assert _compile.cache_info().hits == hits + 1


def test_builtin_chatml() -> None:
    out = render_chat_template(BUILTIN_TEMPLATES["chatml"], CHAT)
    assert out == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\n hi <|im_end|>\n"
        "<|im_start|>assistant\nhello<|im_end|>\n"
        "<|im_start|>user\nbye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_gen = render_chat_template(BUILTIN_TEMPLATES["chatml"], CHAT, add_generation_prompt=False)
    assert no_gen == out[: -len("<|im_start|>assistant\n")]


def test_builtin_llama3() -> None:
    out = render_chat_template(BUILTIN_TEMPLATES["llama3"], CHAT, bos_token="<|begin_of_text|>")
    h = "<|start_header_id|>{}<|end_header_id|>\n\n"
    assert out == (
        "<|begin_of_text|>"
        + h.format("system")
        + "You are terse.<|eot_id|>"
        + h.format("user")
        + "hi<|eot_id|>"
        + h.format("assistant")
        + "hello<|eot_id|>"
        + h.format("user")
        + "bye<|eot_id|>"
        + h.format("assistant")
    )
    # Same as the fixture llama template, which transformers rendered.
    d = FIXTURES / "llama"
    ref = json.loads((d / "reference.json").read_text(encoding="utf-8"))["chat"]
    out = render_chat_template(
        BUILTIN_TEMPLATES["llama3"], ref["messages"], bos_token="<|begin_of_text|>"
    )
    assert out == ref["rendered"]


def test_builtin_gemma_folds_system_into_first_user_turn() -> None:
    out = render_chat_template(BUILTIN_TEMPLATES["gemma"], CHAT, bos_token="<bos>")
    assert out == (
        "<bos><start_of_turn>user\nYou are terse.\n\nhi<end_of_turn>\n"
        "<start_of_turn>model\nhello<end_of_turn>\n"
        "<start_of_turn>user\nbye<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    out = render_chat_template(BUILTIN_TEMPLATES["gemma"], CHAT[1:2], add_generation_prompt=False)
    assert out == "<start_of_turn>user\nhi<end_of_turn>\n"


def test_builtin_gemma4() -> None:
    """Gemma 4's turns (its model card's "Prompt Formatting": `<|turn>role` ... `<turn|>`),
    the system message a turn of its own."""
    out = render_chat_template(BUILTIN_TEMPLATES["gemma4"], CHAT, bos_token="<bos>")
    assert out == (
        "<bos><|turn>system\nYou are terse.<turn|>\n"
        "<|turn>user\nhi<turn|>\n"
        "<|turn>model\nhello<turn|>\n"
        "<|turn>user\nbye<turn|>\n"
        "<|turn>model\n"
    )


def test_builtin_plain() -> None:
    out = render_chat_template(BUILTIN_TEMPLATES["plain"], CHAT)
    assert out == "System: You are terse.\nUser: hi\nAssistant: hello\nUser: bye\nAssistant:"


def test_resolve_template() -> None:
    assert resolve_template("auto", "EMBEDDED") == "EMBEDDED"
    assert resolve_template("auto", None) == BUILTIN_TEMPLATES["chatml"]
    assert resolve_template("auto", "") == BUILTIN_TEMPLATES["chatml"]
    for name in BUILTIN_TEMPLATES:
        assert resolve_template(name, "EMBEDDED") == BUILTIN_TEMPLATES[name]
    assert set(CHAT_FORMATS) == {"auto", "chatml", "llama3", "gemma", "gemma4", "plain"}
    with pytest.raises(InvalidArgument, match="unknown chat format 'vicuna'"):
        resolve_template("vicuna", None)


def test_templateless_models_chat_in_their_familys_format():
    """A GGUF without tokenizer.chat_template (gemma-3-270m's) gets its family's builtin
    format under --chat-format auto; other families get chatml."""
    from cellm.chat import BUILTIN_TEMPLATES, resolve_template
    from cellm.families import by_architecture

    gemma, llama = by_architecture("gemma3").chat_format, by_architecture("llama").chat_format
    assert resolve_template("auto", None, gemma) == BUILTIN_TEMPLATES["gemma"]
    assert resolve_template("auto", None, llama) == BUILTIN_TEMPLATES["chatml"]
    assert resolve_template("auto", "{{ 'own' }}", gemma) == "{{ 'own' }}"
