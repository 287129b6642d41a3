"""Turning what a user passes as a model (a .cellm file, a HF directory, a .gguf file or a
registry name) into a .cellm path."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from cellm.cache import CONVERTER_VERSION, cache_dir
from cellm.errors import FormatError
from cellm.fetch import fetch, registry_names


def resolve_model(path: str | os.PathLike[str], dtype: str = "f16") -> Path:
    """A .cellm file for `path`: the file itself, a cached conversion of a HF directory or a
    GGUF file, or a registry model (`cellm.fetch`) fetched and converted on first use."""
    p = Path(path).expanduser()
    if not p.exists():
        name = str(path)
        if os.sep not in name and "/" not in name:
            if name in registry_names():
                return fetch(name)
        raise FormatError(f"{p}: no such file or directory")
    if p.is_dir():
        return _converted(p, dtype)
    if p.suffix.lower() == ".gguf":
        return _converted_gguf(p)
    return p


def _converted(src: Path, dtype: str) -> Path:
    from cellm.convert import convert_hf  # the converter is only needed on this path

    if not (src / "config.json").is_file():
        raise FormatError(f"{src} has no config.json (not a HuggingFace checkpoint)")
    out = (
        cache_dir() / "converted" / f"{src.resolve().name}-{dtype}-{_fingerprint(src, dtype)}.cellm"
    )
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        convert_hf(src, out, dtype)
    return out


def _converted_gguf(src: Path) -> Path:
    from cellm.convert import convert_gguf

    st = src.stat()
    key = json.dumps([str(src.resolve()), st.st_size, st.st_mtime_ns, CONVERTER_VERSION])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    out = cache_dir() / "converted" / f"{src.stem}-{digest}.cellm"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf(src, out)
    return out


def _fingerprint(src: Path, dtype: str) -> str:
    """Changes whenever the checkpoint's files, the dtype or the converter change."""
    files = sorted(
        (f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in src.iterdir() if f.is_file()
    )
    key = json.dumps([str(src.resolve()), dtype, CONVERTER_VERSION, files])
    return hashlib.sha256(key.encode()).hexdigest()[:16]
