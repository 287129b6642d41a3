"""`cellm chat`: an interactive chat in the terminal. The conversation and its KV cache carry
over between turns, so each answer starts after prefilling only the new message."""

from __future__ import annotations

import os
import shlex
import sys
from typing import Any, Callable, Optional, TextIO, Union

from cellm.cli import Parser, run
from cellm.conversation import Conversation
from cellm.errors import CellmError
from cellm.infer import (
    add_chat_arguments,
    add_model_arguments,
    add_sampling_arguments,
    load_model,
    sampling_params,
)

HELP = "/reset starts over, /exit (or Ctrl-D) quits, Ctrl-C stops an answer"
IMAGE_HELP = "/image PATH [PATH ...] attaches images to your next message"


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


def attach(conversation: Conversation, arguments: str, images: list[str]) -> None:
    """`/image PATH ...`: adds the paths (shell quoting allowed, ~ expanded) to `images`,
    which go with the next message; says on stderr what it did or why it did not."""
    paths: list[str] = []
    if conversation.llm.vision is None:
        problem = f"{conversation.llm.path.name} is a text-only model: it takes no images"
    else:
        try:
            paths = [os.path.expanduser(p) for p in shlex.split(arguments)]
        except ValueError as e:
            problem = f"cannot read the paths: {e}"
        else:
            missing = [p for p in paths if not os.path.isfile(p)]
            problem = f"{missing[0]}: no such file" if missing else ""
            if not paths:
                problem = "usage: /image PATH [PATH ...]"
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return
    images.extend(paths)
    print(f"({len(images)} image(s) attached to your next message)", file=sys.stderr)


def chat_loop(
    conversation: Conversation, read_line: Callable[[], Optional[str]], out: TextIO
) -> None:
    """Reads user messages until end of input or /exit; streams each answer to `out`.
    `/image PATH` attaches images to the next message."""
    images: list[str] = []
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
            images.clear()
            print("(conversation cleared)", file=sys.stderr)
            continue
        if text == "/image" or text.startswith("/image "):
            attach(conversation, text[len("/image") :], images)
            continue
        content: Union[str, list[dict[str, Any]]] = text
        if images:
            content = [{"type": "image", "image": p} for p in images]
            content.append({"type": "text", "text": text})
            images.clear()  # sent with this message, or dropped with it if it fails
        answer = conversation.send(content)
        try:
            for piece in answer:
                out.write(piece)
                out.flush()
        except KeyboardInterrupt:
            answer.close()  # the turn is dropped; the cache is reused up to where it agrees
            out.write(" [stopped]")
        except CellmError as e:  # a bad image, a turn past the context: the chat goes on
            print(f"error: {e} (the message was dropped; /reset starts over)", file=sys.stderr)
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
            commands = f"{HELP}, {IMAGE_HELP}" if llm.vision is not None else HELP
            print(f"cellm chat: {llm.path.name} ({commands})", file=sys.stderr)
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
