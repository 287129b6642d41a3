"""`python -m cellm.pii --model M (--text T ... | --file F ...) [--redact] [--json]`: the
spans of personal data in each text, printed as the seed's `pii` tool printed them (label,
character range, text), with a score; `--redact` adds the redacted text."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from cellm.cli import Parser, bounded, run
from cellm.errors import InvalidArgument
from cellm.pii import PrivacyFilter, redacted


def build_parser() -> Parser:
    p = Parser(prog="python -m cellm.pii", description="Find personal data in text.")
    p.add_argument("--model", required=True, help=".cellm file or HF checkpoint directory")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", action="append", help="a text (repeat for a batch)")
    source.add_argument("--file", action="append", type=Path, help="a UTF-8 text file (repeat)")
    p.add_argument("--redact", action="store_true", help="also print each redacted text")
    p.add_argument("--style", default="[LABEL]", help="redaction placeholder (default [LABEL])")
    p.add_argument("--json", action="store_true", help="one JSON document instead of lines")
    p.add_argument("--threads", type=bounded(int, 1), default=None)
    return p


def read_text(path: Path) -> str:
    """A file's text; InvalidArgument (one line) when it cannot be read or is not UTF-8."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InvalidArgument(f"{path}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidArgument(f"{path} is not UTF-8 text (byte {e.start})") from None


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        texts = args.text if args.text is not None else [read_text(f) for f in args.file]
        for i, text in enumerate(texts):
            if not text.strip():
                raise InvalidArgument(f"text {i + 1} is empty")
        pf = PrivacyFilter(args.model, threads=args.threads)
        found = pf.detect_batch(texts)
        if args.json:
            docs = []
            for text, spans in zip(texts, found):
                doc: dict[str, object] = {"text": text, "spans": [asdict(s) for s in spans]}
                if args.redact:
                    doc["redacted"] = redacted(text, spans, args.style)
                docs.append(doc)
            print(json.dumps(docs, ensure_ascii=False, indent=2))
            return 0
        for text, spans in zip(texts, found):
            print(f"=== {text}")
            for s in spans:
                shown = json.dumps(s.text, ensure_ascii=False)
                print(f"    {s.label:<16} [{s.start:>4}:{s.end:>4}]  {shown}  {s.score:.3f}")
            if args.redact:
                print(f"    redacted: {redacted(text, spans, args.style)}")
        return 0

    return run(body)


if __name__ == "__main__":
    sys.exit(main())
