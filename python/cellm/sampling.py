"""Logits -> next token, with the semantics of Hugging Face ``generate()`` and OpenAI's
penalties.

``make_sampler`` builds the pipeline once per request (like mlx-lm's ``make_sampler``), in this
order: repetition penalty (HF) -> presence and frequency penalties (OpenAI) -> logit_bias
(`Sampler.adjust`); then, among the ids a grammar allows (all without one), either greedy
argmax (temperature 0) or temperature -> top-k -> top-p -> min-p -> one draw from a PCG64
generator seeded per request (`Sampler.pick`). Log-probabilities (`log_softmax`) are those of
the adjusted logits: after the penalties and logit_bias, before the grammar mask, the
temperature and the truncations.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable

import numpy as np

from cellm.errors import InvalidArgument

# A filter maps (candidate ids, their scaled logits) to a subset of them.
Filter = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]

# OpenAI's bound on top_logprobs.
MAX_TOP_LOGPROBS = 20
# top-p looks at this many best candidates, growing it only if their mass is < top_p, so the
# usual case costs an O(vocab) partition instead of a full O(vocab log vocab) sort ...
_TOP_P_FIRST_GUESS = 64
# ... or first every token within this many nats of the best logit (a token of p_max * e^-8
# at most), where those are at most _TOP_P_MANY.
_TOP_P_SPAN = 8.0
_TOP_P_MANY = 4096


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """How to generate: the settings `LLM.generate`, `stream` and `chat` take as keywords, or
    as one object (`params=`). The defaults are greedy decoding with every filter off, up to
    256 tokens, stopping at the model's end-of-turn ids."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repeat_penalty: float = 1.0  # 1 = off (HF repetition_penalty)
    seed: int | None = None  # None = fresh OS entropy
    max_tokens: int = 256
    stop: str | Sequence[str] | None = None  # strings that end the text (not included in it)
    stop_token_ids: Sequence[int] = ()  # ids that end it, besides the end-of-turn ids
    ignore_eos: bool = False  # True: don't stop at the model's end-of-turn ids
    # None: True (special tokens leave the text), except in chat() with tools and with a
    # constraint (below): False.
    skip_special_tokens: bool | None = None
    # OpenAI's penalties over the generated tokens (not the prompt): each logit drops by
    # presence_penalty if its token was generated and by frequency_penalty per time it was.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None  # token id -> added to its logit
    # Each generated token's log-probability, and its top_logprobs best alternatives.
    logprobs: bool = False
    top_logprobs: int = 0
    # Constrained decoding (cellm.structured), at most one of: OpenAI's response_format
    # ({"type": "json_schema", "json_schema": {...}} or {"type": "json_object"}), a regular
    # expression, or a Lark grammar that the whole output must match.
    response_format: Mapping[str, Any] | None = None
    regex: str | None = None
    grammar: str | None = None

    def validate(self) -> SamplingParams:
        """Raise InvalidArgument for an out-of-range value; return self."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        t, k, p, m, r = self.temperature, self.top_k, self.top_p, self.min_p, self.repeat_penalty
        if not (_is_real(t) and math.isfinite(t) and t >= 0):
            raise InvalidArgument(f"temperature must be a finite number >= 0, got {t!r}")
        if not (_is_int(k) and k >= 0):
            raise InvalidArgument(f"top_k must be an integer >= 0 (0 = off), got {k!r}")
        if not (_is_real(p) and 0 < p <= 1):
            raise InvalidArgument(f"top_p must be in (0, 1], got {p!r}")
        if not (_is_real(m) and 0 <= m < 1):
            raise InvalidArgument(f"min_p must be in [0, 1), got {m!r}")
        if not (_is_real(r) and math.isfinite(r) and r > 0):
            raise InvalidArgument(f"repeat_penalty must be a finite number > 0, got {r!r}")
        if self.seed is not None and not (_is_int(self.seed) and self.seed >= 0):
            raise InvalidArgument(f"seed must be an integer >= 0 or None, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (_is_real(v) and -2 <= v <= 2):
                raise InvalidArgument(f"{name} must be a number in [-2, 2], got {v!r}")
        _check_logit_bias(self.logit_bias)
        if not isinstance(self.logprobs, bool):
            raise InvalidArgument(f"logprobs must be True or False, got {self.logprobs!r}")
        n = self.top_logprobs
        if not (_is_int(n) and 0 <= n <= MAX_TOP_LOGPROBS):
            raise InvalidArgument(
                f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {n!r}"
            )
        if n and not self.logprobs:
            raise InvalidArgument("top_logprobs needs logprobs=True")
        return self


def _check_logit_bias(bias: object) -> None:
    if bias is None:
        return
    if not isinstance(bias, Mapping):
        raise InvalidArgument(f"logit_bias must map token ids to numbers, got {bias!r}")
    for token, value in bias.items():
        if not (_is_int(token) and token >= 0):
            raise InvalidArgument(
                f"logit_bias keys must be token ids (integers >= 0), got {token!r}"
            )
        if not (_is_real(value) and -100 <= value <= 100):
            raise InvalidArgument(
                f"logit_bias values must be numbers in [-100, 100], got {value!r} for {token}"
            )


def apply_repeat_penalty(
    logits: np.ndarray, context_ids: Sequence[int], penalty: float
) -> np.ndarray:
    """HF RepetitionPenaltyLogitsProcessor on a copy: each distinct context id's logit l
    becomes l * penalty if l < 0 else l / penalty."""
    ids = np.unique(np.asarray(context_ids, dtype=np.int64))
    if ids.size == 0:
        return logits
    if ids[0] < 0 or ids[-1] >= logits.size:
        raise InvalidArgument(f"context token id out of range for a vocabulary of {logits.size}")
    out: np.ndarray = logits.copy()
    s = out[ids]
    out[ids] = np.where(s < 0, s * penalty, s / penalty)
    return out


def apply_presence_frequency(
    logits: np.ndarray, output_ids: Sequence[int], presence: float, frequency: float
) -> np.ndarray:
    """OpenAI's penalties on a copy: each generated token's logit drops by
    presence + frequency * (times it was generated)."""
    ids, counts = np.unique(np.asarray(output_ids, dtype=np.int64), return_counts=True)
    if ids.size == 0:
        return logits
    if ids[-1] >= logits.size:
        raise InvalidArgument(f"generated token id out of range for a vocabulary of {logits.size}")
    out: np.ndarray = logits.copy()
    out[ids] -= np.float32(presence) + np.float32(frequency) * counts.astype(np.float32)
    return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log p over the vocabulary, in float64 (a float32 sum over 150k entries loses digits)."""
    x = np.asarray(logits, dtype=np.float64)
    top = x.max()
    if not np.isfinite(top):
        raise InvalidArgument("logits contain NaN or are all -inf")
    shifted = x - top
    out: np.ndarray = shifted - np.log(np.exp(shifted).sum())
    return out


def top_entries(values: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k largest (index, value) pairs, largest first (ties: lowest index first)."""
    if k <= 0:
        return []
    k = min(k, values.size)
    best = np.argpartition(-values, k - 1)[:k]
    best = best[np.lexsort((best, -values[best]))]
    return [(int(i), float(values[i])) for i in best]


def _best(z: np.ndarray, k: int) -> np.ndarray:
    # Indices of every entry >= the k-th largest (so ties at the boundary all count), unordered.
    # np.partition is O(n), and much faster than argpartition here.
    if k >= z.size:
        return np.arange(z.size)
    kth = np.partition(z, z.size - k)[z.size - k]
    return np.flatnonzero(z >= kth)


def _top_k(ids: np.ndarray, z: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    # HF TopKLogitsWarper removes only scores < the k-th largest: boundary ties survive.
    keep = _best(z, k)
    return ids[keep], z[keep]


def _top_p(ids: np.ndarray, z: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    # HF TopPLogitsWarper: keep the most probable tokens until their mass reaches top_p; a token
    # is kept iff the mass strictly above it is < top_p, so the best one always survives.
    # Only candidates are sorted, any prefix of the descending order that holds top_p of the
    # mass: first every token within _TOP_P_SPAN of the best logit (one compare, cheaper than
    # a partition; the k best by partition where that is more than _TOP_P_MANY tokens), then,
    # while short of top_p, the k best for a k growing 8-fold.
    top = z.max()
    e = np.exp(z - top)
    total = e.sum()
    cand = np.flatnonzero(z >= top - _TOP_P_SPAN)
    k = _TOP_P_FIRST_GUESS
    if cand.size > _TOP_P_MANY:
        cand = _best(z, k)
    while True:
        p = e[cand] / total
        order = np.argsort(-p, kind="stable")
        # The exact prefix of the full sorted cumulative sum, in float64: float32 would stop
        # adding a long tail's tiny terms once the sum nears 1 (HF sums them first, ascending).
        cum = np.cumsum(p[order], dtype=np.float64)
        if cand.size == z.size or cum[-1] >= top_p:
            break
        k = max(k, cand.size) * 8
        cand = _best(z, k)
    keep = cand[order[: min(order.size, int(np.searchsorted(cum, top_p, side="left")) + 1)]]
    return ids[keep], z[keep]


def _min_p(ids: np.ndarray, z: np.ndarray, min_p: float) -> tuple[np.ndarray, np.ndarray]:
    # HF MinPLogitsWarper drops p < min_p * p_max; p / p_max = exp(z - z_max) needs no softmax.
    keep = np.exp(z - z.max()) >= min_p
    return ids[keep], z[keep]


class Sampler:
    """Picks the next token. Built once per request (it owns the seeded generator)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = replace(params).validate()  # a copy: later edits to params don't leak in
        if self.params.logit_bias:
            self.params.logit_bias = dict(self.params.logit_bias)
        self._rng = np.random.Generator(np.random.PCG64(self.params.seed))
        self._filters: list[Filter] = []
        self._all_ids = np.arange(0)
        self._bias = np.zeros(0, dtype=np.float32)
        # Same order and on/off conditions as HF's _get_logits_processor.
        if self.params.top_k > 0:
            self._filters.append(partial(_top_k, k=self.params.top_k))
        if self.params.top_p < 1.0:
            self._filters.append(partial(_top_p, top_p=self.params.top_p))
        if self.params.min_p > 0.0:
            self._filters.append(partial(_min_p, min_p=self.params.min_p))

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0.0

    def __call__(
        self,
        logits: np.ndarray,
        context_ids: Sequence[int] = (),
        allowed: np.ndarray | None = None,
        output_ids: Sequence[int] = (),
    ) -> int:
        """The next token id for `logits` (vocab,), given every token id so far (prompt included,
        for the repetition penalty) and the generated ones (for the presence and frequency
        penalties); with `allowed` (ascending ids, a grammar's mask), only among those. Never
        modifies `logits`."""
        return self.pick(self.adjust(logits, context_ids, output_ids), allowed)

    def adjust(
        self, logits: np.ndarray, context_ids: Sequence[int] = (), output_ids: Sequence[int] = ()
    ) -> np.ndarray:
        """`logits` as float32 after the penalties and logit_bias (a copy if any applies)."""
        x = np.asarray(logits, dtype=np.float32)  # float32 like HF; float64 exp is ~10x slower
        if x.ndim != 1 or x.size == 0:
            raise InvalidArgument(f"logits must be a non-empty 1-D array, got shape {x.shape}")
        p = self.params
        if p.repeat_penalty != 1.0:
            x = apply_repeat_penalty(x, context_ids, p.repeat_penalty)
        if p.presence_penalty or p.frequency_penalty:
            x = apply_presence_frequency(x, output_ids, p.presence_penalty, p.frequency_penalty)
        if p.logit_bias:
            x = x + self._dense_bias(x.size)  # a new array: logits stay untouched
        return x

    def _dense_bias(self, vocab: int) -> np.ndarray:
        # Made once per request: adding a dense vector beats a scattered add of a copy.
        if self._bias.size != vocab:
            bias = self.params.logit_bias or {}
            bad = [t for t in bias if t >= vocab]
            if bad:
                raise InvalidArgument(
                    f"logit_bias names token {min(bad)}, outside the vocabulary ({vocab})"
                )
            self._bias = np.zeros(vocab, dtype=np.float32)
            for token, value in bias.items():
                self._bias[token] = value
        return self._bias

    def pick(self, x: np.ndarray, allowed: np.ndarray | None = None) -> int:
        """The token drawn from adjusted logits `x` (see `adjust`); only among `allowed`."""
        if allowed is not None:  # the mask comes first: the filters see only what it allows
            if self.greedy:
                return int(allowed[np.argmax(x[allowed])])  # ascending: ties -> lowest id
            ids, z = allowed, x[allowed] / np.float32(self.params.temperature)
        elif self.greedy:
            return int(np.argmax(x))  # ties -> lowest id, like torch.argmax
        else:
            if self._all_ids.size != x.size:  # made once per request, not per token
                self._all_ids = np.arange(x.size)
            ids = self._all_ids
            z = x / np.float32(self.params.temperature)  # a new array: logits stay untouched
        for f in self._filters:
            ids, z = f(ids, z)
        return self._draw(ids, z)

    def _draw(self, ids: np.ndarray, z: np.ndarray) -> int:
        top = z.max()
        if not np.isfinite(top):
            raise InvalidArgument("logits contain NaN or are all -inf")
        # Inverse-CDF draw: one uniform per token, so a seed fixes the whole sequence.
        # z is always our own copy, so work in place (fresh vocab-sized arrays are slow).
        weights = np.exp(np.subtract(z, top, out=z), out=z)
        return int(ids[inverse_cdf(weights, self._rng.random())])


# Above this many weights, `inverse_cdf` finds the draw's block of _DRAW_BLOCK first: numpy's
# cumsum adds one value at a time (127 us over a 49k vocabulary, most of a sampled token's
# cost), while its sums by block are vectorised (12-33 us), and then one block is summed in
# order.
_DRAW_BLOCK = 256
_BLOCKED_DRAW = 16 * _DRAW_BLOCK


def inverse_cdf(weights: np.ndarray, r: float) -> int:
    """The index whose cumulative weight first exceeds `r` times the total, for non-negative
    float32 `weights` (some positive) and `r` in [0, 1): a token drawn with probability
    proportional to its weight. A zero weight is never drawn. `weights` is left as it is."""
    if weights.size <= _BLOCKED_DRAW:
        cum = np.cumsum(weights)
        i = int(np.searchsorted(cum, np.float32(r * float(cum[-1])), "right"))
        if i == cum.size:  # rounded up onto the total: take the last token with any weight
            i = int(np.searchsorted(cum, cum[-1], "left"))
        return i
    ends = np.cumsum(np.add.reduceat(weights, np.arange(0, weights.size, _DRAW_BLOCK)))
    u = np.float32(r * float(ends[-1]))
    b = int(np.searchsorted(ends, u, "right"))
    if b == ends.size:  # rounded up onto the total
        return int(np.flatnonzero(weights)[-1])
    start = b * _DRAW_BLOCK
    block = weights[start : start + _DRAW_BLOCK]
    before = ends[b - 1] if b else np.float32(0.0)
    i = int(np.searchsorted(np.cumsum(block), np.float32(u - before), "right"))
    if i == block.size:  # the block's sum in order came out below its vectorised sum
        i = int(np.flatnonzero(block)[-1])
    return start + i


def make_sampler(params: SamplingParams | None = None) -> Sampler:
    """A Sampler for one request; validates `params` (InvalidArgument if out of range)."""
    return Sampler(params if params is not None else SamplingParams())


__all__ = [
    "MAX_TOP_LOGPROBS",
    "SamplingParams",
    "Sampler",
    "apply_presence_frequency",
    "apply_repeat_penalty",
    "inverse_cdf",
    "log_softmax",
    "make_sampler",
    "top_entries",
]
