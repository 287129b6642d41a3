"""`python -m cellm.convert --input HF_DIR|M.gguf --output M.cellm [--dtype f32|f16|bf16]`."""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from ..cli import Parser, run
from . import convert, read_header
from .dtypes import FORMATS
from .quantize import FLOAT_DTYPES, GROUP_SIZES, SCHEMES


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m cellm.convert",
        description="Convert a HuggingFace checkpoint directory, a GGUF file or a CTranslate2 "
        "Whisper directory (faster-whisper's) to a .cellm file.",
    )
    p.add_argument(
        "--input",
        "-i",
        required=True,
        metavar="HF_DIR|M.gguf|M-v1.cellm|CT2_DIR",
        help="HF checkpoint directory, GGUF file, .cellm v1 file (the earlier engine's) or"
        " CTranslate2 Whisper directory",
    )
    p.add_argument("--output", "-o", required=True, metavar="M.cellm", help="file to write")
    p.add_argument(
        "--dtype",
        choices=FORMATS,
        default=None,
        help="HF and CTranslate2 only: storage format of 2-D+ tensors (1-D ones are always "
        "f32); default f16. GGUF tensors keep their formats",
    )
    p.add_argument(
        "--quantize",
        choices=SCHEMES,
        default=None,
        help="store every matrix whose rows split into its units in this format: int8 (per "
        "row), int4 / int4-affine / int3 / int2 (groups of --group-size; int3 and int2 are "
        "affine), or a GGUF block format (ggml's reference rounding; q1_0 is 1 bit per value). "
        "A GGUF input is dequantized and requantized",
    )
    p.add_argument(
        "--group-size",
        type=int,
        choices=GROUP_SIZES,
        default=None,
        help="values per int4 / int3 / int2 scale (default 64; int3 and int2: 64 or 128)",
    )
    p.add_argument(
        "--embedding",
        choices=SCHEMES + FLOAT_DTYPES,
        default=None,
        help="format of the token embedding (and a tied output head); default: as --quantize",
    )
    p.add_argument(
        "--vision-quantize",
        choices=SCHEMES,
        default=None,
        help="HF vision-language models: quantize the vision tower and connector too (they "
        "stay in --dtype otherwise)",
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

    def body() -> int:
        path = convert(
            args.input,
            args.output,
            args.dtype,
            progress=args.progress,
            quantize=args.quantize,
            group_size=args.group_size,
            embedding=args.embedding,
            vision_quantize=args.vision_quantize,
        )
        size = path.stat().st_size
        source = read_header(path)["source"]
        kind = source.get("quantize") or source.get("dtype") or "from GGUF, formats kept"
        print(f"wrote {path} ({size / (1 << 20):,.1f} MiB, {kind})")
        for why, count in source.get("left_out", {}).items():
            print(f"note: left out {count} checkpoint tensors: {why}")
        return 0

    return run(body)


if __name__ == "__main__":
    sys.exit(main())
