"""`cellm.LLM`: load a model and generate text from Python."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Generator, Mapping, Sequence
from dataclasses import fields, replace
from typing import Any, Optional, Union

import numpy as np

from cellm import _core
from cellm.chat import render_chat_template, resolve_template
from cellm.conversation import Conversation
from cellm.errors import (
    ContextOverflow,
    FormatError,
    InvalidArgument,
    TemplateError,
    UnsupportedArchitecture,
)
from cellm.families import by_architecture
from cellm.fetch import registry_entry_for
from cellm.generation import Decoding, GenerationResult, KvSession, KvStats, Timings
from cellm.multimodal import ANY_FILE, ImageFiles, ImagePrompt, Vision, split_messages
from cellm.resolve import resolve_model
from cellm.sampling import SamplingParams
from cellm.scheduler import AsyncStream, Request, Scheduler
from cellm.tokenizer import Tokenizer
from cellm.tool_formats import check_tools, choice_tools, format_for
from cellm.vision import ImageInput

BACKENDS = ("cpu", "vulkan", "metal", "gpu")
KV_ENCODINGS = ("f16", "f32", "int8", "int4")
Prompt = Union[str, Sequence[int]]
_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))


def _keywords(call: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling keywords that a public method's call (its `locals()`) gives: not None."""
    return {f: call[f] for f in _SAMPLING_FIELDS if call[f] is not None}


def _sampling(params: Optional[SamplingParams], keywords: Mapping[str, Any]) -> SamplingParams:
    """`params` (default: SamplingParams()) with `keywords` overriding its fields; a copy."""
    if params is None:
        params = SamplingParams()
    elif not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a cellm.SamplingParams, got {type(params).__name__}")
    return replace(params, **keywords)


def _chat_keywords(
    keywords: dict[str, Any], tools: Optional[Sequence[Any]], params: Optional[SamplingParams]
) -> dict[str, Any]:
    """With tools, special tokens stay in the text unless asked otherwise: call markers are
    special tokens in the vocabularies that use them."""
    if tools and (params is None or params.skip_special_tokens is None):
        keywords.setdefault("skip_special_tokens", False)
    return keywords


def _drain(events: Generator[str, None, GenerationResult]) -> GenerationResult:
    while True:
        try:
            next(events)
        except StopIteration as done:
            result: GenerationResult = done.value
            return result


def _read_text(path: Union[str, os.PathLike[str]]) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise FormatError(f"{path}: no such file or directory") from None
    except (OSError, UnicodeDecodeError) as e:
        raise FormatError(f"{path}: cannot read: {e}") from None


def _token_ids(prompt: object) -> list[int]:
    """`prompt` as a list of token ids: a sequence of integers (Python or numpy), nothing
    that merely converts to one (bytes, bools, floats, numeric strings)."""
    if isinstance(prompt, (str, bytes, bytearray, memoryview)) or not hasattr(prompt, "__iter__"):
        raise InvalidArgument(
            f"a prompt must be text (str) or a sequence of integer token ids, got "
            f"{type(prompt).__name__}"
        )
    ids = []
    for i, t in enumerate(prompt):
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise InvalidArgument(
                f"token ids must be integers, but item {i} is {t!r} ({type(t).__name__})"
            )
        ids.append(int(t))
    return ids


def _is_messages(prompt: object) -> bool:
    return isinstance(prompt, Sequence) and any(isinstance(m, Mapping) for m in prompt)


class LLM:
    """A loaded model. `path` is a .cellm file or a HF checkpoint directory (converted once
    into the cache, see `cellm.resolve`).

    Thread safety: one `LLM` may be used from several threads at once. Each call into the
    engine (a prefill or decode step, creating, truncating or freeing a session) holds the
    model's lock, which is released between steps, so concurrent generations interleave
    their steps, each on its own KV session. They do not run in parallel (the engine's
    kernels already use its threads) nor share a batch."""

    def __init__(
        self,
        path: Union[str, os.PathLike[str]],
        backend: str = "cpu",
        kv_encoding: str = "f16",
        threads: Optional[int] = None,
        context_length: Optional[int] = None,
        *,
        tokenizer: Optional[Union[str, os.PathLike[str]]] = None,
        convert_dtype: str = "f16",
        kv_capacity_tokens: Optional[int] = None,
        processor: Optional[Mapping[str, Any]] = None,
        max_layers: Optional[int] = None,
        prefix_cache: bool = True,
    ) -> None:
        if backend not in BACKENDS:
            raise InvalidArgument(f"unknown backend {backend!r} (available: {', '.join(BACKENDS)})")
        if kv_encoding not in KV_ENCODINGS:
            raise InvalidArgument(
                f"unknown kv_encoding {kv_encoding!r} (expected {', '.join(KV_ENCODINGS)})"
            )
        limits = (
            ("threads", threads),
            ("context_length", context_length),
            ("kv_capacity_tokens", kv_capacity_tokens),
            ("max_layers", max_layers),
        )
        for name, v in limits:
            if v is not None and (not isinstance(v, int) or v < 1):
                raise InvalidArgument(f"{name} must be a positive integer, got {v!r}")
        self.path = resolve_model(path, convert_dtype)
        self._engine = _core.Engine(
            str(self.path),
            threads=threads,
            kv_encoding=kv_encoding,
            context_length=context_length,
            kv_capacity_tokens=kv_capacity_tokens,
            max_layers=max_layers,
            backend=backend,
            prefix_cache=prefix_cache,
        )
        # Held for each engine call: the engine is not reentrant (see the class docstring).
        self._lock = threading.RLock()
        self._scheduler: Optional[Scheduler] = None
        # Read once: the engine cannot be asked while another thread's step runs in it.
        self._context_length = self._engine.context_length
        # KV tokens (per layer) the pool holds over all sessions; the engine's default is
        # DEFAULT_KV_SESSIONS (8) full contexts.
        self.kv_capacity_tokens = kv_capacity_tokens or 8 * self._context_length
        self._vocab_size = self._engine.vocab_size
        self.header: dict[str, Any] = json.loads(self._engine.header_json())
        if self.header["model"]["architecture"] == "whisper":
            raise UnsupportedArchitecture(
                f"{self.path} is a Whisper speech model, not a text model: use cellm.Whisper "
                "or python -m cellm.transcribe"
            )
        # Chat format and tool-call parser of the model's family.
        self.family = by_architecture(self.header["model"]["architecture"])
        entry = registry_entry_for(self.path)
        # A registry model known to be a base model (no chat template, no chat training).
        self.is_base_model = entry is not None and entry.kind == "base"
        tok = self.header["tokenizer"]
        if tokenizer is not None:
            tok_json = _read_text(tokenizer)
        elif (blob := self._engine.blob(tok["blob"])) is not None:
            tok_json = blob.decode("utf-8")
        else:
            raise FormatError(f"{self.path} has no tokenizer blob {tok['blob']!r}")
        self.tokenizer = Tokenizer.from_json_str(
            tok_json,
            bos_token=tok.get("bos_token"),
            eos_token=tok.get("eos_token"),
            add_bos_token=bool(tok.get("add_bos_token")),
        )
        template = tok.get("chat_template")
        # A template that is not text is reported when a chat needs it (plain generation
        # does not).
        self._template_problem: Optional[str] = None
        if template is not None and not isinstance(template, str):
            self._template_problem = (
                f"{self.path}: the header's tokenizer.chat_template must be a string, got "
                f"{type(template).__name__}"
            )
            template = None
        self.chat_template: Optional[str] = template
        self.eos_token_ids: frozenset[int] = frozenset(self.header["generation"]["eos_token_ids"])
        # How this model writes tool calls: its template's format, else its family's.
        self.tool_format = format_for(template, self.family.tool_call_format)
        # A vision-language model's image side; `processor` overrides the file's processor
        # settings (HF processor keywords, e.g. use_image_special_tokens).
        self.vision: Optional[Vision] = None
        if "vision" in self.header["model"]:
            self.vision = Vision(self.header, self._engine, self._lock, processor)

    @property
    def context_length(self) -> int:
        return self._context_length

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    # -- prompts -------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Optional[Sequence[Mapping[str, Any]]] = None,
        chat_format: str = "auto",
        **template_vars: Any,
    ) -> str:
        """The prompt text for `messages`, rendered with the model's template (or a builtin
        one: chatml, llama3, gemma, plain). Extra keywords (e.g. enable_thinking=False) are
        passed to the template."""
        if chat_format == "auto" and self._template_problem is not None:
            raise TemplateError(self._template_problem)
        if chat_format == "auto" and not self.chat_template and self.is_base_model:
            raise InvalidArgument(
                f"{self.path.parent.name} is a base model with no chat template: give it text to "
                "continue (no --chat), or force a format with --chat-format / chat_format="
            )
        return render_chat_template(
            resolve_template(chat_format, self.chat_template, self.family.chat_format),
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.tokenizer.bos_token,
            eos_token=self.tokenizer.eos_token,
            tools=tools,
            extra=template_vars,
        )

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids for `prompt`: text is tokenized; a sequence of integer ids is checked
        (InvalidArgument for anything else, or an id outside the vocabulary)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        ids = _token_ids(prompt)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidArgument(
                f"token id {bad[0]} is outside the vocabulary ({self.vocab_size})"
            )
        return ids

    # -- model calls ---------------------------------------------------------------------

    def logits(
        self, token_ids: Sequence[int], images: Optional[Sequence[ImageInput]] = None
    ) -> np.ndarray:
        """Next-token logits at every position: float32 array (len(token_ids), vocab).
        `images` (a vision-language model's) fill the image tokens of `token_ids`, in order
        (`prompt_ids` makes such ids from chat messages)."""
        if isinstance(token_ids, str):
            raise InvalidArgument("logits() takes token ids, not text (see LLM.encode)")
        ids = self.encode(token_ids)
        if not ids:
            raise InvalidArgument("logits() needs at least one token id")
        embeds = None
        if images is not None:
            embeds = self._vision().embeds(ids, self._vision().process(images), 0)
        given = None if embeds is None else [(0, embeds.rows, embeds.values)]
        with self._lock:
            session = self._engine.create_session()
            try:
                return self._engine.step([(session, ids)], all_logits=True, embeds=given)
            finally:
                self._engine.free_session(session)

    def encode_images(self, images: Sequence[ImageInput]) -> np.ndarray:
        """A vision-language model's features of `images` (paths, bytes, PIL images or uint8
        arrays): float32 (image tokens, hidden), one row per image token, in order."""
        vision = self._vision()
        return vision.features(vision.process(images))

    def _vision(self) -> Vision:
        if self.vision is None:
            raise InvalidArgument(f"{self.path.name} is a text-only model: it takes no images")
        return self.vision

    def generate(
        self,
        prompt: Prompt,
        *,
        params: Optional[SamplingParams] = None,
        max_tokens: Optional[int] = None,
        temperature: Optional[float] = None,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        min_p: Optional[float] = None,
        repeat_penalty: Optional[float] = None,
        presence_penalty: Optional[float] = None,
        frequency_penalty: Optional[float] = None,
        logit_bias: Optional[Mapping[int, float]] = None,
        seed: Optional[int] = None,
        stop: Union[str, Sequence[str], None] = None,
        stop_token_ids: Optional[Sequence[int]] = None,
        ignore_eos: Optional[bool] = None,
        skip_special_tokens: Optional[bool] = None,
        response_format: Optional[Mapping[str, Any]] = None,
        regex: Optional[str] = None,
        grammar: Optional[str] = None,
        logprobs: Optional[bool] = None,
        top_logprobs: Optional[int] = None,
    ) -> GenerationResult:
        """Generate a completion of `prompt` (text, or token ids used as they are).

        The settings are `SamplingParams`' fields (see it for their defaults: greedy, up to
        256 tokens, special tokens skipped), given as keywords or as `params`; a keyword that
        is not None overrides the same field of `params`. `response_format` (a JSON schema or
        any JSON object, OpenAI's form), `regex` or `grammar` (Lark) constrain the output to
        match (see `cellm.structured`)."""
        return _drain(self._run(prompt, _sampling(params, _keywords(locals()))))

    def stream(
        self,
        prompt: Prompt,
        *,
        params: Optional[SamplingParams] = None,
        max_tokens: Optional[int] = None,
        temperature: Optional[float] = None,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        min_p: Optional[float] = None,
        repeat_penalty: Optional[float] = None,
        presence_penalty: Optional[float] = None,
        frequency_penalty: Optional[float] = None,
        logit_bias: Optional[Mapping[int, float]] = None,
        seed: Optional[int] = None,
        stop: Union[str, Sequence[str], None] = None,
        stop_token_ids: Optional[Sequence[int]] = None,
        ignore_eos: Optional[bool] = None,
        skip_special_tokens: Optional[bool] = None,
        response_format: Optional[Mapping[str, Any]] = None,
        regex: Optional[str] = None,
        grammar: Optional[str] = None,
        logprobs: Optional[bool] = None,
        top_logprobs: Optional[int] = None,
    ) -> Generator[str, None, GenerationResult]:
        """Like generate(), yielding text pieces as they are decoded; the generator's return
        value (`StopIteration.value`) is the GenerationResult."""
        return (yield from self._run(prompt, _sampling(params, _keywords(locals()))))

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Optional[Sequence[Mapping[str, Any]]] = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool = True,
        chat_format: str = "auto",
        template_vars: Optional[Mapping[str, Any]] = None,
        params: Optional[SamplingParams] = None,
        max_tokens: Optional[int] = None,
        temperature: Optional[float] = None,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        min_p: Optional[float] = None,
        repeat_penalty: Optional[float] = None,
        presence_penalty: Optional[float] = None,
        frequency_penalty: Optional[float] = None,
        logit_bias: Optional[Mapping[int, float]] = None,
        seed: Optional[int] = None,
        stop: Union[str, Sequence[str], None] = None,
        stop_token_ids: Optional[Sequence[int]] = None,
        ignore_eos: Optional[bool] = None,
        skip_special_tokens: Optional[bool] = None,
        response_format: Optional[Mapping[str, Any]] = None,
        regex: Optional[str] = None,
        grammar: Optional[str] = None,
        logprobs: Optional[bool] = None,
        top_logprobs: Optional[int] = None,
    ) -> GenerationResult:
        """Answer the conversation `messages` (generate()'s settings apply).

        `tools` (JSON schemas) are passed to the template as its `tools` variable. The answer
        is searched for tool calls in the model family's format (FunctionGemma's
        ``<start_function_call>call:...`` for Gemma; without a well-formed call nothing
        changes): they go to `tool_calls` and leave `text`. With `tools`,
        special tokens are kept in the text unless skip_special_tokens=True is given, since
        call markers are special tokens in the vocabularies that use them."""
        keywords = self._tool_keywords(
            _keywords(locals()), tools, tool_choice, parallel_tool_calls, params
        )
        prompt = self._chat_prompt(messages, tools, chat_format, template_vars)
        if prompt.images:
            result = _drain(
                self._run(prompt.ids, _sampling(params, keywords), images=prompt.images)
            )
        else:
            result = self.generate(prompt.ids, params=params, **keywords)
        result.text, result.tool_calls = self.split_tool_calls(result)
        return result

    def stream_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Optional[Sequence[Mapping[str, Any]]] = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool = True,
        chat_format: str = "auto",
        template_vars: Optional[Mapping[str, Any]] = None,
        params: Optional[SamplingParams] = None,
        max_tokens: Optional[int] = None,
        temperature: Optional[float] = None,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        min_p: Optional[float] = None,
        repeat_penalty: Optional[float] = None,
        presence_penalty: Optional[float] = None,
        frequency_penalty: Optional[float] = None,
        logit_bias: Optional[Mapping[int, float]] = None,
        seed: Optional[int] = None,
        stop: Union[str, Sequence[str], None] = None,
        stop_token_ids: Optional[Sequence[int]] = None,
        ignore_eos: Optional[bool] = None,
        skip_special_tokens: Optional[bool] = None,
        response_format: Optional[Mapping[str, Any]] = None,
        regex: Optional[str] = None,
        grammar: Optional[str] = None,
        logprobs: Optional[bool] = None,
        top_logprobs: Optional[int] = None,
    ) -> Generator[str, None, GenerationResult]:
        """chat() streamed: yields text pieces; the generator's return value is the
        GenerationResult, whose tool calls are parsed as chat()'s are (the streamed pieces
        hold the calls' text as the model wrote it)."""
        keywords = self._tool_keywords(
            _keywords(locals()), tools, tool_choice, parallel_tool_calls, params
        )
        prompt = self._chat_prompt(messages, tools, chat_format, template_vars)
        sampling = _sampling(params, keywords)
        result = yield from self._run(prompt.ids, sampling, images=prompt.images)
        result.text, result.tool_calls = self.split_tool_calls(result)
        return result

    def _image_prompt(self, prompt: Union[Prompt, Sequence[Mapping[str, Any]]]) -> ImagePrompt:
        """`prompt` (text, token ids, or chat messages) as ids and the processed images of
        its image parts."""
        if _is_messages(prompt):
            return self._chat_prompt(prompt)  # type: ignore[arg-type]
        return ImagePrompt(self.prompt_ids(prompt))

    def _chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Optional[Sequence[Mapping[str, Any]]] = None,
        chat_format: str = "auto",
        template_vars: Optional[Mapping[str, Any]] = None,
        files: ImageFiles = ANY_FILE,
    ) -> ImagePrompt:
        """The rendered, tokenized chat, each image's placeholder expanded into its tokens;
        `files` says which local files its image parts may name."""
        messages, sources = split_messages(messages, files)
        text = self.apply_chat_template(
            messages, tools=tools, chat_format=chat_format, **(template_vars or {})
        )
        if not sources and self.vision is None:
            return ImagePrompt(self.tokenizer.encode(text, add_special_tokens=False))
        images = self._vision().process(sources) if sources else []
        expanded = self._vision().expand(text, images)
        return ImagePrompt(self.tokenizer.encode(expanded, add_special_tokens=False), images)

    # -- many requests at once (continuous batching: cellm.scheduler) --------------------------

    def generate_batch(
        self,
        prompts: Sequence[Prompt],
        *,
        params: Optional[SamplingParams] = None,
        max_tokens: Optional[int] = None,
        temperature: Optional[float] = None,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        min_p: Optional[float] = None,
        repeat_penalty: Optional[float] = None,
        presence_penalty: Optional[float] = None,
        frequency_penalty: Optional[float] = None,
        logit_bias: Optional[Mapping[int, float]] = None,
        seed: Optional[int] = None,
        stop: Union[str, Sequence[str], None] = None,
        stop_token_ids: Optional[Sequence[int]] = None,
        ignore_eos: Optional[bool] = None,
        skip_special_tokens: Optional[bool] = None,
        response_format: Optional[Mapping[str, Any]] = None,
        regex: Optional[str] = None,
        grammar: Optional[str] = None,
        logprobs: Optional[bool] = None,
        top_logprobs: Optional[int] = None,
    ) -> list[GenerationResult]:
        """generate() for several prompts in one batched run: each engine step carries every
        running prompt (see `cellm.scheduler`). Results come in the prompts' order; greedy
        results equal each prompt run alone."""
        sampling = _sampling(params, _keywords(locals()))
        return self._run_batch([ImagePrompt(self.prompt_ids(p)) for p in prompts], sampling)

    def chat_batch(
        self,
        conversations: Sequence[Sequence[Mapping[str, Any]]],
        *,
        tools: Optional[Sequence[Mapping[str, Any]]] = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool = True,
        chat_format: str = "auto",
        template_vars: Optional[Mapping[str, Any]] = None,
        params: Optional[SamplingParams] = None,
        max_tokens: Optional[int] = None,
        temperature: Optional[float] = None,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        min_p: Optional[float] = None,
        repeat_penalty: Optional[float] = None,
        presence_penalty: Optional[float] = None,
        frequency_penalty: Optional[float] = None,
        logit_bias: Optional[Mapping[int, float]] = None,
        seed: Optional[int] = None,
        stop: Union[str, Sequence[str], None] = None,
        stop_token_ids: Optional[Sequence[int]] = None,
        ignore_eos: Optional[bool] = None,
        skip_special_tokens: Optional[bool] = None,
        response_format: Optional[Mapping[str, Any]] = None,
        regex: Optional[str] = None,
        grammar: Optional[str] = None,
        logprobs: Optional[bool] = None,
        top_logprobs: Optional[int] = None,
    ) -> list[GenerationResult]:
        """chat() for several conversations in one batched run, results in order (images
        included: those of all the conversations are encoded in one batch)."""
        keywords = self._tool_keywords(
            _keywords(locals()), tools, tool_choice, parallel_tool_calls, params
        )
        sampling = _sampling(params, keywords)
        prompts = [self._chat_prompt(m, tools, chat_format, template_vars) for m in conversations]
        results = self._run_batch(prompts, sampling)
        for result in results:
            result.text, result.tool_calls = self.split_tool_calls(result)
        return results

    def _run_batch(
        self, prompts: list[ImagePrompt], params: SamplingParams
    ) -> list[GenerationResult]:
        scheduler = Scheduler(self, max_running=max(1, len(prompts)))
        requests = [scheduler.submit(self._request(p, params)) for p in prompts]
        scheduler.run_until_idle()
        return [_drain(request.stream()) for request in requests]

    async def agenerate(
        self,
        prompt: Prompt,
        *,
        params: Optional[SamplingParams] = None,
        max_tokens: Optional[int] = None,
        temperature: Optional[float] = None,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        min_p: Optional[float] = None,
        repeat_penalty: Optional[float] = None,
        presence_penalty: Optional[float] = None,
        frequency_penalty: Optional[float] = None,
        logit_bias: Optional[Mapping[int, float]] = None,
        seed: Optional[int] = None,
        stop: Union[str, Sequence[str], None] = None,
        stop_token_ids: Optional[Sequence[int]] = None,
        ignore_eos: Optional[bool] = None,
        skip_special_tokens: Optional[bool] = None,
        response_format: Optional[Mapping[str, Any]] = None,
        regex: Optional[str] = None,
        grammar: Optional[str] = None,
        logprobs: Optional[bool] = None,
        top_logprobs: Optional[int] = None,
    ) -> GenerationResult:
        """generate() for asyncio: concurrent callers share the model's batches."""
        return await self.astream(prompt, params=params, **_keywords(locals())).collect()

    def astream(
        self,
        prompt: Prompt,
        *,
        params: Optional[SamplingParams] = None,
        max_tokens: Optional[int] = None,
        temperature: Optional[float] = None,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        min_p: Optional[float] = None,
        repeat_penalty: Optional[float] = None,
        presence_penalty: Optional[float] = None,
        frequency_penalty: Optional[float] = None,
        logit_bias: Optional[Mapping[int, float]] = None,
        seed: Optional[int] = None,
        stop: Union[str, Sequence[str], None] = None,
        stop_token_ids: Optional[Sequence[int]] = None,
        ignore_eos: Optional[bool] = None,
        skip_special_tokens: Optional[bool] = None,
        response_format: Optional[Mapping[str, Any]] = None,
        regex: Optional[str] = None,
        grammar: Optional[str] = None,
        logprobs: Optional[bool] = None,
        top_logprobs: Optional[int] = None,
    ) -> AsyncStream:
        """stream() for asyncio: `async for piece in llm.astream(...)`; the stream's `result`
        holds the GenerationResult once it ends. Concurrent callers share the model's batches;
        leaving the loop early cancels the request."""
        request = self._request(self._image_prompt(prompt), _sampling(params, _keywords(locals())))
        return AsyncStream(self.shared_scheduler(), request)

    def _request(self, prompt: ImagePrompt, params: SamplingParams) -> Request:
        """A scheduler request for `prompt` (see `_image_prompt`): its ids checked against the
        context length, its images with it."""
        return Request(self.prompt_ids(prompt.ids), params, images=prompt.images)

    def kv_stats(self) -> KvStats:
        """KV pool usage: pages held by sessions, pages allocated so far, bytes per page, pages
        the prefix cache lists and the prompt tokens it saved from prefill so far."""
        with self._lock:
            return KvStats(*self._engine.kv_stats())

    @property
    def prefix_cache(self) -> bool:
        """Whether requests share the KV pages of a common prompt prefix (off when asked, for
        models with recurrent state and on the GPU; see docs/architecture.md)."""
        return self._engine.prefix_cache

    def shared_scheduler(self) -> Scheduler:
        """The model's background scheduler, started on first use (asyncio callers, the
        server); `close()` stops it."""
        with self._lock:
            if self._scheduler is None:
                self._scheduler = Scheduler(self)
                self._scheduler.start()
            return self._scheduler

    def close(self) -> None:
        """Stops the background scheduler, if one runs (requests still in it end with Busy)."""
        scheduler, self._scheduler = self._scheduler, None
        if scheduler is not None:
            scheduler.close()

    def conversation(
        self,
        system: Optional[str] = None,
        *,
        chat_format: str = "auto",
        params: Optional[SamplingParams] = None,
        template_vars: Optional[Mapping[str, Any]] = None,
    ) -> Conversation:
        """A multi-turn chat that keeps its KV cache between turns (`Conversation.send`)."""
        return Conversation(
            self, system, chat_format=chat_format, params=params, template_vars=template_vars
        )

    def tool_grammar(
        self,
        tools: Optional[Sequence[Mapping[str, Any]]],
        tool_choice: Any,
        parallel_tool_calls: bool = True,
    ) -> Optional[str]:
        """The Lark grammar that makes the model call a tool in its own format, when
        `tool_choice` is "required" or names a function (None for "auto", "none" or None);
        with parallel_tool_calls=False, exactly one call.
        InvalidArgument for a bad tool list (duplicate names...) or a model without a known
        tool-call format."""
        if tools is not None:
            check_tools(tools)
        forced = choice_tools(tools or [], tool_choice)
        if forced is None:
            return None
        if not forced:
            raise InvalidArgument(f"tool_choice={tool_choice!r} needs tools")
        if self.tool_format is None:
            raise InvalidArgument(
                f"{self.path.name} has no known tool-call format: tool_choice cannot force a call"
            )
        return self.tool_format.grammar(forced, self.tokenizer, parallel_tool_calls)

    def _tool_keywords(
        self,
        keywords: dict[str, Any],
        tools: Optional[Sequence[Mapping[str, Any]]],
        tool_choice: Any,
        parallel: bool,
        params: Optional[SamplingParams],
    ) -> dict[str, Any]:
        keywords = _chat_keywords(keywords, tools, params)
        grammar = self.tool_grammar(tools, tool_choice, parallel)
        if grammar is not None:
            keywords["grammar"] = grammar  # two constraints at once are refused (structured)
        return keywords

    def split_tool_calls(self, result: GenerationResult) -> tuple[str, list[dict[str, Any]]]:
        """`result.text` as (text, tool calls), read in the model's tool-call format
        (`tool_format`; without one the text stays as it is)."""
        if self.tool_format is None:
            return result.text, []
        return self.tool_format.parse(result.text, self._token_text(result.stop_token_id))

    def _token_text(self, token_id: Optional[int]) -> Optional[str]:
        return None if token_id is None else self.tokenizer.id_to_token(token_id)

    # -- the generation loop ---------------------------------------------------------------

    def _run(
        self,
        prompt: Prompt,
        params: SamplingParams,
        kv: Optional[KvSession] = None,
        images: Sequence[Any] = (),
    ) -> Generator[str, None, GenerationResult]:
        """The generation loop. With `kv`, the prompt continues that session: only the ids
        after what its cache already holds are prefilled, and it stays open afterwards.
        `images` (processed) fill the prompt's image tokens."""
        ids = self.prompt_ids(prompt)
        decoding = Decoding(ids, params, self.tokenizer, self.eos_token_ids, self.context_length)
        session = kv if kv is not None else KvSession(self._engine, self._lock)
        try:
            new = session.reuse(ids, self._shareable(ids))
            timings = Timings(prefill_tokens=len(new))
            t0 = time.perf_counter()
            embeds = None
            if images or (self.vision is not None and self.vision.image_token_id in new):
                embeds = self._vision().embeds(ids, images, len(ids) - len(new))
                timings.images = embeds.images if embeds else 0
                timings.image_encode_s = time.perf_counter() - t0
                t0 = time.perf_counter()
            logits = session.step(new, embeds and (embeds.rows, embeds.values))
            timings.prefill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            while True:
                token, pieces = decoding.advance(logits)
                yield from pieces
                if token is None:
                    break
                logits = session.step([token])
                timings.decode_tokens += 1
            timings.decode_s = time.perf_counter() - t0
        finally:
            if kv is None:
                session.close()
        return decoding.result(timings)

    def _shareable(self, ids: list[int]) -> int:
        """How many leading ids of a prompt may come from the prefix cache: those before its
        first image token (whose rows follow from the image, not from the id)."""
        image = None if self.vision is None else self.vision.image_token_id
        return ids.index(image) if image in ids else len(ids)

    def prompt_ids(self, prompt: Union[Prompt, Sequence[Mapping[str, Any]]]) -> list[int]:
        """The ids of a prompt to generate from: encoded text, checked token ids, or chat
        messages rendered and tokenized with each image's placeholder expanded into its image
        tokens; they leave room in the context for at least one new token."""
        if _is_messages(prompt):
            return self.prompt_ids(self._chat_prompt(prompt).ids)  # type: ignore[arg-type]
        ids = self.encode(prompt)  # type: ignore[arg-type]
        if not ids:
            raise InvalidArgument("the prompt is empty")
        if len(ids) >= self.context_length:
            raise ContextOverflow(
                f"the prompt has {len(ids)} tokens; the context length is {self.context_length}"
            )
        return ids


# Re-exported: results and conversations are part of the LLM API (`from cellm.llm import ...`).
__all__ = [
    "BACKENDS",
    "KV_ENCODINGS",
    "LLM",
    "Conversation",
    "GenerationResult",
    "KvStats",
    "Timings",
]
