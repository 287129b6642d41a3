"""`python -m cellm.convert --input HF_DIR --output M.cellm [--dtype f32|f16|bf16]`."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn, Optional

from ..errors import CellmError
from . import convert_hf
from .dtypes import FORMATS


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad usage as one `error: ...` line (exit 2), like other errors."""

    def error(self, message: str) -> NoReturn:
        _fail(message)
        sys.exit(2)


def _fail(message: object) -> None:
    # One line, no traceback: scripts grep stderr, humans read the first line.
    text = " ".join(str(message).split("\n"))
    print(f"error: {text}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m cellm.convert",
        description="Convert a HuggingFace checkpoint directory to a .cellm file.",
    )
    p.add_argument("--input", "-i", required=True, metavar="HF_DIR", help="checkpoint directory")
    p.add_argument("--output", "-o", required=True, metavar="M.cellm", help="file to write")
    p.add_argument(
        "--dtype",
        choices=FORMATS,
        default="f16",
        help="storage format of 2-D+ tensors (1-D ones are always f32); default f16",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="force the progress bar on or off (default: on for large models on a terminal)",
    )
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        path = convert_hf(args.input, args.output, args.dtype, progress=args.progress)
    except CellmError as e:
        _fail(e)
        return 2
    except OSError as e:
        # Disk full, permission denied...: the environment failed, not the input.
        _fail(e)
        return 1
    except KeyboardInterrupt:
        _fail("interrupted")
        return 130
    size = path.stat().st_size
    print(f"wrote {path} ({size / (1 << 20):,.1f} MiB, {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
