"""Whisper's log-mel spectrogram, as HF's `WhisperFeatureExtractor` computes it (numpy path):
a 400-point periodic Hann STFT with hop 160 over reflect-padded audio, the power spectrum
through Slaney-normalised Slaney-scale mel filters (80 or 128 bins, 0-8 kHz), log10 floored at
1e-10, the last frame dropped, clamped to the window's maximum - 8, then (x + 4) / 4. Computed
in float64 (the reference's own precision) and returned as float32."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from .load import SAMPLE_RATE

N_FFT = 400
HOP = 160
# Whisper's window: 30 s of audio, 3000 frames.
WINDOW_SECONDS = 30
WINDOW_SAMPLES = WINDOW_SECONDS * SAMPLE_RATE
WINDOW_FRAMES = WINDOW_SAMPLES // HOP
MAX_FREQUENCY = 8000.0


def _hz_to_mel(hz: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Slaney's mel scale: linear below 1 kHz (200/3 Hz per mel), logarithmic above."""
    mel = hz / (200.0 / 3.0)
    log_step = np.log(6.4) / 27.0
    above = hz >= 1000.0
    mel[above] = 15.0 + np.log(hz[above] / 1000.0) / log_step
    return mel


def _mel_to_hz(mel: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    hz = mel * (200.0 / 3.0)
    log_step = np.log(6.4) / 27.0
    above = mel >= 15.0
    hz[above] = 1000.0 * np.exp(log_step * (mel[above] - 15.0))
    return hz


def mel_filters(bins: int) -> npt.NDArray[np.float64]:
    """`(N_FFT / 2 + 1) x bins` triangular filters, each scaled to unit area (Slaney)."""
    edges_mel = np.linspace(
        _hz_to_mel(np.array([0.0]))[0], _hz_to_mel(np.array([MAX_FREQUENCY]))[0], bins + 2
    )
    edges = _mel_to_hz(edges_mel)
    fft_hz = np.linspace(0.0, SAMPLE_RATE // 2, N_FFT // 2 + 1)
    widths = np.diff(edges)
    slopes = edges[None, :] - fft_hz[:, None]
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    return filters * (2.0 / (edges[2 : bins + 2] - edges[:bins]))[None, :]


@dataclass(frozen=True)
class MelFrontEnd:
    """Log-mel features of `bins` mel bins for 30-second windows of 16 kHz audio."""

    bins: int = 80
    _filters: npt.NDArray[np.float64] = field(init=False, repr=False, compare=False)
    _window: npt.NDArray[np.float64] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_filters", mel_filters(self.bins))
        object.__setattr__(self, "_window", np.hanning(N_FFT + 1)[:-1])

    def features(self, samples: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """`bins x 3000` features of the first 30 s of `samples` (zero-padded to 30 s)."""
        window = np.zeros(WINDOW_SAMPLES, dtype=np.float64)
        n = min(len(samples), WINDOW_SAMPLES)
        window[:n] = samples[:n]
        return self._log_mel(window)

    def long_form(self, samples: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """Features of the whole of `samples` for window-by-window transcription, as
        OpenAI's and faster-whisper's long-form decoding computes them: the audio and one hop
        of silence in one spectrogram (so the clamp at max - 8 is the whole recording's),
        `len // 160 + 1` frames, of which the last is not content. Windows are cut from it
        and padded with zero features."""
        audio = np.zeros(len(samples) + HOP, dtype=np.float64)
        audio[: len(samples)] = samples
        return self._log_mel(audio)

    def _log_mel(self, audio: npt.NDArray[np.float64]) -> npt.NDArray[np.float32]:
        padded = np.pad(audio, N_FFT // 2, mode="reflect")
        frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP]
        spectrum = np.fft.rfft(frames * self._window, n=N_FFT, axis=1)
        power = spectrum.real**2 + spectrum.imag**2
        mel = power @ self._filters  # frames x bins
        log_mel = np.log10(np.maximum(mel, 1e-10)).T[:, :-1]
        log_mel = np.maximum(log_mel, log_mel.max() - 8.0)
        return np.ascontiguousarray((log_mel + 4.0) / 4.0, dtype=np.float32)
