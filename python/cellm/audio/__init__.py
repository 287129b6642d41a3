"""Audio in: reading any common file (or bytes, or samples) as 16 kHz mono float32
(`load.py`), and Whisper's log-mel features (`mel.py`)."""

from __future__ import annotations

from .load import SAMPLE_RATE, load_audio
from .mel import MelFrontEnd

__all__ = ["SAMPLE_RATE", "MelFrontEnd", "load_audio"]
