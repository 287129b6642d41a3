"""cellm: fast inference of small language models on ordinary hardware."""

from cellm.embeddings import Embedder
from cellm.errors import (
    Busy,
    CellmError,
    ContextOverflow,
    FormatError,
    GrammarError,
    InvalidArgument,
    TemplateError,
    UnsupportedArchitecture,
)
from cellm.generation import GenerationResult, Piece, Timings, TokenLogprob
from cellm.llm import LLM
from cellm.pii import PrivacyFilter, Span
from cellm.sampling import SamplingParams
from cellm.speech import Segment, Transcription, Whisper

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "Embedder",
    "PrivacyFilter",
    "Span",
    "GenerationResult",
    "Piece",
    "SamplingParams",
    "Timings",
    "TokenLogprob",
    "Whisper",
    "Transcription",
    "Segment",
    "Busy",
    "CellmError",
    "ContextOverflow",
    "FormatError",
    "GrammarError",
    "InvalidArgument",
    "TemplateError",
    "UnsupportedArchitecture",
]
