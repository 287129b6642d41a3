//! Float rows as the float kernels read them: the formats the by-rows tables index, their
//! element sizes, and stored bytes as elements.

use cellm_format::TensorFormat;

/// The float formats, in the order the by-rows kernel tables (`tables.rs`) index them, and
/// their element sizes.
pub(super) const FLOAT_FORMATS: [TensorFormat; 3] =
    [TensorFormat::F32, TensorFormat::F16, TensorFormat::BF16];
pub(super) const FLOAT_BYTES: [usize; 3] = [4, 2, 2];

/// The position of a float format in [`FLOAT_FORMATS`].
pub(super) fn float_index(format: TensorFormat) -> usize {
    FLOAT_FORMATS
        .iter()
        .position(|&f| f == format)
        .unwrap_or_else(|| unreachable!("{format:?} is not a float format"))
}

/// Reinterpret bytes as elements; callers pass rows that the format reader aligned.
pub(super) fn cast<T>(bytes: &[u8]) -> &[T] {
    let size = std::mem::size_of::<T>();
    assert!(
        (bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>())
            && bytes.len().is_multiple_of(size),
        "misaligned row"
    );
    // SAFETY: alignment and length checked above; T is a plain number type.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), bytes.len() / size) }
}

/// Float values stored as a float format's row bytes (tests).
#[cfg(test)]
pub(crate) fn encode(format: TensorFormat, v: &[f32]) -> Vec<u8> {
    match format {
        TensorFormat::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        TensorFormat::F16 => {
            v.iter().flat_map(|x| half::f16::from_f32(*x).to_bits().to_le_bytes()).collect()
        }
        TensorFormat::BF16 => {
            v.iter().flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes()).collect()
        }
        other => unreachable!("{other:?} is a block format"),
    }
}
