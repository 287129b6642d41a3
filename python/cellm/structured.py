"""Constrained decoding: outputs that match a JSON schema, a regular expression or a Lark
grammar, with llguidance (the library llama.cpp and mistral.rs use).

A request's constraint becomes one llguidance grammar (`grammar_for`). Per step, its matcher
gives the token ids that keep the output a prefix of some valid text (`TokenConstraint.allowed`);
the sampler draws only among them, so every output that ends by itself parses and validates.
Once the grammar is complete and nothing more may follow, the request ends ("stop") without
another step. An output cut by `max_tokens` or the context can still be incomplete
(finish_reason "length").

The tokenizer side (`LLTokenizer`, built from the model's tokenizer.json) is made once per
tokenizer and works with byte-level BPE and SentencePiece-with-byte-fallback vocabularies alike.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from cellm.errors import GrammarError, InvalidArgument

if TYPE_CHECKING:
    import llguidance

    from cellm.tokenizer import Tokenizer

# JSON as models write it by default (json.dumps' separators), with no free whitespace: a
# flexible-whitespace grammar lets a sampled model pad its output with blanks until max_tokens.
_JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
_RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:  # Python 3.9: llguidance has no wheel for it
        raise InvalidArgument(
            "constrained decoding (response_format, regex, grammar) needs the llguidance "
            "package (Python >= 3.10): pip install llguidance"
        ) from None
    return llguidance


def _one_line(message: str) -> str:
    """llguidance's messages may draw a caret under the grammar over several lines: keep the
    first line and the line saying what is wrong."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "invalid grammar"
    detail = [line for line in lines[1:] if line.startswith("error:")]
    return "; ".join(lines[:1] + detail[:1])


def _schema_of(response_format: Mapping[str, Any]) -> Optional[Any]:
    """The JSON schema an OpenAI `response_format` asks for (None: plain text)."""
    kind = response_format.get("type")
    if kind not in _RESPONSE_FORMATS:
        raise GrammarError(
            f"response_format type must be one of {', '.join(_RESPONSE_FORMATS)}, got {kind!r}"
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
        raise GrammarError('response_format of type "json_schema" needs a json_schema object')
    # OpenAI nests the schema: {"name": ..., "schema": {...}, "strict": ...}; a bare schema is
    # taken as it is.
    schema = spec.get("schema", spec) if "name" in spec or "schema" in spec else spec
    if not isinstance(schema, (Mapping, bool)):
        raise GrammarError("response_format json_schema.schema must be a JSON schema object")
    return schema


def grammar_for(
    response_format: Optional[Mapping[str, Any]] = None,
    regex: Optional[str] = None,
    grammar: Optional[str] = None,
) -> Optional[str]:
    """The llguidance grammar of a request's constraint, or None without one. At most one of
    `response_format` (OpenAI's: {"type": "json_schema", "json_schema": {...}} or
    {"type": "json_object"}), `regex` and `grammar` (Lark syntax) may be given. GrammarError
    if the constraint is malformed (checked without a tokenizer)."""
    given = [n for n, v in (("response_format", response_format), ("regex", regex)) if v]
    given += ["grammar"] if grammar else []
    if len(given) > 1:
        raise GrammarError(f"give at most one of response_format, regex and grammar, got {given}")
    schema = None
    if response_format is not None:
        if not isinstance(response_format, Mapping):
            raise GrammarError("response_format must be an object such as {'type': 'json_object'}")
        schema = _schema_of(response_format)
    if schema is None and regex is None and grammar is None:
        return None  # unconstrained: llguidance is not needed (nor there on Python 3.9)
    llg = _llguidance()
    if schema is not None:
        try:
            text = json.dumps(schema)
        except (TypeError, ValueError) as e:
            raise GrammarError(f"the JSON schema is not JSON: {e}") from None
        compiled: str = llg.LLMatcher.grammar_from_json_schema(text, overrides=_JSON_OPTIONS)
    elif regex is not None:
        if not isinstance(regex, str):
            raise GrammarError(f"regex must be a string, got {type(regex).__name__}")
        compiled = llg.LLMatcher.grammar_from_regex(regex)
    else:
        if not isinstance(grammar, str):
            raise GrammarError(
                f"grammar must be a string (Lark syntax), got {type(grammar).__name__}"
            )
        compiled = llg.LLMatcher.grammar_from_lark(grammar)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(compiled)
    if is_error:
        raise GrammarError(f"invalid {given[0]}: {_one_line(messages[0])}")
    return compiled


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _for_llguidance(tokenizer: Tokenizer) -> str:
    """The tokenizer.json llguidance is given. With byte fallback, the `<0xNN>` pieces are
    bytes; Gemma's tokenizer.json also lists them as special added tokens, which llguidance
    would then treat as special (unwritable) tokens: such entries are dropped from the
    added-token list (the model's vocabulary still holds them)."""
    tokenizer_json: str = tokenizer.raw.to_str()
    if not getattr(tokenizer.raw.model, "byte_fallback", False):
        return tokenizer_json  # nothing to change: skip parsing megabytes of JSON
    spec = json.loads(tokenizer_json)
    added = spec.get("added_tokens") or []
    spec["added_tokens"] = [t for t in added if not _BYTE_TOKEN.fullmatch(t.get("content", ""))]
    return json.dumps(spec)


# One LLTokenizer per (tokenizer, end-of-turn ids): building one walks the whole vocabulary.
_TOKENIZERS: weakref.WeakKeyDictionary[Tokenizer, dict[tuple[int, ...], Any]] = (
    weakref.WeakKeyDictionary()
)
_TOKENIZERS_LOCK = threading.Lock()


def ll_tokenizer(tokenizer: Tokenizer, eos_token_ids: frozenset[int]) -> llguidance.LLTokenizer:
    """llguidance's view of `tokenizer`, ending a grammar with any of `eos_token_ids`. Made
    on first use and kept while `tokenizer` lives: it walks the whole vocabulary, which takes
    seconds on a 150k-262k vocabulary (see docs/benchmarks.md)."""
    llg = _llguidance()
    eos = tuple(sorted(eos_token_ids))
    with _TOKENIZERS_LOCK:
        per_eos = _TOKENIZERS.setdefault(tokenizer, {})
        found = per_eos.get(eos)
        if found is None:
            try:
                found = llg.LLTokenizer(
                    _for_llguidance(tokenizer),
                    n_vocab=tokenizer.vocab_size,
                    eos_token=list(eos) or None,
                )
            except Exception as e:  # llguidance raises plain ValueError/RuntimeError
                raise GrammarError(
                    f"this tokenizer cannot be used for constrained decoding: {e}"
                ) from None
            per_eos[eos] = found
    result: llguidance.LLTokenizer = found
    return result


def token_bytes(tokenizer: Tokenizer, eos_token_ids: frozenset[int], token_id: int) -> bytes:
    """The bytes token `token_id` stands for (a special token: its text), whatever the
    vocabulary's kind: byte-level pieces, byte-fallback `<0xNN>`, SentencePiece's spaces."""
    return bytes(ll_tokenizer(tokenizer, eos_token_ids).decode_bytes([token_id]))


class TokenConstraint:
    """One request's matcher: which tokens may come next, and the tokens that came."""

    def __init__(self, grammar: str, tokenizer: Tokenizer, eos_token_ids: frozenset[int]) -> None:
        llg = _llguidance()
        self.vocab_size = tokenizer.vocab_size
        self.consumed = 0
        self._matcher = llg.LLMatcher(ll_tokenizer(tokenizer, eos_token_ids), grammar, log_level=0)
        self._check()
        self._mask = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)
        # Computed now, so that a constraint the tokenizer cannot start fails before any step.
        self._next: Optional[np.ndarray] = self._compute()

    def _check(self) -> None:
        if not self._matcher.is_error():
            return
        problem = _one_line(self._matcher.get_error())
        if problem.startswith("NoExtension"):  # the mask came out empty
            raise GrammarError(
                "the model's tokenizer cannot spell any text the constraint allows after "
                f"{self.consumed} generated tokens"
            )
        raise GrammarError(f"constrained decoding failed: {problem}")

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (only an end-of-turn token)."""
        return bool(self._matcher.is_stopped())

    def allowed(self) -> np.ndarray:
        """The ids that may come next, ascending (int64); never empty."""
        found, self._next = self._next, None
        return found if found is not None else self._compute()

    def _compute(self) -> np.ndarray:
        self._matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        self._check()
        bits = np.unpackbits(self._mask.view(np.uint8), bitorder="little")
        ids = np.flatnonzero(bits[: self.vocab_size])
        if ids.size == 0:  # llguidance normally reports this itself (above)
            raise GrammarError(
                f"the constraint allows no token after {self.consumed} generated tokens"
            )
        return ids

    def accept(self, token: int) -> None:
        """Advance past `token` (one `allowed` gave)."""
        self._matcher.consume_token(token)
        self.consumed += 1
        self._check()


__all__ = ["GrammarError", "TokenConstraint", "grammar_for", "ll_tokenizer", "token_bytes"]
