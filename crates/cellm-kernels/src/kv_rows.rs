//! Compressed KV cache rows: one kv head of one position, stored in fewer bytes than f16.
//!
//! - int8: an f16 scale `d`, then `dim` int8 values (`x = d * q`, `d = max|x| / 127`):
//!   `dim + 2` bytes, 0.52x of f16 at 64 dimensions.
//! - int4: groups of 32 values in q4_0's block layout (an f16 scale `d`, then 16 bytes whose
//!   low nibbles are values 0-15 and high nibbles 16-31, `x = d * (q - 8)`): 18 bytes per 32
//!   values, 0.28x of f16. A last partial group (head sizes that are not a multiple of 32)
//!   is stored as a whole one, its missing values zero.
//!
//! The cache rotates rows before they get here (`cellm-kv`), which spreads a head's outlier
//! dimensions over all of them, so one scale fits the row (int8) or each group (int4); 4-bit
//! keys are first taken relative to a per-page header there (`KeyHeader`).
//!
//! Attention widens a page's rows of one kv head to f32 (in L1, per page) with [`KvCodes`]'
//! decoders, then runs the float kernels on them: nothing wider than these bytes is kept.

use half::f16;

use crate::dot::DecodeFn;
use crate::isa::Isa;

/// Values per int4 group.
pub const I4_GROUP: usize = 32;
const I4_BLOCK: usize = 2 + I4_GROUP / 2;

/// Bytes of an int8 row of `dim` values.
pub fn i8_row_bytes(dim: usize) -> usize {
    2 + dim
}

/// Bytes of an int4 row of `dim` values.
pub fn i4_row_bytes(dim: usize) -> usize {
    dim.div_ceil(I4_GROUP) * I4_BLOCK
}

/// `x` as little-endian f16, rounded to nearest even (as `half::f16::from_f32`), 8 values
/// at a time with F16C where the CPU has it.
pub fn encode_f16(x: &[f32], out: &mut [u8]) {
    assert!(out.len() >= 2 * x.len(), "encode_f16: output too short");
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX2 paths' baseline (F16C) is checked first; `out` holds 2 * x.len() bytes.
    let done = if Isa::Avx2.supported() { unsafe { encode_f16_f16c(x, out) } } else { 0 };
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    for (d, s) in out[2 * done..].chunks_exact_mut(2).zip(&x[done..]) {
        d.copy_from_slice(&half::f16::from_f32(*s).to_bits().to_le_bytes());
    }
}

/// Whole eights of `x` into `out`; returns how many values it wrote.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn encode_f16_f16c(x: &[f32], out: &mut [u8]) -> usize {
    use std::arch::x86_64::*;
    let n = x.len() / 8 * 8;
    for i in (0..n).step_by(8) {
        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(x.as_ptr().add(i)));
        _mm_storeu_si128(out.as_mut_ptr().add(2 * i).cast(), h);
    }
    n
}

/// Stores `x` as an int8 row (`out` is [`i8_row_bytes`] long).
pub fn encode_i8(x: &[f32], out: &mut [u8]) {
    let top = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    // The scale as stored (f16), so the values are rounded against what decoding multiplies.
    let d = f16::from_f32(top / 127.0);
    let inv = if d.to_f32() > 0.0 { 1.0 / d.to_f32() } else { 0.0 };
    out[..2].copy_from_slice(&d.to_bits().to_le_bytes());
    for (o, v) in out[2..].iter_mut().zip(x) {
        *o = (v * inv).round().clamp(-127.0, 127.0) as i8 as u8;
    }
}

/// Stores `x` as an int4 row. Each group's scale is the one of a few candidates (the group's
/// extreme at -8 and slightly smaller steps, which clip it) whose rounded values have the
/// least squared error.
pub fn encode_i4(x: &[f32], out: &mut [u8]) {
    for (part, block) in x.chunks(I4_GROUP).zip(out.chunks_exact_mut(I4_BLOCK)) {
        let mut g = [0.0f32; I4_GROUP];
        g[..part.len()].copy_from_slice(part);
        let extreme = g.iter().fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
        let level = |v: f32, inv: f32| ((v * inv + 8.5) as i32).clamp(0, 15);
        let error = |d: f32| {
            let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
            g.iter().map(|&v| (v - d * (level(v, inv) - 8) as f32).powi(2)).sum::<f32>()
        };
        let d = I4_STEPS
            .iter()
            .map(|k| f16::from_f32(extreme / -k))
            .min_by(|a, b| error(a.to_f32()).total_cmp(&error(b.to_f32())))
            .expect("candidates");
        let inv = if d.to_f32() != 0.0 { 1.0 / d.to_f32() } else { 0.0 };
        block[..2].copy_from_slice(&d.to_bits().to_le_bytes());
        for j in 0..I4_GROUP / 2 {
            let (a, b) = (level(g[j], inv), level(g[j + I4_GROUP / 2], inv));
            block[2 + j] = (a | (b << 4)) as u8;
        }
    }
}

/// The group's extreme divided by these is the candidate step: 8 keeps it exact (q4_0's
/// choice); larger divisors clip it to -8 steps and round the others more finely.
const I4_STEPS: [f32; 5] = [8.0, 8.5, 9.0, 9.5, 10.0];

/// The decoders of one ISA path.
#[derive(Clone, Copy)]
pub struct KvCodes {
    pub i8: DecodeFn,
    pub i4: DecodeFn,
}

impl KvCodes {
    /// The decoders of `isa` (SIMD on AVX2; the scalar reference elsewhere). Panics unless
    /// this CPU runs `isa`: the SIMD decoders rely on that check.
    pub fn of(isa: Isa) -> Self {
        assert!(isa.supported(), "{} kernels requested on this CPU", isa.name());
        #[cfg(target_arch = "x86_64")]
        if isa.has_avx2() {
            return Self { i8: avx2::decode_i8, i4: avx2::decode_i4 };
        }
        Self { i8: decode_i8, i4: decode_i4 }
    }

    pub fn selected() -> Self {
        Self::of(crate::isa::selected())
    }
}

fn scale(bytes: &[u8]) -> f32 {
    f16::from_bits(u16::from_le_bytes([bytes[0], bytes[1]])).to_f32()
}

fn decode_i8(row: &[u8], out: &mut [f32]) {
    let (d, n) = (scale(row), out.len());
    for (o, &q) in out.iter_mut().zip(&row[2..2 + n]) {
        *o = d * q as i8 as f32;
    }
}

fn decode_i4(row: &[u8], out: &mut [f32]) {
    let blocks = row[..i4_row_bytes(out.len())].chunks_exact(I4_BLOCK);
    for (o, block) in out.chunks_mut(I4_GROUP).zip(blocks) {
        let d = scale(block);
        let mut group = [0.0f32; I4_GROUP];
        let (lo, hi) = group.split_at_mut(I4_GROUP / 2);
        for ((l, h), &b) in lo.iter_mut().zip(hi).zip(&block[2..]) {
            *l = d * ((b & 15) as i32 - 8) as f32;
            *h = d * ((b >> 4) as i32 - 8) as f32;
        }
        o.copy_from_slice(&group[..o.len()]);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{i4_row_bytes, scale, I4_BLOCK, I4_GROUP};

    pub fn decode_i8(row: &[u8], out: &mut [f32]) {
        assert!(row.len() >= 2 + out.len(), "int8 KV row too short");
        // SAFETY: handed out only after `Isa::supported` (AVX2); the loads stay inside
        // `row`, the stores inside `out` (checked above).
        unsafe { i8_rows(row, out) }
    }

    pub fn decode_i4(row: &[u8], out: &mut [f32]) {
        assert!(row.len() >= i4_row_bytes(out.len()), "int4 KV row too short");
        let whole = out.len() / I4_GROUP * I4_GROUP;
        let (groups, tail) = out.split_at_mut(whole);
        // SAFETY: as above; `groups` is whole groups, each within `row` (checked above).
        unsafe { i4_rows(row, groups) };
        if !tail.is_empty() {
            super::decode_i4(&row[whole / I4_GROUP * I4_BLOCK..], tail);
        }
    }

    /// Eight int8 lanes (the low 8 bytes of `b`) times `d`, stored at `out`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn widen8(b: __m128i, d: __m256, out: *mut f32) {
        _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), d));
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn i8_rows(row: &[u8], out: &mut [f32]) {
        let n = out.len();
        let d = scale(row);
        let (q, o) = (row.as_ptr().add(2), out.as_mut_ptr());
        let vd = _mm256_set1_ps(d);
        let mut i = 0;
        while i + 8 <= n {
            widen8(_mm_loadl_epi64(q.add(i).cast()), vd, o.add(i));
            i += 8;
        }
        for j in i..n {
            *o.add(j) = d * *q.add(j).cast::<i8>() as f32;
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn i4_rows(row: &[u8], out: &mut [f32]) {
        let (mask, eight) = (_mm_set1_epi8(15), _mm_set1_epi8(8));
        for (g, o) in out.chunks_exact_mut(I4_GROUP).enumerate() {
            let block = row.as_ptr().add(g * I4_BLOCK);
            let vd = _mm256_set1_ps(scale(&row[g * I4_BLOCK..]));
            let b = _mm_loadu_si128(block.add(2).cast());
            let lo = _mm_sub_epi8(_mm_and_si128(b, mask), eight);
            let hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), mask), eight);
            let o = o.as_mut_ptr();
            widen8(lo, vd, o);
            widen8(_mm_srli_si128(lo, 8), vd, o.add(8));
            widen8(hi, vd, o.add(16));
            widen8(_mm_srli_si128(hi, 8), vd, o.add(24));
        }
    }
}

#[cfg(test)]
mod tests {
    use cellm_format::TensorFormat;

    use super::*;
    use crate::dot::PathKernels;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).max(1);
        (0..n)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                // A few large outliers, as real keys have.
                let v = (s as f32 / u32::MAX as f32) * 2.0 - 1.0;
                if i % 29 == 3 {
                    v * 12.0
                } else {
                    v
                }
            })
            .collect()
    }

    /// int4 rows are q4_0 blocks: ggml's q4_0 dequantization (the block reference in
    /// `dot::blocks`) reads them as the int4 decoders do, on every path; encoding keeps each
    /// value within half a step (or clips it to the end levels), and its chosen step gives no
    /// more squared error than q4_0's own (the extreme at -8).
    #[test]
    fn int4_rows_are_q4_0_blocks() {
        let reference = PathKernels::of(Isa::Scalar).row_kernels(TensorFormat::Q4_0).decode;
        for dim in [32, 64, 128, 256, 40, 16] {
            let x = values(dim, dim as u32);
            let mut row = vec![0u8; i4_row_bytes(dim)];
            encode_i4(&x, &mut row);
            // A partial last group reads as a whole one whose missing values are zero.
            let mut want = vec![0.0; dim.next_multiple_of(32)];
            reference(&row, &mut want);
            assert!(want[dim..].iter().all(|&v| v == 0.0), "padding decodes to zero");
            want.truncate(dim);
            for isa in Isa::available() {
                let mut got = vec![f32::NAN; dim];
                (KvCodes::of(isa).i4)(&row, &mut got);
                assert_eq!(got, want, "{isa:?} dim {dim}");
            }
            for (g, (xs, ws)) in x.chunks(32).zip(want.chunks(32)).enumerate() {
                let d = scale(&row[g * I4_BLOCK..]);
                for (a, b) in xs.iter().zip(ws) {
                    // Levels run from -8 to +7 steps (sign of d): a value past them clips.
                    let clipped = (a / d).clamp(-8.0, 7.0) * d;
                    let tol = (0.5 * d.abs()).max((a - clipped).abs()) * 1.001 + 1e-7;
                    assert!((a - b).abs() <= tol, "{a} vs {b} (step {d})");
                }
                // q4_0's step, rounded as in ggml's quantize_row_q4_0_ref.
                let extreme = xs.iter().fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
                let q4_0 = half::f16::from_f32(extreme / -8.0).to_f32();
                let sq = |d: f32| -> f32 {
                    xs.iter()
                        .map(|&v| {
                            let q = ((v / d + 8.5) as i32).clamp(0, 15);
                            (v - d * (q - 8) as f32).powi(2)
                        })
                        .sum()
                };
                let ours: f32 = xs.iter().zip(ws).map(|(a, b)| (a - b).powi(2)).sum();
                assert!(ours <= sq(q4_0) * 1.0001 + 1e-12, "{ours} vs q4_0's {}", sq(q4_0));
            }
        }
    }

    /// int8 rows decode to within half a step of the values on every path (the same bits as
    /// the scalar decoder), tails included, and an all-zero row stays zero.
    #[test]
    fn f16_rows_round_to_nearest_even() {
        let mut x = values(67, 5);
        x.extend([65504.0, 65520.0, 1e-8, -0.0, 2049.0, 2051.0, f32::INFINITY, 5.960_464_5e-8]);
        let mut got = vec![0u8; 2 * x.len()];
        encode_f16(&x, &mut got);
        let want: Vec<u8> =
            x.iter().flat_map(|v| half::f16::from_f32(*v).to_bits().to_le_bytes()).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn int8_rows_round_trip() {
        for dim in [1, 7, 64, 100, 256] {
            for x in [values(dim, 7 + dim as u32), vec![0.0; dim]] {
                let mut row = vec![0u8; i8_row_bytes(dim)];
                encode_i8(&x, &mut row);
                let step = scale(&row);
                let top = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                assert!((step * 127.0 - top).abs() <= top * 1e-3, "the scale covers max|x|");
                let mut want = vec![0.0; dim];
                decode_i8(&row, &mut want);
                for (a, b) in x.iter().zip(&want) {
                    assert!((a - b).abs() <= 0.5 * step * 1.001, "{a} vs {b} (step {step})");
                }
                for isa in Isa::available() {
                    let mut got = vec![f32::NAN; dim];
                    (KvCodes::of(isa).i8)(&row, &mut got);
                    assert_eq!(got, want, "{isa:?} dim {dim}");
                }
            }
        }
    }
}
