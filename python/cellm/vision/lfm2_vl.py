"""LFM2-VL's image processing, as HF's `Lfm2VlImageProcessor` and `Lfm2VlProcessor` do it:
`smart_resize` to multiples of patch x downsample with the area between the min and max image
tokens; large images cut into a grid of square tiles (plus a thumbnail) when tiling is on;
patches in (y, x, channel) order; in the prompt, runs of `<image>`, wrapped in image start/end
and row/column tokens when `use_image_special_tokens` says so."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .aa_resize import resize_aa
from .images import patchify
from .processed import ProcessedImage, int_field, section

IMAGE = "<image>"


class Lfm2VlImages:
    """`config`: the processor config (an `image_processor` section, and optionally
    `use_image_special_tokens`, HF's processor default True)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        ip = section(config, "image_processor")
        self.factor = int_field(ip, "downsample_factor", 2)
        self.patch = int_field(ip, "encoder_patch_size", 16)
        self.min_tokens = int_field(ip, "min_image_tokens", 64)
        self.max_tokens = int_field(ip, "max_image_tokens", 256)
        self.min_tiles = int_field(ip, "min_tiles", 2)
        self.max_tiles = int_field(ip, "max_tiles", 10)
        self.tile = int_field(ip, "tile_size", 512)
        self.tolerance = float(ip.get("max_pixels_tolerance", 2.0))
        self.thumbnail = bool(ip.get("use_thumbnail", True))
        self.resample = int(ip.get("resample", 2))
        splitting = bool(ip.get("do_image_splitting", True))
        if not splitting:
            self.min_tiles = self.max_tiles = 1
        # The padded length of HF's pixel_values (only `hf_arrays` pads).
        tile_patches = (self.tile // self.patch) ** 2 if splitting else 0
        self.max_patches = max(self.max_tokens * self.factor**2, tile_patches)
        self.special_tokens = bool(config.get("use_image_special_tokens", True))

    def tiles(self, rgb: np.ndarray) -> tuple[list[np.ndarray], int, int, tuple[int, int]]:
        """The resized uint8 tiles (grid row by row, then the thumbnail), the grid's rows and
        columns, and the single-image (or thumbnail) size."""
        height, width = rgb.shape[:2]
        new_h, new_w = self.smart_resize(height, width)
        splitting = not self.min_tiles == self.max_tiles == 1
        if splitting and self.too_large(height, width):
            cols, rows = self.grid(height, width)
            t = self.tile
            big = resize_aa(rgb, rows * t, cols * t, self.resample)
            tiles = [
                big[r * t : (r + 1) * t, c * t : (c + 1) * t]
                for r in range(rows)
                for c in range(cols)
            ]
            if self.thumbnail and rows * cols != 1:
                tiles.append(resize_aa(rgb, new_h, new_w, self.resample))
            return tiles, rows, cols, (new_h, new_w)
        return [resize_aa(rgb, new_h, new_w, self.resample)], 1, 1, (new_h, new_w)

    def smart_resize(self, height: int, width: int) -> tuple[int, int]:
        """(height, width), multiples of patch * factor, area within the token bounds."""
        f = self.patch * self.factor
        lo, hi = self.min_tokens * f * f, self.max_tokens * f * f
        h_bar, w_bar = max(f, round(height / f) * f), max(f, round(width / f) * f)
        if h_bar * w_bar > hi:
            beta = math.sqrt(height * width / hi)
            h_bar = max(f, math.floor(height / beta / f) * f)
            w_bar = max(f, math.floor(width / beta / f) * f)
        elif h_bar * w_bar < lo:
            beta = math.sqrt(lo / (height * width))
            h_bar, w_bar = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
        return h_bar, w_bar

    def too_large(self, height: int, width: int) -> bool:
        f = self.patch * self.factor
        h_bar, w_bar = max(self.patch, round(height / f) * f), max(self.patch, round(width / f) * f)
        return h_bar * w_bar > self.max_tokens * f * f * self.tolerance

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """The tile grid (columns, rows) whose aspect is closest to the image's; ties go to
        the larger grid when the image covers more than half its area."""
        ratios = sorted(
            {
                (w, h)
                for n in range(self.min_tiles, self.max_tiles + 1)
                for w in range(1, n + 1)
                for h in range(1, n + 1)
                if self.min_tiles <= w * h <= self.max_tiles
            },
            key=lambda r: r[0] * r[1],
        )
        aspect, best, best_diff = width / height, (1, 1), math.inf
        for w, h in ratios:
            diff = abs(aspect - w / h)
            if diff < best_diff:
                best, best_diff = (w, h), diff
            elif diff == best_diff and width * height > 0.5 * self.tile * self.tile * w * h:
                best = (w, h)
        return best

    def tokens_for(self, height: int, width: int) -> int:
        """Image tokens of one tile of (height, width) pixels after the downsampling."""
        per_h = math.ceil((height // self.patch) / self.factor)
        per_w = math.ceil((width // self.patch) / self.factor)
        return per_h * per_w

    def placeholder(self, rows: int, cols: int, size: tuple[int, int]) -> tuple[str, int]:
        """The prompt text for an image cut into `rows` x `cols` tiles, and its image tokens."""
        special = self.special_tokens
        per_tile, whole = self.tokens_for(self.tile, self.tile), self.tokens_for(*size)
        parts, tokens = ["<|image_start|>"] if special else [], 0
        if rows > 1 or cols > 1:
            for r in range(rows):
                for c in range(cols):
                    parts += [f"<|img_row_{r + 1}_col_{c + 1}|>"] if special else []
                    parts.append(IMAGE * per_tile)
                    tokens += per_tile
            if self.thumbnail:
                parts += ["<|img_thumbnail|>"] if special else []
                parts.append(IMAGE * whole)
                tokens += whole
        else:
            parts.append(IMAGE * whole)
            tokens += whole
        parts += ["<|image_end|>"] if special else []
        return "".join(parts), tokens

    def normalized(self, tile: np.ndarray) -> np.ndarray:
        """uint8 (h, w, 3) -> float32 (3, h, w), `(x - 127.5) / 127.5` as HF's fused
        torchvision rescale-and-normalise computes it."""
        x = tile.astype(np.float32).transpose(2, 0, 1)
        return np.ascontiguousarray((x - np.float32(127.5)) / np.float32(127.5))

    def process(self, rgb: np.ndarray) -> ProcessedImage:
        tiles, rows, cols, size = self.tiles(rgb)
        text, tokens = self.placeholder(rows, cols, size)
        p = self.patch
        return ProcessedImage(
            patches=np.concatenate([patchify(self.normalized(t), p) for t in tiles]),
            grids=tuple((t.shape[0] // p, t.shape[1] // p) for t in tiles),
            placeholder=text,
            tokens=tokens,
        )

    def hf_arrays(self, images: list[ProcessedImage]) -> dict[str, np.ndarray]:
        """HF's `pixel_values` (tiles, max_patches, 3 p p) zero-padded, its
        `pixel_attention_mask` and `spatial_shapes`: for comparing with the reference."""
        rows, masks, shapes = [], [], []
        for image in images:
            at = 0
            for gh, gw in image.grids:
                # As HF pads: a tile past max_patches (an extreme aspect ratio) stays whole.
                n = gh * gw
                padded = np.zeros((max(n, self.max_patches), image.patches.shape[1]), np.float32)
                padded[:n] = image.patches[at : at + n]
                mask = np.zeros(self.max_patches, np.int32)
                mask[:n] = 1
                rows.append(padded)
                masks.append(mask)
                shapes.append((gh, gw))
                at += n
        return {
            "pixel_values": np.stack(rows),
            "pixel_attention_mask": np.stack(masks),
            "spatial_shapes": np.asarray(shapes, np.int64),
        }
