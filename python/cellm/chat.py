"""Chat templates, rendered with the semantics of Hugging Face transformers' apply_chat_template.

The environment mirrors transformers' ``_compile_jinja_template`` (utils/chat_template_utils.py)
so that a model's embedded template renders byte-for-byte as it does under transformers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cellm.errors import CellmError, InvalidArgument, TemplateError

# Names a message's reasoning may arrive under; templates read the first (as in transformers).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Variables the renderer sets itself; `extra` must not silently replace them.
_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters and sorts keys; templates expect plain json.dumps.
    return json.dumps(
        x,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
        default=_json_default,
    )


def _json_default(x: Any) -> Any:
    # Filters such as map/select/reject yield generators; `tools | map(attribute='function') |
    # tojson` (llama.cpp's templates) means the list they produce.
    if isinstance(x, Iterator):
        return list(x)
    raise TypeError(f"Object of type {type(x).__name__} is not JSON serializable")


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    # A bare callable instead of the dict type, so templates cannot reach type attributes.
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Templates are untrusted: refuse underscore names on namespaces, as transformers does.
    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore-prefixed namespace attributes: {name!r}"
            )


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for transformers'
    return_assistant_tokens_mask (its AssistantTracker); rendering, it is just its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    @staticmethod
    def _render_body(caller: Any) -> str:
        return str(caller())


def _make_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


_ENV = _make_env()


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    try:
        return _ENV.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"chat template does not compile: {e} (line {e.lineno})") from e


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidArgument(f"messages must be a list of dicts, got {type(messages).__name__}")
    out = []
    for m in messages:
        if not isinstance(m, Mapping):
            raise InvalidArgument(f"each message must be a dict, got {type(m).__name__}")
        # Like transformers: a None value means "absent" (OpenAI clients send content=None).
        msg = {k: v for k, v in m.items() if v is not None}
        reasoning = next((msg[k] for k in _REASONING_FIELDS if k in msg), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


def _check_dict_list(name: str, value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, Sequence) or not all(isinstance(v, Mapping) for v in value):
        raise InvalidArgument(f"{name} must be a list of dicts (JSON schemas)")
    return [dict(v) for v in value]


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> str:
    """Render `messages` with a jinja chat template exactly as transformers would.

    `extra` holds further template variables (e.g. ``enable_thinking``). Raises TemplateError
    when the template does not compile, fails, or calls ``raise_exception(msg)`` (message = msg).
    """
    compiled = _compile(template)
    context: dict[str, Any] = {}
    # transformers passes only the special tokens that are set: an unset bos_token is undefined
    # in the template (renders as ""), not the string "None".
    if bos_token is not None:
        context["bos_token"] = bos_token
    if eos_token is not None:
        context["eos_token"] = eos_token
    if extra:
        clash = _RESERVED.intersection(extra)
        if clash:
            raise InvalidArgument(f"extra template variables may not set {sorted(clash)}")
        context.update(extra)
    context.update(
        messages=_normalize_messages(messages),
        tools=_check_dict_list("tools", tools),
        documents=_check_dict_list("documents", documents),
        add_generation_prompt=add_generation_prompt,
    )
    try:
        return compiled.render(**context)
    except CellmError:
        raise
    except Exception as e:  # anything an untrusted template does wrong is a template error
        raise TemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from e


# Builtin formats for --chat-format. Written on one line each so trim/lstrip_blocks can't bite.
BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    # Meta's Llama 3 Instruct template (bos only when the tokenizer has one).
    "llama3": (
        "{% if bos_token %}{{ bos_token }}{% endif %}"
        "{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
        " + message['content'] | trim + '<|eot_id|>' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
        "{% endif %}"
    ),
    # Gemma has no system role: like Gemma 3's template, prepend it to the first user turn.
    "gemma": (
        "{% if bos_token %}{{ bos_token }}{% endif %}"
        "{% if messages and messages[0]['role'] == 'system' %}"
        "{% set system = messages[0]['content'] + '\\n\\n' %}"
        "{% set loop_messages = messages[1:] %}"
        "{% else %}{% set system = '' %}{% set loop_messages = messages %}{% endif %}"
        "{% for message in loop_messages %}"
        "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
        "{{ '<start_of_turn>' + role + '\\n' + (system if loop.first else '')"
        " + message['content'] | trim + '<end_of_turn>\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
    ),
    # For base models: "System: ...\nUser: ...\nAssistant:" (no space after the colon, since
    # BPE vocabularies carry the space on the next word's token).
    "plain": (
        "{% for message in messages %}"
        "{{ message['role'] | capitalize + ': ' + message['content'] | trim + '\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}Assistant:{% endif %}"
    ),
}

CHAT_FORMATS: tuple[str, ...] = ("auto", *BUILTIN_TEMPLATES)


def resolve_template(chat_format: str, embedded: str | None, family_format: str = "chatml") -> str:
    """The template for a --chat-format value; "auto" = the model's own, else its family's
    builtin format (`family_format`; GGUF files often carry no template)."""
    if chat_format == "auto":
        if embedded:
            return embedded
        return BUILTIN_TEMPLATES[family_format]
    try:
        return BUILTIN_TEMPLATES[chat_format]
    except KeyError:
        raise InvalidArgument(
            f"unknown chat format {chat_format!r}; choose one of {', '.join(CHAT_FORMATS)}"
        ) from None


__all__ = ["BUILTIN_TEMPLATES", "CHAT_FORMATS", "render_chat_template", "resolve_template"]
