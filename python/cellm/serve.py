"""`cellm serve` (`python -m cellm.serve`): an OpenAI-compatible HTTP server over one model.

Routes: `POST /v1/chat/completions`, `POST /v1/completions` (each streaming over server-sent
events when `stream` is true), `GET /v1/models`, `GET /health`. Every request joins the model's
continuous batch (`cellm.scheduler`). Bad requests get OpenAI error objects with 4xx codes
(429 when the queue is full); a client that disconnects cancels its request. `response_format`
(json_schema / json_object) constrains the answer (`cellm.structured`).

A vision-language model takes images as OpenAI `image_url` content parts holding data: URLs
(base64). The server fetches nothing from the network, and reads local files only when started
with `--image-root DIR`, then only those under DIR.

Built on Starlette and uvicorn (the `serve` extra: `pip install "cellm[serve]"`).
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from cellm.errors import Busy, CellmError
from cellm.generation import GenerationResult
from cellm.llm import LLM
from cellm.multimodal import NO_FILES, ImageFiles, ImagePrompt
from cellm.sampling import SamplingParams
from cellm.scheduler import AsyncStream, Scheduler
from cellm.structured import GrammarError, grammar_for

try:
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request as HttpRequest
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route
except ImportError:  # pragma: no cover - the optional extra
    Starlette = None  # type: ignore[assignment, misc]

# OpenAI's defaults where a request leaves a setting out.
DEFAULT_COMPLETION_TOKENS = 16


class BadRequest(Exception):
    """A request the API refuses: 400 with an OpenAI error object naming `param`."""

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class Server:
    llm: LLM
    model_name: str
    scheduler: Scheduler
    files: ImageFiles = NO_FILES  # the local image files clients may name

    # -- routes ------------------------------------------------------------------------------

    async def health(self, request: HttpRequest) -> Response:
        in_use, allocated, page_bytes = self.llm.kv_stats()
        return JSONResponse(
            {
                "status": "ok",
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
                "kv_pages_in_use": in_use,
                "kv_pages_allocated": allocated,
                "kv_page_bytes": page_bytes,
            }
        )

    async def models(self, request: HttpRequest) -> Response:
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "cellm"}
        return JSONResponse({"object": "list", "data": [model]})

    async def completions(self, request: HttpRequest) -> Response:
        return await self._handle(request, chat=False)

    async def chat_completions(self, request: HttpRequest) -> Response:
        return await self._handle(request, chat=True)

    # -- the shared path -----------------------------------------------------------------------

    async def _handle(self, http: HttpRequest, chat: bool) -> Response:
        try:
            body = await _json_body(http)
            tools = _tools(body) if chat else None
            params = _sampling(body, chat, tools is not None)
            # Off the event loop: images are decoded and resized there.
            if chat:
                prompt = await run_in_threadpool(self._chat_prompt, body, tools)
            else:
                prompt = await run_in_threadpool(self._prompt, body)
            request = self.llm._request(prompt, params)
            stream = AsyncStream(self.scheduler, request)
            if body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                first = await _first_event(stream)
                events = self._sse(stream, first, chat, tools is not None, include_usage)
                return StreamingResponse(events, media_type="text/event-stream")
            result = await stream.collect()
            return JSONResponse(self._response(result, chat, tools is not None))
        except BadRequest as e:
            return _error(400, str(e), "invalid_request_error", e.param)
        except Busy as e:
            return _error(429, str(e), "server_busy")
        except CellmError as e:  # a prompt too long, a template refusing the messages, ...
            return _error(400, str(e), "invalid_request_error")

    def _prompt(self, body: Mapping[str, Any]) -> ImagePrompt:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if not isinstance(prompt, (str, list)):
            raise BadRequest("prompt must be a string or a list of token ids", "prompt")
        return ImagePrompt(self.llm.prompt_ids(prompt))

    def _chat_prompt(self, body: Mapping[str, Any], tools: Optional[list[Any]]) -> ImagePrompt:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list", "messages")
        return self.llm._chat_prompt(messages, tools, "auto", None, self.files)

    async def _sse(
        self,
        stream: AsyncStream,
        first: Optional[str],
        chat: bool,
        with_tools: bool,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        ident, created = _ident(chat), int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choice: dict[str, Any], usage: Optional[dict[str, int]] = None) -> str:
            body = {"id": ident, "object": kind, "created": created, "model": self.model_name}
            body["choices"] = [{"index": 0, "logprobs": None, **choice}]
            if usage is not None:
                body["usage"] = usage
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        if chat:
            yield chunk({"delta": {"role": "assistant", "content": ""}, "finish_reason": None})
        pieces = [] if first is None else [first]

        async def all_pieces() -> AsyncIterator[str]:
            for piece in pieces:
                yield piece
            async for piece in stream:
                yield piece

        async for piece in all_pieces():
            if with_tools:
                continue  # calls are parsed from the whole answer: sent at the end
            delta: dict[str, Any] = {"delta": {"content": piece}} if chat else {"text": piece}
            yield chunk({**delta, "finish_reason": None})
        result = stream.result
        if result is None:  # the request failed after it started
            yield f"data: {json.dumps(_error_body('generation failed', 'server_error'))}\n\n"
            return
        final = self._choice(result, chat, with_tools)
        if chat:
            message = final.pop("message")
            delta = {k: v for k, v in message.items() if k != "role" and v is not None}
            if not with_tools:
                delta.pop("content", None)  # already streamed
            final = {"delta": delta, **final}
        else:
            final["text"] = ""
        yield chunk(final, _usage(result) if include_usage else None)
        yield "data: [DONE]\n\n"

    def _response(self, result: GenerationResult, chat: bool, with_tools: bool) -> dict[str, Any]:
        return {
            "id": _ident(chat),
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "logprobs": None, **self._choice(result, chat, with_tools)}],
            "usage": _usage(result),
        }

    def _choice(self, result: GenerationResult, chat: bool, with_tools: bool) -> dict[str, Any]:
        finish = "length" if result.finish_reason == "length" else "stop"
        if not chat:
            return {"text": result.text, "finish_reason": finish}
        text, calls = self.llm.split_tool_calls(result) if with_tools else (result.text, [])
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = [_tool_call(call) for call in calls]
            finish = "tool_calls"
        return {"message": message, "finish_reason": finish}


# -- request parsing ---------------------------------------------------------------------------


async def _json_body(http: HttpRequest) -> dict[str, Any]:
    try:
        body = json.loads(await http.body())
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if body.get("n", 1) != 1:
        raise BadRequest("only n=1 is supported", "n")
    return body


def _tools(body: Mapping[str, Any]) -> Optional[list[Any]]:
    tools = body.get("tools")
    if tools is None or body.get("tool_choice") == "none":
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRequest("tools must be a list of objects", "tools")
    names = [(t.get("function") or {}).get("name") for t in tools]
    if len(set(names)) != len(names):
        raise BadRequest("tool names must be unique", "tools")
    return tools


def _sampling(body: Mapping[str, Any], chat: bool, with_tools: bool) -> SamplingParams:
    """The request's settings, with OpenAI's defaults (temperature 1; completions stop after
    16 tokens, chats at the end of the turn or the context)."""

    def number(key: str, default: Optional[float], low: float, high: float) -> Optional[float]:
        value = body.get(key, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BadRequest(f"{key} must be a number", key)
        if not low <= value <= high:
            raise BadRequest(f"{key} must be between {low} and {high}", key)
        return float(value)

    for key in ("presence_penalty", "frequency_penalty"):
        if number(key, 0.0, -2.0, 2.0):
            raise BadRequest(f"{key} is not supported yet", key)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = 1 << 30 if chat else DEFAULT_COMPLETION_TOKENS
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise BadRequest("max_tokens must be a positive integer", "max_tokens")
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise BadRequest("stop must be a string or a list of strings", "stop")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise BadRequest("seed must be a non-negative integer", "seed")
    response_format = body.get("response_format")
    try:  # checked here, so that a bad schema is refused before the request is queued
        grammar_for(response_format)
    except GrammarError as e:
        raise BadRequest(str(e), "response_format") from None
    return SamplingParams(
        temperature=number("temperature", 1.0, 0.0, 2.0) or 0.0,
        top_p=number("top_p", 1.0, 0.0, 1.0) or 1.0,
        max_tokens=max_tokens,
        stop=stop,
        seed=seed,
        # Call markers are special tokens: keep them so the calls can be parsed (and keep
        # every token a constraint matched: see Decoding).
        skip_special_tokens=None if response_format else not with_tools,
        response_format=response_format,
    )


async def _first_event(stream: AsyncStream) -> Optional[str]:
    """Starts the request and waits for its first piece, so that errors (a full queue, a
    prompt too long) still become a status code before the event stream begins."""
    try:
        return await stream.__aiter__().__anext__()
    except StopAsyncIteration:
        return None


# -- responses ---------------------------------------------------------------------------------


def _ident(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def _usage(result: GenerationResult) -> dict[str, int]:
    completion = len(result.token_ids)
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": result.prompt_tokens + completion,
    }


def _tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
    }


def _error_body(message: str, kind: str, param: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def _error(status: int, message: str, kind: str, param: Optional[str] = None) -> Response:
    return JSONResponse(_error_body(message, kind, param), status_code=status)


def build_app(
    llm: LLM,
    model_name: str,
    scheduler: Optional[Scheduler] = None,
    image_root: Optional[str] = None,
) -> Starlette:
    """The ASGI app serving `llm` as `model_name`, on `scheduler` (default: the model's
    shared one). Image parts may name local files under `image_root` only (none without)."""
    if Starlette is None:
        raise ImportError('cellm serve needs Starlette and uvicorn: pip install "cellm[serve]"')
    files = NO_FILES if image_root is None else ImageFiles(anywhere=False, root=image_root)
    server = Server(llm, model_name, scheduler or llm.shared_scheduler(), files)
    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
    ]
    return Starlette(routes=routes)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from cellm.cli import Parser, bounded, run
    from cellm.infer import add_model_arguments, load_model

    p = Parser(prog="cellm serve", description="An OpenAI-compatible server for one model.")
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=bounded(int, 1, 65535), default=8000)
    p.add_argument("--max-sessions", type=bounded(int, 1), default=16, help="requests per batch")
    p.add_argument("--kv-capacity", type=bounded(int, 1), default=None, help="KV tokens in all")
    p.add_argument(
        "--image-root",
        metavar="DIR",
        default=None,
        help="let image parts name local files under DIR (default: data: URLs only)",
    )
    args = p.parse_args(argv)
    if args.image_root is not None and not os.path.isdir(args.image_root):
        p.error(f"--image-root {args.image_root}: not a directory")

    def body() -> int:
        import uvicorn

        args.kv_capacity_tokens = args.kv_capacity
        llm = load_model(args)
        scheduler = Scheduler(llm, max_running=args.max_sessions)
        scheduler.start()
        name = args.model or llm.path.stem
        print(f"cellm serve: {name} on http://{args.host}:{args.port}", file=sys.stderr)
        app = build_app(llm, name, scheduler, args.image_root)
        uvicorn.run(app, host=args.host, port=args.port)
        scheduler.close()
        return 0

    return run(body)


if __name__ == "__main__":
    sys.exit(main())
