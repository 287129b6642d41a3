"""Reading the JSON side files of a HF checkpoint with one-line, path-naming errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from ..errors import FormatError


def read_json(path: Path, *, required: bool) -> Optional[dict[str, Any]]:
    """Parse a JSON object file; a missing optional file gives None, anything broken raises."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if required:
            raise FormatError(f"{path}: no such file or directory") from None
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise FormatError(f"{path}: cannot read: {e}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise FormatError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(value, dict):
        raise FormatError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value
