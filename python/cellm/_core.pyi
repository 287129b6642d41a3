"""Type stubs for the Rust extension `cellm._core` (crates/cellm-python); `python -m
mypy.stubtest cellm._core` checks them against the built module."""

import os
from collections.abc import Sequence
from typing import final

import numpy as np
import numpy.typing as npt

__all__ = [
    "Encoder",
    "Engine",
    "selected_isa",
    "available_isas",
    "set_isa",
    "dequantize",
    "matmul",
    "read_bandwidth",
    "architectures",
    "expected_tensors",
    "__version__",
]

__version__: str

@final
class Encoder:
    """An encoder `.cellm` model (token classifier, sentence embedder): whole token
    sequences in, one row per token out."""

    def __new__(cls, path: str | os.PathLike[str], *, threads: int | None = None) -> Encoder: ...
    def header_json(self) -> str: ...
    def blob(self, name: str) -> bytes | None: ...
    @property
    def width(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def threads(self) -> int: ...
    def forward(self, seqs: Sequence[Sequence[int]]) -> npt.NDArray[np.float32]: ...

@final
class Engine:
    """One loaded `.cellm` model with its KV page pool and sessions."""

    def __new__(
        cls,
        path: str | os.PathLike[str],
        *,
        threads: int | None = None,
        kv_encoding: str = "f16",
        context_length: int | None = None,
        kv_capacity_tokens: int | None = None,
        max_layers: int | None = None,
        backend: str = "cpu",
        gpu_max_binding: int | None = None,
    ) -> Engine: ...
    def header_json(self) -> str: ...
    def blob(self, name: str) -> bytes | None: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def context_length(self) -> int: ...
    @property
    def threads(self) -> int: ...
    def kv_stats(self) -> tuple[int, int, int]:
        """(pages in use, pages allocated, bytes per page)."""
    def create_session(self) -> int: ...
    def free_session(self, session: int) -> None: ...
    def truncate_session(self, session: int, length: int) -> None: ...
    def session_len(self, session: int) -> int: ...
    def encode_images(
        self, patches: npt.NDArray[np.float32], grids: Sequence[tuple[int, int]]
    ) -> npt.NDArray[np.float32]: ...
    def encode_speech(
        self, session: int, features: npt.NDArray[np.float32]
    ) -> npt.NDArray[np.float32]: ...
    def step(
        self,
        batch: Sequence[tuple[int, Sequence[int]]],
        *,
        all_logits: bool = False,
        embeds: Sequence[tuple[int, Sequence[int], npt.NDArray[np.float32]]] | None = None,
    ) -> npt.NDArray[np.float32]: ...

def selected_isa() -> str: ...
def available_isas() -> list[str]: ...
def set_isa(name: str) -> None: ...
def dequantize(format: str, data: bytes, rows: int, cols: int) -> npt.NDArray[np.float32]: ...
def matmul(
    format: str, data: bytes, rows: int, cols: int, x: npt.NDArray[np.float32]
) -> npt.NDArray[np.float32]: ...
def read_bandwidth(mib: int = 1024, threads: int = 2, reps: int = 5) -> float: ...
def architectures() -> list[str]: ...
def expected_tensors(model_json: str) -> list[tuple[str, list[int], list[str]]]: ...
