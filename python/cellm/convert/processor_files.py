"""A vision-language checkpoint's image processing settings, as one `processor` object for
the `.cellm` header: `processor_config.json` (HF's processor: `image_seq_len`, ...) with the
image processor's settings under `image_processor`, which recent checkpoints nest there and
older ones keep in `preprocessor_config.json`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import FormatError
from .jsonfiles import read_json


def load_processor_config(directory: Path) -> dict[str, Any]:
    processor = read_json(directory / "processor_config.json", required=False) or {}
    image = processor.get("image_processor")
    if image is None:
        image = read_json(directory / "preprocessor_config.json", required=False)
    if not isinstance(image, dict):
        raise FormatError(
            f"{directory} has no image processor settings (processor_config.json's "
            "image_processor, or preprocessor_config.json)"
        )
    return {**processor, "image_processor": image}
