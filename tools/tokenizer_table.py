"""Print a markdown table of how cellm's GGUF tokenizer conversion does on llama.cpp's
tokenizer test vectors: vocab | cases | passed, for every ggml-vocab-*.gguf file.

Each case is tokenised as llama.cpp's tests/test-tokenizer-0.cpp does: no BOS/EOS
(add_special=false) and special tokens written in the text not parsed (parse_special=false,
i.e. ``encode_special_tokens`` in HF tokenizers; user-defined tokens are still matched).
Run ``python tools/fetch_llama_cpp_vectors.py`` first or let this script fetch them.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fetch_llama_cpp_vectors import fetch, read_cases, vocab_files  # noqa: E402

from cellm.convert.gguf import GGUFFile  # noqa: E402
from cellm.convert.gguf_tokenizer import tokenizer_from_gguf  # noqa: E402
from cellm.errors import CellmError  # noqa: E402
from cellm.tokenizer import Tokenizer  # noqa: E402


@dataclass
class VocabResult:
    name: str  # e.g. "llama-bpe"
    cases: int | None  # None: the vocabulary ships without test cases
    passed: int = 0
    error: str | None = None  # why the tokenizer could not be built
    failures: list[tuple[str, list[int], list[int]]] = field(default_factory=list)


def vocab_name(path: Path) -> str:
    return path.name[len("ggml-vocab-") : -len(".gguf")]


def load_tokenizer(path: Path) -> Tokenizer:
    """cellm's Tokenizer for a GGUF file, set up like test-tokenizer-0 (parse_special=false)."""
    gg = GGUFFile(path)
    try:
        tok = tokenizer_from_gguf(gg.metadata)
    finally:
        try:
            gg.close()
        except BufferError:  # numpy views of metadata arrays still alive
            pass
    t = Tokenizer.from_json_str(tok.json, bos_token=tok.bos_token, eos_token=tok.eos_token)
    t.raw.encode_special_tokens = True
    return t


def check_vocab(path: Path) -> VocabResult:
    cases = read_cases(path)
    res = VocabResult(vocab_name(path), None if cases is None else len(cases))
    try:
        tok = load_tokenizer(path)
    except CellmError as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    for text, expected in cases or []:
        got = tok.encode(text, add_special_tokens=False)
        if got == expected:
            res.passed += 1
        else:
            res.failures.append((text, expected, got))
    return res


def table(results: list[VocabResult]) -> str:
    rows = ["| vocab | cases | passed |", "|---|---:|---:|"]
    for r in results:
        if r.error is not None:
            passed = f"unsupported ({r.error.split(':', 1)[0]})"
        elif r.cases is None:
            passed = "builds (no cases)"
        else:
            passed = str(r.passed)
        rows.append(f"| {r.name} | {'-' if r.cases is None else r.cases} | {passed} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cache-dir", type=Path, help="default: $CELLM_CACHE_DIR or ~/.cache/cellm"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show failing cases")
    args = parser.parse_args(argv)
    results = [check_vocab(p) for p in vocab_files(fetch(args.cache_dir))]
    print(table(results))
    if args.verbose:
        for r in results:
            if r.error:
                print(f"\n{r.name}: {r.error}")
            for text, expected, got in r.failures:
                print(f"\n{r.name}: {text!r}\n  expected {expected}\n  got      {got}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
