//! One error type for the whole engine. Each kind maps to one Python exception class.

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// A file is missing, truncated, corrupted or not in the expected format.
    Format(String),
    /// The model's architecture or a tensor format has no implementation.
    Unsupported(String),
    /// A request would exceed the context length or the KV cache.
    ContextOverflow(String),
    /// An argument is out of range (unknown session, bad encoding name, ...).
    InvalidArgument(String),
    /// The caller's cancel hook stopped a step (Ctrl-C); nothing changed.
    Interrupted,
    /// No GPU adapter, or the GPU failed (out of memory, a lost device).
    Device(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Format(m)
            | Error::Unsupported(m)
            | Error::ContextOverflow(m)
            | Error::InvalidArgument(m)
            | Error::Device(m) => f.write_str(m),
            Error::Interrupted => f.write_str("interrupted"),
        }
    }
}

impl std::error::Error for Error {}

impl Error {
    pub fn format(msg: impl Into<String>) -> Self {
        Error::Format(msg.into())
    }
}
