//! The `.cellm` v2 container (see `docs/format.md`): header schema, tensor table, and an mmap
//! reader that validates every offset, size, shape and format before handing out zero-copy views.

mod error;
mod reader;
mod tensor;

pub use error::{Error, Result};
pub use reader::{BlobEntry, CellmFile, Header, TensorEntry, FORMAT_VERSION, MAGIC};
pub use tensor::{Interleaved, Tensor, TensorFormat, INTERLEAVE};
