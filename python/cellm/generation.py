"""One request's generation, apart from who drives the engine: its result types, the engine
session it owns (`KvSession`) and its decoding state (`Decoding`: sampler, stop rules,
detokenizer). `LLM` drives one request at a time; `cellm.scheduler` drives many in one batch."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import numpy as np

from cellm import _core
from cellm.errors import InvalidArgument
from cellm.sampling import SamplingParams, log_softmax, make_sampler, top_entries
from cellm.structured import TokenConstraint, grammar_for
from cellm.textstream import IncrementalDecoder, StopStringMatcher
from cellm.tokenizer import Tokenizer

# The fewest prompt rows a reused prefix leaves to prefill: attention sends runs of fewer new
# rows through its row path, which rounds differently from the query tiles that filled the
# cached pages (`MIN_TILED_ROWS` in crates/cellm-kv/src/attention.rs and cellm/scheduler.py).
MIN_PREFILL_TAIL = 8


@dataclass
class Timings:
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    # A vision-language prompt's images: how many were encoded, in how long (not in prefill_s).
    images: int = 0
    image_encode_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class TokenLogprob:
    """A generated token's log-probability and the best alternatives at its position, from
    the logits after the penalties and logit_bias, before the grammar mask, the temperature
    and top-k/top-p/min-p (see `cellm.sampling`)."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)  # (id, logprob), best first


class Piece(str):
    """A piece of streamed text, with the log-probabilities of the tokens that completed it
    (empty unless logprobs were asked for; a piece may span several tokens, and the tokens
    whose text is held back at the end come with the result only)."""

    logprobs: tuple[TokenLogprob, ...]

    def __new__(cls, text: str, logprobs: Sequence[TokenLogprob] = ()) -> Piece:
        piece = super().__new__(cls, text)
        piece.logprobs = tuple(logprobs)
        return piece


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (end-of-turn id or stop string) or "length"
    prompt_tokens: int
    timings: Timings = field(default_factory=Timings)
    stop_token_id: Optional[int] = None  # the end-of-turn/stop id that ended it, if one did
    # chat() only: the parsed tool calls ({"name", "arguments"}), removed from `text`.
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    # With logprobs=True: one entry per token of `token_ids`.
    logprobs: Optional[list[TokenLogprob]] = None


class KvStats(NamedTuple):
    """The KV pool's usage (`LLM.kv_stats()`)."""

    pages_in_use: int  # held by sessions (a page shared by several counts once)
    pages_allocated: int  # the pool's high-water mark
    page_bytes: int
    cached_pages: int  # listed by the prefix cache (held by sessions or idle)
    prefix_hit_tokens: int  # prompt positions taken from the prefix cache instead of prefill


class KvSession:
    """An engine session and the token ids its cache holds, so that a later prompt which
    starts with them prefills only the rest; an empty session starts from the engine's prefix
    cache (pages of earlier requests with the same leading ids). Every engine call holds
    `lock`, the model's (shared by all its sessions: the engine takes one call at a time)."""

    def __init__(self, engine: _core.Engine, lock: threading.RLock) -> None:
        self._engine = engine
        self._lock = lock
        with lock:
            self.id: Optional[int] = engine.create_session()
        self.ids: list[int] = []

    def reuse(self, ids: list[int], shareable: Optional[int] = None) -> list[int]:
        """Keeps the longest cached prefix of `ids` (all but its last id, which must be
        stepped for its logits) and returns the ids still to prefill. Only the first
        `shareable` ids (default: all) may come from the engine's prefix cache: the rows of
        image tokens follow from the image, not from their ids."""
        keep = 0
        limit = min(len(self.ids), len(ids) - 1)
        while keep < limit and self.ids[keep] == ids[keep]:
            keep += 1
        if keep < len(self.ids):
            with self._lock:
                try:
                    self._engine.truncate_session(self.live(), keep)
                except InvalidArgument:  # recurrent or sliding state cannot rewind: start over
                    self._engine.truncate_session(self.live(), 0)
                    keep = 0
            del self.ids[keep:]
        if not self.ids:
            # Cached pages cover whole pages of the prompt; the rest is prefilled here. Leave
            # at least MIN_PREFILL_TAIL rows, so the rest runs through attention's query tiles
            # as it did when those pages were filled (chunks of the scheduler never end with
            # fewer rows), and the prompt's logits are bitwise a cold run's.
            cap = len(ids) - MIN_PREFILL_TAIL + 1
            share = cap if shareable is None else min(shareable, cap)
            with self._lock:
                keep = self._engine.reuse_prefix(self.live(), ids[: max(share, 0)])
            self.ids = ids[:keep]
        return ids[keep:]

    def step(
        self, ids: list[int], embeds: Optional[tuple[list[int], np.ndarray]] = None
    ) -> np.ndarray:
        """Next-token logits after feeding `ids` to the session; `embeds` (positions among
        `ids`, rows) replaces those tokens' embeddings (image features)."""
        given = [] if embeds is None else [(0, *embeds)]
        row: np.ndarray = step_sessions(self._engine, self._lock, [(self, ids)], given)[0]
        return row

    def close(self) -> None:
        if self.id is not None:
            with self._lock:
                self._engine.free_session(self.id)
            self.id = None

    def live(self) -> int:
        if self.id is None:
            raise InvalidArgument("this session was closed")
        return self.id


def step_sessions(
    engine: _core.Engine,
    lock: threading.RLock,
    batch: Sequence[tuple[KvSession, list[int]]],
    embeds: Sequence[tuple[int, list[int], np.ndarray]] = (),
) -> np.ndarray:
    """One engine step over several sessions' new ids; row i holds the next-token logits of
    `batch[i]`. Each session then holds its ids. `embeds` replace some tokens' embeddings
    (image features): (index in `batch`, positions among its ids, rows)."""
    given = list(embeds) or None
    with lock:
        logits: np.ndarray = engine.step([(kv.live(), ids) for kv, ids in batch], embeds=given)
    for kv, ids in batch:
        kv.ids.extend(ids)
    return logits


class Decoding:
    """A request's decoding state. Given the logits after its last fed token, `advance`
    samples the next token, applies the stop rules (end-of-turn ids, stop strings, the token
    and context limits) and returns the token to feed next (None once finished) with the text
    it completed."""

    def __init__(
        self,
        ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        eos_token_ids: frozenset[int],
        context_length: int,
    ) -> None:
        self.sampler = make_sampler(params)  # validates `params` (max_tokens first)
        p = self.sampler.params
        self.params, self.tokenizer, self.context_length = p, tokenizer, context_length
        self.prompt_tokens = len(ids)
        self.stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        outside = [t for t in p.logit_bias or {} if t >= tokenizer.vocab_size]
        if outside:
            raise InvalidArgument(
                f"logit_bias names token {min(outside)}, outside the vocabulary "
                f"({tokenizer.vocab_size})"
            )
        grammar = grammar_for(p.response_format, p.regex, p.grammar)
        self.constraint = (
            None if grammar is None else TokenConstraint(grammar, tokenizer, eos_token_ids)
        )
        # A constrained text is every token the grammar matched: a vocabulary may mark pieces
        # of text as special (Gemma's HF tokenizer.json does so with its byte tokens).
        skip = p.skip_special_tokens
        if skip is None:
            skip = self.constraint is None
        self.decoder = IncrementalDecoder(tokenizer, skip_special_tokens=skip)
        self.matcher = StopStringMatcher(
            [p.stop] if isinstance(p.stop, str) else list(p.stop or [])
        )
        self.out: list[int] = []
        self.logprobs: Optional[list[TokenLogprob]] = [] if p.logprobs else None
        self._sent = 0  # logprobs already attached to a piece
        self.context = list(ids)  # prompt + output, grown in place for the repetition penalty
        self.text: list[str] = []
        self.finish_reason = "length"
        self.stop_token_id: Optional[int] = None
        self.done = False

    def advance(self, logits: np.ndarray) -> tuple[Optional[int], list[Piece]]:
        x = self.sampler.adjust(logits[: self.tokenizer.vocab_size], self.context, self.out)
        allowed = None if self.constraint is None else self.constraint.allowed()
        token = self.sampler.pick(x, allowed)
        if token in self.stops:
            self.finish_reason, self.stop_token_id = "stop", token
            return None, self._finish(cut=False)
        if self.constraint is not None:
            self.constraint.accept(token)
        if self.logprobs is not None:
            lp = log_softmax(x)
            top = top_entries(lp, self.params.top_logprobs)
            self.logprobs.append(TokenLogprob(token, float(lp[token]), top))
        self.out.append(token)
        self.context.append(token)
        text, hit = self.matcher.feed(self.decoder.add(token))
        pieces = self._pieces(text)
        if hit:  # a stop string ended the text mid-stream: what it held back is not text
            self.finish_reason = "stop"
            return None, pieces + self._finish(cut=True)
        if self.constraint is not None and self.constraint.finished:
            # The grammar is complete and allows only an end-of-turn token: end here.
            self.finish_reason = "stop"
            return None, pieces + self._finish(cut=False)
        full = self.prompt_tokens + len(self.out) >= self.context_length
        if len(self.out) >= self.params.max_tokens or full:
            return None, pieces + self._finish(cut=False)
        return token, pieces

    def _pieces(self, text: str) -> list[Piece]:
        """`text` as the next piece (none if empty), carrying the logprobs not yet sent."""
        if not text:
            return []
        self.text.append(text)
        sent, self._sent = self._sent, len(self.logprobs or ())
        return [Piece(text, (self.logprobs or [])[sent:])]

    def _finish(self, cut: bool) -> list[Piece]:
        self.done = True
        if cut:
            return []
        # Text held back (partial UTF-8, a possible stop prefix) is real text.
        tail, _ = self.matcher.feed(self.decoder.flush())
        return self._pieces(tail + self.matcher.flush())

    def result(self, timings: Timings) -> GenerationResult:
        return GenerationResult(
            "".join(self.text),
            self.out,
            self.finish_reason,
            self.prompt_tokens,
            timings,
            self.stop_token_id,
            logprobs=None if self.logprobs is None else list(self.logprobs),
        )
