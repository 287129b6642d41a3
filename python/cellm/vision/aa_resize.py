"""Torchvision's antialiased resize of uint8 images (the HF torchvision-backend processors',
LFM2-VL's), reproduced bit for bit: per axis, PyTorch's filter weights rounded to int16 at
the precision their largest weight allows, a horizontal then a vertical pass, each rounded
back to uint8. Pillow's resize differs by one level on some pixels (it keeps 22 bits)."""

from __future__ import annotations

from typing import Callable

import numpy as np
from PIL import Image

# Accumulator elements at once (int64), so an 8000x6000 image never becomes int64 whole.
CHUNK = 1 << 22


def triangle(x: float) -> float:
    x = abs(x)
    return 1.0 - x if x < 1.0 else 0.0


def cubic(x: float) -> float:
    # PyTorch's antialiased bicubic uses a = -0.5 (Pillow's), not -0.75.
    a, x = -0.5, abs(x)
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    if x < 2.0:
        return (((x - 5.0) * x + 8.0) * x - 4.0) * a
    return 0.0


FILTERS: dict[int, tuple[Callable[[float], float], float]] = {
    int(Image.Resampling.BILINEAR): (triangle, 1.0),
    int(Image.Resampling.BICUBIC): (cubic, 2.0),
}


def weights(size_in: int, size_out: int, resample: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Per output pixel, the input pixels it reads (`size_out x taps`, padded with weight 0)
    and their weights as int16 values; and the weights' precision in bits."""
    kernel, half_width = FILTERS[resample]
    scale = size_in / size_out
    support = half_width * scale if scale >= 1.0 else half_width
    inv = 1.0 / scale if scale >= 1.0 else 1.0
    taps = int(2 * support) + 3
    index = np.zeros((size_out, taps), np.int64)
    w = np.zeros((size_out, taps))
    for i in range(size_out):
        center = scale * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), size_in)
        ws = [kernel((j + lo - center + 0.5) * inv) for j in range(hi - lo)]
        total = sum(ws)
        index[i, : hi - lo] = np.arange(lo, hi)
        w[i, : hi - lo] = [v / total for v in ws] if total != 0.0 else ws
    precision = 0
    while precision < 22 and int(0.5 + w.max() * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    v = w * (1 << precision)
    return index, np.where(v < 0, np.trunc(v - 0.5), np.trunc(v + 0.5)).astype(np.int64), precision


def resample_axis0(x: np.ndarray, size_out: int, resample: int) -> np.ndarray:
    """One pass along axis 0: `clamp((sum(w * x) + 2^(p-1)) >> p, 0, 255)` in int64."""
    index, w, precision = weights(x.shape[0], size_out, resample)
    flat = x.reshape(x.shape[0], -1)
    half = (1 << (precision - 1)) if precision > 0 else 0
    step = max(1, CHUNK // flat.shape[1])
    out = np.empty((size_out, flat.shape[1]), np.uint8)
    # int32 sums (half the memory traffic) where no sum can overflow them.
    wide = half + 255 * int(np.abs(w).sum(axis=1).max()) >= 2**31
    w = w.astype(np.int64 if wide else np.int32)
    for o in range(0, size_out, step):
        rows, taps = index[o : o + step], w[o : o + step]
        acc = np.full((len(rows), flat.shape[1]), half, w.dtype)
        for k in range(index.shape[1]):  # one tap of every output row at a time
            acc += flat[rows[:, k]] * taps[:, k, None]
        out[o : o + step] = np.clip(acc >> precision, 0, 255)
    return out.reshape(size_out, *x.shape[1:])


def resize_aa(rgb: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    """(h, w, c) uint8 -> (height, width, c) uint8 as `torchvision.transforms.v2.functional
    .resize(antialias=True)` computes it; filters other than bilinear and bicubic use Pillow."""
    if resample not in FILTERS:
        return np.asarray(Image.fromarray(rgb).resize((width, height), Image.Resampling(resample)))
    out = rgb
    if width != rgb.shape[1]:
        out = resample_axis0(out.transpose(1, 0, 2), width, resample).transpose(1, 0, 2)
    if height != rgb.shape[0]:
        out = resample_axis0(out, height, resample)
    return np.ascontiguousarray(out)
