"""Reading the JSON side files of a HF checkpoint with one-line, path-naming errors."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, Optional

from ..errors import FormatError

# Deeper JSON is refused: no config or tokenizer file nests this far, and the engine's header
# parser (serde_json) stops at 128 levels.
MAX_JSON_DEPTH = 64


def read_bytes(path: Path) -> bytes:
    """The bytes of regular file `path`. A named pipe, device or directory is a FormatError,
    found without blocking: the file is opened non-blocking and checked before it is read."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise FormatError(f"{path}: no such file or directory") from None
    except OSError as e:
        raise FormatError(f"{path}: cannot read: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FormatError(f"{path} is not a regular file")
        try:
            return f.read()
        except OSError as e:
            raise FormatError(f"{path}: cannot read: {e.strerror or e}") from None


def read_text(path: Path) -> str:
    """The UTF-8 text of regular file `path` (see read_bytes)."""
    try:
        return read_bytes(path).decode("utf-8")
    except UnicodeDecodeError:
        raise FormatError(f"{path}: not UTF-8 text") from None


def read_json(path: Path, *, required: bool) -> Optional[dict[str, Any]]:
    """Parse a JSON object file; a missing optional file gives None, anything broken raises."""
    if not required and not os.path.exists(path):
        return None
    return parse_json_object(read_text(path), str(path))


def parse_json_object(raw: str | bytes, where: str) -> dict[str, Any]:
    """A JSON object from `raw` (UTF-8 bytes or text); FormatError naming `where` if not."""
    try:
        value = json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{where}: invalid JSON ({e})") from None
    except RecursionError:
        raise FormatError(f"{where}: invalid JSON (nested too deeply)") from None
    if not isinstance(value, dict):
        raise FormatError(f"{where}: expected a JSON object, found {type(value).__name__}")
    check_depth(value, where)
    return value


def check_depth(value: Any, where: str, limit: int = MAX_JSON_DEPTH) -> None:
    """FormatError naming `where` if `value` nests lists and objects more than `limit` deep."""
    level = [value]
    for _ in range(limit):
        level = [
            child
            for v in level
            if isinstance(v, (dict, list))
            for child in (v.values() if isinstance(v, dict) else v)
            if isinstance(child, (dict, list))
        ]
        if not level:
            return
    raise FormatError(f"{where}: JSON nested more than {limit} levels deep")
