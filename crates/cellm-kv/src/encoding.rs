//! How cached keys and values are stored, and how attention reads them back.

use cellm_format::{Error, Result, TensorFormat};
use cellm_kernels::dot::{DecodeFn, HeadKernels, PathKernels};
use cellm_kernels::kv_rows::{self, KvCodes};

use crate::rotation::Rotation;

/// The storage of one cached row (one kv head of one position).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvEncoding {
    F16,
    F32,
    /// int8 with an f16 scale per position and kv head (`kv_rows`), after a fixed Hadamard
    /// rotation per head (`rotation`).
    Int8,
    /// 4-bit groups of 32 with an f16 scale each, after the same rotation.
    Int4,
}

/// What attention's row path runs over a page's rows of one kv head.
#[derive(Clone, Copy)]
pub(crate) enum PageReader {
    /// The float head kernels read the stored rows as they are.
    Float(HeadKernels),
    /// Rows are widened to f32 (`decode`), then read by the f32 head kernels.
    Widened { decode: DecodeFn, f32: HeadKernels },
}

impl KvEncoding {
    pub const NAMES: [&str; 4] = ["f16", "f32", "int8", "int4"];

    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "f16" => Ok(Self::F16),
            "f32" => Ok(Self::F32),
            "int8" => Ok(Self::Int8),
            "int4" => Ok(Self::Int4),
            other => Err(Error::InvalidArgument(format!(
                "unknown KV encoding '{other}' (expected one of {})",
                Self::NAMES.join(", ")
            ))),
        }
    }

    /// Bytes of one kv head's row of `head_dim` values.
    pub fn head_bytes(self, head_dim: usize) -> usize {
        match self {
            Self::F16 => 2 * head_dim,
            Self::F32 => 4 * head_dim,
            Self::Int8 => kv_rows::i8_row_bytes(head_dim),
            Self::Int4 => kv_rows::i4_row_bytes(head_dim),
        }
    }

    /// The rotation of heads of `head_dim` before they are stored (queries and outputs
    /// turn with them), for the encodings that rotate.
    pub(crate) fn rotation(self, head_dim: usize) -> Option<Rotation> {
        matches!(self, Self::Int8 | Self::Int4).then(|| Rotation::new(head_dim))
    }

    /// Stores one head's values (already rotated where the encoding rotates).
    pub(crate) fn encode(self, src: &[f32], dst: &mut [u8]) {
        match self {
            Self::F32 => {
                for (d, s) in dst.chunks_exact_mut(4).zip(src) {
                    d.copy_from_slice(&s.to_le_bytes());
                }
            }
            Self::F16 => {
                for (d, s) in dst.chunks_exact_mut(2).zip(src) {
                    d.copy_from_slice(&half::f16::from_f32(*s).to_bits().to_le_bytes());
                }
            }
            Self::Int8 => kv_rows::encode_i8(src, dst),
            Self::Int4 => kv_rows::encode_i4(src, dst),
        }
    }

    /// The decoder of one stored head row, on the selected ISA path.
    pub(crate) fn decoder(self) -> DecodeFn {
        match self {
            Self::F16 => PathKernels::selected().row_kernels(TensorFormat::F16).decode,
            Self::F32 => PathKernels::selected().row_kernels(TensorFormat::F32).decode,
            Self::Int8 => KvCodes::selected().i8,
            Self::Int4 => KvCodes::selected().i4,
        }
    }

    pub(crate) fn reader(self) -> PageReader {
        let path = PathKernels::selected();
        match self {
            Self::F16 => PageReader::Float(path.head_kernels(TensorFormat::F16)),
            Self::F32 => PageReader::Float(path.head_kernels(TensorFormat::F32)),
            Self::Int8 | Self::Int4 => PageReader::Widened {
                decode: self.decoder(),
                f32: path.head_kernels(TensorFormat::F32),
            },
        }
    }
}

/// What a cache of `encoding` gives back for rows `x` of heads of `head_dim`: each head
/// rotated (where the encoding rotates), stored, decoded by the scalar reference and turned
/// back. Attention over a cache must equal dense attention over these values.
#[cfg(test)]
pub(crate) fn stored_values(encoding: KvEncoding, head_dim: usize, x: &[f32]) -> Vec<f32> {
    use cellm_kernels::isa::Isa;
    let rotation = encoding.rotation(head_dim);
    let mut x = x.to_vec();
    if let Some(r) = &rotation {
        r.rotate(&mut x);
    }
    let decode = match encoding {
        KvEncoding::F16 | KvEncoding::F32 => {
            let format =
                if encoding == KvEncoding::F16 { TensorFormat::F16 } else { TensorFormat::F32 };
            PathKernels::of(Isa::Scalar).row_kernels(format).decode
        }
        KvEncoding::Int8 => KvCodes::of(Isa::Scalar).i8,
        KvEncoding::Int4 => KvCodes::of(Isa::Scalar).i4,
    };
    // u32 storage: the float decoders read aligned rows.
    let mut words = vec![0u32; encoding.head_bytes(head_dim).div_ceil(4)];
    for head in x.chunks_exact_mut(head_dim) {
        // SAFETY: any byte pattern is a valid u32; the slice covers the same storage.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), words.len() * 4)
        };
        encoding.encode(head, &mut bytes[..encoding.head_bytes(head_dim)]);
        decode(&bytes[..encoding.head_bytes(head_dim)], head);
    }
    if let Some(r) = &rotation {
        r.unrotate(&mut x);
    }
    x
}
