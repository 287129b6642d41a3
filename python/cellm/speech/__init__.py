"""Speech to text with Whisper: `cellm.Whisper` (`model.py`), its special tokens
(`tokens.py`), the decoding rules applied to each step's logits (`rules.py`) and the
window-by-window transcription of long audio with timestamp seeking (`longform.py`)."""

from __future__ import annotations

from .model import Segment, Transcription, Whisper

__all__ = ["Segment", "Transcription", "Whisper"]
