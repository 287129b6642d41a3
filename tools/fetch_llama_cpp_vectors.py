"""Fetch llama.cpp's tokenizer test vectors and chat templates (not committed to this repo).

Downloads the llama-cpp-python sdist (pinned version and sha256; it vendors llama.cpp) into
``$CELLM_CACHE_DIR`` or ``~/.cache/cellm``, subdirectory ``llama-cpp-python-<version>``, and
extracts only ``vendor/llama.cpp/models/ggml-vocab-*`` (vocabulary-only GGUF files with their
``.inp``/``.out`` test cases) and ``vendor/llama.cpp/models/templates/*.jinja``. The sdist itself
is deleted afterwards. Prints the directory holding ``models/``.

The test-case format is that of llama.cpp's tests/test-tokenizer-0.cpp: ``X.gguf.inp`` holds
the inputs separated by ``\\n__ggml_vocab_test__\\n`` (a trailing separator ends the last case),
``X.gguf.out`` one line of space-separated expected ids per case; the text is tokenised with
add_special=false and parse_special=false.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
URL = (
    "https://files.pythonhosted.org/packages/ec/e9/"
    "e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/" + SDIST
)
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
PREFIX = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
SEPARATOR = "\n__ggml_vocab_test__\n"
_DONE = ".complete"


def cache_root() -> Path:
    return Path(os.environ.get("CELLM_CACHE_DIR") or Path.home() / ".cache" / "cellm")


def vectors_dir(root: Path | None = None) -> Path:
    """Where the extracted files live (they are under ``models/`` in it)."""
    return (root or cache_root()) / f"llama-cpp-python-{VERSION}"


def _wanted(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    if rel.startswith("models/ggml-vocab-") and "/" not in rel[len("models/") :]:
        return True
    return rel.startswith("models/templates/") and rel.count("/") == 2 and name.endswith(".jinja")


def _download(dest: Path, timeout: float) -> None:
    digest = hashlib.sha256()
    with urllib.request.urlopen(URL, timeout=timeout) as r, open(dest, "wb") as f:
        while chunk := r.read(1 << 20):
            digest.update(chunk)
            f.write(chunk)
    if digest.hexdigest() != SHA256:
        raise RuntimeError(f"{SDIST}: sha256 {digest.hexdigest()} is not the pinned {SHA256}")


def _extract(sdist: Path, out: Path) -> int:
    count = 0
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar:
            if not member.name.startswith(PREFIX):
                continue
            rel = member.name[len(PREFIX) :]
            if not member.isfile() or not _wanted(rel) or ".." in rel.split("/"):
                continue
            target = out / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(member)
            assert src is not None
            with src, open(target, "wb") as f:
                shutil.copyfileobj(src, f)
            count += 1
    return count


def fetch(root: Path | None = None, timeout: float = 120.0) -> Path:
    """The directory holding ``models/ggml-vocab-*`` and ``models/templates/*.jinja``,
    downloading and extracting them on first use (raises OSError/RuntimeError on failure)."""
    out = vectors_dir(root)
    if (out / _DONE).exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        sdist = Path(tmp) / SDIST
        _download(sdist, timeout)
        if _extract(sdist, out) == 0:
            raise RuntimeError(f"{SDIST} holds no llama.cpp test vocabularies")
    (out / _DONE).write_text(f"{URL}\nsha256 {SHA256}\n")
    return out


def vocab_files(root: Path) -> list[Path]:
    """Every ggml-vocab-*.gguf file, sorted by name."""
    return sorted((root / "models").glob("ggml-vocab-*.gguf"))


def read_cases(gguf: Path) -> list[tuple[str, list[int]]] | None:
    """(text, expected ids) for each case of ``gguf``'s .inp/.out pair, parsed exactly as
    test-tokenizer-0.cpp does; None when the vocabulary has no test cases."""
    inp, outp = Path(f"{gguf}.inp"), Path(f"{gguf}.out")
    if not inp.exists() or not outp.exists():
        return None
    raw = inp.read_bytes().decode("utf-8")
    texts = []
    pos = 0
    while pos < len(raw):  # a trailing separator does not start an empty last case
        nxt = raw.find(SEPARATOR, pos)
        if nxt < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:nxt])
        pos = nxt + len(SEPARATOR)
    lines = outp.read_bytes().decode("utf-8").split("\n")
    if lines and lines[-1] == "":  # std::getline does not yield the empty tail
        lines.pop()
    if len(texts) != len(lines):
        raise ValueError(f"{inp}: {len(texts)} inputs but {len(lines)} expected outputs")
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cache-dir", type=Path, help="default: $CELLM_CACHE_DIR or ~/.cache/cellm"
    )
    args = parser.parse_args(argv)
    try:
        print(fetch(args.cache_dir))
    except (OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
