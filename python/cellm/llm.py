"""`cellm.LLM`: load a model and generate text from Python."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional, Union

import numpy as np

from cellm import _core
from cellm.chat import render_chat_template, resolve_template
from cellm.errors import ContextOverflow, FormatError, InvalidArgument, TemplateError
from cellm.families import by_architecture
from cellm.fetch import registry_entry_for
from cellm.resolve import resolve_model
from cellm.sampling import SamplingParams, make_sampler
from cellm.textstream import IncrementalDecoder, StopStringMatcher
from cellm.tokenizer import Tokenizer

BACKENDS = ("cpu",)
KV_ENCODINGS = ("f16", "f32")
Prompt = Union[str, Sequence[int]]
_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))


@dataclass
class Timings:
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (end-of-turn id or stop string) or "length"
    prompt_tokens: int
    timings: Timings = field(default_factory=Timings)
    stop_token_id: Optional[int] = None  # the end-of-turn/stop id that ended it, if one did
    # chat() only: the parsed tool calls ({"name", "arguments"}), removed from `text`.
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


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
    ) -> None:
        if backend not in BACKENDS:
            raise InvalidArgument(f"unknown backend {backend!r} (available: {', '.join(BACKENDS)})")
        if kv_encoding not in KV_ENCODINGS:
            raise InvalidArgument(f"unknown kv_encoding {kv_encoding!r} (expected f16 or f32)")
        for name, v in (("threads", threads), ("context_length", context_length)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise InvalidArgument(f"{name} must be a positive integer, got {v!r}")
        self.path = resolve_model(path, convert_dtype)
        self._engine = _core.Engine(
            str(self.path), threads=threads, kv_encoding=kv_encoding, context_length=context_length
        )
        # Held for each engine call: the engine is not reentrant (see the class docstring).
        self._lock = threading.RLock()
        # Read once: the engine cannot be asked while another thread's step runs in it.
        self._context_length = self._engine.context_length
        self._vocab_size = self._engine.vocab_size
        self.header: dict[str, Any] = json.loads(self._engine.header_json())
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

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Next-token logits at every position: float32 array (len(token_ids), vocab)."""
        if isinstance(token_ids, str):
            raise InvalidArgument("logits() takes token ids, not text (see LLM.encode)")
        ids = self.encode(token_ids)
        if not ids:
            raise InvalidArgument("logits() needs at least one token id")
        with self._lock:
            session = self._engine.create_session()
            try:
                return self._engine.step([(session, ids)], all_logits=True)
            finally:
                self._engine.free_session(session)

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
        seed: Optional[int] = None,
        stop: Union[str, Sequence[str], None] = None,
        stop_token_ids: Optional[Sequence[int]] = None,
        ignore_eos: Optional[bool] = None,
        skip_special_tokens: Optional[bool] = None,
    ) -> GenerationResult:
        """Generate a completion of `prompt` (text, or token ids used as they are).

        The settings are `SamplingParams`' fields (see it for their defaults: greedy, up to
        256 tokens, special tokens skipped), given as keywords or as `params`; a keyword that
        is not None overrides the same field of `params`."""
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
        seed: Optional[int] = None,
        stop: Union[str, Sequence[str], None] = None,
        stop_token_ids: Optional[Sequence[int]] = None,
        ignore_eos: Optional[bool] = None,
        skip_special_tokens: Optional[bool] = None,
    ) -> Generator[str, None, GenerationResult]:
        """Like generate(), yielding text pieces as they are decoded; the generator's return
        value (`StopIteration.value`) is the GenerationResult."""
        return (yield from self._run(prompt, _sampling(params, _keywords(locals()))))

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Optional[Sequence[Mapping[str, Any]]] = None,
        chat_format: str = "auto",
        template_vars: Optional[Mapping[str, Any]] = None,
        params: Optional[SamplingParams] = None,
        max_tokens: Optional[int] = None,
        temperature: Optional[float] = None,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        min_p: Optional[float] = None,
        repeat_penalty: Optional[float] = None,
        seed: Optional[int] = None,
        stop: Union[str, Sequence[str], None] = None,
        stop_token_ids: Optional[Sequence[int]] = None,
        ignore_eos: Optional[bool] = None,
        skip_special_tokens: Optional[bool] = None,
    ) -> GenerationResult:
        """Answer the conversation `messages` (generate()'s settings apply).

        `tools` (JSON schemas) are passed to the template as its `tools` variable. The answer
        is searched for tool calls in the model family's format (FunctionGemma's
        ``<start_function_call>call:...`` for Gemma; without a well-formed call nothing
        changes): they go to `tool_calls` and leave `text`. With `tools`,
        special tokens are kept in the text unless skip_special_tokens=True is given, since
        call markers are special tokens in the vocabularies that use them."""
        keywords = _keywords(locals())
        if tools and (params is None or params.skip_special_tokens is None):
            keywords.setdefault("skip_special_tokens", False)
        prompt = self.apply_chat_template(
            messages, tools=tools, chat_format=chat_format, **(template_vars or {})
        )
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        result = self.generate(ids, params=params, **keywords)
        result.text, result.tool_calls = self.split_tool_calls(result)
        return result

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

    def split_tool_calls(self, result: GenerationResult) -> tuple[str, list[dict[str, Any]]]:
        """`result.text` as (text, tool calls), read in the model family's tool-call format
        (none for families without one: the text stays as it is)."""
        parse = self.family.tool_call_parser
        if parse is None:
            return result.text, []
        return parse(result.text, self._token_text(result.stop_token_id))

    def _token_text(self, token_id: Optional[int]) -> Optional[str]:
        return None if token_id is None else self.tokenizer.id_to_token(token_id)

    # -- the generation loop ---------------------------------------------------------------

    def _run(
        self, prompt: Prompt, params: SamplingParams, kv: Optional[KvSession] = None
    ) -> Generator[str, None, GenerationResult]:
        """The generation loop. With `kv`, the prompt continues that session: only the ids
        after what its cache already holds are prefilled, and it stays open afterwards."""
        sampler = make_sampler(params)  # validates `params` (max_tokens first)
        p = sampler.params
        ids = self.encode(prompt)
        if not ids:
            raise InvalidArgument("the prompt is empty")
        if len(ids) >= self.context_length:
            raise ContextOverflow(
                f"the prompt has {len(ids)} tokens; the context length is {self.context_length}"
            )
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
        skip = True if p.skip_special_tokens is None else p.skip_special_tokens
        decoder = IncrementalDecoder(self.tokenizer, skip_special_tokens=skip)
        matcher = StopStringMatcher([p.stop] if isinstance(p.stop, str) else list(p.stop or []))
        out: list[int] = []
        context = list(ids)  # prompt + output, grown in place for the repetition penalty
        text: list[str] = []
        finish, cut = "length", False  # cut: a stop string ended the text mid-stream
        stop_token_id: Optional[int] = None
        session = kv if kv is not None else KvSession(self._engine, self._lock)
        try:
            new = session.reuse(ids)
            timings = Timings(prefill_tokens=len(new))
            t0 = time.perf_counter()
            logits = session.step(new)
            timings.prefill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            while True:
                token = sampler(logits[: self.tokenizer.vocab_size], context)
                if token in stops:
                    finish, stop_token_id = "stop", token
                    break
                out.append(token)
                context.append(token)
                piece, hit = matcher.feed(decoder.add(token))
                if piece:
                    text.append(piece)
                    yield piece
                if hit:
                    finish, cut = "stop", True
                    break
                if len(out) >= p.max_tokens or len(ids) + len(out) >= self.context_length:
                    break
                logits = session.step([token])
                timings.decode_tokens += 1
            timings.decode_s = time.perf_counter() - t0
        finally:
            if kv is None:
                session.close()
        if not cut:  # text held back (partial UTF-8, a possible stop prefix) is real text
            tail, _ = matcher.feed(decoder.flush())
            tail += matcher.flush()
            if tail:
                text.append(tail)
                yield tail
        return GenerationResult("".join(text), out, finish, len(ids), timings, stop_token_id)


class KvSession:
    """An engine session and the token ids its cache holds, so that a later prompt which
    starts with them prefills only the rest. Every engine call holds `lock`, the model's
    (shared by all its sessions: the engine takes one call at a time)."""

    def __init__(self, engine: _core.Engine, lock: threading.RLock) -> None:
        self._engine = engine
        self._lock = lock
        with lock:
            self.id: Optional[int] = engine.create_session()
        self.ids: list[int] = []

    def reuse(self, ids: list[int]) -> list[int]:
        """Keeps the longest cached prefix of `ids` (all but its last id, which must be
        stepped for its logits) and returns the ids still to prefill."""
        keep = 0
        limit = min(len(self.ids), len(ids) - 1)
        while keep < limit and self.ids[keep] == ids[keep]:
            keep += 1
        if keep < len(self.ids):
            with self._lock:
                try:
                    self._engine.truncate_session(self._live(), keep)
                except InvalidArgument:  # recurrent or sliding state cannot rewind: start over
                    self._engine.truncate_session(self._live(), 0)
                    keep = 0
            del self.ids[keep:]
        return ids[keep:]

    def step(self, ids: list[int]) -> np.ndarray:
        """Next-token logits after feeding `ids` to the session."""
        with self._lock:
            logits: np.ndarray = self._engine.step([(self._live(), ids)])[0]
        self.ids.extend(ids)
        return logits

    def close(self) -> None:
        if self.id is not None:
            with self._lock:
                self._engine.free_session(self.id)
            self.id = None

    def _live(self) -> int:
        if self.id is None:
            raise InvalidArgument("this session was closed")
        return self.id


class Conversation:
    """A multi-turn chat that keeps its KV session between turns: each turn renders the whole
    conversation but prefills only what follows the tokens already cached (the new user
    message and the template's markers), as an interactive chat should."""

    def __init__(
        self,
        llm: LLM,
        system: Optional[str] = None,
        *,
        chat_format: str = "auto",
        params: Optional[SamplingParams] = None,
        template_vars: Optional[Mapping[str, Any]] = None,
    ) -> None:
        self.llm, self.chat_format = llm, chat_format
        self.template_vars = dict(template_vars or {})
        self.params = params if params is not None else SamplingParams()
        self.system = system
        self.messages: list[dict[str, str]] = []
        self._kv = KvSession(llm._engine, llm._lock)
        self.reset()

    def reset(self) -> None:
        """Forget the turns (the system message stays) and the cached tokens."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self._kv.close()
        self._kv = KvSession(self.llm._engine, self.llm._lock)

    def send(self, text: str) -> Generator[str, None, GenerationResult]:
        """Adds the user message `text` and streams the answer, which joins the conversation
        (the generator's return value is its GenerationResult). A turn that fails (for
        example past the context length) leaves the conversation as it was."""
        messages = [*self.messages, {"role": "user", "content": text}]
        prompt = self.llm.apply_chat_template(
            messages, chat_format=self.chat_format, **self.template_vars
        )
        ids = self.llm.tokenizer.encode(prompt, add_special_tokens=False)
        result = yield from self.llm._run(ids, self.params, self._kv)
        self.messages = [*messages, {"role": "assistant", "content": result.text}]
        return result

    @property
    def cached_tokens(self) -> int:
        """Tokens of this conversation held in the KV cache."""
        return len(self._kv.ids)

    def close(self) -> None:
        self._kv.close()
