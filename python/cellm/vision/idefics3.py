"""SmolVLM's (Idefics3's) image processing, as HF's `Idefics3ImageProcessorPil` and
`Idefics3Processor` do it: the longest edge resized to `size`, then to multiples of
`max_image_size`, cut into square tiles plus the whole image at tile size, normalised; in the
prompt, `<fake_token_around_image>`, `<row_i_col_j>` and `<global-img>` around
`image_seq_len` image tokens per tile."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import FormatError
from .images import normalize, patchify, resize
from .processed import ProcessedImage, floats, int_field, section

# HF's cap on the resized image's longest edge.
MAX_IMAGE_SIZE = 4096
FAKE = "<fake_token_around_image>"
GLOBAL = "<global-img>"
IMAGE = "<image>"


class Idefics3Images:
    """`config`: the processor config (`image_processor` section and `image_seq_len`);
    `patch_size`: the vision tower's."""

    def __init__(self, config: Mapping[str, Any], patch_size: int) -> None:
        ip = section(config, "image_processor")
        size, tile = section(ip, "size"), section(ip, "max_image_size")
        self.longest_edge = int_field(size, "longest_edge", 4 * 364)
        self.tile = int_field(tile, "longest_edge", 364)
        self.resample = int(ip.get("resample", 1))
        self.do_resize = bool(ip.get("do_resize", True))
        self.splitting = bool(ip.get("do_image_splitting", True))
        self.scale = float(ip.get("rescale_factor", 1 / 255)) if ip.get("do_rescale", True) else 1.0
        normalizing = ip.get("do_normalize", True)
        self.mean = floats(ip, "image_mean", [0.5] * 3) if normalizing else [0.0] * 3
        self.std = floats(ip, "image_std", [0.5] * 3) if normalizing else [1.0] * 3
        self.seq_len = int_field(config, "image_seq_len", 169)
        self.patch = patch_size
        if self.tile % patch_size:
            raise FormatError(
                f"processor config: max_image_size {self.tile} is not a multiple of the vision "
                f"tower's patch size {patch_size}"
            )

    def frames(self, rgb: np.ndarray) -> tuple[list[np.ndarray], int, int]:
        """The image's normalised (3, tile, tile) frames, tiles row by row and then the whole
        image, with the tile rows and columns (0, 0 when it is not split)."""
        if self.do_resize:
            size = fit_longest_edge(rgb.shape[0], rgb.shape[1], self.longest_edge)
            rgb = resize(rgb, *size, self.resample)
        if self.splitting:
            size = tile_multiples(rgb.shape[0], rgb.shape[1], self.tile)
            rgb = resize(rgb, *size, self.resample)
            tiles, rows, cols = self.split(rgb)
        else:
            tiles, rows, cols = [resize(rgb, self.tile, self.tile, self.resample)], 0, 0
        return [normalize(t, self.scale, self.mean, self.std) for t in tiles], rows, cols

    def split(self, rgb: np.ndarray) -> tuple[list[np.ndarray], int, int]:
        height, width = rgb.shape[:2]
        t = self.tile
        if height <= t and width <= t:
            return [rgb], 0, 0
        rows, cols = (height - t) // t + 1, (width - t) // t + 1
        tiles = [
            rgb[r * t : (r + 1) * t, c * t : (c + 1) * t] for r in range(rows) for c in range(cols)
        ]
        return [*tiles, resize(rgb, t, t, self.resample)], rows, cols

    def placeholder(self, rows: int, cols: int) -> str:
        """The prompt text for an image cut into `rows` x `cols` tiles (0 x 0: not cut)."""
        image = IMAGE * self.seq_len
        whole = f"{FAKE}{GLOBAL}{image}{FAKE}"
        if rows == 0 and cols == 0:
            return whole
        grid = "".join(
            "".join(f"{FAKE}<row_{r + 1}_col_{c + 1}>{image}" for c in range(cols)) + "\n"
            for r in range(rows)
        )
        return f"{grid}\n{whole}"

    def process(self, rgb: np.ndarray) -> ProcessedImage:
        frames, rows, cols = self.frames(rgb)
        side = self.tile // self.patch
        return ProcessedImage(
            patches=np.concatenate([patchify(f, self.patch) for f in frames]),
            grids=((side, side),) * len(frames),
            placeholder=self.placeholder(rows, cols),
            tokens=self.seq_len * len(frames),
        )


def fit_longest_edge(height: int, width: int, longest: int) -> tuple[int, int]:
    """HF's `_resize_output_size_rescale_to_max_len` (the short edge rounded up to even),
    then `_resize_output_size_scale_below_upper_bound` at MAX_IMAGE_SIZE."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def tile_multiples(height: int, width: int, tile: int) -> tuple[int, int]:
    """HF's `resize_for_vision_encoder`: both edges up to multiples of the tile size."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width
