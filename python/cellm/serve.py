"""`cellm serve` (`python -m cellm.serve`): an OpenAI-compatible HTTP server over one model.

Routes: `POST /v1/chat/completions`, `POST /v1/completions` (each streaming over server-sent
events when `stream` is true), `POST /v1/embeddings` (when started with `--embedding-model`:
`cellm.Embedder`, texts only; an empty text or one longer than the encoder's positions is
refused with 400, not cut), `GET /v1/models`, `GET /health`. Every request joins the model's
continuous batch (`cellm.scheduler`). Bad requests get OpenAI error objects with 4xx codes
(429 when the queue is full); a client that disconnects cancels its request. `response_format`
(json_schema / json_object) constrains the answer (`cellm.structured`).

A vision-language model takes images as OpenAI `image_url` content parts holding data: URLs
(base64). The server fetches nothing from the network, and reads local files only when started
with `--image-root DIR`, then only those under DIR.

Built on Starlette and uvicorn (the `serve` extra: `pip install "cellm[serve]"`).
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from cellm.embeddings import Embedder
from cellm.errors import Busy, CellmError, InvalidArgument
from cellm.generation import GenerationResult, Piece, TokenLogprob
from cellm.llm import LLM
from cellm.multimodal import NO_FILES, ImageFiles, ImagePrompt
from cellm.sampling import MAX_TOP_LOGPROBS, SamplingParams
from cellm.scheduler import AsyncStream, Scheduler
from cellm.structured import GrammarError, grammar_for, ll_tokenizer, token_bytes
from cellm.tool_formats import check_tools

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
# Choices per request (OpenAI allows 128; each one is a sequence in the batch).
MAX_CHOICES = 16
# Texts per embeddings request (OpenAI's limit).
MAX_EMBEDDING_INPUTS = 2048


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
    embedder: Optional[Embedder] = None
    embedder_name: str = ""
    # One embeddings batch at a time (the encoder runs off the event loop, on its threads).
    embed_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    # -- routes ------------------------------------------------------------------------------

    async def health(self, request: HttpRequest) -> Response:
        kv = self.llm.kv_stats()
        return JSONResponse(
            {
                "status": "ok",
                # Which process answered (a Ray Serve deployment has several).
                "pid": os.getpid(),
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
                "kv_pages_in_use": kv.pages_in_use,
                "kv_pages_allocated": kv.pages_allocated,
                "kv_page_bytes": kv.page_bytes,
                "kv_cached_pages": kv.cached_pages,
                "prefix_hit_tokens": kv.prefix_hit_tokens,
            }
        )

    async def models(self, request: HttpRequest) -> Response:
        names = [self.model_name] + ([self.embedder_name] if self.embedder is not None else [])
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "cellm"} for n in names]
        return JSONResponse({"object": "list", "data": data})

    async def embeddings(self, http: HttpRequest) -> Response:
        if self.embedder is None:
            return _error(
                404,
                "this server has no embedding model (start it with --embedding-model M)",
                "invalid_request_error",
                "model",
            )
        embedder = self.embedder
        try:
            body = await _json_body(http)
            texts = _embedding_inputs(body)
            base64_wanted = _encoding_format(body)
            dims = body.get("dimensions")
            if dims is not None and dims != embedder.dim:
                raise BadRequest(
                    f"this model's embeddings have {embedder.dim} dimensions", "dimensions"
                )
            async with self.embed_lock:
                ids = await run_in_threadpool(embedder.token_ids, texts)
                vectors = await run_in_threadpool(embedder.embed_ids, ids)
        except BadRequest as e:
            return _error(400, str(e), "invalid_request_error", e.param)
        except CellmError as e:  # a text longer than the encoder's positions
            return _error(400, str(e), "invalid_request_error", "input")
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": (
                    base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
                    if base64_wanted
                    else v.tolist()
                ),
            }
            for i, v in enumerate(vectors)
        ]
        tokens = sum(len(x) for x in ids)
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "model": self.embedder_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

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
            if tools is not None:
                params = self._tool_choice(body, tools, params)
            # Off the event loop: images are decoded and resized there.
            if chat:
                prompt = await run_in_threadpool(self._chat_prompt, body, tools)
            else:
                prompt = await run_in_threadpool(self._prompt, body)
            n = _choices(body)
            streams = [
                AsyncStream(self.scheduler, self.llm._request(prompt, choice_params))
                for choice_params in _per_choice(params, n)
            ]
            want = _logprobs_wanted(body, chat)
            if body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                firsts = await _start(streams)
                events = self._sse(streams, firsts, chat, tools is not None, include_usage, want)
                return StreamingResponse(events, media_type="text/event-stream")
            results = await _collect(streams)
            return JSONResponse(self._response(results, chat, tools is not None, want))
        except BadRequest as e:
            return _error(400, str(e), "invalid_request_error", e.param)
        except Busy as e:
            return _error(429, str(e), "server_busy")
        except CellmError as e:  # a prompt too long, a template refusing the messages, ...
            return _error(400, str(e), "invalid_request_error")

    def _tool_choice(
        self, body: Mapping[str, Any], tools: list[Any], params: SamplingParams
    ) -> SamplingParams:
        """`params` with the grammar that forces a call, when `tool_choice` asks for one."""
        try:
            parallel = body.get("parallel_tool_calls", True) is not False
            grammar = self.llm.tool_grammar(tools, body.get("tool_choice"), parallel)
        except InvalidArgument as e:
            raise BadRequest(str(e), "tool_choice") from None
        if grammar is None:
            return params
        if params.response_format is not None:
            raise BadRequest(
                "tool_choice cannot force a call with a response_format", "tool_choice"
            )
        return replace(params, grammar=grammar, skip_special_tokens=False)

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
        streams: list[AsyncStream],
        firsts: list[Optional[str]],
        chat: bool,
        with_tools: bool,
        include_usage: bool,
        logprobs: bool,
    ) -> AsyncIterator[str]:
        ident, created = _ident(chat), int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[dict[str, Any]], usage: Optional[dict[str, int]] = None) -> str:
            body = {"id": ident, "object": kind, "created": created, "model": self.model_name}
            body["choices"] = choices
            if usage is not None:
                body["usage"] = usage
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        if chat:
            for i in range(len(streams)):
                delta = {"role": "assistant", "content": ""}
                yield chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
        sent = [0] * len(streams)  # logprobs entries sent, per choice
        offsets = [0] * len(streams)  # text sent, per choice (completions' text_offset)
        async for i, piece in _merge(streams, firsts):
            stream = streams[i]
            if piece is not None:
                if with_tools:
                    continue  # calls are parsed from the whole answer: sent at the end
                entries = piece.logprobs if isinstance(piece, Piece) else ()
                choice: dict[str, Any] = {"index": i, "finish_reason": None}
                if chat:
                    choice["delta"] = {"content": str(piece)}
                else:
                    choice["text"] = str(piece)
                choice["logprobs"] = self._logprobs(entries, chat, offsets[i]) if logprobs else None
                sent[i] += len(entries)
                offsets[i] += len(piece)
                yield chunk([choice])
                continue
            result = stream.result
            if result is None:  # the request failed after it started
                yield f"data: {json.dumps(_error_body('generation failed', 'server_error'))}\n\n"
                return
            final = {"index": i, **self._choice(result, chat, with_tools)}
            final["logprobs"] = None
            if logprobs and result.logprobs is not None:
                rest = result.logprobs if with_tools else result.logprobs[sent[i] :]
                final["logprobs"] = self._logprobs(rest, chat, 0 if with_tools else offsets[i])
            if chat:
                message = final.pop("message")
                delta = {k: v for k, v in message.items() if k != "role" and v is not None}
                if not with_tools:
                    delta.pop("content", None)  # already streamed
                final["delta"] = delta
            else:
                final["text"] = ""
            yield chunk([final])
        if include_usage:  # OpenAI's last chunk: no choices, the usage of all of them
            done = [s.result for s in streams if s.result is not None]
            yield chunk([], _usage(done))
        yield "data: [DONE]\n\n"

    def _response(
        self, results: list[GenerationResult], chat: bool, with_tools: bool, logprobs: bool
    ) -> dict[str, Any]:
        choices = []
        for i, result in enumerate(results):
            entries = result.logprobs if logprobs else None
            lp = None if entries is None else self._logprobs(entries, chat, 0)
            choices.append({"index": i, "logprobs": lp, **self._choice(result, chat, with_tools)})
        return {
            "id": _ident(chat),
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": _usage(results),
        }

    def _logprobs(self, entries: Sequence[TokenLogprob], chat: bool, offset: int) -> dict[str, Any]:
        """OpenAI's logprobs object: chat's `content` list, or completions' parallel lists."""
        tokenizer, eos = self.llm.tokenizer, self.llm.eos_token_ids

        def token(token_id: int) -> tuple[str, bytes]:
            raw = token_bytes(tokenizer, eos, token_id)
            return raw.decode("utf-8", errors="replace"), raw

        if chat:
            content = []
            for e in entries:
                text, raw = token(e.token_id)
                top = []
                for alt, lp in e.top_logprobs:
                    alt_text, alt_raw = token(alt)
                    top.append({"token": alt_text, "logprob": lp, "bytes": list(alt_raw)})
                content.append(
                    {"token": text, "logprob": e.logprob, "bytes": list(raw), "top_logprobs": top}
                )
            return {"content": content}
        tokens, offsets = [], []
        for e in entries:
            text = token(e.token_id)[0]
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token(a)[0]: lp for a, lp in e.top_logprobs} for e in entries],
            "text_offset": offsets,
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
    return body


def _choices(body: Mapping[str, Any]) -> int:
    n = body.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise BadRequest(f"n must be an integer from 1 to {MAX_CHOICES}", "n")
    return int(n)


def _per_choice(params: SamplingParams, n: int) -> list[SamplingParams]:
    """Each choice's settings: with a seed, choice i draws with seed + i (so that choices
    differ and the request stays reproducible)."""
    if params.seed is None:
        return [params] * n
    return [replace(params, seed=params.seed + i) for i in range(n)]


def _logprobs_wanted(body: Mapping[str, Any], chat: bool) -> bool:
    return bool(body.get("logprobs")) if chat else body.get("logprobs") is not None


def _tools(body: Mapping[str, Any]) -> Optional[list[Any]]:
    tools = body.get("tools")
    if tools is None or body.get("tool_choice") == "none":
        return None
    try:
        check_tools(tools)
    except InvalidArgument as e:
        raise BadRequest(str(e), "tools") from None
    return list(tools)


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

    presence = number("presence_penalty", 0.0, -2.0, 2.0) or 0.0
    frequency = number("frequency_penalty", 0.0, -2.0, 2.0) or 0.0
    logprobs, top_logprobs = _logprobs_settings(body, chat)
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
        presence_penalty=presence,
        frequency_penalty=frequency,
        logit_bias=_logit_bias(body),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )


def _logit_bias(body: Mapping[str, Any]) -> Optional[dict[int, float]]:
    """OpenAI's logit_bias: token ids (JSON object keys, so strings) -> -100..100."""
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise BadRequest("logit_bias must map token ids to numbers", "logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else None
        if token is None or token >= 1 << 31:
            raise BadRequest(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BadRequest(f"logit_bias values must be numbers, got {value!r}", "logit_bias")
        if not -100 <= value <= 100:
            raise BadRequest("logit_bias values must be between -100 and 100", "logit_bias")
        out[token] = float(value)
    return out


def _logprobs_settings(body: Mapping[str, Any], chat: bool) -> tuple[bool, int]:
    """(logprobs, top_logprobs): chat takes `logprobs` (bool) and `top_logprobs` (0..20);
    completions take `logprobs` as the number of alternatives (0..5)."""
    value = body.get("logprobs")
    if chat:
        if value is not None and not isinstance(value, bool):
            raise BadRequest("logprobs must be true or false", "logprobs")
        top = body.get("top_logprobs")
        if top is None:
            return bool(value), 0
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise BadRequest(
                f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}", "top_logprobs"
            )
        if not value:
            raise BadRequest("top_logprobs needs logprobs to be true", "top_logprobs")
        return True, top
    if value is None:
        return False, 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 5:
        raise BadRequest("logprobs must be an integer from 0 to 5", "logprobs")
    return True, value


async def _first_event(stream: AsyncStream) -> Optional[str]:
    """Starts the request and waits for its first piece, so that errors (a full queue, a
    prompt too long) still become a status code before the event stream begins."""
    try:
        return await stream.__aiter__().__anext__()
    except StopAsyncIteration:
        return None


async def _start(streams: list[AsyncStream]) -> list[Optional[str]]:
    """Each choice's first piece (see `_first_event`); if one fails, all are cancelled."""
    firsts = await asyncio.gather(*(_first_event(s) for s in streams), return_exceptions=True)
    for first in firsts:
        if isinstance(first, BaseException):
            for stream in streams:
                await stream.aclose()
            raise first
    return [f for f in firsts if not isinstance(f, BaseException)]


async def _collect(streams: list[AsyncStream]) -> list[GenerationResult]:
    results = await asyncio.gather(*(s.collect() for s in streams), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            for stream in streams:
                await stream.aclose()
            raise result
    return [r for r in results if not isinstance(r, BaseException)]


async def _merge(
    streams: list[AsyncStream], firsts: list[Optional[str]]
) -> AsyncIterator[tuple[int, Optional[str]]]:
    """(choice, piece) as the choices' pieces come, then (choice, None) when one ends.
    Closing this generator (a client gone) cancels every choice still running."""
    events: asyncio.Queue[tuple[int, Optional[str]]] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            if firsts[i] is not None:
                events.put_nowait((i, firsts[i]))
            async for piece in streams[i]:
                events.put_nowait((i, piece))
        except CellmError:
            pass  # the choice ends without a result: reported as an error event
        finally:
            events.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
    running = len(streams)
    try:
        while running:
            i, piece = await events.get()
            running -= piece is None
            yield i, piece
    finally:
        for task in tasks:
            task.cancel()


# -- responses ---------------------------------------------------------------------------------


def _ident(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def _usage(results: Sequence[GenerationResult]) -> dict[str, int]:
    """The prompt counts once however many choices were generated from it."""
    prompt = results[0].prompt_tokens if results else 0
    completion = sum(len(r.token_ids) for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
    }


def _embedding_inputs(body: Mapping[str, Any]) -> list[str]:
    """`input`: a text or a non-empty list of texts, none empty."""
    raw = body.get("input")
    texts = [raw] if isinstance(raw, str) else raw
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise BadRequest("input must be a string or a non-empty list of strings", "input")
    if len(texts) > MAX_EMBEDDING_INPUTS:
        raise BadRequest(f"input has {len(texts)} texts, more than {MAX_EMBEDDING_INPUTS}", "input")
    for i, t in enumerate(texts):
        if not t.strip():
            raise BadRequest(f"input {i} is empty", "input")
    return texts


def _encoding_format(body: Mapping[str, Any]) -> bool:
    """True for base64 (little-endian float32), False for float lists (the default)."""
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise BadRequest("encoding_format must be float or base64", "encoding_format")
    return bool(fmt == "base64")


def _error_body(message: str, kind: str, param: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def _error(status: int, message: str, kind: str, param: Optional[str] = None) -> Response:
    return JSONResponse(_error_body(message, kind, param), status_code=status)


def build_app(
    llm: LLM,
    model_name: str,
    scheduler: Optional[Scheduler] = None,
    image_root: Optional[str] = None,
    embedder: Optional[Embedder] = None,
    embedder_name: str = "",
) -> Starlette:
    """The ASGI app serving `llm` as `model_name`, on `scheduler` (default: the model's
    shared one). Image parts may name local files under `image_root` only (none without).
    `embedder` (named `embedder_name`) answers `/v1/embeddings`."""
    if Starlette is None:
        raise ImportError('cellm serve needs Starlette and uvicorn: pip install "cellm[serve]"')
    files = NO_FILES if image_root is None else ImageFiles(anywhere=False, root=image_root)
    server = Server(
        llm, model_name, scheduler or llm.shared_scheduler(), files, embedder, embedder_name
    )
    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/embeddings", server.embeddings, methods=["POST"]),
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
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="prefill every prompt in full (default: share the KV pages of common prefixes)",
    )
    p.add_argument(
        "--image-root",
        metavar="DIR",
        default=None,
        help="let image parts name local files under DIR (default: data: URLs only)",
    )
    p.add_argument(
        "--embedding-model",
        metavar="M",
        default=None,
        help="also serve /v1/embeddings with this encoder (registry name, .cellm, HF directory)",
    )
    ray = p.add_argument_group("Ray Serve (the ray extra: cellm.serve_ray)")
    ray.add_argument(
        "--ray", action="store_true", help="serve as a Ray Serve deployment of --replicas copies"
    )
    ray.add_argument("--replicas", type=bounded(int, 1), default=1, help="with --ray")
    ray.add_argument(
        "--replicas-per-node",
        type=bounded(int, 1),
        default=1,
        help="with --ray: most replicas on one Ray node (default 1: one per machine)",
    )
    ray.add_argument(
        "--ray-address", default=None, help="with --ray: join this cluster (default: start one)"
    )
    args = p.parse_args(argv)
    if args.image_root is not None and not os.path.isdir(args.image_root):
        p.error(f"--image-root {args.image_root}: not a directory")
    if not args.ray and (args.replicas != 1 or args.ray_address is not None):
        p.error("--replicas and --ray-address need --ray")
    if args.ray and importlib.util.find_spec("ray") is None:
        p.error('--ray needs Ray Serve: pip install "cellm[ray]"')

    def body() -> int:
        if args.ray:
            return _serve_on_ray(args)
        import uvicorn

        args.kv_capacity_tokens = args.kv_capacity
        llm = load_model(args)
        embedder = None
        if args.embedding_model is not None:
            embedder = Embedder(args.embedding_model, threads=args.threads)
        try:  # now, so that the first request with a response_format does not wait for it
            ll_tokenizer(llm.tokenizer, llm.eos_token_ids)
        except CellmError as e:
            print(f"cellm serve: constrained decoding unavailable: {e}", file=sys.stderr)
        scheduler = Scheduler(llm, max_running=args.max_sessions)
        scheduler.start()
        name = args.model or llm.path.stem
        print(f"cellm serve: {name} on http://{args.host}:{args.port}", file=sys.stderr)
        app = build_app(
            llm, name, scheduler, args.image_root, embedder, str(args.embedding_model or "")
        )
        uvicorn.run(app, host=args.host, port=args.port)
        scheduler.close()
        return 0

    return run(body)


def _serve_on_ray(args: Any) -> int:
    from cellm.fetch import default_model
    from cellm.serve_ray import run as run_on_ray

    config = {
        "model": args.model or default_model(),
        "model_name": args.model,
        "max_sessions": args.max_sessions,
        "image_root": args.image_root,
        "embedding_model": args.embedding_model,
        "llm": {
            "backend": args.backend,
            "kv_encoding": args.kv_encoding,
            "threads": args.threads,
            "context_length": args.context_length,
            "tokenizer": args.tokenizer,
            "kv_capacity_tokens": args.kv_capacity,
            "max_layers": args.max_layers,
            "prefix_cache": args.prefix_cache,
        },
    }
    run_on_ray(
        config,
        replicas=args.replicas,
        replicas_per_node=args.replicas_per_node,
        cpus_per_replica=float(args.threads or 1),
        host=args.host,
        port=args.port,
        address=args.ray_address,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
