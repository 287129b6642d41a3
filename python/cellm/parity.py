"""cellm and llama.cpp side by side on the same GGUF file: next-token logits on a fixed text and
greedy generations, with the agreement measures the parity tests and tables report.

llama.cpp comes from `llama-cpp-python` (a test and benchmark dependency only, built from its
PyPI sdist). Both engines get the same token ids, so only the numerics are compared.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from cellm.llm import LLM


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    out: np.ndarray = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return out


class LlamaCpp:
    """llama.cpp on one GGUF file, fed token ids (its own tokenizer is not used)."""

    def __init__(self, gguf: os.PathLike[str], n_ctx: int = 2048, threads: int = 2) -> None:
        from llama_cpp import Llama  # imported here: an optional dependency

        self.model = Llama(
            model_path=str(gguf),
            n_ctx=n_ctx,
            n_batch=512,
            n_threads=threads,
            logits_all=True,
            verbose=False,
        )

    def logits(self, ids: list[int], one_by_one: bool = False) -> np.ndarray:
        """Next-token logits after every prefix of `ids`: (len(ids), vocab), from one batched
        evaluation or, with `one_by_one`, token by token."""
        self.model.reset()
        if one_by_one:
            for t in ids:
                self.model.eval([t])
        else:
            self.model.eval(ids)
        return np.array(self.model.scores[: len(ids)], dtype=np.float32)

    def greedy(self, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
        """`n` greedy tokens after `ids`, and the logits each was chosen from."""
        self.model.reset()
        self.model.eval(ids)
        out, rows = [], []
        for _ in range(n):
            row = np.array(self.model.scores[self.model.n_tokens - 1], dtype=np.float32)
            rows.append(row)
            out.append(int(row.argmax()))
            self.model.eval([out[-1]])
        return out, np.stack(rows)


def cellm_greedy(llm: LLM, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """`n` greedy tokens after `ids` from cellm, and the logits each was chosen from."""
    engine = llm._engine
    session = engine.create_session()
    try:
        rows = [engine.step([(session, ids)])[0]]
        out = [int(rows[0].argmax())]
        for _ in range(n - 1):
            rows.append(engine.step([(session, [out[-1]])])[0])
            out.append(int(rows[-1].argmax()))
    finally:
        engine.free_session(session)
    return out, np.stack(rows)


@dataclass
class LogitsParity:
    positions: int
    argmax_agreement: float
    mean_kl: float  # KL(llama.cpp || cellm), nats, averaged over positions
    max_kl: float


def compare_logits(reference: np.ndarray, ours: np.ndarray) -> LogitsParity:
    p, q = log_softmax(reference), log_softmax(ours)
    kl = (np.exp(p) * (p - q)).sum(-1)
    agree = float((reference.argmax(-1) == ours.argmax(-1)).mean())
    return LogitsParity(len(kl), agree, float(kl.mean()), float(kl.max()))


@dataclass
class NoiseFloor:
    """How far llama.cpp is from itself: batched vs token-by-token evaluation of the same
    ids. Int8 activations make results depend on rounding, so this is the closest agreement
    any other engine can be expected to reach."""

    logits: LogitsParity
    max_top_logit_change: float  # largest change of the chosen token's logit


def noise_floor(peer: LlamaCpp, ids: list[int]) -> NoiseFloor:
    batched, single = peer.logits(ids), peer.logits(ids, one_by_one=True)
    top = batched.argmax(-1)
    rows = np.arange(len(top))
    change = float(np.abs(batched[rows, top] - single[rows, top]).max())
    return NoiseFloor(compare_logits(batched, single), change)


@dataclass
class GreedyParity:
    identical: bool
    diverged_at: Optional[int]  # first differing position, or None
    gap: Optional[float]  # llama.cpp's logit gap between the two choices there

    def near_tie(self, limit: float) -> bool:
        return self.identical or (self.gap is not None and self.gap <= limit)


def compare_greedy(
    ref: tuple[list[int], np.ndarray], ours: tuple[list[int], np.ndarray]
) -> GreedyParity:
    (ref_ids, ref_rows), (our_ids, _) = ref, ours
    for i, (a, b) in enumerate(zip(ref_ids, our_ids)):
        if a != b:
            return GreedyParity(False, i, float(ref_rows[i][a] - ref_rows[i][b]))
    return GreedyParity(True, None, None)


# The registry's real models, each checked against llama.cpp on its own GGUF file.
REAL_MODELS = ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "gemma-3-270m"]

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a lighthouse.",
    "Translate 'good morning, how are you?' into Spanish.",
]


def _data_text_ids(llm: LLM, name: str, n_tokens: int) -> list[int]:
    """A fixed text shipped in python/cellm/data as ids, checked to be `n_tokens` long."""
    ids = llm.tokenizer.encode((Path(__file__).resolve().parent / "data" / name).read_text())
    if len(ids) < n_tokens:
        raise ValueError(f"{name} has only {len(ids)} tokens, {n_tokens} needed")
    return ids


def parity_text_ids(llm: LLM, n_tokens: int = 256) -> list[int]:
    """The fixed English text for logits parity (data/english.txt)."""
    return _data_text_ids(llm, "english.txt", n_tokens)


def perplexity(logits: Callable[[list[int]], np.ndarray], ids: list[int], ctx: int = 512) -> float:
    """exp(mean negative log-likelihood) of `ids`, in independent windows of `ctx` tokens
    (each window's first token is context only): the same windows for every engine."""
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, ctx):
        window = ids[start : start + ctx]
        if len(window) < 2:
            break
        lp = log_softmax(logits(window)[:-1])
        nll -= float(lp[np.arange(len(window) - 1), window[1:]].sum())
        count += len(window) - 1
    return float(np.exp(nll / count))


def perplexity_text_ids(llm: LLM, n_tokens: int = 2048) -> list[int]:
    """The fixed text for perplexity (data/perplexity.txt), at least 2k tokens."""
    return _data_text_ids(llm, "perplexity.txt", n_tokens)


def chat_ids(llm: LLM, prompt: str) -> list[int]:
    # Agreement needs prompts, not good answers: a base model (no template) gets its family's
    # builtin format explicitly, as it did before base models refused `auto`.
    chat_format = llm.family.chat_format if llm.is_base_model else "auto"
    text = llm.apply_chat_template([{"role": "user", "content": prompt}], chat_format=chat_format)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def run(llm: LLM, peer: LlamaCpp, greedy_tokens: int = 64) -> dict[str, Any]:
    """Everything the parity table reports for one model."""
    ids = parity_text_ids(llm)
    logits = compare_logits(peer.logits(ids), llm.logits(ids))
    floor = noise_floor(peer, ids)
    greedy = []
    for prompt in CHAT_PROMPTS:
        p = chat_ids(llm, prompt)
        greedy.append(
            compare_greedy(peer.greedy(p, greedy_tokens), cellm_greedy(llm, p, greedy_tokens))
        )
    return {"logits": logits, "floor": floor, "greedy": greedy}
