"""Audio of any length, 30-second window by window, as OpenAI's `transcribe` and
faster-whisper do it (greedy): the features of the whole recording are cut into windows at
`seek`; each window is encoded once into the session's memory and decoded after a prompt of
the previous window's text. With timestamps, the window's text splits into segments at
pairs of timestamp tokens and the next window starts at the last complete segment's end (or
after the whole window when the text ends on a single timestamp); without, each window is
one segment and the next starts 30 s later. A window the model finds silent (no-speech
probability above 0.6 and mean log-probability below -1) is skipped."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np
import numpy.typing as npt

from ..audio.load import SAMPLE_RATE
from ..audio.mel import HOP, WINDOW_FRAMES
from .rules import Rules, log_softmax
from .tokens import TIME_PRECISION

if TYPE_CHECKING:
    from .model import Segment, Transcription, Whisper

SECONDS_PER_FRAME = HOP / SAMPLE_RATE
# Feature frames per timestamp step (the encoder halves the frames; one step is 0.02 s).
FRAMES_PER_STEP = 2
NO_SPEECH_THRESHOLD = 0.6
LOGPROB_THRESHOLD = -1.0


@dataclass
class Decoded:
    tokens: list[int]
    avg_logprob: float
    no_speech_prob: float


def transcribe_samples(
    w: Whisper,
    samples: npt.NDArray[np.float32],
    language: Optional[str],
    task: str,
    timestamps: bool,
) -> Transcription:
    from .model import Segment, Transcription

    t = w.tokens
    mel = w.front_end.long_form(samples)
    content_frames = mel.shape[1] - 1
    rules = w.rules(timestamps)
    task_token = t.transcribe if task == "transcribe" else t.translate
    assert task_token is not None
    engine = w.engine
    session = engine.create_session()
    try:
        segments: list[Segment] = []
        history: list[int] = []
        seek = 0
        while seek < content_frames:
            size = min(WINDOW_FRAMES, content_frames - seek)
            window = np.zeros((mel.shape[0], WINDOW_FRAMES), dtype=np.float32)
            window[:, :size] = mel[:, seek : seek + size]
            engine.truncate_session(session, 0)
            engine.encode_speech(session, window)
            if language is None:
                language = _detect_language(w, session)
            prompt = _prompt(w, history, t.languages[language], task_token, timestamps)
            decoded = _greedy(w, session, prompt, rules)
            time_offset = seek * SECONDS_PER_FRAME
            if (
                decoded.no_speech_prob > NO_SPEECH_THRESHOLD
                and decoded.avg_logprob < LOGPROB_THRESHOLD
            ):
                seek += size
                continue
            pieces, seek = _split(decoded.tokens, t.timestamp_begin, seek, size, timestamps)
            for start, end, ids in pieces:
                text = w.decode_text(ids)
                segments.append(Segment(time_offset + start, time_offset + end, text, ids))
                history.extend(ids)
        return Transcription(
            text="".join(s.text for s in segments).strip(),
            segments=[s for s in segments if s.text.strip()],
            language=language or "",
            duration=len(samples) / SAMPLE_RATE,
        )
    finally:
        engine.free_session(session)


def _detect_language(w: Whisper, session: int) -> str:
    """The language token the model finds likeliest after `<|startoftranscript|>`."""
    languages = w.tokens.languages
    if not languages:
        return ""
    logits = w.engine.step([(session, [w.tokens.sot])])[0]
    w.engine.truncate_session(session, 0)
    codes = list(languages)
    ids = np.array([languages[c] for c in codes])
    return codes[int(np.argmax(logits[ids]))]


def _prompt(
    w: Whisper, history: list[int], language: int, task: int, timestamps: bool
) -> list[int]:
    """The previous text (at most half the context), then the task's start tokens."""
    t = w.tokens
    prompt: list[int] = []
    if history and t.sot_prev is not None:
        prompt = [t.sot_prev] + history[-(w.context_length // 2 - 1) :]
    prompt += [t.sot, language, task]
    if not timestamps:
        prompt.append(t.no_timestamps)
    return prompt


def _greedy(w: Whisper, session: int, prompt: list[int], rules: Rules) -> Decoded:
    """The window's tokens after `prompt` by argmax under `rules`, to end of text or the end
    of the context; with the no-speech probability at `<|startoftranscript|>`."""
    t = w.tokens
    engine = w.engine
    engine.truncate_session(session, 0)
    at_sot = prompt.index(t.sot) + 1
    head = engine.step([(session, prompt[:at_sot])])[0]
    no_speech = 0.0
    if t.no_speech is not None:
        no_speech = float(np.exp(log_softmax(head)[t.no_speech]))
    row = engine.step([(session, prompt[at_sot:])])[0] if at_sot < len(prompt) else head
    sampled: list[int] = []
    total = 0.0
    while len(prompt) + len(sampled) < w.context_length:
        logits = row.copy()
        rules.apply(logits, sampled)
        token = int(np.argmax(logits))
        total += float(log_softmax(logits)[token])
        if token == t.eot:
            break
        sampled.append(token)
        if len(prompt) + len(sampled) >= w.context_length:
            break
        row = engine.step([(session, [token])])[0]
    return Decoded(sampled, total / (len(sampled) + 1), no_speech)


def _split(
    tokens: list[int], begin: int, seek: int, size: int, timestamps: bool
) -> tuple[list[tuple[float, float, list[int]]], int]:
    """The window's segments (start and end in seconds from the window's start, tokens) and
    the next window's first frame."""
    duration = size * SECONDS_PER_FRAME
    if not timestamps:
        return [(0.0, duration, tokens)], seek + size
    pairs = [i for i in range(1, len(tokens)) if tokens[i] >= begin and tokens[i - 1] >= begin]
    single_ending = len(tokens) >= 2 and tokens[-2] < begin <= tokens[-1]
    if not pairs:
        stamps = [x for x in tokens if x >= begin]
        end = duration
        if stamps and stamps[-1] != begin:
            end = (stamps[-1] - begin) * TIME_PRECISION
        return [(0.0, end, tokens)], seek + size
    cuts = pairs + ([len(tokens)] if single_ending else [])
    pieces = []
    last = 0
    for cut in cuts:
        piece = tokens[last:cut]
        start = (piece[0] - begin) * TIME_PRECISION
        end = (piece[-1] - begin) * TIME_PRECISION
        pieces.append((start, end, piece))
        last = cut
    if single_ending:
        return pieces, seek + size
    return pieces, seek + (tokens[last - 1] - begin) * FRAMES_PER_STEP
