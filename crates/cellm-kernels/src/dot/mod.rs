//! Row kernels: dot product of one stored weight row with f32 activations, and decoding a
//! stored row to f32. One table per (format, ISA); every SIMD entry has a scalar twin.

#[macro_use]
mod tables;

#[cfg(target_arch = "x86_64")]
mod avx2;
mod blocks;
#[cfg(target_arch = "x86_64")]
mod bytes;
#[cfg(target_arch = "aarch64")]
mod bytes_neon;
#[cfg(target_arch = "x86_64")]
mod int_avx2;
#[cfg(target_arch = "aarch64")]
mod int_neon;
mod int_scalar;
#[cfg(target_arch = "aarch64")]
mod neon;
#[cfg(target_arch = "x86_64")]
mod prefetch;
mod scalar;
pub mod x8;
#[cfg(target_arch = "x86_64")]
mod x8_avx2;
#[cfg(target_arch = "aarch64")]
mod x8_neon;

use cellm_format::TensorFormat;

use crate::acts::Q8Row;
use crate::isa::Isa;

/// Dot product of a stored row (raw bytes) with `x` (same length in elements).
pub type DotFn = fn(&[u8], &[f32]) -> f32;
/// Decode a stored row into `out`.
pub type DecodeFn = fn(&[u8], &mut [f32]);
/// `acc += w * row`, for attention's weighted sum of values.
pub type AxpyFn = fn(f32, &[u8], &mut [f32]);
/// Dot product of a stored row with int8-quantized activations.
pub type QDotFn = fn(&[u8], Q8Row) -> f32;
/// The same for four activation rows at once (each weight block unpacked once).
pub type QDot4Fn = fn(&[u8], &[Q8Row; 4]) -> [f32; 4];

/// `out[r * T + t] = dot(rows[r], x[t])` for 1..=4 float rows of one length and the `T` =
/// 1..=3 token rows in `x`: a register tile of the float matmul.
pub type DotTileFn = fn(&[&[u8]], &[f32], &mut [f32]);
/// Rows and tokens of the largest [`DotTileFn`] tile.
pub const TILE_ROWS: usize = 4;
pub const TILE_TOKENS: usize = 3;

/// A run of cached rows of one kv head: `count` rows of `dim` stored elements, `stride` bytes
/// apart, the first at the start of `bytes` (a page plane holds every kv head of a position
/// side by side, so one head's rows are strided).
#[derive(Clone, Copy)]
pub struct CachedRows<'a> {
    pub bytes: &'a [u8],
    pub stride: usize,
    pub count: usize,
    pub dim: usize,
}

impl<'a> CachedRows<'a> {
    /// The same rows in a plane that starts `offset` bytes later.
    pub fn offset_by(self, offset: usize) -> Self {
        Self { bytes: &self.bytes[offset..], ..self }
    }

    /// Row `s`, for elements of `elem` bytes.
    pub fn row(&self, s: usize, elem: usize) -> &'a [u8] {
        &self.bytes[s * self.stride..][..self.dim * elem]
    }

    /// The number of heads in `per_head = (len, per)`: `len` values, `per` for each head
    /// (`dim` for queries and accumulators, `count` for scores and weights). Checks that
    /// every row lies inside `bytes` and that `other = (len, per)` holds as many heads. The
    /// SIMD kernels read through raw pointers after this check.
    fn heads(&self, elem: usize, per_head: (usize, usize), other: (usize, usize)) -> usize {
        let end = self.count.checked_sub(1).map_or(0, |last| last * self.stride + self.dim * elem);
        assert!(self.bytes.len() >= end, "cached rows end at {end}, past the plane");
        assert!(self.dim > 0 && self.count > 0, "cached rows: empty run");
        let heads = per_head.0 / per_head.1;
        assert!(per_head.0 == heads * per_head.1 && other.0 == heads * other.1, "head shapes");
        heads
    }
}

/// `scores[h * rows.count + s] = dot(q[h], row s)` for the query heads that share the rows'
/// kv head (`q` holds those heads, `rows.dim` apart; `scores` is heads x rows).
pub type DotHeadsFn = fn(CachedRows, &[f32], &mut [f32]);
/// `acc[h] += sum over s of weights[h * rows.count + s] * row s`, for the heads that share
/// the rows' kv head (`acc` holds those heads, `rows.dim` apart).
pub type AxpyHeadsFn = fn(&[f32], CachedRows, &mut [f32]);

/// How many heads of a group a page kernel takes in one pass, and the passes' sizes: the
/// group split as evenly as it goes into passes of at most `most` (7 in threes: 3, 2, 2).
pub fn head_passes(heads: usize, most: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let passes = heads.div_ceil(most);
    (0..passes).map(move |p| p * heads / passes..(p + 1) * heads / passes)
}

/// Widens columns `0..cols` (a multiple of 8) of up to 16 stored float rows into `panel`,
/// column-major with 16 rows per column; rows past `rows.len()` are zeros (`gemm`'s panels).
pub type PanelFn = fn(rows: &[&[u8]], cols: usize, panel: &mut [f32]);

/// The SIMD panel widener of a float format (None on the scalar and NEON paths: `gemm` widens
/// row by row there).
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
pub fn panel_widener(format: TensorFormat, isa: Isa) -> Option<PanelFn> {
    match isa {
        #[cfg(target_arch = "x86_64")]
        isa if isa.has_avx2() => Some(avx2::panel_widener(format)),
        _ => None,
    }
}

/// Attention's kernels over a float cache row, for a group of query heads at once.
#[derive(Clone, Copy)]
pub struct HeadKernels {
    pub dot: DotHeadsFn,
    pub axpy: AxpyHeadsFn,
}

/// The float formats, in the order the by-rows kernel tables (`tables.rs`) index them, and
/// their element sizes.
const FLOAT_FORMATS: [TensorFormat; 3] = [TensorFormat::F32, TensorFormat::F16, TensorFormat::BF16];
const FLOAT_BYTES: [usize; 3] = [4, 2, 2];

/// The position of a float format in [`FLOAT_FORMATS`].
fn float_index(format: TensorFormat) -> usize {
    FLOAT_FORMATS
        .iter()
        .position(|&f| f == format)
        .unwrap_or_else(|| unreachable!("{format:?} is not a float format"))
}

/// The head-group kernels of a float (cache) format on an ISA path.
pub fn head_kernels(format: TensorFormat, isa: Isa) -> HeadKernels {
    match isa {
        #[cfg(target_arch = "x86_64")]
        isa if isa.has_avx2() => avx2::head_kernels(format),
        #[cfg(target_arch = "aarch64")]
        isa if isa.has_neon() => neon::head_kernels(format),
        _ => scalar::head_kernels(format),
    }
}

/// The float matmul's tile kernel of a float format on an ISA path.
pub fn dot_tiles(format: TensorFormat, isa: Isa) -> DotTileFn {
    match isa {
        #[cfg(target_arch = "x86_64")]
        isa if isa.has_avx2() => avx2::dot_tiles(format),
        #[cfg(target_arch = "aarch64")]
        isa if isa.has_neon() => neon::dot_tiles(format),
        _ => scalar::dot_tiles(format),
    }
}

#[derive(Clone, Copy)]
pub struct RowKernels {
    pub dot: DotFn,
    pub decode: DecodeFn,
    pub axpy: AxpyFn,
    /// Integer kernels (one and four activation rows), for formats that take int8
    /// activations.
    pub qdot: Option<(QDotFn, QDot4Fn)>,
}

/// The kernel table for a format on an ISA path. Interleaved formats have no row kernels:
/// see [`group_kernel`] and `matmul::decode_row_raw`.
pub fn kernels(format: TensorFormat, isa: Isa) -> RowKernels {
    assert!(format.interleaved().is_none(), "{format:?} is read by group kernels, not by rows");
    // Block formats decode with the scalar reference and multiply with integer kernels.
    if let Some(k) = blocks::kernels(format) {
        let qdot = match isa {
            #[cfg(target_arch = "x86_64")]
            isa if isa.has_avx2() => int_avx2::qdot(format, isa),
            #[cfg(target_arch = "aarch64")]
            isa if isa.has_neon() => int_neon::qdot(format, isa),
            _ => int_scalar::qdot(format),
        };
        return RowKernels { qdot, ..k };
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        isa if isa.has_avx2() => avx2::kernels(format),
        #[cfg(target_arch = "aarch64")]
        isa if isa.has_neon() => neon::kernels(format),
        _ => scalar::kernels(format),
    }
}

/// The group kernel of an interleaved format on an ISA path (None for other formats).
pub fn group_kernel(format: TensorFormat, isa: Isa) -> Option<x8::QDotX8Fn> {
    match isa {
        #[cfg(target_arch = "x86_64")]
        isa if isa.has_avx2() => x8_avx2::qdot(format, isa),
        #[cfg(target_arch = "aarch64")]
        isa if isa.has_neon() => x8_neon::qdot(format, isa),
        _ => x8::scalar(format),
    }
}

/// Every group kernel of an interleaved format this CPU can run, by path name, plus the VNNI
/// kernel code on AVX2 with `vpdpbusd` emulated: what the kernel tests check.
#[cfg(test)]
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
fn group_kernels_to_test(format: TensorFormat) -> Vec<(&'static str, x8::QDotX8Fn)> {
    let mut out: Vec<_> = Isa::available()
        .into_iter()
        .map(|i| (i.name(), group_kernel(format, i).unwrap()))
        .collect();
    #[cfg(target_arch = "x86_64")]
    if Isa::Avx2.supported() {
        out.push(("emulated vnni", x8_avx2::qdot_emulated_vnni(format).unwrap()));
    }
    out
}

/// As [`group_kernels_to_test`] for the integer row kernels of a block format.
#[cfg(test)]
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
fn integer_kernels_to_test(format: TensorFormat) -> Vec<(&'static str, (QDotFn, QDot4Fn))> {
    let mut out: Vec<_> = Isa::available()
        .into_iter()
        .map(|i| (i.name(), kernels(format, i).qdot.unwrap()))
        .collect();
    #[cfg(target_arch = "x86_64")]
    if Isa::Avx2.supported() {
        out.push(("emulated vnni", int_avx2::qdot_emulated_vnni(format).unwrap()));
    }
    out
}

/// Panics unless every activation row covers the integer kernel's weight row.
fn check_integer_acts(row: &[u8], x: &[Q8Row], f: TensorFormat) {
    let elems = (row.len() - f.row_header()) / f.block_bytes() * f.block_len();
    for r in x {
        assert!(r.qs.len() >= elems && r.ds.len() * 32 >= elems, "activations too short");
    }
}

/// Deterministic pseudo-random bytes for the kernel tests.
#[cfg(test)]
fn noise(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 24) as u8
        })
        .collect()
}

/// Reinterpret bytes as elements; callers pass rows that the format reader aligned.
pub(crate) fn cast<T>(bytes: &[u8]) -> &[T] {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn aligned(bytes: &[u8]) -> Vec<u32> {
        let mut words = vec![0u32; bytes.len().div_ceil(4)];
        // SAFETY: the u32 buffer is at least as long as `bytes`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                words.as_mut_ptr().cast::<u8>(),
                bytes.len(),
            )
        };
        words
    }

    fn as_bytes(words: &[u32], len: usize) -> &[u8] {
        // SAFETY: reading initialised u32 storage as bytes.
        unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), len) }
    }

    fn pseudo_random(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).max(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s as f32 / u32::MAX as f32) * 4.0 - 2.0
            })
            .collect()
    }

    /// The page kernels equal one scalar row kernel call per (head, row) on every path, for
    /// head dims with and without a tail, groups of 1 to 7 heads (one to three passes) and
    /// runs of rows that do and do not fill the last four, strided as in a page plane.
    #[test]
    fn head_kernels_match_per_row_calls() {
        for isa in Isa::available() {
            for format in [TensorFormat::F32, TensorFormat::F16, TensorFormat::BF16] {
                let (rows, heads) = (kernels(format, Isa::Scalar), head_kernels(format, isa));
                let elem = format.nbytes(&[1]).unwrap();
                for (n, group, count) in
                    [(64, 1, 16), (64, 3, 7), (60, 7, 5), (256, 4, 1), (12, 5, 9)]
                {
                    // Each row sits in a stride of three rows (kv heads side by side), the
                    // run starting at the second.
                    let stride = 3 * n * elem;
                    let plane = encode(format, &pseudo_random(3 * n * count, n as u32));
                    let words = aligned(&plane);
                    let plane = as_bytes(&words, plane.len());
                    let run = CachedRows { bytes: &plane[n * elem..], stride, count, dim: n };
                    let row = |s: usize| &plane[s * stride + n * elem..][..n * elem];
                    let q = pseudo_random(n * group, 9);
                    let mut got = vec![0.0; group * count];
                    (heads.dot)(run, &q, &mut got);
                    for (i, g) in got.iter().enumerate() {
                        let (h, s) = (i / count, i % count);
                        let want = (rows.dot)(row(s), &q[h * n..(h + 1) * n]);
                        assert!((g - want).abs() <= 1e-5 * n as f32, "{isa:?} {format:?} dot");
                    }
                    let w: Vec<f32> = (0..group * count).map(|i| 0.3 - 0.07 * i as f32).collect();
                    let (mut got, mut want) = (q.clone(), q.clone());
                    (heads.axpy)(&w, run, &mut got);
                    for (i, &wi) in w.iter().enumerate() {
                        let (h, s) = (i / count, i % count);
                        (rows.axpy)(wi, row(s), &mut want[h * n..(h + 1) * n]);
                    }
                    for (g, w) in got.iter().zip(&want) {
                        let tol = 1e-5 * w.abs().max(1.0) * count as f32;
                        assert!((g - w).abs() <= tol, "{isa:?} {format:?} axpy: {g} vs {w}");
                    }
                }
            }
        }
    }

    /// The float tiles equal one row kernel call per (row, token) on every path, for every
    /// tile shape and for row lengths with and without a tail.
    #[test]
    fn tiles_match_row_kernels() {
        for isa in Isa::available() {
            for format in [TensorFormat::F32, TensorFormat::F16, TensorFormat::BF16] {
                let (rows_k, tile) = (kernels(format, Isa::Scalar), dot_tiles(format, isa));
                for n in [8, 29, 64, 200] {
                    let stored: Vec<Vec<u32>> = (0..TILE_ROWS)
                        .map(|r| aligned(&encode(format, &pseudo_random(n, 40 + r as u32))))
                        .collect();
                    let len = encode(format, &pseudo_random(n, 1)).len();
                    let x = pseudo_random(n * TILE_TOKENS, 77);
                    for r_count in 1..=TILE_ROWS {
                        for t_count in 1..=TILE_TOKENS {
                            let rows: Vec<&[u8]> =
                                stored[..r_count].iter().map(|w| as_bytes(w, len)).collect();
                            let mut got = vec![0.0; r_count * t_count];
                            tile(&rows, &x[..t_count * n], &mut got);
                            for (r, row) in rows.iter().enumerate() {
                                for t in 0..t_count {
                                    let want = (rows_k.dot)(row, &x[t * n..(t + 1) * n]);
                                    let g = got[r * t_count + t];
                                    assert!(
                                        (g - want).abs() <= 1e-5 * n as f32,
                                        "{isa:?} {format:?} n={n} {r_count}x{t_count}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// Every ISA path agrees with the scalar reference on every format, for lengths that are
    /// and are not multiples of the vector width, and on zeros and extreme magnitudes.
    #[test]
    fn simd_paths_match_scalar() {
        let formats = [TensorFormat::F32, TensorFormat::F16, TensorFormat::BF16];
        for isa in Isa::available() {
            for format in formats {
                let reference = kernels(format, Isa::Scalar);
                let k = kernels(format, isa);
                for (n, seed) in [(1, 1), (7, 2), (8, 3), (31, 4), (64, 5), (333, 6), (1024, 7)] {
                    for scale in [0.0f32, 1.0e-6, 1.0, 3.0e4] {
                        let w: Vec<f32> =
                            pseudo_random(n, seed).iter().map(|v| v * scale).collect();
                        let x = pseudo_random(n, seed + 100);
                        let bytes = encode(format, &w);
                        let words = aligned(&bytes);
                        let row = as_bytes(&words, bytes.len());
                        let (a, b) = ((reference.dot)(row, &x), (k.dot)(row, &x));
                        let mag: f32 = w.iter().zip(&x).map(|(p, q)| (p * q).abs()).sum();
                        assert!(
                            (a - b).abs() <= 1e-5 * mag.max(1.0),
                            "{isa:?} {format:?} n={n}: {a} vs {b}"
                        );
                        let (mut da, mut db) = (vec![0.0; n], vec![0.0; n]);
                        (reference.decode)(row, &mut da);
                        (k.decode)(row, &mut db);
                        assert_eq!(da, db, "{isa:?} {format:?} decode n={n}");
                        let (mut aa, mut ab) = (x.clone(), x.clone());
                        (reference.axpy)(0.37, row, &mut aa);
                        (k.axpy)(0.37, row, &mut ab);
                        for (p, q) in aa.iter().zip(&ab) {
                            assert!(
                                (p - q).abs() <= 1e-6 * p.abs().max(1.0),
                                "{isa:?} {format:?} axpy"
                            );
                        }
                    }
                }
            }
        }
    }
}
