"""From per-token BIOES label logits to labelled spans: Viterbi decoding over the label
sequences that are well formed (an entity opens with `B-x` and closes with `E-x`, or is one
`S-x` token; `I-x`/`E-x` only continue an open `x`), so no decoded span is half open."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cellm.errors import FormatError

OUTSIDE = "O"
_TAGS = ("B", "I", "E", "S")


@dataclass(frozen=True)
class Scheme:
    """A BIOES label set: each label's tag (O, B, I, E, S) and entity (empty for O)."""

    labels: tuple[str, ...]
    tags: tuple[str, ...]
    entities: tuple[str, ...]

    @classmethod
    def parse(cls, labels: Sequence[str]) -> Scheme:
        tags, entities = [], []
        for label in labels:
            if label == OUTSIDE:
                tags.append(OUTSIDE)
                entities.append("")
                continue
            tag, sep, entity = label.partition("-")
            if not sep or tag not in _TAGS or not entity:
                raise FormatError(f"label {label!r} is not a BIOES label (O, B-x, I-x, E-x, S-x)")
            tags.append(tag)
            entities.append(entity)
        if OUTSIDE not in labels:
            raise FormatError("the labels have no 'O' (outside) label")
        return cls(tuple(labels), tuple(tags), tuple(entities))

    def allowed(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(start, transition, end): which labels may open a sequence, follow each label
        (`transition[prev, next]`) and close it."""
        n = len(self.labels)
        closed = np.array([t in (OUTSIDE, "E", "S") for t in self.tags])
        opening = np.array([t in (OUTSIDE, "B", "S") for t in self.tags])
        inside = np.array([t in ("I", "E") for t in self.tags])
        transition = np.zeros((n, n), dtype=bool)
        for prev in range(n):
            if closed[prev]:
                transition[prev] = opening
            else:  # B-x or I-x: only I-x or E-x of the same entity
                same = np.array([e == self.entities[prev] for e in self.entities])
                transition[prev] = inside & same
        return opening, transition, closed

    def valid(self, path: Sequence[int]) -> bool:
        """Whether a label sequence is well formed."""
        start, transition, end = self.allowed()
        if not path:
            return True
        steps = all(transition[a, b] for a, b in zip(path, path[1:]))
        return bool(start[path[0]] and steps and end[path[-1]])


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    out: np.ndarray = x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return out


def viterbi(logits: np.ndarray, scheme: Scheme) -> list[int]:
    """The well-formed label sequence of highest total log-probability (per-token softmax of
    `logits`, `(tokens, labels)`); ties go to the lower label id."""
    n, width = logits.shape
    if width != len(scheme.labels):
        raise FormatError(f"{width} logits per token for {len(scheme.labels)} labels")
    if n == 0:
        return []
    start, transition, end = scheme.allowed()
    logp = log_softmax(logits)
    forbid = np.where(transition, 0.0, -np.inf)
    score = np.where(start, logp[0], -np.inf)
    back = np.zeros((n, width), dtype=np.int64)
    for t in range(1, n):
        # candidates[prev, next]
        candidates = score[:, None] + forbid
        back[t] = candidates.argmax(axis=0)
        score = candidates.max(axis=0) + logp[t]
    score = np.where(end, score, -np.inf)
    path = [int(score.argmax())]
    for t in range(n - 1, 0, -1):
        path.append(int(back[t, path[-1]]))
    return path[::-1]


@dataclass(frozen=True)
class TokenSpan:
    """An entity over tokens `first..last` (inclusive)."""

    entity: str
    first: int
    last: int


def token_spans(path: Sequence[int], scheme: Scheme) -> list[TokenSpan]:
    """The entities of a well-formed label sequence."""
    spans, opened = [], 0
    for i, label in enumerate(path):
        tag = scheme.tags[label]
        if tag == "B":
            opened = i
        elif tag in ("E", "S"):
            spans.append(TokenSpan(scheme.entities[label], opened if tag == "E" else i, i))
    return spans
