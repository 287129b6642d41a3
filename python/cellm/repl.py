"""`cellm chat`: an interactive chat in the terminal. The conversation and its KV cache carry
over between turns, so each answer starts after prefilling only the new message."""

from __future__ import annotations

import sys
from typing import Callable, Optional, TextIO

from cellm.cli import Parser, run
from cellm.conversation import Conversation
from cellm.errors import ContextOverflow
from cellm.infer import (
    add_chat_arguments,
    add_model_arguments,
    add_sampling_arguments,
    load_model,
    sampling_params,
)

HELP = "/reset starts over, /exit (or Ctrl-D) quits, Ctrl-C stops an answer"


def build_parser() -> Parser:
    p = Parser(
        prog="cellm chat",
        description="Chat with a model in the terminal; the conversation (and its KV cache) "
        "carries over between turns.",
    )
    add_model_arguments(p)
    add_chat_arguments(p)
    add_sampling_arguments(p)
    p.set_defaults(gen=512)
    return p


def read_piped() -> Optional[str]:
    return sys.stdin.readline() or None


def read_typed() -> Optional[str]:
    """A line typed at the terminal, with line editing and history (readline)."""
    try:
        return input("> ") + "\n"
    except EOFError:
        print(file=sys.stderr)
        return None


def chat_loop(
    conversation: Conversation, read_line: Callable[[], Optional[str]], out: TextIO
) -> None:
    """Reads user messages until end of input or /exit; streams each answer to `out`."""
    while True:
        line = read_line()
        if line is None:  # end of input
            return
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            conversation.reset()
            print("(conversation cleared)", file=sys.stderr)
            continue
        answer = conversation.send(text)
        try:
            for piece in answer:
                out.write(piece)
                out.flush()
        except KeyboardInterrupt:
            answer.close()  # the turn is dropped; the cache is reused up to where it agrees
            out.write(" [stopped]")
        except ContextOverflow as e:
            print(f"error: {e} (/reset to start over)", file=sys.stderr)
        out.write("\n")
        out.flush()


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        llm = load_model(args)
        extra = {"enable_thinking": False} if args.no_think else {}
        conversation = llm.conversation(
            args.system,
            chat_format=args.chat_format,
            params=sampling_params(args),
            template_vars=extra,
        )
        read_line = read_piped
        if sys.stdin.isatty():
            import readline  # noqa: F401  (gives input() line editing and history)

            read_line = read_typed
            print(f"cellm chat: {llm.path.name} ({HELP})", file=sys.stderr)
        try:
            chat_loop(conversation, read_line, sys.stdout)
        except KeyboardInterrupt:  # Ctrl-C at the prompt quits
            print(file=sys.stderr)
        finally:
            conversation.close()
        return 0

    return run(body)


if __name__ == "__main__":
    sys.exit(main())
