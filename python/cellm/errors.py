"""Typed exceptions, defined once. The Rust core raises these same classes."""


class CellmError(Exception):
    """Base class of every error cellm raises on bad input."""


class FormatError(CellmError):
    """A file is missing, truncated, corrupted or not in the expected format."""


class UnsupportedArchitecture(CellmError):
    """The checkpoint's model_type / architecture has no engine family."""


class ContextOverflow(CellmError):
    """A prompt or generation would exceed the context length."""


class InvalidArgument(CellmError):
    """An argument or flag value is out of range."""


class GrammarError(InvalidArgument):
    """A JSON schema, regular expression or grammar that is invalid, or that the model's
    tokenizer cannot produce; raised before any token is generated."""


class TemplateError(CellmError):
    """A chat template failed to compile or render, or rejected the messages (raise_exception)."""


class DeviceError(CellmError):
    """No GPU adapter of the kind asked for, or the GPU failed (out of memory, lost)."""


class Busy(CellmError):
    """The scheduler's queue is full: try again later (the server answers 429)."""


__all__ = [
    "Busy",
    "CellmError",
    "DeviceError",
    "FormatError",
    "UnsupportedArchitecture",
    "ContextOverflow",
    "InvalidArgument",
    "GrammarError",
    "TemplateError",
]
