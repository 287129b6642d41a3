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
    except OSError as e:
        raise FormatError(f"{path}: cannot read: {e}") from None
    except UnicodeDecodeError:
        raise FormatError(f"{path}: not UTF-8 text") from None
    return parse_json_object(text, str(path))


def parse_json_object(raw: str | bytes, where: str) -> dict[str, Any]:
    """A JSON object from `raw` (UTF-8 bytes or text); FormatError naming `where` if not."""
    try:
        value = json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{where}: invalid JSON ({e})") from None
    if not isinstance(value, dict):
        raise FormatError(f"{where}: expected a JSON object, found {type(value).__name__}")
    return value
