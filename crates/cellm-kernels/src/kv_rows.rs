//! Compressed KV cache rows: one kv head of one position, stored in fewer bytes than f16.
//!
//! - int8: an f16 scale `d`, then `dim` int8 values (`x = d * q`, `d = max|x| / 127`):
//!   `dim + 2` bytes, 0.52x of f16 at 64 dimensions.
//! - int4: groups of 16 values, each a scale byte `b` then 8 bytes whose low nibbles are
//!   values 0-7 and high nibbles 8-15. A nibble `q` stands for `d * I4_LEVELS[q]`, with
//!   `d = 2^((b - 160) / 8)` (`b = 0`: the group is zero) and `I4_LEVELS` the 16 Lloyd-Max
//!   levels of a unit Gaussian times 46.5 (rounded to integers, the outermost at +-127):
//!   after the cache's rotation a row's values are close to Gaussian, and these levels give
//!   them about 30% less squared error than 16 evenly spaced ones at the same 4.5 bits a
//!   value (9 bytes per 16, 0.28x of f16). A last partial group is stored as a whole one,
//!   its missing values zero.
//!
//! The cache rotates rows before they get here (`cellm-kv`), which spreads a head's outlier
//! dimensions over all of them, so one scale fits the row (int8) or each group (int4); 4-bit
//! keys are first taken relative to a per-page header there (`KeyHeader`).
//!
//! Attention widens a page's rows of one kv head to f32 (in L1, per page) with [`KvCodes`]'
//! decoders, then runs the float kernels on them: nothing wider than these bytes is kept.

use half::f16;

use crate::dot::kinds::DecodeFn;
use crate::isa::Isa;

/// Values per int4 group.
pub const I4_GROUP: usize = 16;
const I4_BLOCK: usize = 1 + I4_GROUP / 2;

/// The int4 levels: the Lloyd-Max quantizer of a unit Gaussian with 16 levels (+-0.1284,
/// 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326), times 127 / 2.7326, rounded.
pub const I4_LEVELS: [i8; 16] =
    [-127, -96, -75, -58, -44, -31, -18, -6, 6, 18, 31, 44, 58, 75, 96, 127];

/// The scale byte's zero point: `d = 2^((b - I4_BIAS) / 8)`, so codes 1-255 span steps of
/// 2^-19.9 to 2^11.9 (values of magnitude 2e-4 to 5e5 at the outermost level).
const I4_BIAS: i32 = 160;

/// The step of scale byte `b` (0 for 0): `2^((b - I4_BIAS) / 8)` as a power of two times
/// an eighth-octave mantissa, the same bits on every path (a table: the decoders look one
/// up per 16 values).
#[inline]
fn i4_step(b: u8) -> f32 {
    I4_STEPS[b as usize]
}

/// [`i4_step`] for every byte, computed at compile time.
const I4_STEPS: [f32; 256] = {
    /// `2^(r / 8)` for r = 0..8, rounded to f32.
    const MANT: [f32; 8] = [
        1.0,
        1.090_507_7,
        1.189_207_1,
        1.296_839_6,
        std::f32::consts::SQRT_2,
        1.542_210_8,
        1.681_792_8,
        1.834_008_1,
    ];
    let mut steps = [0.0f32; 256];
    let mut b = 1;
    while b < 256 {
        let e = b as i32 - I4_BIAS;
        let (whole, frac) = (e.div_euclid(8), e.rem_euclid(8));
        steps[b] = MANT[frac as usize] * f32::from_bits(((whole + 127) as u32) << 23);
        b += 1;
    }
    steps
};

/// Bytes before an int8 row's values: its f16 scale.
pub const I8_SCALE_BYTES: usize = 2;

/// Bytes of an int8 row of `dim` values.
pub fn i8_row_bytes(dim: usize) -> usize {
    I8_SCALE_BYTES + dim
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

/// Stores `x` as an int4 row. Each group's scale byte is the one, of seven eighth-octave
/// steps around `rms / 55` (where the best one of a Gaussian group of 16 usually lies) and
/// the two smallest that reach its extreme, whose rounded values have the least squared
/// error.
pub fn encode_i4(x: &[f32], out: &mut [u8]) {
    for (part, block) in x.chunks(I4_GROUP).zip(out.chunks_exact_mut(I4_BLOCK)) {
        let mut g = [0.0f32; I4_GROUP];
        g[..part.len()].copy_from_slice(part);
        let (b, codes) = i4_group(&g);
        block[0] = b;
        for j in 0..I4_GROUP / 2 {
            block[1 + j] = codes[j] | (codes[j + I4_GROUP / 2] << 4);
        }
    }
}

/// The scale byte and the level indices of one group.
fn i4_group(g: &[f32; I4_GROUP]) -> (u8, [u8; I4_GROUP]) {
    let sq: f32 = g.iter().map(|v| v * v).sum();
    if !(sq > 0.0 && sq.is_finite()) {
        return (0, [0; I4_GROUP]);
    }
    let rms = (sq / I4_GROUP as f32).sqrt();
    let centre = ((rms / 55.0).log2() * 8.0).round() as i32 + I4_BIAS;
    // And the two smallest steps that reach the group's extreme (groups far from Gaussian,
    // with a few values much larger than the rest, need one of these).
    let top = g.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let reach = ((top / 127.0).log2() * 8.0).ceil() as i32 + I4_BIAS;
    let mut best = (f32::INFINITY, 0u8, [0u8; I4_GROUP]);
    let candidates = (centre - 3..=centre + 3).chain([reach - 1, reach]);
    for b in candidates.map(|b| b.clamp(1, 255) as u8) {
        let d = i4_step(b);
        let inv = 1.0 / d;
        let mut codes = [0u8; I4_GROUP];
        let mut err = 0.0f32;
        for (c, &v) in codes.iter_mut().zip(g) {
            let q = nearest_level(v * inv);
            *c = q;
            let e = v - d * I4_LEVELS[q as usize] as f32;
            err += e * e;
        }
        if err < best.0 {
            best = (err, b, codes);
        }
    }
    (best.1, best.2)
}

/// The index of the level nearest `y` (in level units; a tie goes up). The midpoints
/// between levels are multiples of a half, so `floor(2y)` decides: a table of its values.
#[inline]
fn nearest_level(y: f32) -> u8 {
    const NEAREST: [u8; 512] = {
        let mut t = [0u8; 512];
        let mut i = 0;
        while i < 512 {
            // floor(2y) = i - 256: the levels whose midpoint (x2) with the next is <= it.
            let mut q = 0;
            while q < 15 && (I4_LEVELS[q] as i32 + I4_LEVELS[q + 1] as i32) <= i as i32 - 256 {
                q += 1;
            }
            t[i] = q as u8;
            i += 1;
        }
        t
    };
    let at = ((2.0 * y).floor().clamp(-256.0, 255.0) as i32 + 256) as usize;
    NEAREST[at]
}

/// Bytes of a q4_0 row of `dim` values (groups of 32: an f16 scale, then 16 bytes whose low
/// nibbles are values 0-15 and high nibbles 16-31, `x = d * (q - 8)`; a last partial group
/// is stored whole, its missing values zero). The int4 cache keeps its key headers'
/// reference keys so: they are not rotated, and evenly spaced levels with a zero keep the
/// small channels that share a group with a large one (Qwen2.5's k bias) near their value,
/// where the Gaussian levels of int4 rows would move them by their smallest level.
pub fn q4_0_row_bytes(dim: usize) -> usize {
    dim.div_ceil(32) * 18
}

/// Stores `x` as a q4_0 row. Each group's scale is the one of a few candidates (the group's
/// extreme at -8 and slightly smaller steps, which clip it) whose rounded values have the
/// least squared error.
pub fn encode_q4_0(x: &[f32], out: &mut [u8]) {
    for (part, block) in x.chunks(32).zip(out.chunks_exact_mut(18)) {
        let mut g = [0.0f32; 32];
        g[..part.len()].copy_from_slice(part);
        let extreme = g.iter().fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
        let level = |v: f32, inv: f32| ((v * inv + 8.5) as i32).clamp(0, 15);
        let error = |d: f32| {
            let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
            g.iter().map(|&v| (v - d * (level(v, inv) - 8) as f32).powi(2)).sum::<f32>()
        };
        let d = [8.0f32, 8.5, 9.0, 9.5, 10.0]
            .iter()
            .map(|k| f16::from_f32(extreme / -k))
            .min_by(|a, b| error(a.to_f32()).total_cmp(&error(b.to_f32())))
            .expect("candidates");
        let inv = if d.to_f32() != 0.0 { 1.0 / d.to_f32() } else { 0.0 };
        block[..2].copy_from_slice(&d.to_bits().to_le_bytes());
        for j in 0..16 {
            let (a, b) = (level(g[j], inv), level(g[j + 16], inv));
            block[2 + j] = (a | (b << 4)) as u8;
        }
    }
}

/// Reads a q4_0 row back (scalar: the cache reads one a page and kv head).
pub fn decode_q4_0(row: &[u8], out: &mut [f32]) {
    let blocks = row[..q4_0_row_bytes(out.len())].chunks_exact(18);
    for (o, block) in out.chunks_mut(32).zip(blocks) {
        let d = scale(block);
        let mut group = [0.0f32; 32];
        let (lo, hi) = group.split_at_mut(16);
        for ((l, h), &b) in lo.iter_mut().zip(hi).zip(&block[2..]) {
            *l = d * ((b & 15) as i32 - 8) as f32;
            *h = d * ((b >> 4) as i32 - 8) as f32;
        }
        o.copy_from_slice(&group[..o.len()]);
    }
}

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
        let d = i4_step(block[0]);
        let mut group = [0.0f32; I4_GROUP];
        let (lo, hi) = group.split_at_mut(I4_GROUP / 2);
        for ((l, h), &b) in lo.iter_mut().zip(hi).zip(&block[1..]) {
            *l = d * I4_LEVELS[(b & 15) as usize] as f32;
            *h = d * I4_LEVELS[(b >> 4) as usize] as f32;
        }
        o.copy_from_slice(&group[..o.len()]);
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use avx2::scale_f16c;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{i4_row_bytes, i4_step, I4_BLOCK, I4_GROUP, I4_LEVELS};

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

    /// The row's f16 scale through F16C (the same bits as `scale`, without `half`'s
    /// run-time dispatch: a call per row was 7% of an int8 attention step).
    #[inline(always)]
    pub(crate) unsafe fn scale_f16c(row: &[u8]) -> f32 {
        let bits = u16::from_le_bytes([row[0], row[1]]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn i8_rows(row: &[u8], out: &mut [f32]) {
        let n = out.len();
        let d = scale_f16c(row);
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
        let mask = _mm_set1_epi8(15);
        let levels = _mm_loadu_si128(I4_LEVELS.as_ptr().cast());
        for (g, o) in out.chunks_exact_mut(I4_GROUP).enumerate() {
            let block = row.as_ptr().add(g * I4_BLOCK);
            let vd = _mm256_set1_ps(i4_step(*block));
            let b = _mm_loadl_epi64(block.add(1).cast());
            // Values 0-7 (low nibbles) then 8-15 (high nibbles), as level indices.
            let idx = _mm_unpacklo_epi64(
                _mm_and_si128(b, mask),
                _mm_and_si128(_mm_srli_epi16(b, 4), mask),
            );
            let v = _mm_shuffle_epi8(levels, idx);
            let o = o.as_mut_ptr();
            widen8(v, vd, o);
            widen8(_mm_srli_si128(v, 8), vd, o.add(8));
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

    /// The step table is `2^((b - 160) / 8)` to within an f32 rounding, and 0 for byte 0.
    #[test]
    fn int4_steps_are_eighth_octaves() {
        assert_eq!(i4_step(0), 0.0);
        for b in 1..=255u8 {
            let want = 2f64.powf((f64::from(b) - 160.0) / 8.0);
            let got = f64::from(i4_step(b));
            assert!((got - want).abs() <= want * 1.2e-7, "byte {b}: {got} vs {want}");
        }
    }

    /// int4 rows decode to the same bits on every path (partial last groups too); each value lands on the level nearest it under its group's
    /// step (or the outermost, past them); and on Gaussian rows (what the rotation gives the
    /// cache) the squared error is at least 20% under that of q4_0's evenly spaced levels
    /// with the group's extreme at -8 (measured: 0.0049 against 0.0069 per unit variance).
    #[test]
    fn int4_rows_round_to_the_nearest_level() {
        for dim in [32, 64, 128, 256, 40, 16, 8] {
            for x in [values(dim, dim as u32), vec![0.0; dim]] {
                let mut row = vec![0u8; i4_row_bytes(dim)];
                encode_i4(&x, &mut row);
                let mut want = vec![0.0; dim];
                decode_i4(&row, &mut want);
                for isa in Isa::available() {
                    let mut got = vec![f32::NAN; dim];
                    (KvCodes::of(isa).i4)(&row, &mut got);
                    assert_eq!(got, want, "{isa:?} dim {dim}");
                }
                for (g, (xs, ws)) in x.chunks(I4_GROUP).zip(want.chunks(I4_GROUP)).enumerate() {
                    let d = i4_step(row[g * I4_BLOCK]);
                    for (a, b) in xs.iter().zip(ws) {
                        let best = I4_LEVELS
                            .iter()
                            .map(|&l| (a - d * l as f32).abs())
                            .fold(f32::INFINITY, f32::min);
                        assert!((a - b).abs() <= best * 1.0001 + 1e-6, "{a} vs {b} (step {d})");
                    }
                }
            }
        }
        // Gaussian rows (Box-Muller over a xorshift), 64 values each.
        let mut s = 12345u32;
        let mut uniform = || {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s as f32 + 1.0) / (u32::MAX as f32 + 2.0)
        };
        let x: Vec<f32> = (0..64 * 512)
            .map(|_| {
                let (u, v) = (uniform(), uniform());
                (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
            })
            .collect();
        let (mut ours, mut q4_0) = (0.0f64, 0.0f64);
        for row in x.chunks(64) {
            let mut bytes = vec![0u8; i4_row_bytes(64)];
            encode_i4(row, &mut bytes);
            let mut back = vec![0.0; 64];
            decode_i4(&bytes, &mut back);
            ours += row.iter().zip(&back).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>();
            for g in row.chunks(32) {
                let extreme = g.iter().fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
                let d = extreme / -8.0;
                q4_0 += g
                    .iter()
                    .map(|&v| {
                        let q = ((v / d + 8.5).floor()).clamp(0.0, 15.0);
                        ((v - d * (q - 8.0)) as f64).powi(2)
                    })
                    .sum::<f64>();
            }
        }
        let n = x.len() as f64;
        assert!(ours / n < 0.8 * q4_0 / n, "{} vs q4_0's {}", ours / n, q4_0 / n);
        assert!(ours / n < 0.0052, "{}", ours / n);
    }

    /// The key headers' q4_0 rows are ggml's q4_0 blocks: its dequantization (the block
    /// reference in `dot::blocks`) reads them as `decode_q4_0` does, partial groups included.
    #[test]
    fn q4_0_rows_are_q4_0_blocks() {
        let reference = PathKernels::of(Isa::Scalar).row_kernels(TensorFormat::Q4_0).decode;
        for dim in [32, 64, 256, 40, 16] {
            let x = values(dim, dim as u32);
            let mut row = vec![0u8; q4_0_row_bytes(dim)];
            encode_q4_0(&x, &mut row);
            let mut want = vec![0.0; dim.next_multiple_of(32)];
            reference(&row, &mut want);
            assert!(want[dim..].iter().all(|&v| v == 0.0), "padding decodes to zero");
            let mut got = vec![f32::NAN; dim];
            decode_q4_0(&row, &mut got);
            assert_eq!(got, want[..dim], "dim {dim}");
            for (g, (xs, ws)) in x.chunks(32).zip(got.chunks(32)).enumerate() {
                let d = scale(&row[g * 18..]);
                for (a, b) in xs.iter().zip(ws) {
                    let clipped = (a / d).clamp(-8.0, 7.0) * d;
                    let tol = (0.5 * d.abs()).max((a - clipped).abs()) * 1.001 + 1e-7;
                    assert!((a - b).abs() <= tol, "{a} vs {b} (step {d})");
                }
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
