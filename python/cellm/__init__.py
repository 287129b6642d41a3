"""cellm: fast inference of small language models on ordinary hardware."""

from cellm.errors import (
    Busy,
    CellmError,
    ContextOverflow,
    FormatError,
    InvalidArgument,
    TemplateError,
    UnsupportedArchitecture,
)
from cellm.generation import GenerationResult, Timings
from cellm.llm import LLM
from cellm.sampling import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "GenerationResult",
    "SamplingParams",
    "Timings",
    "Busy",
    "CellmError",
    "ContextOverflow",
    "FormatError",
    "InvalidArgument",
    "TemplateError",
    "UnsupportedArchitecture",
]
