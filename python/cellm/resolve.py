"""Turning what a user passes as a model into a .cellm path: a .cellm file, a HF checkpoint
directory or a .gguf file (converted once into the cache), a registry name (fetched and
converted on first use), or a Hugging Face Hub id (from the user's HF cache, or downloaded
where the network allows, then converted)."""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
from pathlib import Path

from cellm.cache import CONVERTER_VERSION, cache_dir
from cellm.errors import FormatError
from cellm.fetch import fetch, registry_names

# What a HF checkpoint directory needs for conversion (no other weights formats, no images).
_HUB_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja"]


def resolve_model(path: str | os.PathLike[str], dtype: str = "f16") -> Path:
    """A .cellm file for `path`: the file itself, a cached conversion of a HF directory, a
    GGUF file or a `.cellm` v1 file, a registry model, or a Hugging Face Hub id (`org/name`)."""
    p = Path(path).expanduser()
    if p.exists():
        if p.is_dir():
            return _converted(p, dtype)
        if not p.is_file():  # a named pipe or a device: opening it could block forever
            raise FormatError(f"{p} is not a regular file")
        if p.suffix.lower() == ".gguf":
            return _converted_gguf(p)
        from cellm.convert.cellm_v1 import is_cellm_v1

        if is_cellm_v1(p):  # the earlier engine's files: converted to v2 once, like a GGUF
            return _converted_file(p, "convert_v1")
        return p
    name = str(path)
    if name in registry_names():
        return fetch(name)
    if _looks_like_hub_id(name):
        return _converted(_hub_snapshot(name), dtype)
    raise FormatError(_unknown_model_message(name))


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def _looks_like_hub_id(name: str) -> bool:
    """`org/name`, and not a path to a missing model file."""
    return bool(_HUB_ID.match(name)) and not name.endswith((".cellm", ".gguf", ".json"))


def _hub_snapshot(repo_id: str) -> Path:
    """The checkpoint folder of Hub model `repo_id`: the user's HF cache first (all that is
    used with HF_HUB_OFFLINE=1), else a download of the files conversion needs."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - a dependency of tokenizers, so always there
        raise FormatError(f"{repo_id}: Hub ids need the huggingface_hub package") from None
    try:
        folder = snapshot_download(repo_id, allow_patterns=_HUB_FILES)
    except LocalEntryNotFoundError:
        raise FormatError(
            f"{repo_id}: not in the Hugging Face cache, and the Hub cannot be reached "
            "(offline, or HF_HUB_OFFLINE=1)"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FormatError(f"{repo_id}: cannot get it from the Hugging Face Hub: {first}") from None
    return Path(folder)


def _unknown_model_message(name: str) -> str:
    names = registry_names()
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    close = close or [n for n in names if n.startswith(name.lower())][:1]
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return (
        f"{name}: no such file, registry model or Hugging Face id.{hint} "
        f"Registry models: {', '.join(names)}"
    )


def _converted(src: Path, dtype: str) -> Path:
    # The converter is only needed on this path.
    from cellm.convert import convert_ct2_whisper, convert_hf, is_ct2_whisper_dir

    ct2 = is_ct2_whisper_dir(src) and not any(src.glob("*.safetensors*"))
    if not ct2 and not (src / "config.json").is_file():
        raise FormatError(f"{src} has no config.json (not a HuggingFace checkpoint)")
    out = (
        cache_dir() / "converted" / f"{src.resolve().name}-{dtype}-{_fingerprint(src, dtype)}.cellm"
    )
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        if ct2:  # faster-whisper's model directories
            convert_ct2_whisper(src, out, dtype)
        else:
            convert_hf(src, out, dtype)
    return out


def _converted_gguf(src: Path) -> Path:
    return _converted_file(src, "convert_gguf")


def _converted_file(src: Path, converter: str) -> Path:
    """The cached conversion of a single-file model (`cellm.convert.<converter>`)."""
    import cellm.convert

    st = src.stat()
    key = json.dumps([str(src.resolve()), st.st_size, st.st_mtime_ns, CONVERTER_VERSION])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    out = cache_dir() / "converted" / f"{src.stem}-{digest}.cellm"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        getattr(cellm.convert, converter)(src, out)
    return out


def _fingerprint(src: Path, dtype: str) -> str:
    """Changes whenever the checkpoint's files, the dtype or the converter change."""
    files = sorted(
        (f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in src.iterdir() if f.is_file()
    )
    key = json.dumps([str(src.resolve()), dtype, CONVERTER_VERSION, files])
    return hashlib.sha256(key.encode()).hexdigest()[:16]
