//! Tensor formats and zero-copy tensor views into the mapped file.

use std::sync::Arc;

use memmap2::Mmap;

use crate::{Error, Result};

/// Storage format of one tensor, as named in the file's tensor table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorFormat {
    F32,
    F16,
    BF16,
}

impl TensorFormat {
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "f32" => Ok(Self::F32),
            "f16" => Ok(Self::F16),
            "bf16" => Ok(Self::BF16),
            other => Err(Error::Unsupported(format!(
                "tensor format '{other}' is not supported by this version of cellm"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::BF16 => "bf16",
        }
    }

    /// Bytes needed for `elements` values, or None when the count is not representable
    /// (block formats add a divisibility rule here).
    pub fn nbytes(self, elements: usize) -> Option<usize> {
        match self {
            Self::F32 => elements.checked_mul(4),
            Self::F16 | Self::BF16 => elements.checked_mul(2),
        }
    }

    /// Required alignment of the data pointer for typed access.
    pub fn alignment(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
        }
    }
}

/// A view of one tensor inside the mapped file. Cloning is cheap (an `Arc` and a range).
#[derive(Clone)]
pub struct Tensor {
    map: Arc<Mmap>,
    start: usize,
    len: usize,
    pub name: String,
    pub format: TensorFormat,
    pub shape: Vec<usize>,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tensor({} {:?} {})",
            self.name,
            self.shape,
            self.format.name()
        )
    }
}

impl Tensor {
    /// Built only by the reader, after the range, size and alignment were checked.
    pub(crate) fn new(
        map: Arc<Mmap>,
        start: usize,
        len: usize,
        name: String,
        format: TensorFormat,
        shape: Vec<usize>,
    ) -> Self {
        Self {
            map,
            start,
            len,
            name,
            format,
            shape,
        }
    }

    pub fn bytes(&self) -> &[u8] {
        &self.map[self.start..self.start + self.len]
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Rows and columns of a 2-D tensor (a 1-D tensor is one row).
    pub fn rows_cols(&self) -> (usize, usize) {
        let cols = self.shape.last().copied().unwrap_or(1);
        (self.numel() / cols.max(1), cols)
    }

    /// The elements of an `f32` tensor.
    pub fn as_f32(&self) -> Result<&[f32]> {
        self.expect(TensorFormat::F32)?;
        // SAFETY: the reader checked that the range lies in the map, that its length is
        // 4 * numel and that the start is 64-byte aligned (the map itself is page aligned).
        Ok(
            unsafe {
                std::slice::from_raw_parts(self.bytes().as_ptr().cast::<f32>(), self.numel())
            },
        )
    }

    /// The raw 16-bit words of an `f16` or `bf16` tensor.
    pub fn as_u16(&self) -> Result<&[u16]> {
        if !matches!(self.format, TensorFormat::F16 | TensorFormat::BF16) {
            return Err(self.wrong_format("f16 or bf16"));
        }
        // SAFETY: as in `as_f32`, with 2-byte elements.
        Ok(
            unsafe {
                std::slice::from_raw_parts(self.bytes().as_ptr().cast::<u16>(), self.numel())
            },
        )
    }

    fn expect(&self, format: TensorFormat) -> Result<()> {
        if self.format == format {
            Ok(())
        } else {
            Err(self.wrong_format(format.name()))
        }
    }

    fn wrong_format(&self, wanted: &str) -> Error {
        Error::Format(format!(
            "tensor {} is {} but {wanted} is required here",
            self.name,
            self.format.name()
        ))
    }
}
