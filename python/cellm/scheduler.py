"""Continuous batching: many requests share each engine step.

Every step carries the next token of each decoding request, plus chunks of waiting prompts up
to a token budget (chunked prefill), so a long prompt never stalls the running streams. Each
request keeps its own sampler (parameters, seed), stop rules and detokenizer (a `Decoding`).

KV memory: a request is admitted only when the pool can hold its worst case (prompt plus
`max_tokens`, rounded up to whole pages), and that room stays reserved until it ends (even when
part of its prompt comes from the engine's prefix cache, whose pages it then shares: the count
errs on the safe side, and idle cached pages give way to new ones whenever the pool is full). A
running request therefore never runs out of pages: nothing is preempted or recomputed. Requests
that do not fit yet wait in a bounded queue; past its bound `submit` raises `Busy`. A request
that could never fit (its worst case exceeds the whole pool) is refused at once. Cancelling a
request frees its pages at the next step.

Images (a vision-language model's): a request carries its processed images; they are encoded
at the step that starts its prefill, together with those of the other requests starting there
(one batched encode), and each prompt chunk gets the features of the image tokens it holds.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Union

import numpy as np

from cellm.errors import Busy, ContextOverflow
from cellm.generation import Decoding, GenerationResult, KvSession, Timings, step_sessions
from cellm.multimodal import PromptFeatures
from cellm.sampling import SamplingParams
from cellm.vision import ProcessedImage

if TYPE_CHECKING:
    from cellm.llm import LLM

PAGE_TOKENS = 16  # the engine's KV page size (crates/cellm-engine: PAGE_SIZE)

# What a request reports: a text piece, its final result, or the error that ended it.
Event = Union[str, GenerationResult, BaseException]


@dataclass
class Request:
    """One request in the scheduler. Consumers read `events` (pieces, then the result or an
    error); `on_event`, when set, is called with each event instead (from the scheduler's
    thread: asyncio callers pass `loop.call_soon_threadsafe`-based callbacks)."""

    ids: list[int]
    params: SamplingParams
    # The images whose tokens `ids` hold, in order (a vision-language model's).
    images: list[ProcessedImage] = field(default_factory=list)
    on_event: Optional[Callable[[Event], None]] = None
    events: queue.SimpleQueue[Event] = field(default_factory=queue.SimpleQueue)
    cancelled: bool = False
    # Set by the scheduler.
    decoding: Optional[Decoding] = None
    kv: Optional[KvSession] = None
    pending: list[int] = field(default_factory=list)  # ids to feed at the next steps
    features: Optional[PromptFeatures] = None  # the images' features, while prefilling
    reserved: int = 0
    timings: Timings = field(default_factory=Timings)
    submitted: float = field(default_factory=time.perf_counter)
    first_token: Optional[float] = None

    def emit(self, event: Event) -> None:
        if self.on_event is None:
            self.events.put(event)
            return
        try:
            self.on_event(event)
        except RuntimeError:  # the caller's event loop is gone: nobody is listening
            self.cancelled = True

    def stream(self) -> Generator[str, None, GenerationResult]:
        """Blocks for the pieces (when `on_event` is unset); returns the result."""
        while True:
            event = self.events.get()
            if isinstance(event, BaseException):
                raise event
            if isinstance(event, GenerationResult):
                return event
            yield event

    @property
    def prefilling(self) -> bool:
        return self.first_token is None

    @property
    def session(self) -> KvSession:
        if self.kv is None:
            raise RuntimeError("the request is not running")
        return self.kv


class Scheduler:
    """Runs requests for one `LLM` in shared engine steps (see the module docstring).

    `step()` runs one engine step; `run_until_idle()` drives it in the caller's thread;
    `start()` runs it in a background thread for concurrent callers (asyncio, the server)."""

    def __init__(
        self,
        llm: LLM,
        *,
        max_running: int = 16,
        token_budget: int = 256,
        max_queue: int = 256,
    ) -> None:
        self.llm = llm
        self.max_running, self.token_budget, self.max_queue = max_running, token_budget, max_queue
        self.capacity = llm.kv_capacity_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.reserved = 0
        self._wake = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._stopping = False

    # -- requests ----------------------------------------------------------------------------

    def submit(self, request: Request) -> Request:
        """Queues `request`; InvalidArgument when its images do not fill its image tokens,
        ContextOverflow when it could never fit, Busy when the queue is full."""
        if request.images or self.llm.vision is not None:
            self.llm._vision().positions(request.ids, request.images)
        need = self._worst_case(request)
        if need > self.capacity:
            raise ContextOverflow(
                f"the request needs up to {need} tokens of KV cache (prompt {len(request.ids)} + "
                f"max_tokens {request.params.max_tokens}); the pool holds {self.capacity}"
            )
        with self._wake:
            if len(self.waiting) >= self.max_queue:
                raise Busy(f"the server is busy: {len(self.waiting)} requests are waiting")
            self.waiting.append(request)
            self._wake.notify()
        return request

    def cancel(self, request: Request) -> None:
        """Ends `request`; its pages are freed at the next step."""
        with self._wake:
            request.cancelled = True
            self._wake.notify()

    def _worst_case(self, request: Request) -> int:
        tokens = min(len(request.ids) + request.params.max_tokens, self.llm.context_length)
        return -(-tokens // PAGE_TOKENS) * PAGE_TOKENS

    # -- the loop ----------------------------------------------------------------------------

    def step(self) -> bool:
        """One engine step over every running request; False when there was nothing to do."""
        with self._wake:
            self._drop_cancelled()
            self._admit()
            batch = self._batch()
        batch = self._encode_images(batch)
        if not batch:
            return False
        llm = self.llm
        t0 = time.perf_counter()
        try:
            sessions = [(r.session, ids) for r, ids in batch]
            logits = step_sessions(llm._engine, llm._lock, sessions, _embeds(batch))
        except Exception as e:  # noqa: BLE001 - the step's requests end with its error
            for r, _ in batch:
                self._end(r, e)
            return True
        elapsed = time.perf_counter() - t0
        for (r, ids), row in zip(batch, logits):
            del r.pending[: len(ids)]
            if r.prefilling:
                r.timings.prefill_s += elapsed
            else:
                r.timings.decode_s += elapsed
                r.timings.decode_tokens += 1
            if r.pending:  # a prompt chunk: its logits are not wanted
                continue
            if r.first_token is None:
                r.first_token = time.perf_counter()
                r.images, r.features = [], None  # prefilled: the pixels are no longer needed
            assert r.decoding is not None
            try:
                token, pieces = r.decoding.advance(row)
            except Exception as e:  # noqa: BLE001 - a sampler error ends this request only
                self._end(r, e)
                continue
            for piece in pieces:
                r.emit(piece)
            if token is None:
                self._end(r, r.decoding.result(r.timings))
            else:
                r.pending = [token]
        return True

    def run_until_idle(self) -> None:
        while self.step():
            pass

    def start(self) -> None:
        """Runs the loop in a daemon thread until `close()`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="cellm-scheduler", daemon=True)
            self._thread.start()

    def close(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for r in [*self.running, *self.waiting]:
            self._end(r, Busy("the scheduler was closed"))
        self.waiting.clear()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not (self.waiting or self.running):
                    self._wake.wait()
                if self._stopping:
                    return
            if not self.step():
                with self._wake:  # waiting requests that cannot be admitted yet
                    self._wake.wait(timeout=0.05)

    # -- bookkeeping (under self._wake) ------------------------------------------------------

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            request = self.waiting[0]
            need = self._worst_case(request)
            if self.reserved + need > self.capacity:
                return  # first come, first served: later requests wait behind it
            self.waiting.popleft()
            llm = self.llm
            try:
                request.decoding = Decoding(
                    request.ids,
                    request.params,
                    llm.tokenizer,
                    llm.eos_token_ids,
                    llm.context_length,
                )
                request.kv = KvSession(llm._engine, llm._lock)
                # A prefix other requests left in the engine's cache is not prefilled again.
                request.pending = request.kv.reuse(request.ids, llm._shareable(request.ids))
            except Exception as e:  # noqa: BLE001 - bad parameters end this request only
                self._end(request, e)
                continue
            request.timings.prefill_tokens = len(request.pending)
            request.reserved = need
            self.reserved += need
            self.running.append(request)

    def _batch(self) -> list[tuple[Request, list[int]]]:
        """Every decoding request's token, then prompt chunks within the budget."""
        batch = [(r, r.pending) for r in self.running if not r.prefilling]
        budget = max(self.token_budget - len(batch), 1)
        decoding = len(batch)
        for r in self.running:
            if r.prefilling and budget > 0:
                chunk = r.pending[: _chunk_length(r, budget)]
                if chunk:
                    batch.append((r, chunk))
                    budget -= len(chunk)
        if len(batch) == decoding:
            # No aligned chunk fits the budget (a budget under CHUNK_ALIGN, or decoding rows
            # taking nearly all of it): the first prompt takes what is left rather than wait.
            first = next((r for r in self.running if r.prefilling), None)
            if first is not None:
                batch.append((first, first.pending[:budget]))
        return batch

    def _encode_images(
        self, batch: list[tuple[Request, list[int]]]
    ) -> list[tuple[Request, list[int]]]:
        """Encodes the images of the requests whose prefill starts in `batch`, all in one
        call; the batch without the requests that failed (the error ends them)."""
        starting = [r for r, _ in batch if r.images and r.features is None]
        if not starting:
            return batch
        t0 = time.perf_counter()
        try:
            prompts = [(r.ids, r.images) for r in starting]
            features = self.llm._vision().prompt_features(prompts)
        except Exception as e:  # noqa: BLE001 - the encode's requests end with its error
            with self._wake:
                for r in starting:
                    self._end(r, e)
            return [(r, ids) for r, ids in batch if r not in starting]
        elapsed = time.perf_counter() - t0
        for r, f in zip(starting, features):
            r.features = f
            r.timings.images, r.timings.image_encode_s = len(r.images), elapsed
        return batch

    def _drop_cancelled(self) -> None:
        for r in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(r)
            self._end(r, _cancelled_result(r))
        for r in [r for r in self.running if r.cancelled]:
            self._end(r, _cancelled_result(r))

    def _end(self, request: Request, outcome: Union[GenerationResult, BaseException]) -> None:
        if request in self.running:
            self.running.remove(request)
            self.reserved -= request.reserved
        if request.kv is not None:
            request.kv.close()
            request.kv = None
        request.emit(outcome)


class AsyncStream:
    """A request seen from asyncio: `async for piece in stream` submits it and yields its
    pieces; `result` holds the GenerationResult once it ended. Leaving the loop early (a
    break, a cancelled task, a client gone) cancels the request."""

    def __init__(self, scheduler: Scheduler, request: Request) -> None:
        self.scheduler, self.request = scheduler, request
        self.result: Optional[GenerationResult] = None
        self._iter: Optional[AsyncIterator[str]] = None

    def __aiter__(self) -> AsyncIterator[str]:
        # One iteration per request: a second `async for` continues where the first stopped.
        if self._iter is None:
            self._iter = self._pieces()
        return self._iter

    async def _pieces(self) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def forward(event: Event) -> None:  # runs on the scheduler's thread
            loop.call_soon_threadsafe(events.put_nowait, event)

        self.request.on_event = forward
        self.scheduler.submit(self.request)
        try:
            while True:
                event = await events.get()
                if isinstance(event, BaseException):
                    raise event
                if isinstance(event, GenerationResult):
                    self.result = event
                    return
                yield event
        finally:
            if self.result is None:
                self.scheduler.cancel(self.request)

    async def aclose(self) -> None:
        """Cancels the request if it is still running (its pages are freed at the next step)."""
        if self._iter is not None:
            await self._iter.aclose()  # type: ignore[attr-defined]
        elif self.result is None:
            self.scheduler.cancel(self.request)

    async def collect(self) -> GenerationResult:
        """Runs the request to its end and returns its result."""
        async for _ in self:
            pass
        assert self.result is not None
        return self.result


# Prefill chunks end on multiples of this many positions (the engine's KV page and query tile)
# and are never shorter than MIN_TILED_ROWS: a prompt prefilled in such chunks gets bitwise the
# logits it gets in one step. Other splits move a quantized model's logits by up to about 2%
# (SmolLM2 Q4_1: benches/chunk_invariance.py), enough to flip a greedy near-tie against the
# same request run alone.
CHUNK_ALIGN = 16
MIN_TILED_ROWS = 8


def _chunk_length(request: Request, budget: int) -> int:
    """How many of `request`'s pending prompt tokens to prefill within `budget`: all when they
    fit; else up to the last aligned position within the budget (none when no aligned position
    lies within it: the prompt waits for a step with more room), taking the rest too when fewer
    than MIN_TILED_ROWS would be left (overrunning the budget by at most that)."""
    pending = len(request.pending)
    if pending <= budget:
        return pending
    start = len(request.ids) - pending
    length = (start + budget) // CHUNK_ALIGN * CHUNK_ALIGN - start
    if length <= 0:
        return 0
    return pending if pending - length < MIN_TILED_ROWS else length


def _embeds(batch: list[tuple[Request, list[int]]]) -> list[tuple[int, list[int], np.ndarray]]:
    """The image features of the prompt chunks in `batch`, as `step_sessions` takes them."""
    out = []
    for i, (r, ids) in enumerate(batch):
        if r.features is not None:
            start = len(r.ids) - len(r.pending)  # the chunk's place in the prompt
            rows = r.features.chunk(start, start + len(ids))
            if rows is not None:
                out.append((i, *rows))
    return out


def _cancelled_result(request: Request) -> GenerationResult:
    if request.decoding is None:
        return GenerationResult("", [], "cancelled", len(request.ids), request.timings)
    result = request.decoding.result(request.timings)
    result.finish_reason = "cancelled"
    return result
