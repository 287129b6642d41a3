"""Whisper's special tokens, found by name in the model's tokenizer: start of transcript,
the language tokens (between it and `<|translate|>`), the task tokens, the previous-text and
no-timestamps markers, and the timestamp tokens that follow `<|notimestamps|>` (0.00 s to
30.00 s in steps of 0.02 s, not in `tokenizer.json` but in the vocabulary)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import tokenizers

from ..errors import FormatError

# Seconds per timestamp token.
TIME_PRECISION = 0.02
_LANGUAGE = re.compile(r"^<\|([a-z]{2,3}|haw|yue)\|>$")


@dataclass(frozen=True)
class SpecialTokens:
    eot: int
    sot: int
    transcribe: int
    no_timestamps: int
    translate: Optional[int]
    sot_prev: Optional[int]
    sot_lm: Optional[int]
    no_speech: Optional[int]
    # Language code -> token id, in id order (the order of the detection's candidates).
    languages: dict[str, int]

    @property
    def timestamp_begin(self) -> int:
        return self.no_timestamps + 1

    @classmethod
    def of(cls, tok: tokenizers.Tokenizer, source: str) -> SpecialTokens:
        def find(*names: str) -> Optional[int]:
            for name in names:
                i = tok.token_to_id(name)
                if i is not None:
                    return int(i)
            return None

        def need(name: str) -> int:
            i = find(name)
            if i is None:
                raise FormatError(f"{source}: the tokenizer has no {name} (not a Whisper model?)")
            return i

        sot = need("<|startoftranscript|>")
        translate = find("<|translate|>")
        transcribe = need("<|transcribe|>")
        end = translate if translate is not None else transcribe
        languages = {}
        for i in range(sot + 1, end):
            m = _LANGUAGE.match(tok.id_to_token(i) or "")
            if m:
                languages[m.group(1)] = i
        return cls(
            eot=need("<|endoftext|>"),
            sot=sot,
            transcribe=transcribe,
            no_timestamps=need("<|notimestamps|>"),
            translate=translate,
            sot_prev=find("<|startofprev|>"),
            sot_lm=find("<|startoflm|>"),
            no_speech=find("<|nospeech|>", "<|nocaptions|>"),
            languages=languages,
        )
