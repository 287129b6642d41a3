//! Tensor formats and zero-copy tensor views into the mapped file.

use std::sync::Arc;

use memmap2::Mmap;

use crate::{Error, Result};

/// Storage format of one tensor, as named in the file's tensor table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorFormat {
    F32,
    F16,
    BF16,
    /// GGUF blocks, kept byte for byte as llama.cpp stores them.
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q4K,
    Q5K,
    Q6K,
}

/// Every format: file name, elements per block, bytes per block.
const FORMATS: &[(TensorFormat, &str, usize, usize)] = &[
    (TensorFormat::F32, "f32", 1, 4),
    (TensorFormat::F16, "f16", 1, 2),
    (TensorFormat::BF16, "bf16", 1, 2),
    (TensorFormat::Q8_0, "q8_0", 32, 34),
    (TensorFormat::Q4_0, "q4_0", 32, 18),
    (TensorFormat::Q4_1, "q4_1", 32, 20),
    (TensorFormat::Q5_0, "q5_0", 32, 22),
    (TensorFormat::Q4K, "q4_k", 256, 144),
    (TensorFormat::Q5K, "q5_k", 256, 176),
    (TensorFormat::Q6K, "q6_k", 256, 210),
];

impl TensorFormat {
    /// The GGUF block formats, in one order other tables can index by.
    pub const BLOCKS: [TensorFormat; 7] =
        [Self::Q8_0, Self::Q4_0, Self::Q4_1, Self::Q5_0, Self::Q4K, Self::Q5K, Self::Q6K];

    fn entry(self) -> &'static (TensorFormat, &'static str, usize, usize) {
        FORMATS.iter().find(|e| e.0 == self).expect("every format is in the table")
    }

    pub fn parse(name: &str) -> Result<Self> {
        FORMATS.iter().find(|e| e.1 == name).map(|e| e.0).ok_or_else(|| {
            Error::Unsupported(format!(
                "tensor format '{name}' is not supported by this version of cellm"
            ))
        })
    }

    pub fn name(self) -> &'static str {
        self.entry().1
    }

    /// Elements per block (1 for plain floats).
    pub fn block_len(self) -> usize {
        self.entry().2
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        self.entry().3
    }

    /// Bytes of a tensor of this shape, or None when its rows do not split into whole blocks
    /// (blocks never cross rows) or the size overflows.
    pub fn nbytes(self, shape: &[usize]) -> Option<usize> {
        let cols = shape.last().copied().unwrap_or(1);
        let rows = shape[..shape.len().saturating_sub(1)]
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))?;
        if !cols.is_multiple_of(self.block_len()) {
            return None;
        }
        rows.checked_mul(cols / self.block_len())?.checked_mul(self.block_bytes())
    }

    /// Required alignment of the data pointer for typed access (blocks are read unaligned).
    pub fn alignment(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            _ => 1,
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
        write!(f, "Tensor({} {:?} {})", self.name, self.shape, self.format.name())
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
        Self { map, start, len, name, format, shape }
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
        Ok(unsafe { std::slice::from_raw_parts(self.bytes().as_ptr().cast::<f32>(), self.numel()) })
    }

    /// The raw 16-bit words of an `f16` or `bf16` tensor.
    pub fn as_u16(&self) -> Result<&[u16]> {
        if !matches!(self.format, TensorFormat::F16 | TensorFormat::BF16) {
            return Err(self.wrong_format("f16 or bf16"));
        }
        // SAFETY: as in `as_f32`, with 2-byte elements.
        Ok(unsafe { std::slice::from_raw_parts(self.bytes().as_ptr().cast::<u16>(), self.numel()) })
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
