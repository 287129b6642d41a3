"""Streaming text out of a token stream: incremental detokenisation and stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cellm.errors import InvalidArgument

_REPLACEMENT = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence


class IncrementalDecoder:
    """Turns token ids, one at a time, into text pieces that concatenate to ``decode(all ids)``.

    Like vLLM's detokenizer / HF TextStreamer, it decodes only a short window: the tokens of the
    last emitted piece (the prefix, which gives the decoder its context, e.g. leading spaces)
    plus the ones not emitted yet. A piece ending in U+FFFD is held back, since a multi-byte
    character split over byte tokens decodes to U+FFFD until its last byte arrives.
    `tokenizer` is a ``tokenizers.Tokenizer`` (or anything with one in ``.raw``).
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tok = getattr(tokenizer, "raw", tokenizer)
        self._skip = skip_special_tokens
        self._window: list[int] = []  # the prefix tokens, then the unemitted ones
        self._read = 0  # window[:read] is the prefix
        self._prefix_text = ""  # decode(window[:read]), cached

    def _decode(self, ids: list[int]) -> str:
        text: str = self._tok.decode(ids, skip_special_tokens=self._skip)
        return text

    def add(self, token_id: int) -> str:
        """Feed one token; return the newly completed text (often "")."""
        self._window.append(int(token_id))
        text = self._decode(self._window)
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        piece = text[len(self._prefix_text) :]
        # The tokens just emitted become the next prefix; everything before them is dropped.
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        return piece

    def flush(self) -> str:
        """Return whatever is held back (at the end of generation) and reset."""
        text = self._decode(self._window)
        piece = text[len(self._prefix_text) :] if len(text) > len(self._prefix_text) else ""
        self._window, self._read, self._prefix_text = [], 0, ""
        return piece


class StopStringMatcher:
    """Cuts a text stream at the first stop string.

    ``feed`` holds back any tail that could be the start of a stop string, so a stop string
    split across pieces is still caught and none of it is ever emitted.
    """

    def __init__(self, stops: Sequence[str] | str) -> None:
        if isinstance(stops, str):
            stops = [stops]
        for s in stops:
            if not isinstance(s, str) or not s:
                raise InvalidArgument(f"stop strings must be non-empty strings, got {s!r}")
        self._stops = tuple(dict.fromkeys(stops))  # dedupe, keep order
        self._held = ""
        self.matched: str | None = None  # the stop string that ended the stream

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string was hit).

        On a hit the text before the stop string is returned; later calls return ("", True).
        """
        if self.stopped:
            return "", True
        buf = self._held + text
        hits = [(buf.find(s), s) for s in self._stops]
        hits = [h for h in hits if h[0] >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda h: h[0])  # the earliest stop wins
            self._held = ""
            return buf[:at], True
        keep = self._partial_len(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def _partial_len(self, buf: str) -> int:
        # Length of the longest tail of buf that is a proper prefix of some stop string.
        best = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best

    def flush(self) -> str:
        """Return the held-back text at the end of the stream (it was not a stop string)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


__all__ = ["IncrementalDecoder", "StopStringMatcher"]
