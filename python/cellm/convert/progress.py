"""A tiny stderr progress bar (no tqdm): one line redrawn in place with a carriage return."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


class ProgressBar:
    """Byte-count progress bar; silent unless the stream is a terminal or `force` is set.

    Silence by default keeps logs and CI output free of `\\r` noise.
    """

    WIDTH = 30
    # Redraw at most this often: converting a large model calls `update` thousands of times.
    MIN_INTERVAL_S = 0.1

    def __init__(
        self,
        total: int,
        label: str = "",
        *,
        force: bool = False,
        stream: Optional[TextIO] = None,
    ) -> None:
        self.total = max(0, int(total))
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = force or _isatty(self.stream)
        self.done = 0
        self._start = time.monotonic()
        self._last_draw = 0.0
        self._closed = False

    def update(self, n: int) -> None:
        self.done = min(self.total, self.done + n) if self.total else self.done + n
        now = time.monotonic()
        if self.enabled and now - self._last_draw >= self.MIN_INTERVAL_S:
            self._last_draw = now
            self._draw(now)

    def close(self) -> None:
        if self.enabled and not self._closed:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
        self._closed = True

    def _draw(self, now: float) -> None:
        frac = self.done / self.total if self.total else 1.0
        filled = int(frac * self.WIDTH)
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        elapsed = max(now - self._start, 1e-9)
        rate = self.done / elapsed / (1 << 20)
        line = (
            f"\r{self.label} [{bar}] {frac * 100:5.1f}% "
            f"{self.done / (1 << 20):,.0f}/{self.total / (1 << 20):,.0f} MiB {rate:,.0f} MiB/s"
        )
        self.stream.write(line)
        self.stream.flush()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


# Conversions get a bar by themselves only from this size: small ones take well under a second.
AUTO_PROGRESS_BYTES = 64 << 20


def conversion_bar(total: int, label: str, progress: Optional[bool]) -> ProgressBar:
    """The bar of a conversion writing `total` bytes: `progress` True always draws it on
    stderr, False never, None on a terminal for large models."""
    wanted = progress or (progress is None and total >= AUTO_PROGRESS_BYTES)
    bar = ProgressBar(total, label, force=bool(progress))
    bar.enabled = bar.enabled and bool(wanted)
    return bar
