"""`cellm.Whisper`: speech to text on a Whisper `.cellm` model (or a HF checkpoint, or a
registry name such as `whisper-base`, converted once). The engine encodes each 30-second
window and keeps it as the session's cross-attention memory; decoding (prompt, rules,
greedy choice, seeking) runs here."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np
import numpy.typing as npt
import tokenizers

from .. import _core
from ..audio import MelFrontEnd, load_audio
from ..audio.load import AudioInput
from ..errors import FormatError, InvalidArgument, UnsupportedArchitecture
from ..resolve import resolve_model
from .rules import Rules, make_rules
from .tokens import SpecialTokens

TASKS = ("transcribe", "translate")


@dataclass(frozen=True)
class Segment:
    start: float  # seconds
    end: float
    text: str
    tokens: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Transcription:
    text: str
    segments: list[Segment]
    language: str
    # Seconds of audio transcribed.
    duration: float


class Whisper:
    """A Whisper model. `transcribe` turns audio (a path, a file's bytes, or 16 kHz float
    samples) into text; `features` and `logits` expose the model's input and its next-token
    logits for tests and token-level use.

    One `Whisper` may be used from several threads; calls run one at a time."""

    def __init__(
        self,
        model: Union[str, os.PathLike[str]],
        *,
        threads: Optional[int] = None,
        kv_encoding: str = "f16",
        dtype: str = "f16",
    ) -> None:
        path = resolve_model(model, dtype)
        self.engine = _core.Engine(str(path), threads=threads, kv_encoding=kv_encoding)
        header = json.loads(self.engine.header_json())
        description = header.get("model", {})
        if description.get("architecture") != "whisper":
            raise UnsupportedArchitecture(
                f"{path}: a {description.get('architecture')!r} model, not a Whisper model"
            )
        blob = self.engine.blob("tokenizer.json")
        if blob is None:
            raise FormatError(f"{path} has no embedded tokenizer.json")
        self.tokenizer = tokenizers.Tokenizer.from_str(blob.decode("utf-8"))
        self.tokens = SpecialTokens.of(self.tokenizer, str(path))
        self.vocab_size = int(description["vocab_size"])
        self.context_length = int(self.engine.context_length)
        self.front_end = MelFrontEnd(int(description["whisper"]["num_mel_bins"]))
        generation = header.get("generation", {})
        self._suppress: list[int] = _ids(generation.get("suppress_tokens"))
        self._begin_suppress: list[int] = _ids(
            generation.get("begin_suppress_tokens"), default=[self.tokens.eot]
        )
        self._lock = threading.Lock()

    @property
    def languages(self) -> list[str]:
        return list(self.tokens.languages)

    def features(self, audio: AudioInput) -> npt.NDArray[np.float32]:
        """The log-mel input (`bins x 3000`) of the first 30 s of `audio`, as HF's
        `WhisperFeatureExtractor` computes it."""
        return self.front_end.features(load_audio(audio))

    def logits(self, audio: AudioInput, decoder_ids: list[int]) -> npt.NDArray[np.float32]:
        """Next-token logits (`len(decoder_ids) x vocab`) at every decoder position, with the
        first 30 s of `audio` as the encoder's input."""
        if not decoder_ids:
            raise InvalidArgument("decoder_ids is empty")
        return self.logits_of_features(self.features(audio), decoder_ids)

    def encoder_states(self, features: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """The encoder's output (`positions x hidden`) for one window of features."""
        with self._lock:
            session = self.engine.create_session()
            try:
                return self.engine.encode_speech(session, _window(features))
            finally:
                self.engine.free_session(session)

    def logits_of_features(
        self, features: npt.NDArray[np.float32], decoder_ids: list[int]
    ) -> npt.NDArray[np.float32]:
        with self._lock:
            session = self.engine.create_session()
            try:
                self.engine.encode_speech(session, _window(features))
                return self.engine.step([(session, list(decoder_ids))], all_logits=True)
            finally:
                self.engine.free_session(session)

    def rules(self, timestamps: bool) -> Rules:
        return make_rules(
            self.tokens, self.vocab_size, self._suppress, self._begin_suppress, timestamps
        )

    def language_token(self, language: str) -> int:
        token = self.tokens.languages.get(language.lower())
        if token is None:
            known = ", ".join(self.tokens.languages) or "none"
            raise InvalidArgument(
                f"language {language!r} is not one this model knows (it knows: {known})"
            )
        return token

    def transcribe(
        self,
        audio: AudioInput,
        language: Optional[str] = None,
        task: str = "transcribe",
        timestamps: bool = False,
    ) -> Transcription:
        """Transcribe (or, with task="translate", translate to English) `audio` of any
        length, 30-second window by window. `language` None detects it from the first
        window. `timestamps` decodes timestamp tokens, giving segments within windows and
        seeking to the last complete segment; without, each window is one segment."""
        from .longform import transcribe_samples

        if task not in TASKS:
            raise InvalidArgument(f"task must be one of {', '.join(TASKS)}, not {task!r}")
        if task == "translate" and self.tokens.translate is None:
            raise InvalidArgument("this model cannot translate (no <|translate|> token)")
        if language is not None:
            self.language_token(language)
        samples = load_audio(audio)
        with self._lock:
            return transcribe_samples(self, samples, language, task, timestamps)

    def decode_text(self, ids: list[int]) -> str:
        """Text of `ids`, timestamps and special tokens left out."""
        text_ids = [i for i in ids if i < self.tokens.eot]
        return str(self.tokenizer.decode(text_ids, skip_special_tokens=True))

    def encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)


def _window(features: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    return np.ascontiguousarray(features, dtype=np.float32)


def _ids(value: Any, default: Optional[list[int]] = None) -> list[int]:
    if isinstance(value, list) and all(type(i) is int for i in value):
        return [int(i) for i in value]
    return list(default or [])
