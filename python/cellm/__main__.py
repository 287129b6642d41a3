"""The `cellm` command (also `python -m cellm`): one entry point for the subcommands."""

from __future__ import annotations

import importlib
import sys
from typing import Callable, Optional

# Subcommand -> (module with `main(argv)`, what it does).
COMMANDS = {
    "infer": ("cellm.infer", "generate text from a prompt"),
    "chat": ("cellm.repl", "chat in the terminal, keeping the conversation"),
    "convert": ("cellm.convert.__main__", "convert a HF checkpoint or GGUF file to .cellm"),
    "fetch": ("cellm.fetch", "download a registry model (and convert it)"),
    "transcribe": ("cellm.transcribe", "speech to text with a Whisper model"),
    "serve": ("cellm.serve", "an OpenAI-compatible server for one model"),
    "cache": ("cellm.cache", "list or remove cached models"),
    "bench": ("cellm.bench", "benchmark against llama.cpp"),
}


def usage() -> str:
    rows = "\n".join(f"  {name:<8} {what}" for name, (_, what) in COMMANDS.items())
    return (
        "usage: cellm COMMAND [options]   (cellm COMMAND --help for its options)\n\n"
        f"commands:\n{rows}\n"
    )


def main(argv: Optional[list[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage(), end="")
        return 0
    if args[0] in ("-V", "--version"):
        from cellm import __version__

        print(f"cellm {__version__}")
        return 0
    entry = COMMANDS.get(args[0])
    if entry is None:
        print(f"error: unknown command {args[0]!r}", file=sys.stderr)
        print(usage(), end="", file=sys.stderr)
        return 2
    command: Callable[[list[str]], int] = importlib.import_module(entry[0]).main
    return command(args[1:])


if __name__ == "__main__":
    sys.exit(main())
