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
    /// GGUF's 1-bit blocks of 128 (type 41, PrismML's Q1_0_g128): an f16 scale `d`, then one
    /// bit per value, LSB first (`w = +d` where the bit is set, `-d` where it is clear).
    Q1_0,
    /// cellm int8 per row: an f32 scale, then the row's int8 values (`w = s * q`).
    I8Row,
    /// cellm int4, symmetric, groups of 64 / 128: per group an f16 scale `d`, then its 4-bit
    /// values, 32 at a time in ggml's nibble order (`w = d * (q - 8)`). Groups of 32 are
    /// `q4_0`'s layout, which the converter writes for them.
    I4G64,
    I4G128,
    /// cellm int4, affine (MLX style), groups of 64 / 128: an f16 scale `d` and bias `m`,
    /// then the values as above (`w = d * q + m`). Groups of 32 are `q4_1`.
    I4AG64,
    I4AG128,
    /// cellm int2 / int3, affine, groups of 64 / 128: an f16 scale `d` and bias `m`, then
    /// 32-value sub-blocks (`w = d * q + m`): int2's are 8 bytes, byte `j` holding values `j`,
    /// `j + 8`, `j + 16`, `j + 24` in bits 0-1, 2-3, 4-5, 6-7; int3's add 4 bytes whose bit `i`
    /// is value `i`'s third bit.
    I2AG64,
    I2AG128,
    I3AG64,
    I3AG128,
    /// Row-interleaved q8_0 / q4_0 / q4_1 / q5_0 / q4_k / q6_k: the same blocks, regrouped so that a kernel reads
    /// 8 rows at once (`docs/format.md`, "Interleaved formats"). The converter writes them;
    /// the row count must be a multiple of [`INTERLEAVE`].
    Q8_0X8,
    Q4_0X8,
    Q4_1X8,
    Q5_0X8,
    Q4KX8,
    Q6KX8,
}

/// Rows per group of an interleaved format.
pub const INTERLEAVE: usize = 8;

/// One format: file name, elements per block, bytes per block, bytes of a per-row header.
struct FormatInfo(TensorFormat, &'static str, usize, usize, usize);

const FORMATS: &[FormatInfo] = &[
    FormatInfo(TensorFormat::F32, "f32", 1, 4, 0),
    FormatInfo(TensorFormat::F16, "f16", 1, 2, 0),
    FormatInfo(TensorFormat::BF16, "bf16", 1, 2, 0),
    FormatInfo(TensorFormat::Q8_0, "q8_0", 32, 34, 0),
    FormatInfo(TensorFormat::Q4_0, "q4_0", 32, 18, 0),
    FormatInfo(TensorFormat::Q4_1, "q4_1", 32, 20, 0),
    FormatInfo(TensorFormat::Q5_0, "q5_0", 32, 22, 0),
    FormatInfo(TensorFormat::Q4K, "q4_k", 256, 144, 0),
    FormatInfo(TensorFormat::Q5K, "q5_k", 256, 176, 0),
    FormatInfo(TensorFormat::Q6K, "q6_k", 256, 210, 0),
    FormatInfo(TensorFormat::Q1_0, "q1_0", 128, 18, 0),
    FormatInfo(TensorFormat::I8Row, "i8_row", 32, 32, 4),
    FormatInfo(TensorFormat::I4G64, "i4_g64", 64, 34, 0),
    FormatInfo(TensorFormat::I4G128, "i4_g128", 128, 66, 0),
    FormatInfo(TensorFormat::I4AG64, "i4a_g64", 64, 36, 0),
    FormatInfo(TensorFormat::I4AG128, "i4a_g128", 128, 68, 0),
    FormatInfo(TensorFormat::I2AG64, "i2a_g64", 64, 20, 0),
    FormatInfo(TensorFormat::I2AG128, "i2a_g128", 128, 36, 0),
    FormatInfo(TensorFormat::I3AG64, "i3a_g64", 64, 28, 0),
    FormatInfo(TensorFormat::I3AG128, "i3a_g128", 128, 52, 0),
    FormatInfo(TensorFormat::Q8_0X8, "q8_0x8", 32, 34, 0),
    FormatInfo(TensorFormat::Q4_0X8, "q4_0x8", 32, 18, 0),
    FormatInfo(TensorFormat::Q4_1X8, "q4_1x8", 32, 20, 0),
    FormatInfo(TensorFormat::Q5_0X8, "q5_0x8", 32, 22, 0),
    FormatInfo(TensorFormat::Q4KX8, "q4_kx8", 256, 144, 0),
    FormatInfo(TensorFormat::Q6KX8, "q6_kx8", 256, 210, 0),
];

/// How an interleaved format regroups the blocks of its base format: the `fields` bytes of
/// f16 fields at `fields_at` in each source block go first (field by field, 8 rows each),
/// then the rest of the block in 4-byte chunks (chunk by chunk, 8 rows each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interleaved {
    pub base: TensorFormat,
    pub fields: usize,
    pub fields_at: usize,
}

const fn x8(base: TensorFormat, fields: usize, fields_at: usize) -> Interleaved {
    Interleaved { base, fields, fields_at }
}

/// Interleaved formats and their layouts.
const INTERLEAVED: &[(TensorFormat, Interleaved)] = &[
    (TensorFormat::Q8_0X8, x8(TensorFormat::Q8_0, 2, 0)),
    (TensorFormat::Q4_0X8, x8(TensorFormat::Q4_0, 2, 0)),
    (TensorFormat::Q4_1X8, x8(TensorFormat::Q4_1, 4, 0)),
    (TensorFormat::Q5_0X8, x8(TensorFormat::Q5_0, 2, 0)),
    (TensorFormat::Q4KX8, x8(TensorFormat::Q4K, 4, 0)),
    // q6_k keeps its scale `d` last; the interleaved column puts it first.
    (TensorFormat::Q6KX8, x8(TensorFormat::Q6K, 2, 208)),
];

impl TensorFormat {
    /// The block formats (GGUF's, then cellm's), in one order other tables can index by.
    pub const BLOCKS: [TensorFormat; 17] = [
        Self::Q8_0,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q4K,
        Self::Q5K,
        Self::Q6K,
        Self::Q1_0,
        Self::I8Row,
        Self::I4G64,
        Self::I4G128,
        Self::I4AG64,
        Self::I4AG128,
        Self::I2AG64,
        Self::I2AG128,
        Self::I3AG64,
        Self::I3AG128,
    ];

    /// The interleaved formats, in one order other tables can index by.
    pub const INTERLEAVED: [TensorFormat; 6] =
        [Self::Q8_0X8, Self::Q4_0X8, Self::Q4_1X8, Self::Q5_0X8, Self::Q4KX8, Self::Q6KX8];

    /// Every format this version reads, in the file table's order.
    pub fn all() -> impl Iterator<Item = TensorFormat> {
        FORMATS.iter().map(|e| e.0)
    }

    /// For an interleaved format, its layout; None for the others.
    pub fn interleaved(self) -> Option<Interleaved> {
        INTERLEAVED.iter().find(|e| e.0 == self).map(|e| e.1)
    }

    /// The interleaved variant of a block format, if it has one.
    pub fn interleaved_variant(self) -> Option<TensorFormat> {
        INTERLEAVED.iter().find(|e| e.1.base == self).map(|e| e.0)
    }

    fn entry(self) -> &'static FormatInfo {
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

    /// Bytes before a row's first block (i8_row's scale; 0 for the others).
    pub fn row_header(self) -> usize {
        self.entry().4
    }

    /// Bytes of a tensor of this shape, or None when its rows do not split into whole blocks
    /// (blocks never cross rows), an interleaved format's rows into whole groups, or the size
    /// overflows.
    pub fn nbytes(self, shape: &[usize]) -> Option<usize> {
        let cols = shape.last().copied().unwrap_or(1);
        let rows = shape[..shape.len().saturating_sub(1)]
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))?;
        if !cols.is_multiple_of(self.block_len())
            || (self.interleaved().is_some() && !rows.is_multiple_of(INTERLEAVE))
        {
            return None;
        }
        let row = (cols / self.block_len()).checked_mul(self.block_bytes())? + self.row_header();
        rows.checked_mul(row)
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

    /// A tensor of zeros in anonymous memory, for planning a model's layout without a file
    /// (`cellm_models::expected_tensors`): it costs address space, and memory only where read.
    pub fn zeros(name: &str, format: TensorFormat, shape: &[usize]) -> Result<Self> {
        let len = format.nbytes(shape).ok_or_else(|| {
            Error::format(format!("tensor {name}: shape {shape:?} does not fit {}", format.name()))
        })?;
        // An empty map is refused by the OS; one spare byte keeps the code path uniform.
        let map = memmap2::MmapOptions::new()
            .len(len.max(1))
            .map_anon()
            .and_then(|m| m.make_read_only())
            .map_err(|e| Error::format(format!("tensor {name}: cannot map {len} bytes: {e}")))?;
        Ok(Self::new(Arc::new(map), 0, len, name.to_string(), format, shape.to_vec()))
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
