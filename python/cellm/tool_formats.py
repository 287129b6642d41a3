"""Tool calls in each model family's own format: reading them out of an answer into
``{"name": str, "arguments": dict}``, and the grammar that makes a model write one
(``tool_choice="required"`` or a named function, through `cellm.structured`).

A model's format is chosen once, from its chat template (the markers the template writes or
tells the model to write) or else its family's default: never by trying every parser on an
answer. Formats:

- ``hermes`` (Qwen2.5, Qwen3, SmolLM3): one block per call,
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.
- ``llama3`` (Llama 3.1 - 3.3): the answer is ``{"name": ..., "parameters": {...}}`` (calls
  separated by ``;``), or a built-in tool ``<|python_tag|>name.call(key="value")``.
- ``granite`` (Granite 3.x): ``<|tool_call|>[{"name": ..., "arguments": {...}}, ...]``.
- ``lfm2`` (LFM2): ``<|tool_call_start|>[name(key="value"), ...]<|tool_call_end|>`` (Python
  call syntax; a JSON object or list in the same markers is read too).
- ``functiongemma`` (Gemma): ``<start_function_call>call:NAME{key:value}<end_function_call>``
  (`cellm.tool_calls`).

Malformed calls never raise: their text stays in the answer and yields no call.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

from cellm.errors import InvalidArgument
from cellm.tokenizer import Tokenizer
from cellm.tool_calls import CALL_END, CALL_START, ESCAPE, split_functiongemma_calls

Call = dict[str, Any]
Parsed = tuple[str, list[Call]]
# JSON inside a tool-call grammar is written like json.dumps writes it (see cellm.structured).
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def check_tools(tools: object) -> list[str]:
    """The function names of OpenAI-style `tools`; InvalidArgument for a list that is not one
    or that names a function twice."""
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise InvalidArgument("tools must be a list of objects")
    names = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise InvalidArgument(f"tools[{i}] must be an object")
        function = tool.get("function", tool)
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"tools[{i}] has no function name")
        names.append(name)
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise InvalidArgument(f"tool names must be unique; repeated: {', '.join(repeated)}")
    return names


def _function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    function = tool.get("function", tool)
    return function if isinstance(function, Mapping) else {}


def _parameters(tool: Mapping[str, Any]) -> dict[str, Any]:
    params = _function(tool).get("parameters")
    return dict(params) if isinstance(params, Mapping) else {"type": "object"}


def _call(obj: object, argument_keys: Sequence[str]) -> Optional[Call]:
    """A decoded JSON call as {"name", "arguments"}, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments: Any = {}
    for key in argument_keys:
        if key in obj:
            arguments = obj[key]
            break
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"name": obj["name"], "arguments": arguments}


def _json_values(text: str) -> Optional[list[Any]]:
    """The JSON values `text` holds one after another (separated by blanks or `;`), or None."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    pos = 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
            pos += 1
        if pos == len(text):
            return values
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        values.append(value)


def _calls(values: Optional[list[Any]], argument_keys: Sequence[str]) -> Optional[list[Call]]:
    """Every value a call (a list of calls counts as its calls), or None."""
    if not values:
        return None
    flat = [v for value in values for v in (value if isinstance(value, list) else [value])]
    calls = [_call(v, argument_keys) for v in flat]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


# -- hermes (Qwen2.5, Qwen3, SmolLM3) -------------------------------------------------------------

_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)


def parse_hermes(text: str, stop_token: Optional[str] = None) -> Parsed:
    calls: list[Call] = []
    kept, pos = [], 0
    for m in _HERMES.finditer(text):
        found = _calls(_json_values(m.group(1)), ("arguments", "parameters"))
        if found is None:
            continue  # malformed: stays in the text
        kept.append(text[pos : m.start()])
        pos = m.end()
        calls += found
    if not calls:
        return text, []
    return ("".join(kept) + text[pos:]).strip(), calls


# -- llama3 ---------------------------------------------------------------------------------------

PYTHON_TAG = "<|python_tag|>"
_BUILTIN = re.compile(r"([A-Za-z_][\w]*)\.call\((.*)\)", re.S)


def parse_llama3(text: str, stop_token: Optional[str] = None) -> Parsed:
    head, tag, body = text.partition(PYTHON_TAG)
    if not tag:
        head, body = "", text
    body = body.strip()
    builtin = _BUILTIN.fullmatch(body)
    if tag and builtin:
        arguments = _python_arguments(f"f({builtin.group(2)})")
        if arguments is not None:
            return head.strip(), [{"name": builtin.group(1), "arguments": arguments}]
    found = _calls(_json_values(body), ("parameters", "arguments"))
    if found is None:
        return text, []
    return head.strip(), found


# -- granite --------------------------------------------------------------------------------------

GRANITE_TAG = "<|tool_call|>"


def parse_granite(text: str, stop_token: Optional[str] = None) -> Parsed:
    head, tag, body = text.partition(GRANITE_TAG)
    if not tag:
        return text, []
    try:
        value, end = json.JSONDecoder().raw_decode(body.lstrip())
    except ValueError:
        return text, []
    found = _calls([value], ("arguments", "parameters"))
    if found is None:
        return text, []
    rest = body.lstrip()[end:]
    return (head + rest).strip(), found


# -- lfm2 -----------------------------------------------------------------------------------------

LFM2_START, LFM2_END = "<|tool_call_start|>", "<|tool_call_end|>"
_LFM2 = re.compile(re.escape(LFM2_START) + r"(.*?)" + re.escape(LFM2_END), re.S)
# JSON's literals, as a model trained on JSON may write them inside Python calls.
_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values) if k is not None}
    return ast.literal_eval(node)


def _call_name(node: ast.expr) -> Optional[str]:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        owner = _call_name(node.value)
        return None if owner is None else f"{owner}.{node.attr}"
    return None


def _python_calls(source: str) -> Optional[list[Call]]:
    """`[f(a=1), g(b="x")]` (or one call) as calls; None unless every part is literal."""
    try:
        tree = ast.parse(source.strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return None
    nodes = tree.elts if isinstance(tree, ast.List) else [tree]
    calls = []
    for node in nodes:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = _call_name(node.func)
        try:
            arguments = {k.arg: _literal(k.value) for k in node.keywords if k.arg is not None}
        except (ValueError, TypeError, SyntaxError):
            return None
        if name is None or len(arguments) != len(node.keywords):
            return None
        calls.append({"name": name, "arguments": arguments})
    return calls or None


def _python_arguments(source: str) -> Optional[dict[str, Any]]:
    found = _python_calls(source)
    return None if found is None else found[0]["arguments"]


def parse_lfm2(text: str, stop_token: Optional[str] = None) -> Parsed:
    calls: list[Call] = []
    kept, pos = [], 0
    for m in _LFM2.finditer(text):
        payload = m.group(1)
        found = _python_calls(payload) or _calls(_json_values(payload), ("arguments",))
        if found is None:
            continue
        kept.append(text[pos : m.start()])
        pos = m.end()
        calls += found
    if not calls:
        return text, []
    return ("".join(kept) + text[pos:]).strip(), calls


# -- grammars for tool_choice ---------------------------------------------------------------------


def _token(tokenizer: Tokenizer, text: str) -> str:
    """`text` in a Lark grammar: the vocabulary's token for it when it has one (the model
    writes markers as such tokens), else the literal string."""
    token_id = tokenizer.token_to_id(text)
    return f"<[{token_id}]>" if token_id is not None else json.dumps(text)


def _json(schema: Any) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_STYLE})


def _closed(params: dict[str, Any]) -> dict[str, Any]:
    """A forced call holds the declared parameters only, unless the schema says otherwise
    (JSON Schema's default would let a model add keys no function takes)."""
    return {"additionalProperties": False, **params}


def _call_schema(tools: Sequence[Mapping[str, Any]], argument_key: str) -> dict[str, Any]:
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"const": _function(t)["name"]},
                argument_key: _closed(_parameters(t)),
            },
            "required": ["name", argument_key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def hermes_grammar(
    tools: Sequence[Mapping[str, Any]], tokenizer: Tokenizer, parallel: bool = True
) -> str:
    start, end = _token(tokenizer, "<tool_call>"), _token(tokenizer, "</tool_call>")
    call = f'{start} "\\n" {_json(_call_schema(tools, "arguments"))} "\\n" {end}'
    more = ' ("\\n" call)*' if parallel else ""
    return f"start: call{more}\ncall: {call}\n"


def llama3_grammar(
    tools: Sequence[Mapping[str, Any]], tokenizer: Tokenizer, parallel: bool = True
) -> str:
    # One call either way: Llama 3's templates refuse several calls in one turn.
    return f"start: {_json(_call_schema(tools, 'parameters'))}\n"


def granite_grammar(
    tools: Sequence[Mapping[str, Any]], tokenizer: Tokenizer, parallel: bool = True
) -> str:
    calls = {"type": "array", "items": _call_schema(tools, "arguments"), "minItems": 1}
    if not parallel:
        calls["maxItems"] = 1
    return f"start: {_token(tokenizer, GRANITE_TAG)} {_json(calls)}\n"


def _keyword_calls(
    tools: Sequence[Mapping[str, Any]],
    write: Callable[[str, Mapping[str, Any]], str],
    brackets: str = "()",
    sep: str = ", ",
) -> str:
    """Lark alternatives, one per tool: NAME, the opening bracket, its required parameters in
    order (each written by `write(key, schema)`), then its optional ones, each optional, in
    order, and the closing bracket."""
    comma = json.dumps(sep)
    rules = []
    for tool in tools:
        params = _parameters(tool)
        props = params.get("properties") or {}
        required = [k for k in params.get("required") or [] if k in props]
        optional = [k for k in props if k not in required]
        if required:
            parts = [f" {comma} ".join(write(k, props[k]) for k in required)]
        elif optional:  # the first argument needs no separator before it
            parts, optional = [f"({write(optional[0], props[optional[0]])})?"], optional[1:]
        else:
            parts = []
        parts += [f"({comma} {write(k, props[k])})?" for k in optional]
        head = json.dumps(_function(tool)["name"] + brackets[0])
        rules.append(" ".join([head, *parts, json.dumps(brackets[1])]))
    return " | ".join(f"({rule})" for rule in rules)


def lfm2_grammar(
    tools: Sequence[Mapping[str, Any]], tokenizer: Tokenizer, parallel: bool = True
) -> str:
    def write(key: str, schema: Mapping[str, Any]) -> str:
        return f"{json.dumps(key + '=')} {_json(schema)}"  # JSON literals: parse_lfm2 reads them

    calls = _keyword_calls(tools, write)
    start, end = _token(tokenizer, LFM2_START), _token(tokenizer, LFM2_END)
    more = ' (", " call)*' if parallel else ""
    return f'start: {start} "[" call{more} "]" {end}\ncall: {calls}\n'


def functiongemma_grammar(
    tools: Sequence[Mapping[str, Any]], tokenizer: Tokenizer, parallel: bool = True
) -> str:
    """One call: FunctionGemma writes one call per <start_function_call> block."""
    escape = _token(tokenizer, ESCAPE)

    def write(key: str, schema: Mapping[str, Any]) -> str:
        kind = schema.get("type")
        if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
            values = " | ".join(json.dumps(v) for v in schema["enum"])
            return f'"{key}:" {escape} ({values}) {escape}'
        if kind == "string":  # any text without "<" (markers start with it), within its bounds
            low, high = schema.get("minLength", 0), schema.get("maxLength")
            text = f"/[^<]{{{low},{'' if high is None else high}}}/"
            return f'"{key}:" {escape} {text} {escape}'
        if kind in ("integer", "number", "boolean"):
            return f'"{key}:" {_json(schema)}'
        raise InvalidArgument(
            f"tool_choice with this model's call format takes string, number and boolean "
            f"parameters only; {key!r} is {kind or 'untyped'}"
        )

    calls = _keyword_calls(tools, write, brackets="{}", sep=",")
    start, end = _token(tokenizer, CALL_START), _token(tokenizer, CALL_END)
    return f'start: {start} "call:" call {end}\ncall: {calls}\n'


# -- the registry ---------------------------------------------------------------------------------

# (tools, tokenizer, parallel: several calls allowed) -> Lark grammar
Grammar = Callable[[Sequence[Mapping[str, Any]], Tokenizer, bool], str]


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    # Text a chat template holds when it uses this format (it writes it or asks for it).
    markers: tuple[str, ...]
    parse: Callable[[str, Optional[str]], Parsed]
    grammar: Grammar


FORMATS = {
    f.name: f
    for f in (
        ToolCallFormat(
            "functiongemma", (CALL_START,), split_functiongemma_calls, functiongemma_grammar
        ),
        ToolCallFormat("granite", (GRANITE_TAG,), parse_granite, granite_grammar),
        ToolCallFormat("lfm2", (LFM2_START, "<|tool_list_start|>"), parse_lfm2, lfm2_grammar),
        ToolCallFormat("hermes", ("<tool_call>",), parse_hermes, hermes_grammar),
        ToolCallFormat(
            "llama3",
            (PYTHON_TAG, '{"name": function name, "parameters"'),
            parse_llama3,
            llama3_grammar,
        ),
    )
}


def format_for(template: Optional[str], default: Optional[str]) -> Optional[ToolCallFormat]:
    """The tool-call format of a chat template: the first format (in `FORMATS`' order) whose
    marker it holds, else the family's `default` (a name in FORMATS, or None)."""
    for fmt in FORMATS.values():
        if template and any(marker in template for marker in fmt.markers):
            return fmt
    return FORMATS[default] if default is not None else None


def choice_tools(
    tools: Sequence[Mapping[str, Any]], tool_choice: object
) -> Optional[list[Mapping[str, Any]]]:
    """The tools a `tool_choice` forces a call to (None: the model may answer in text):
    "auto" / "none" / None -> None, "required" -> all of them, a named function (OpenAI's
    {"type": "function", "function": {"name": ...}} or the name) -> that one."""
    if tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "required":
        return list(tools)
    name = tool_choice
    if isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name")
    names = check_tools(tools)
    if not isinstance(name, str) or name not in names:
        raise InvalidArgument(
            f"tool_choice must be 'auto', 'none', 'required' or one of the tools "
            f"({', '.join(names)}), got {tool_choice!r}"
        )
    return [tools[names.index(name)]]


__all__ = [
    "FORMATS",
    "ToolCallFormat",
    "check_tools",
    "choice_tools",
    "format_for",
    "parse_granite",
    "parse_hermes",
    "parse_lfm2",
    "parse_llama3",
]
