"""Personal data in text with openai/privacy-filter: `cellm.PrivacyFilter(model).detect(text)`
gives labelled character spans, `.redact(text)` replaces them.

The model labels every token with BIOES logits; `cellm.bioes` decodes the best well-formed
label sequence, and each entity's span runs from its first token's start to its last token's
end in the tokenizer's character offsets (so a leading space that belongs to a token is inside
the span, as the seed's `pii` tool printed it). A span's score is the mean probability, over
its tokens, of the label decoded there.

`python -m cellm.pii --model M (--text T ... | --file F ...) [--redact] [--json]`
(`cellm.pii.__main__`).
Texts longer than the model's positions are refused (ContextOverflow), not cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from cellm.bioes import Scheme, log_softmax, token_spans, viterbi
from cellm.encoder import EncoderModel, ModelRef

ARCHITECTURE = "openai_privacy_filter"


@dataclass(frozen=True)
class Span:
    """One entity: its label (without the BIOES tag), `text[start:end]`, and a score."""

    label: str
    start: int
    end: int
    text: str
    score: float


class PrivacyFilter:
    """openai/privacy-filter from a `.cellm` file or a HF checkpoint directory."""

    def __init__(self, model: ModelRef, *, threads: Optional[int] = None, dtype: str = "f32"):
        self._model = EncoderModel(model, ARCHITECTURE, threads=threads, dtype=dtype)
        self.scheme = Scheme.parse(self._model.description["labels"])

    @property
    def labels(self) -> tuple[str, ...]:
        """Every label, indexed by label id."""
        return self.scheme.labels

    @property
    def entities(self) -> list[str]:
        """The entity kinds the model finds."""
        return sorted({e for e in self.scheme.entities if e})

    def logits(self, ids: list[int]) -> np.ndarray:
        """Label logits, float32 `(len(ids), labels)`, of one token sequence."""
        if not ids:
            return np.zeros((0, len(self.labels)), dtype=np.float32)
        return self._model.forward([list(ids)])[0]

    def detect(self, text: str) -> list[Span]:
        return self.detect_batch([text])[0]

    def detect_batch(self, texts: list[str]) -> list[list[Span]]:
        """The spans of each text, all texts in one forward (an empty text has none)."""
        encodings = self._model.encode(list(texts))
        todo = [i for i, e in enumerate(encodings) if e.ids]
        outputs = self._model.forward([encodings[i].ids for i in todo]) if todo else []
        found: list[list[Span]] = [[] for _ in texts]
        for i, logits in zip(todo, outputs):
            found[i] = self._spans(texts[i], logits, encodings[i].offsets)
        return found

    def redact(self, text: str, style: str = "[LABEL]") -> str:
        return self.redact_batch([text], style)[0]

    def redact_batch(self, texts: list[str], style: str = "[LABEL]") -> list[str]:
        """Each text with its spans replaced by `style`, where `LABEL` becomes the label in
        capitals and `label` the label as the model names it."""
        return [
            redacted(text, spans, style) for text, spans in zip(texts, self.detect_batch(texts))
        ]

    def _spans(self, text: str, logits: np.ndarray, offsets: list[tuple[int, int]]) -> list[Span]:
        path = viterbi(logits, self.scheme)
        probs = np.exp(log_softmax(logits))
        spans = []
        for s in token_spans(path, self.scheme):
            start, end = offsets[s.first][0], offsets[s.last][1]
            score = float(np.mean([probs[t, path[t]] for t in range(s.first, s.last + 1)]))
            spans.append(Span(s.entity, start, end, text[start:end], score))
        return spans


def redacted(text: str, spans: list[Span], style: str = "[LABEL]") -> str:
    """`text` with each span replaced (spans in order, not overlapping)."""
    out, at = [], 0
    for s in spans:
        out.append(text[at : s.start])
        out.append(style.replace("LABEL", s.label.upper()).replace("label", s.label))
        at = s.end
    out.append(text[at:])
    return "".join(out)
