"""`cellm infer` (`python -m cellm.infer`): stream a completion to stdout, timings to stderr."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Generator
from dataclasses import replace
from typing import Any, Optional

from cellm.chat import CHAT_FORMATS
from cellm.cli import Parser, bounded, int_list, run
from cellm.errors import FormatError, InvalidArgument
from cellm.fetch import default_model
from cellm.llm import BACKENDS, KV_ENCODINGS, LLM, GenerationResult
from cellm.sampling import SamplingParams


def build_parser() -> Parser:
    p = Parser(prog="cellm infer", description="Generate text with a cellm model.")
    add_model_arguments(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--tokens", type=int_list, help="prompt as token ids: 1,2,3")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="an image for a vision-language model, placed before the prompt (implies --chat; "
        "repeat for several)",
    )
    add_chat_arguments(p)
    add_sampling_arguments(p)
    p.add_argument(
        "--stop-tokens",
        type=_token_list,
        default=[],
        help="extra tokens that end the turn, as ids or vocabulary entries: "
        "1,2 or '<end_function_call>,<start_function_response>'",
    )
    p.add_argument(
        "--tools",
        metavar="FILE.json",
        help="JSON list of tool schemas for the chat template (implies --chat); "
        "the parsed tool calls are printed as one JSON line after the text",
    )
    constraint = p.add_mutually_exclusive_group()
    constraint.add_argument(
        "--json-schema", metavar="FILE.json", help="the output is JSON that validates against it"
    )
    constraint.add_argument("--regex", help="the output matches this regular expression")
    constraint.add_argument(
        "--grammar", metavar="FILE.lark", help="the output parses with this Lark grammar"
    )
    return p


def add_model_arguments(p: Parser) -> None:
    """Which model, and how to load it (shared with `cellm chat`)."""
    p.add_argument(
        "--model",
        help=".cellm or .gguf file, HuggingFace checkpoint dir or Hub id (org/name), or a "
        "registry name (`cellm fetch --list`); default: the registry's default model",
    )
    p.add_argument("--tokenizer", help="tokenizer.json to use instead of the embedded one")
    p.add_argument("--backend", choices=BACKENDS, default="cpu")
    p.add_argument(
        "--max-layers",
        type=bounded(int, 1),
        default=None,
        help="run only the model's first N layers (a debugging aid)",
    )
    p.add_argument("--kv-encoding", choices=KV_ENCODINGS, default="f16")
    p.add_argument("--threads", type=bounded(int, 1), default=None, help="default: physical cores")
    p.add_argument(
        "--context-length",
        type=bounded(int, 1),
        default=None,
        help="default: the model's trained context",
    )


def add_chat_arguments(p: Parser) -> None:
    p.add_argument(
        "--chat-format",
        choices=CHAT_FORMATS,
        default="auto",
        help="auto = the model's own template",
    )
    p.add_argument("--system", help="system message")
    p.add_argument(
        "--no-think",
        action="store_true",
        help="ask thinking models to answer directly (enable_thinking=False)",
    )


def add_sampling_arguments(p: Parser) -> None:
    p.add_argument("--gen", type=bounded(int, 1), default=128, help="tokens to generate")
    p.add_argument("--temperature", type=bounded(float, 0.0), default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=bounded(int, 0), default=0, help="0 = off")
    p.add_argument("--top-p", type=bounded(float, 0.0, 1.0, open_low=True), default=1.0)
    p.add_argument("--min-p", type=bounded(float, 0.0, 1.0), default=0.0)
    p.add_argument("--repeat-penalty", type=bounded(float, 0.0, open_low=True), default=1.0)
    p.add_argument("--seed", type=bounded(int, 0), default=None)


def load_model(args: argparse.Namespace) -> LLM:
    return LLM(
        args.model or default_model(),
        backend=args.backend,
        kv_encoding=args.kv_encoding,
        threads=args.threads,
        context_length=args.context_length,
        tokenizer=args.tokenizer,
        kv_capacity_tokens=getattr(args, "kv_capacity_tokens", None),
        max_layers=args.max_layers,
        prefix_cache=getattr(args, "prefix_cache", True),
    )


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.gen,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        seed=args.seed,
    )


def _token_list(text: str) -> list[str]:
    """Parses `a,b,c` into stripped, non-empty items; they become ids once the model is
    loaded (see _stop_token_ids), since only its vocabulary can tell what a name means."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r} lists no tokens")
    return items


def _stop_token_ids(llm: LLM, items: list[str]) -> list[int]:
    """Each item is a token id (ASCII digits, so a vocabulary entry made of digits cannot be
    named) or one vocabulary entry, e.g. <end_function_call>."""
    ids = []
    for item in items:
        is_id = item.isascii() and item.isdigit()
        token_id = int(item) if is_id else llm.tokenizer.token_to_id(item)
        if token_id is None:
            raise InvalidArgument(
                f"--stop-tokens: {item!r} is not a single token of the model's vocabulary"
            )
        if token_id >= llm.tokenizer.vocab_size:
            raise InvalidArgument(
                f"--stop-tokens: token id {token_id} is outside the vocabulary "
                f"({llm.tokenizer.vocab_size})"
            )
        ids.append(token_id)
    return ids


def _read_file(flag: str, path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise FormatError(f"{flag} {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise FormatError(f"{flag} {path}: cannot read: {e}") from None


def _read_json(flag: str, path: str) -> Any:
    try:
        return json.loads(_read_file(flag, path))
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"{flag} {path}: not valid JSON: {e}") from None


def _read_tools(path: str) -> list[Any]:
    tools = _read_json("--tools", path)
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InvalidArgument(f"--tools {path}: expected a JSON list of tool schemas (objects)")
    return tools


def _constraint(args: argparse.Namespace) -> dict[str, Any]:
    """The SamplingParams fields of --json-schema, --regex or --grammar (see cellm.structured)."""
    if args.json_schema is not None:
        schema = _read_json("--json-schema", args.json_schema)
        return {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.grammar is not None:
        return {"grammar": _read_file("--grammar", args.grammar)}
    return {}


def _prompt(llm: LLM, args: argparse.Namespace, tools: Optional[list[Any]]) -> list[int]:
    if args.tokens is not None:
        ids: list[int] = args.tokens
        return ids
    if not (args.chat or tools is not None):
        return llm.encode(args.prompt)
    text = llm.apply_chat_template(
        _messages(args, args.prompt), tools=tools, chat_format=args.chat_format, **_extra(args)
    )
    return llm.tokenizer.encode(text, add_special_tokens=False)


def _messages(args: argparse.Namespace, content: Any) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    return [*messages, {"role": "user", "content": content}]


def _extra(args: argparse.Namespace) -> dict[str, Any]:
    return {"enable_thinking": False} if args.no_think else {}


def _image_chat(llm: LLM, args: argparse.Namespace) -> Generator[str, None, GenerationResult]:
    """A chat turn of the images (in order) followed by the prompt."""
    parts: list[dict[str, Any]] = [{"type": "image", "image": path} for path in args.image]
    parts.append({"type": "text", "text": args.prompt})
    return llm.stream_chat(
        _messages(args, parts),
        chat_format=args.chat_format,
        template_vars=_extra(args),
        params=sampling_params(args),
        stop_token_ids=_stop_token_ids(llm, args.stop_tokens),
    )


def _print_tool_calls(llm: LLM, r: GenerationResult) -> None:
    _, calls = llm.split_tool_calls(r)
    print(json.dumps(calls, ensure_ascii=False))


def _report(r: GenerationResult) -> None:
    t = r.timings
    images = f"images: {t.images} encoded in {t.image_encode_s:.3f} s | " if t.images else ""
    print(
        f"\n{images}prefill: {t.prefill_tokens} tokens in {t.prefill_s:.3f} s "
        f"({t.prefill_tps:.1f} tok/s)"
        f" | decode: {t.decode_tokens} tokens in {t.decode_s:.3f} s ({t.decode_tps:.1f} tok/s)"
        f" | finish: {r.finish_reason}",
        file=sys.stderr,
    )


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tools is not None and args.tokens is not None:
        parser.error("--tools needs a text --prompt (it goes through the chat template)")
    if args.image and (args.tokens is not None or args.tools is not None):
        parser.error("--image needs a text --prompt, without --tools")

    def body() -> int:
        tools = _read_tools(args.tools) if args.tools is not None else None
        constraint = _constraint(args)  # files read before the model loads
        llm = load_model(args)
        events = (
            _image_chat(llm, args)
            if args.image
            else llm.stream(
                _prompt(llm, args, tools),
                params=replace(sampling_params(args), **constraint),
                stop_token_ids=_stop_token_ids(llm, args.stop_tokens),
                # Tool-call markers are special tokens: keep them so the calls can be seen
                # (a constraint keeps every token it matched by itself).
                skip_special_tokens=None if constraint else tools is None,
            )
        )
        while True:
            try:
                sys.stdout.write(next(events))
                sys.stdout.flush()
            except StopIteration as done:
                sys.stdout.write("\n")
                if tools is not None:
                    _print_tool_calls(llm, done.value)
                _report(done.value)
                return 0

    return run(body)


if __name__ == "__main__":
    sys.exit(main())
