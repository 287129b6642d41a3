"""`python -m cellm.transcribe`: speech to text with a Whisper model.

    python -m cellm.transcribe --model whisper-base --audio talk.wav [--language en]
        [--task translate] [--timestamps] [--json]

Prints the text (with `--timestamps`, one `[start --> end] text` line per segment), or with
`--json` one object with text, language and segments. Bad input is one `error:` line and
exit code 2."""

from __future__ import annotations

import json
import sys
from typing import Optional

from cellm.cli import Parser, bounded, run
from cellm.speech import Transcription, Whisper
from cellm.speech.model import TASKS


def build_parser() -> Parser:
    p = Parser(prog="python -m cellm.transcribe", description="Transcribe speech with Whisper.")
    p.add_argument(
        "--model",
        default="whisper-base",
        help="a Whisper .cellm file, HF checkpoint directory, or registry name "
        "(default: whisper-base)",
    )
    p.add_argument("--audio", required=True, help="audio file (WAV, FLAC, OGG, ...)")
    p.add_argument("--language", help="language code (en, fr, ...); default: detected")
    p.add_argument("--task", choices=TASKS, default="transcribe")
    p.add_argument("--timestamps", action="store_true", help="segments with start and end times")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--threads", type=bounded(int, 1, 1024), help="worker threads")
    return p


def _format(result: Transcription, timestamps: bool, as_json: bool) -> str:
    if as_json:
        return json.dumps(
            {
                "text": result.text,
                "language": result.language,
                "duration": result.duration,
                "segments": [
                    {"start": round(s.start, 2), "end": round(s.end, 2), "text": s.text}
                    for s in result.segments
                ],
            },
            ensure_ascii=False,
        )
    if timestamps:
        return "\n".join(
            f"[{s.start:7.2f} --> {s.end:7.2f}] {s.text.strip()}" for s in result.segments
        )
    return result.text


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        model = Whisper(args.model, threads=args.threads)
        result = model.transcribe(
            args.audio, language=args.language, task=args.task, timestamps=args.timestamps
        )
        print(_format(result, args.timestamps, args.json))
        return 0

    return run(body)


if __name__ == "__main__":
    sys.exit(main())
