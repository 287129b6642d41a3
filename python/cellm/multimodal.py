"""Images in chats and prompts of vision-language models: the content parts that carry them,
the model's image processor (from the file's `processor` settings), the expansion of each
`<image>` placeholder into the image's tokens, and the features the engine places there."""

from __future__ import annotations

import base64
import binascii
import os
import threading
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Union

import numpy as np

from cellm import _core
from cellm.errors import FormatError, InvalidArgument
from cellm.vision import Idefics3Images, ImageInput, Lfm2VlImages, ProcessedImage, load_rgb

PLACEHOLDER = "<image>"


class Features(NamedTuple):
    """Image features for some tokens of a step: their positions, the rows, and how many
    images were encoded for them."""

    rows: list[int]
    values: np.ndarray
    images: int


@dataclass
class ImagePrompt:
    """Prompt ids and the processed images whose tokens they hold, in order."""

    ids: list[int]
    images: list[ProcessedImage] = field(default_factory=list)


@dataclass
class PromptFeatures:
    """A prompt's image features on the positions of its image tokens, so that a prompt fed
    in chunks (the scheduler's chunked prefill) gets each chunk's rows."""

    positions: list[int]  # the image tokens' positions in the prompt, ascending
    values: np.ndarray  # (len(positions), hidden)

    def chunk(self, start: int, end: int) -> Optional[tuple[list[int], np.ndarray]]:
        """The image tokens among prompt[start:end]: positions relative to `start`, rows."""
        lo, hi = bisect_left(self.positions, start), bisect_left(self.positions, end)
        if lo == hi:
            return None
        return [p - start for p in self.positions[lo:hi]], self.values[lo:hi]


@dataclass(frozen=True)
class ImageFiles:
    """Which local files a chat's image parts may name. A library caller is on its own
    machine and may name any (the default); a server's clients none, or those under `root`
    (`cellm serve --image-root DIR`): relative names are read from there, and a name that
    resolves outside it (`..`, a symbolic link) is refused."""

    anywhere: bool = True
    root: Optional[str] = None

    def path(self, name: str) -> str:
        if self.anywhere:
            return name
        if self.root is None:
            raise InvalidArgument(
                "images must be sent as data: URLs (this server reads no local files; see "
                "cellm serve --image-root)"
            )
        root = os.path.realpath(self.root)
        real = os.path.realpath(os.path.join(root, name))
        if os.path.commonpath([root, real]) != root:
            raise InvalidArgument(f"image {name!r} is outside the server's image root")
        return real


ANY_FILE = ImageFiles()
NO_FILES = ImageFiles(anywhere=False)


def split_messages(
    messages: Sequence[Mapping[str, Any]], files: ImageFiles = ANY_FILE
) -> tuple[list[dict[str, Any]], list[ImageInput]]:
    """The messages as a template sees them (an image part becomes `{"type": "image"}`) and
    the images their parts carry, in order: `{"type": "image", "image": path | bytes | PIL |
    array}` or OpenAI's `{"type": "image_url", "image_url": {"url": data URL or path}}`.
    `files` says which local paths the parts may name."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidArgument(f"messages must be a list of dicts, got {type(messages).__name__}")
    out: list[dict[str, Any]] = []
    images: list[ImageInput] = []
    for m in messages:
        if not isinstance(m, Mapping):
            raise InvalidArgument(f"each message must be a dict, got {type(m).__name__}")
        content = m.get("content")
        if not isinstance(content, list):
            out.append(dict(m))
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "image":
                source = part.get("image")
                if source is None:
                    raise InvalidArgument('an {"type": "image"} part needs its "image"')
                if isinstance(source, (str, os.PathLike)):
                    source = files.path(os.fspath(source))
                images.append(source)
                parts.append({"type": "image"})
            elif kind == "image_url":
                images.append(_from_url(part.get("image_url"), files))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**m, "content": parts})
    return out, images


def _from_url(value: Any, files: ImageFiles) -> ImageInput:
    url = value.get("url") if isinstance(value, Mapping) else value
    if not isinstance(url, str):
        raise InvalidArgument('an image_url part needs {"url": "data:image/...;base64,..."}')
    if url.startswith("data:"):
        header, _, data = url.partition(",")
        if not header.endswith(";base64"):
            raise InvalidArgument("an image data URL must be base64 (data:image/...;base64,...)")
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidArgument("an image data URL holds invalid base64") from None
    if url.startswith("file://"):
        return files.path(url.removeprefix("file://"))
    if "://" in url:
        raise InvalidArgument(f"image URL {url[:60]!r}: only data: URLs and file paths are read")
    return files.path(url)


class Vision:
    """A vision-language model's image side: its processor and its encoder (the engine's)."""

    def __init__(
        self,
        header: Mapping[str, Any],
        engine: _core.Engine,
        lock: threading.RLock,
        overrides: Optional[Mapping[str, Any]] = None,
    ) -> None:
        vision = header["model"]["vision"]
        settings = dict(header.get("processor") or {})
        overrides = dict(overrides or {})
        image = {**settings.get("image_processor", {}), **overrides.pop("image_processor", {})}
        settings = {**settings, **overrides, "image_processor": image}
        self.processor: Union[Idefics3Images, Lfm2VlImages]
        if vision["connector"] == "idefics3":
            self.processor = Idefics3Images(settings, vision["patch_size"])
            side = self.processor.tile // vision["patch_size"]
            per_tile = (side // vision["scale_factor"]) ** 2
            if side % vision["scale_factor"] or per_tile != self.processor.seq_len:
                raise FormatError(
                    f"processor config: image_seq_len {self.processor.seq_len} does not match "
                    f"the {per_tile} tokens the model makes of a {self.processor.tile} px tile"
                )
        else:
            self.processor = Lfm2VlImages(settings)
        self.image_token_id: int = vision["image_token_id"]
        self._engine, self._lock = engine, lock

    def process(self, images: Sequence[ImageInput]) -> list[ProcessedImage]:
        if isinstance(images, (str, bytes)) or not isinstance(images, Sequence):
            raise InvalidArgument("images must be a list (paths, bytes, PIL images or arrays)")
        return [self.processor.process(load_rgb(image)) for image in images]

    def expand(self, text: str, images: Sequence[ProcessedImage]) -> str:
        """`text` with its i-th `<image>` replaced by image i's tokens."""
        pieces = text.split(PLACEHOLDER)
        if len(pieces) - 1 != len(images):
            raise InvalidArgument(
                f"the prompt has {len(pieces) - 1} image placeholders ({PLACEHOLDER}) but "
                f"{len(images)} images were given"
            )
        return pieces[0] + "".join(im.placeholder + rest for im, rest in zip(images, pieces[1:]))

    def features(self, images: Sequence[ProcessedImage]) -> np.ndarray:
        """Every image's embedding rows, one per image token, in order (one batched encode)."""
        patches = np.concatenate([im.patches for im in images])
        grids = [g for im in images for g in im.grids]
        with self._lock:
            return self._engine.encode_images(patches, grids)

    def positions(self, ids: Sequence[int], images: Sequence[ProcessedImage]) -> list[int]:
        """Where `ids` hold image tokens; InvalidArgument unless `images` make as many."""
        at = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(at) != sum(im.tokens for im in images):
            raise InvalidArgument(
                f"the prompt has {len(at)} image tokens but its images make "
                f"{sum(im.tokens for im in images)}"
            )
        return at

    def prompt_features(
        self, prompts: Sequence[tuple[Sequence[int], Sequence[ProcessedImage]]]
    ) -> list[PromptFeatures]:
        """Each prompt's features (prompt ids, its images), all images in one batched encode."""
        at = [self.positions(ids, images) for ids, images in prompts]
        values = self.features([im for _, images in prompts for im in images])
        out, row = [], 0
        for positions in at:
            out.append(PromptFeatures(positions, values[row : row + len(positions)]))
            row += len(positions)
        return out

    def embeds(
        self, ids: Sequence[int], images: Sequence[ProcessedImage], start: int
    ) -> Optional[Features]:
        """For the ids from `start` on (those a step feeds), the positions of their image
        tokens and those tokens' features; only images with tokens there are encoded."""
        at = self.positions(ids, images)
        done = sum(1 for i in at if i < start)  # image tokens already cached
        if done == len(at):
            return None
        first, skipped = 0, 0
        while skipped + images[first].tokens <= done:
            skipped += images[first].tokens
            first += 1
        features = self.features(images[first:])[done - skipped :]
        return Features([i - start for i in at[done:]], features, len(images) - first)
