"""`python -m cellm.infer`: stream a completion to stdout, timings to stderr."""

from __future__ import annotations

import sys
from typing import Optional

from cellm.chat import CHAT_FORMATS
from cellm.cli import Parser, bounded, int_list, run
from cellm.fetch import default_model
from cellm.llm import BACKENDS, KV_ENCODINGS, LLM, GenerationResult


def build_parser() -> Parser:
    p = Parser(prog="python -m cellm.infer", description="Generate text with a cellm model.")
    p.add_argument(
        "--model",
        help=".cellm or .gguf file, HuggingFace checkpoint dir, or a registry name "
        "(`python -m cellm.fetch --list`); default: the registry's default model",
    )
    p.add_argument("--tokenizer", help="tokenizer.json to use instead of the embedded one")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--tokens", type=int_list, help="prompt as token ids: 1,2,3")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument(
        "--chat-format",
        choices=CHAT_FORMATS,
        default="auto",
        help="auto = the model's own template",
    )
    p.add_argument("--system", help="system message (with --chat)")
    p.add_argument(
        "--no-think",
        action="store_true",
        help="ask thinking models to answer directly (enable_thinking=False)",
    )
    p.add_argument("--gen", type=bounded(int, 1), default=128, help="tokens to generate")
    p.add_argument("--temperature", type=bounded(float, 0.0), default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=bounded(int, 0), default=0, help="0 = off")
    p.add_argument("--top-p", type=bounded(float, 0.0, 1.0, open_low=True), default=1.0)
    p.add_argument("--min-p", type=bounded(float, 0.0, 1.0), default=0.0)
    p.add_argument("--repeat-penalty", type=bounded(float, 0.0, open_low=True), default=1.0)
    p.add_argument("--seed", type=bounded(int, 0), default=None)
    p.add_argument(
        "--stop-tokens", type=int_list, default=[], help="extra token ids that end the turn: 1,2"
    )
    p.add_argument("--backend", choices=BACKENDS, default="cpu")
    p.add_argument("--kv-encoding", choices=KV_ENCODINGS, default="f16")
    p.add_argument("--threads", type=bounded(int, 1), default=None, help="default: physical cores")
    p.add_argument(
        "--context-length",
        type=bounded(int, 1),
        default=None,
        help="default: the model's trained context",
    )
    return p


def _prompt(llm: LLM, args) -> list[int]:
    if args.tokens is not None:
        return args.tokens
    if not args.chat:
        return llm.encode(args.prompt)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.prompt})
    extra = {"enable_thinking": False} if args.no_think else {}
    text = llm.apply_chat_template(messages, chat_format=args.chat_format, **extra)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def _report(r: GenerationResult) -> None:
    t = r.timings
    print(
        f"\nprefill: {t.prefill_tokens} tokens in {t.prefill_s:.3f} s ({t.prefill_tps:.1f} tok/s)"
        f" | decode: {t.decode_tokens} tokens in {t.decode_s:.3f} s ({t.decode_tps:.1f} tok/s)"
        f" | finish: {r.finish_reason}",
        file=sys.stderr,
    )


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        llm = LLM(
            args.model or default_model(),
            backend=args.backend,
            kv_encoding=args.kv_encoding,
            threads=args.threads,
            context_length=args.context_length,
            tokenizer=args.tokenizer,
        )
        events = llm.stream(
            _prompt(llm, args),
            max_tokens=args.gen,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            repeat_penalty=args.repeat_penalty,
            seed=args.seed,
            stop_token_ids=args.stop_tokens,
        )
        while True:
            try:
                sys.stdout.write(next(events))
                sys.stdout.flush()
            except StopIteration as done:
                sys.stdout.write("\n")
                _report(done.value)
                return 0

    return run(body)


if __name__ == "__main__":
    sys.exit(main())
