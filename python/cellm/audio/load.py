"""Audio as Whisper hears it: 16 kHz mono float32 in [-1, 1]. Files (WAV, FLAC, OGG and what
else libsndfile reads) and in-memory file bytes go through `soundfile`; channels are averaged;
other rates are resampled with `soxr` (its high-quality polyphase filter). A float array is
taken as 16 kHz samples already. Bad input is one `FormatError` / `InvalidArgument` line."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Union

import numpy as np
import numpy.typing as npt

from ..errors import FormatError, InvalidArgument

SAMPLE_RATE = 16000
# Longer input is refused before it is decoded into memory (10 hours of 16 kHz float32 is
# 2.3 GB).
MAX_SECONDS = 10 * 3600

AudioInput = Union[str, os.PathLike[str], bytes, bytearray, npt.NDArray[np.floating]]


def load_audio(audio: AudioInput) -> npt.NDArray[np.float32]:
    """16 kHz mono float32 samples of `audio`: a path, a file's bytes, or samples."""
    if isinstance(audio, np.ndarray):
        return _samples(audio)
    if isinstance(audio, (bytes, bytearray)):
        return _decode(io.BytesIO(bytes(audio)), "the audio bytes")
    if isinstance(audio, (str, os.PathLike)):
        path = Path(audio)
        if not path.exists():
            raise FormatError(f"{path}: no such file")
        if not path.is_file():
            raise FormatError(f"{path} is not a regular file")
        with open(path, "rb") as f:
            return _decode(f, str(path))
    raise InvalidArgument(
        f"audio must be a path, bytes or a float array, not {type(audio).__name__}"
    )


def _samples(x: npt.NDArray[np.floating]) -> npt.NDArray[np.float32]:
    if x.dtype.kind != "f":
        raise InvalidArgument(
            f"audio samples must be floats in [-1, 1] at {SAMPLE_RATE} Hz, not {x.dtype}"
        )
    if x.ndim != 1:
        raise InvalidArgument(f"audio samples must be one channel (1-D), not shape {x.shape}")
    if x.size == 0:
        raise InvalidArgument("the audio is empty")
    if not np.isfinite(x).all():
        raise InvalidArgument("the audio samples hold NaN or infinity")
    if x.size > MAX_SECONDS * SAMPLE_RATE:
        raise InvalidArgument(f"the audio is longer than {MAX_SECONDS // 3600} hours")
    return np.ascontiguousarray(x, dtype=np.float32)


def _decode(f: io.BufferedIOBase | io.BytesIO, name: str) -> npt.NDArray[np.float32]:
    try:
        import soundfile
        import soxr  # noqa: F401 - checked here, used below for other rates
    except ImportError:
        raise FormatError(
            "reading audio files needs the soundfile and soxr packages (pip install 'cellm[audio]')"
        ) from None

    try:
        info = soundfile.info(f)
        f.seek(0)
        if info.frames > MAX_SECONDS * info.samplerate:
            raise InvalidArgument(f"{name}: longer than {MAX_SECONDS // 3600} hours")
        data, rate = soundfile.read(f, dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as e:
        detail = str(e).split(":")[-1].strip() or type(e).__name__
        raise FormatError(f"{name}: not a readable audio file ({detail})") from None
    if data.shape[0] == 0:
        raise FormatError(f"{name}: the audio is empty (no samples)")
    mono = data.mean(axis=1, dtype=np.float32) if data.shape[1] > 1 else data[:, 0]
    if not np.isfinite(mono).all():
        raise FormatError(f"{name}: the samples hold NaN or infinity")
    if rate != SAMPLE_RATE:
        import soxr

        mono = soxr.resample(mono, rate, SAMPLE_RATE, quality="HQ")
    return np.ascontiguousarray(mono, dtype=np.float32)
