"""Sentence embeddings with BERT-style encoders: `cellm.Embedder("all-minilm-l6-v2")
.embed(texts)` gives one L2-normalised float32 row per text, the mean of its tokens' last
hidden states (`[CLS]` and `[SEP]` included, as sentence-transformers' mean pooling over the
attention mask counts them). Texts go through the encoder together, each attending only to
its own tokens, so no padding enters the mean.

Texts longer than the model's positions are refused (ContextOverflow) unless `truncate`
(then their first `max_tokens` tokens count, the last one kept as `[SEP]`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import numpy as np

from cellm.encoder import EncoderModel, ModelRef
from cellm.errors import InvalidArgument

ARCHITECTURE = "bert"
DEFAULT_MODEL = "all-minilm-l6-v2"


class Embedder:
    def __init__(
        self,
        model: ModelRef = DEFAULT_MODEL,
        *,
        threads: Optional[int] = None,
        dtype: str = "f32",
        truncate: bool = False,
    ) -> None:
        self._model = EncoderModel(model, ARCHITECTURE, threads=threads, dtype=dtype)
        self.truncate = truncate
        self.dim: int = self._model.core.width

    @property
    def max_tokens(self) -> int:
        return self._model.max_tokens

    def token_ids(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's ids (`[CLS] ... [SEP]`), cut to the model's positions if `truncate`."""
        if isinstance(texts, str):
            raise InvalidArgument("embed takes a list of texts, not one str")
        raw = self._model.tokenizer.raw
        if self.truncate:
            encodings = raw.encode_batch(list(texts))
            return [self._cut(e.ids) for e in encodings]
        return [e.ids for e in self._model.encode(list(texts))]

    def _cut(self, ids: list[int]) -> list[int]:
        if len(ids) <= self.max_tokens:
            return ids
        return ids[: self.max_tokens - 1] + ids[-1:]

    def token_states(self, ids: list[list[int]]) -> list[np.ndarray]:
        """Each sequence's last hidden states, `(len, dim)` float32."""
        return self._model.forward(ids)

    def embed(self, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
        """`(len(texts), dim)` float32, each row of unit length."""
        return self.embed_ids(self.token_ids(texts), batch_size)

    def embed_ids(self, ids: list[list[int]], batch_size: int = 64) -> np.ndarray:
        """`embed` of texts already turned into `token_ids`."""
        if batch_size < 1:
            raise InvalidArgument(f"batch_size must be >= 1, got {batch_size}")
        out = np.zeros((len(ids), self.dim), dtype=np.float32)
        for at in range(0, len(ids), batch_size):
            states = self.token_states(ids[at : at + batch_size])
            for i, s in enumerate(states):
                mean = s.astype(np.float64).mean(axis=0)
                out[at + i] = mean / max(float(np.linalg.norm(mean)), 1e-12)
        return out
