"""Where cellm keeps what it downloads and converts (shared by `cellm.resolve` and
`cellm.fetch`, so neither imports the other for it)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "CELLM_CACHE_DIR"
# Bump when the converter's output changes, so stale cached conversions are not reused.
CONVERTER_VERSION = 3


def cache_dir() -> Path:
    """Where converted and fetched models live: $CELLM_CACHE_DIR or ~/.cache/cellm."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "cellm")
