"""What every `python -m cellm.*` command shares: one-line errors and exit codes."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn, TypeVar

from cellm.errors import CellmError

# Exit codes: 2 for bad input (files, flags, prompts), 1 when the environment failed.
EXIT_BAD_INPUT = 2
EXIT_ENVIRONMENT = 1
_N = TypeVar("_N", int, float)


def fail(message: object) -> None:
    """Print one `error: ...` line (no traceback): scripts grep it, humans read it."""
    text = " ".join(str(message).split())
    print(f"error: {text}", file=sys.stderr)


class Parser(argparse.ArgumentParser):
    """argparse that reports bad usage as one `error: ...` line with exit code 2."""

    def error(self, message: str) -> NoReturn:
        fail(message)
        sys.exit(EXIT_BAD_INPUT)


def run(main: Callable[[], int]) -> int:
    """Run a command body, turning cellm errors into one line and an exit code."""
    try:
        return main()
    except CellmError as e:
        fail(e)
        return EXIT_BAD_INPUT
    except OSError as e:
        # Disk full, permission denied...: the environment failed, not the input.
        fail(e)
        return EXIT_ENVIRONMENT
    except KeyboardInterrupt:
        fail("interrupted")
        return 130


def bounded(
    kind: type[_N], low: float | None = None, high: float | None = None, *, open_low: bool = False
) -> Callable[[str], _N]:
    """An argparse `type=` that parses `kind` and checks `low <= v <= high` (or `low < v`)."""

    def parse(text: str) -> _N:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {kind.__name__}") from None
        if low is not None and (v <= low if open_low else v < low):
            sign = ">" if open_low else ">="
            raise argparse.ArgumentTypeError(f"{text} is out of range (must be {sign} {low})")
        if high is not None and v > high:
            raise argparse.ArgumentTypeError(f"{text} is out of range (must be <= {high})")
        return v

    return parse


def int_list(text: str) -> list[int]:
    """Parses `1,2,3` into token ids."""
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ids") from None
    if not ids or any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"{text!r} must list non-negative token ids")
    return ids
