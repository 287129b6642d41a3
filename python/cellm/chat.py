"""Chat templates, rendered with the semantics of Hugging Face transformers' apply_chat_template.

The environment mirrors transformers' ``_compile_jinja_template`` (utils/chat_template_utils.py)
so that a model's embedded template renders byte-for-byte as it does under transformers.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from typing import Any, Optional

import jinja2
import jinja2.ext
import jinja2.nodes as nodes
import jinja2.visitor
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

from cellm.errors import CellmError, InvalidArgument, TemplateError

# Names a message's reasoning may arrive under; templates read the first (as in transformers).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Variables the renderer sets itself; `extra` must not silently replace them.
_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})

# Templates come from strangers: one render may take this long, produce this many characters
# (text, or any string, list or integer's size along the way), and run this many loop
# iterations (every `for` step and every `range()` item counts), whatever the template does.
TEMPLATE_TIME_LIMIT_S = 10.0
TEMPLATE_MAX_CHARS = 8 * 1024 * 1024
TEMPLATE_MAX_LOOP_STEPS = 1_000_000
# Integers a template computes (`10 ** 10 ** 9` would take minutes) are capped in bits.
_MAX_INT_BITS = 1 << 16


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


class _Budget:
    """What one render may still spend: loop iterations and time."""

    def __init__(self) -> None:
        self.steps = TEMPLATE_MAX_LOOP_STEPS
        self.deadline = time.monotonic() + TEMPLATE_TIME_LIMIT_S

    def charge(self, steps: int) -> None:
        self.steps -= steps
        if self.steps < 0:
            raise TemplateError(
                f"chat template stopped: it ran more than {TEMPLATE_MAX_LOOP_STEPS:,} loop "
                "iterations"
            )
        self.check_time()

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateError(
                f"chat template stopped: rendering took more than {TEMPLATE_TIME_LIMIT_S:g} s"
            )


# The budget of the render in progress (None outside render_chat_template: no limits).
_BUDGET: ContextVar[Optional[_Budget]] = ContextVar("cellm_template_budget", default=None)


def _charge(steps: int) -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.charge(steps)


def _range(*args: int) -> range:
    # jinja's sandboxed range (at most 100,000 items), charged in full to the render's budget.
    rng = safe_range(*args)
    _charge(len(rng))
    return rng


@jinja2.pass_context  # never evaluated at compile time
def _counted(context: Any, iterable: Iterable[Any]) -> Iterator[Any]:
    """Every `for` loop iterates through this: each step is charged to the budget."""
    for item in iterable:
        _charge(1)
        yield item


def _sized(value: Any) -> Any:
    """`value` unless it is a string, list or integer past the limits (checked after every
    filter, call, `~`, `+` and `%`, so repeated doubling stops at twice the limit)."""
    if isinstance(value, (str, list, tuple, dict)) and len(value) > TEMPLATE_MAX_CHARS:
        raise TemplateError(
            f"chat template stopped: it built {_describe(value, len(value))} (the limit is "
            f"{TEMPLATE_MAX_CHARS:,})"
        )
    if isinstance(value, int) and value.bit_length() > _MAX_INT_BITS:
        raise TemplateError(
            f"chat template stopped: it built an integer of over {_MAX_INT_BITS:,} bits"
        )
    return value


def _describe(value: Any, size: int) -> str:
    if isinstance(value, str):
        return f"a string of {size:,} characters"
    return f"a {type(value).__name__} of {size:,} items"


def _check_operands(operator: str, left: Any, right: Any) -> None:
    """Refuse `seq * n` and `a ** b` whose results would be past the limits, before
    computing them."""
    if operator == "*":
        seq, n = (right, left) if isinstance(left, int) else (left, right)
        if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
            if len(seq) * n > TEMPLATE_MAX_CHARS:
                raise TemplateError(
                    f"chat template stopped: it would build {_describe(seq, len(seq) * n)} "
                    f"(the limit is {TEMPLATE_MAX_CHARS:,})"
                )
    elif operator == "**" and isinstance(left, int) and isinstance(right, int):
        if right > 0 and abs(left) > 1 and abs(left).bit_length() * right > _MAX_INT_BITS:
            raise TemplateError(
                f"chat template stopped: {left} ** {right} has over {_MAX_INT_BITS:,} bits"
            )


class _Guard(jinja2.visitor.NodeTransformer):
    """Rewrites a parsed template so that every loop charges the budget and every filter,
    call and concatenation checks the size of what it built."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = _filter(node.iter, "cellm_counted")
        return node

    def visit_CallBlock(self, node: nodes.CallBlock) -> nodes.Node:
        # `node.call` must stay a Call: guard its arguments, not its result.
        call = node.call
        self.generic_visit(call)
        node.call = None  # type: ignore[assignment]  # generic_visit skips None
        self.generic_visit(node)
        node.call = call
        return node

    def visit_Filter(self, node: nodes.Filter) -> nodes.Node:
        self.generic_visit(node)
        # A filter block's filter (node None) applies to the block's text: not an expression.
        return node if node.node is None else _filter(node, "cellm_sized")

    def visit_Call(self, node: nodes.Call) -> nodes.Node:
        self.generic_visit(node)
        return _filter(node, "cellm_sized")

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return _filter(node, "cellm_sized")


def _filter(node: nodes.Node, name: str) -> nodes.Filter:
    return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)


class _Environment(ImmutableSandboxedEnvironment):
    """The sandbox, with the template's operators and loops under the render's limits."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_operands(operator, left, right)
        return _sized(super().call_binop(context, operator, left, right))

    def _parse(self, source: str, name: Optional[str], filename: Optional[str]) -> nodes.Template:
        template = super()._parse(source, name, filename)
        guarded: nodes.Template = _Guard().visit(template)
        return guarded


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


def _make_env() -> _Environment:
    env = _Environment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    env.globals["range"] = _range
    env.filters["cellm_counted"] = _counted
    env.filters["cellm_sized"] = _sized
    return env


_ENV = _make_env()


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    try:
        return _ENV.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"chat template does not compile: {e} (line {e.lineno})") from e
    except (RecursionError, MemoryError) as e:  # e.g. brackets nested thousands deep
        raise TemplateError(f"chat template does not compile: {type(e).__name__}") from None


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
    when the template does not compile, fails, calls ``raise_exception(msg)`` (message = msg),
    or passes the limits on time, output size and loop iterations (TEMPLATE_TIME_LIMIT_S,
    TEMPLATE_MAX_CHARS, TEMPLATE_MAX_LOOP_STEPS).
    """
    if not isinstance(template, str):
        raise TemplateError(f"the chat template must be a string, got {type(template).__name__}")
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
    budget = _Budget()
    token = _BUDGET.set(budget)
    try:
        return _render(compiled, context, budget)
    except CellmError:
        raise
    except Exception as e:  # anything an untrusted template does wrong is a template error
        raise TemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from e
    finally:
        _BUDGET.reset(token)


def _render(compiled: jinja2.Template, context: dict[str, Any], budget: _Budget) -> str:
    """The template's text, checked for size and time after every piece it yields."""
    pieces: list[str] = []
    size = 0
    for piece in compiled.generate(**context):
        size += len(piece)
        if size > TEMPLATE_MAX_CHARS:
            raise TemplateError(
                f"chat template stopped: its output passed {TEMPLATE_MAX_CHARS:,} characters"
            )
        budget.check_time()
        pieces.append(piece)
    return "".join(pieces)


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
    # Gemma 4: every role (system included) is a turn, `<|turn>role\n...<turn|>\n`; the
    # generation prompt opens the model's turn without a thought channel, as E2B/E4B do.
    "gemma4": (
        "{% if bos_token %}{{ bos_token }}{% endif %}"
        "{% for message in messages %}"
        "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
        "{{ '<|turn>' + role + '\\n' + message['content'] | trim + '<turn|>\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|turn>model\\n' }}{% endif %}"
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
