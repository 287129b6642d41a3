"""What Whisper may say next: the rules OpenAI's decoder (and CTranslate2's, which
faster-whisper runs) apply to each step's logits before the argmax.

- Always suppressed: the model's non-speech tokens (its generation config's list) and the
  task and marker tokens. At the first sampled position also the blank and end of text.
- With timestamps: `<|notimestamps|>` is never sampled; the first token is a timestamp of at
  most 1.00 s; timestamps come in pairs (after a lone timestamp, text is forbidden only if the
  previous token was text, i.e. a pair closes), never decrease, and a segment has nonzero
  length; when the timestamps' total probability beats every text token, a timestamp it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .tokens import SpecialTokens

# The first timestamp is at most 1.00 s (OpenAI's and faster-whisper's default).
MAX_INITIAL_TIMESTAMP_INDEX = 50


@dataclass(frozen=True)
class Rules:
    tokens: SpecialTokens
    suppress: npt.NDArray[np.int64]
    begin_suppress: npt.NDArray[np.int64]
    timestamps: bool

    def apply(self, logits: npt.NDArray[np.float32], sampled: Sequence[int]) -> None:
        """Masks (to -inf) what may not follow `sampled`, the tokens decoded so far in this
        window after its prompt, in `logits` (one row, modified in place)."""
        logits[self.suppress] = -np.inf
        if not sampled:
            logits[self.begin_suppress] = -np.inf
        if self.timestamps:
            self._timestamp_rules(logits, sampled)

    def _timestamp_rules(self, logits: npt.NDArray[np.float32], sampled: Sequence[int]) -> None:
        t = self.tokens
        begin = t.timestamp_begin
        logits[t.no_timestamps] = -np.inf
        last_ts = len(sampled) >= 1 and sampled[-1] >= begin
        penultimate_ts = len(sampled) < 2 or sampled[-2] >= begin
        if last_ts:
            if penultimate_ts:
                logits[begin:] = -np.inf
            else:
                logits[: t.eot] = -np.inf
        stamps = [s for s in sampled if s >= begin]
        if stamps:
            last = stamps[-1] if last_ts and not penultimate_ts else stamps[-1] + 1
            logits[begin:last] = -np.inf
        if not sampled:
            logits[:begin] = -np.inf
            logits[begin + MAX_INITIAL_TIMESTAMP_INDEX + 1 :] = -np.inf
        logprobs = log_softmax(logits)
        stamp_mass = np.logaddexp.reduce(logprobs[begin:])
        if stamp_mass > logprobs[:begin].max():
            logits[:begin] = -np.inf


def log_softmax(x: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    x64 = x.astype(np.float64)
    top = x64.max()
    out: npt.NDArray[np.float64] = x64 - top - np.log(np.exp(x64 - top).sum())
    return out


def make_rules(
    tokens: SpecialTokens,
    vocab_size: int,
    suppress: Sequence[int],
    begin_suppress: Sequence[int],
    timestamps: bool,
) -> Rules:
    t = tokens
    markers = [t.transcribe, t.translate, t.sot, t.sot_prev, t.sot_lm, t.no_speech]
    ids = {int(i) for i in suppress if 0 <= int(i) < vocab_size}
    ids.update(m for m in markers if m is not None)
    begin = {int(i) for i in begin_suppress if 0 <= int(i) < vocab_size}
    return Rules(
        tokens=t,
        suppress=np.array(sorted(ids), dtype=np.int64),
        begin_suppress=np.array(sorted(begin), dtype=np.int64),
        timestamps=timestamps,
    )
