"""What the encoders (`cellm.PrivacyFilter`, `cellm.Embedder`) share: the model resolved to a
`.cellm` file (converted in float32 by default: these models are small and read once per
text), the engine's encoder, and its tokenizer with character offsets."""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Union

import numpy as np
import tokenizers

from cellm import _core
from cellm.errors import ContextOverflow, FormatError, InvalidArgument
from cellm.resolve import resolve_model
from cellm.tokenizer import Tokenizer

ModelRef = Union[str, "os.PathLike[str]"]


class EncoderModel:
    """An encoder `.cellm` file, opened: `architecture`, `description`, `tokenizer`."""

    def __init__(
        self,
        model: ModelRef,
        architecture: str,
        threads: Optional[int] = None,
        dtype: str = "f32",
    ) -> None:
        path = resolve_model(model, dtype)
        self.path = path
        self.core = _core.Encoder(str(path), threads=threads)
        header: dict[str, Any] = json.loads(self.core.header_json())
        self.description: dict[str, Any] = header["model"]
        found = self.description.get("architecture")
        if found != architecture:
            raise FormatError(f"{path} holds a {found} model, not {architecture}")
        blob = self.core.blob(header.get("tokenizer", {}).get("blob", "tokenizer.json"))
        if blob is None:
            raise FormatError(f"{path} has no embedded tokenizer")
        self.tokenizer = Tokenizer.from_json_str(blob.decode("utf-8"))
        # A tokenizer.json may pad (all-MiniLM-L6-v2's pads every text to 128 tokens) or cut:
        # padding would enter the mean and the states, and cutting is the caller's choice.
        self.tokenizer.raw.no_padding()
        self.tokenizer.raw.no_truncation()
        self.max_tokens: int = self.core.max_tokens

    def encode(self, texts: list[str]) -> list[tokenizers.Encoding]:
        """Each text's tokens (ids and character offsets), checked against the model's limit."""
        for text in texts:
            if not isinstance(text, str):
                raise InvalidArgument(f"texts must be str, got {type(text).__name__}")
        encodings: list[tokenizers.Encoding] = self.tokenizer.raw.encode_batch(texts)
        for i, enc in enumerate(encodings):
            if len(enc.ids) > self.max_tokens:
                raise ContextOverflow(
                    f"text {i} is {len(enc.ids):,} tokens, more than the model's "
                    f"{self.max_tokens:,}"
                )
        return encodings

    def forward(self, ids: list[list[int]]) -> list[np.ndarray]:
        """Each sequence's output rows (`(len, width)` float32)."""
        rows = self.core.forward(ids)
        bounds = np.cumsum([len(s) for s in ids])[:-1]
        return list(np.split(rows, bounds))
