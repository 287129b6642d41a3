"""FunctionGemma tool calls: ``<start_function_call>call:NAME{key:value,...}<end_function_call>``.

Values follow the model's training format: strings are wrapped in ``<escape>...<escape>`` (so
commas, braces and quotes inside them are plain text), numbers and ``true``/``false`` are bare,
``{k:v,...}`` is an object and ``[v,...]`` a list, nested to any depth.
"""

from __future__ import annotations

import re
from typing import Any, Optional

CALL_START = "<start_function_call>"
CALL_END = "<end_function_call>"
ESCAPE = "<escape>"
_CALL_PREFIX = "call:"

# Names and keys: anything up to the next piece of syntax (names may hold dots or dashes).
_NAME = re.compile(r"[^\s{}\[\],:<>]+")
# A bare (unescaped) value runs to the next separator; it never contains a marker's "<".
_BARE = re.compile(r"[^,{}\[\]<>]*")
_INT = re.compile(r"-?\d+")
_FLOAT = re.compile(r"-?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?")
_LITERALS = {"true": True, "false": False, "null": None}


class _Malformed(Exception):
    """Raised inside the parser; never leaves this module."""


class _CallParser:
    """Recursive descent over one call, starting just after ``<start_function_call>``."""

    def __init__(self, text: str, pos: int) -> None:
        self.text = text
        self.pos = pos

    def parse_call(self) -> dict[str, Any]:
        self._expect(_CALL_PREFIX)
        name = self._name()
        arguments = self._object()
        self._skip_space()
        self._expect(CALL_END)
        return {"name": name, "arguments": arguments}

    # -- syntax ---------------------------------------------------------------------------

    def _object(self) -> dict[str, Any]:
        self._expect("{")
        out: dict[str, Any] = {}
        if self._take("}"):
            return out
        while True:
            key = self._name()
            self._expect(":")
            out[key] = self._value()
            if self._take("}"):
                return out
            self._expect(",")

    def _list(self) -> list[Any]:
        self._expect("[")
        out: list[Any] = []
        if self._take("]"):
            return out
        while True:
            out.append(self._value())
            if self._take("]"):
                return out
            self._expect(",")

    def _value(self) -> Any:
        self._skip_space()
        if self.text.startswith(ESCAPE, self.pos):
            return self._escaped_string()
        if self.text.startswith("{", self.pos):
            return self._object()
        if self.text.startswith("[", self.pos):
            return self._list()
        return self._bare()

    def _escaped_string(self) -> str:
        start = self.pos + len(ESCAPE)
        end = self.text.find(ESCAPE, start)
        # A string never spans a call marker: if it seems to, its closing <escape> is missing
        # and the one found belongs to a later call.
        if end < 0 or CALL_END in self.text[start:end] or CALL_START in self.text[start:end]:
            raise _Malformed("unterminated <escape>")
        self.pos = end + len(ESCAPE)
        return self.text[start:end]  # verbatim: no trimming, no unescaping

    def _bare(self) -> Any:
        m = _BARE.match(self.text, self.pos)
        word = m.group().strip() if m else ""
        if m is None or not word:
            raise _Malformed(f"missing value at {self.pos}")
        self.pos = m.end()
        return _convert_bare(word)

    def _name(self) -> str:
        self._skip_space()
        m = _NAME.match(self.text, self.pos)
        if not m:
            raise _Malformed(f"missing name at {self.pos}")
        self.pos = m.end()
        return m.group()

    # -- cursor helpers -------------------------------------------------------------------

    def _skip_space(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def _take(self, literal: str) -> bool:
        self._skip_space()
        if self.text.startswith(literal, self.pos):
            self.pos += len(literal)
            return True
        return False

    def _expect(self, literal: str) -> None:
        if not self._take(literal):
            raise _Malformed(f"expected {literal!r} at {self.pos}")


def _convert_bare(word: str) -> Any:
    if word in _LITERALS:
        return _LITERALS[word]
    if _INT.fullmatch(word):
        return int(word)
    if _FLOAT.fullmatch(word):
        return float(word)
    return word  # an unescaped word: keep what the model wrote rather than drop the call


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Split a FunctionGemma answer into its text and its tool calls.

    Returns ``(content, calls)``: each call is ``{"name": str, "arguments": dict}`` in the
    order written; values become Python types (``<escape>`` strings verbatim, int, float,
    bool, None for ``null``, dict, list; any other bare word stays a str). Without
    a well-formed call, ``content`` is ``text`` unchanged; otherwise it is the text around the
    calls, stripped of surrounding whitespace.

    Malformed calls (no ``<end_function_call>``, no ``call:``, unbalanced braces or brackets,
    an unterminated ``<escape>``) never raise: a model's answer is data, not a program error.
    The malformed span is left in ``content``, verbatim, and yields no call, so the caller
    still sees what the model wrote; later well-formed calls are still parsed.
    """
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0  # text[pos:] is not yet kept or consumed
    search = 0
    while True:
        start = text.find(CALL_START, search)
        if start < 0:
            break
        parser = _CallParser(text, start + len(CALL_START))
        try:
            calls.append(parser.parse_call())
        except _Malformed:
            search = start + len(CALL_START)  # keep it as text; look for the next call
            continue
        kept.append(text[pos:start])
        pos = search = parser.pos
    if not calls:
        return text, []
    kept.append(text[pos:])
    return "".join(kept).strip(), calls


def close_call_cut_by_stop(text: str, stop_token: Optional[str]) -> str:
    """Put back an ``<end_function_call>`` that ended generation as a stop token.

    Stop tokens are not part of the generated text, so with ``<end_function_call>`` among
    them the last call would otherwise look unterminated."""
    if stop_token == CALL_END and text.rfind(CALL_START) > text.rfind(CALL_END):
        return text + CALL_END
    return text


def split_functiongemma_calls(
    text: str, stop_token: Optional[str]
) -> tuple[str, list[dict[str, Any]]]:
    """The Gemma family's tool-call parser: an answer that a stop token (`stop_token`, its
    text) ended, as ``(content, calls)``."""
    return parse_tool_calls(close_call_cut_by_stop(text, stop_token))


__all__ = [
    "CALL_END",
    "CALL_START",
    "ESCAPE",
    "close_call_cut_by_stop",
    "parse_tool_calls",
    "split_functiongemma_calls",
]
