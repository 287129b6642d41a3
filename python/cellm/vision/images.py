"""Images in, as RGB uint8 arrays (height, width, 3): a path, bytes, a PIL image or a numpy
array; every mode Pillow opens; EXIF orientation applied to decoded files; Pillow's
decompression-bomb limit enforced before any pixel is decoded. Bad input is one
`InvalidArgument` line."""

from __future__ import annotations

import io
import os
import warnings
from typing import Union

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from ..errors import InvalidArgument

ImageInput = Union[str, "os.PathLike[str]", bytes, Image.Image, np.ndarray]


def load_rgb(source: ImageInput) -> np.ndarray:
    """`source` as an RGB uint8 array of shape (height, width, 3)."""
    return np.asarray(to_rgb(open_image(source)), dtype=np.uint8)


def open_image(source: ImageInput) -> Image.Image:
    """A decoded PIL image; files and bytes are read whole, their EXIF rotation applied."""
    if isinstance(source, Image.Image):
        check_size(source.size, "the image")
        return source
    if isinstance(source, np.ndarray):
        return from_array(source)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return decode(io.BytesIO(bytes(source)), "the image bytes")
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise InvalidArgument(f"image {path}: no such file")
        return decode(path, f"image {path}")
    raise InvalidArgument(
        f"an image must be a path, bytes, a PIL image or a numpy array, not {type(source).__name__}"
    )


def decode(fp: str | io.BytesIO, what: str) -> Image.Image:
    # Pillow only warns between its limit and twice it; here both are refusals, raised from
    # the header before the pixels are allocated.
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            with Image.open(fp) as img:
                check_size(img.size, what)
                img.load()
                return ImageOps.exif_transpose(img)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise InvalidArgument(f"{what} is too large to decode safely: {e}") from None
        except UnidentifiedImageError:
            raise InvalidArgument(f"{what} is not an image Pillow can read") from None
        except (OSError, ValueError, SyntaxError) as e:
            raise InvalidArgument(f"{what} cannot be decoded: {e}") from None


def check_size(size: tuple[int, int], what: str) -> None:
    """Pillow's decompression-bomb limit (`Image.MAX_IMAGE_PIXELS`; None turns it off)."""
    width, height = size
    limit = Image.MAX_IMAGE_PIXELS
    if width < 1 or height < 1:
        raise InvalidArgument(f"{what} is empty ({width}x{height})")
    if limit is not None and width * height > limit:
        raise InvalidArgument(
            f"{what} is {width}x{height} = {width * height:,} pixels, more than Pillow's "
            f"decompression-bomb limit of {int(limit):,}"
        )


def from_array(a: np.ndarray) -> Image.Image:
    """A uint8 array (height, width) or (height, width, 1|3|4) as L, RGB or RGBA."""
    if a.dtype != np.uint8:
        raise InvalidArgument(f"an image array must be uint8, not {a.dtype}")
    if a.ndim == 3 and a.shape[2] == 1:
        a = a[:, :, 0]
    if not (a.ndim == 2 or (a.ndim == 3 and a.shape[2] in (3, 4))):
        raise InvalidArgument(
            f"an image array must be (height, width) or (height, width, 1|3|4), not {a.shape}"
        )
    check_size((a.shape[1], a.shape[0]), "the image array")
    return Image.fromarray(np.ascontiguousarray(a))


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB as HF's `convert_to_rgb` makes it: transparency composited onto white."""
    try:
        if "A" in img.getbands() or img.info.get("transparency") is not None:
            rgba = img.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        return img.convert("RGB")
    except (OSError, ValueError) as e:
        raise InvalidArgument(f"an image of mode {img.mode} cannot be made RGB: {e}") from None


def resize(rgb: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    """Pillow's resize of an RGB uint8 array (the filter numbered as `PIL.Image.Resampling`)."""
    img = Image.fromarray(rgb)
    return np.asarray(img.resize((width, height), resample=Image.Resampling(resample)))


def normalize(rgb: np.ndarray, scale: float, mean: list[float], std: list[float]) -> np.ndarray:
    """(height, width, 3) uint8 -> (3, height, width) float32 `(x * scale - mean) / std`,
    rounded as HF's numpy path rounds it (the scaling in float64, the rest in float32)."""
    x = (rgb.astype(np.float64) * scale).astype(np.float32)
    y: np.ndarray = (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return np.ascontiguousarray(y.transpose(2, 0, 1))


def patchify(chw: np.ndarray, patch: int) -> np.ndarray:
    """(3, h, w) -> (h/p * w/p, p * p * 3), patches row-major, each in (y, x, channel) order:
    the layout of a linear patch embedding (SigLIP2's, and SigLIP's conv reordered)."""
    c, h, w = chw.shape
    grid = chw.reshape(c, h // patch, patch, w // patch, patch)
    return np.ascontiguousarray(grid.transpose(1, 3, 2, 4, 0).reshape(-1, patch * patch * c))
