//! Block formats, decoded exactly as ggml defines GGUF's and as docs/format.md defines cellm's.
//! Row kernels decode one block at a time into a stack buffer, so weights stay in their file
//! layout (no load-time dequantize). These are the scalar reference; integer-dot SIMD paths
//! compare against them.

use cellm_format::TensorFormat;
use half::f16;

use super::kinds::RowKernels;

/// Largest block (the K-quants' 256 elements).
const MAX_BLOCK: usize = 256;

/// Decodes one block; the second argument is the row's header (i8_row's scale, else empty).
type DecodeBlock = fn(&[u8], &[u8], &mut [f32]);

fn half_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

fn q8_0(b: &[u8], _: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    for (y, &q) in y.iter_mut().zip(&b[2..34]) {
        *y = f32::from(q as i8) * d;
    }
}

fn q4_0(b: &[u8], _: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    for (j, &q) in b[2..18].iter().enumerate() {
        y[j] = (i32::from(q & 0xF) - 8) as f32 * d;
        y[j + 16] = (i32::from(q >> 4) - 8) as f32 * d;
    }
}

fn q4_1(b: &[u8], _: &[u8], y: &mut [f32]) {
    let (d, m) = (half_at(b, 0), half_at(b, 2));
    for (j, &q) in b[4..20].iter().enumerate() {
        y[j] = f32::from(q & 0xF) * d + m;
        y[j + 16] = f32::from(q >> 4) * d + m;
    }
}

fn q5_0(b: &[u8], _: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for (j, &q) in b[6..22].iter().enumerate() {
        let hi0 = ((qh >> j) << 4) & 0x10;
        let hi1 = (qh >> (j + 12)) & 0x10;
        y[j] = ((u32::from(q & 0xF) | hi0) as i32 - 16) as f32 * d;
        y[j + 16] = ((u32::from(q >> 4) | hi1) as i32 - 16) as f32 * d;
    }
}

/// The 6-bit scale and min of sub-block `j` in a K-quant's 12 packed scale bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (f32, f32) {
    let (sc, m) = if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    };
    (f32::from(sc), f32::from(m))
}

fn q4_k(b: &[u8], _: &[u8], y: &mut [f32]) {
    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    for chunk in 0..4 {
        let (s1, m1) = scale_min_k4(2 * chunk, scales);
        let (s2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let q = &qs[32 * chunk..32 * chunk + 32];
        let out = &mut y[64 * chunk..64 * chunk + 64];
        for l in 0..32 {
            out[l] = d * s1 * f32::from(q[l] & 0xF) - dmin * m1;
            out[l + 32] = d * s2 * f32::from(q[l] >> 4) - dmin * m2;
        }
    }
}

fn q5_k(b: &[u8], _: &[u8], y: &mut [f32]) {
    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    for chunk in 0..4 {
        let (s1, m1) = scale_min_k4(2 * chunk, scales);
        let (s2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (u1, u2) = (1u8 << (2 * chunk), 2u8 << (2 * chunk));
        let q = &qs[32 * chunk..32 * chunk + 32];
        let out = &mut y[64 * chunk..64 * chunk + 64];
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16.0 } else { 0.0 };
            let h2 = if qh[l] & u2 != 0 { 16.0 } else { 0.0 };
            out[l] = d * s1 * (f32::from(q[l] & 0xF) + h1) - dmin * m1;
            out[l + 32] = d * s2 * (f32::from(q[l] >> 4) + h2) - dmin * m2;
        }
    }
}

fn q6_k(b: &[u8], _: &[u8], y: &mut [f32]) {
    let d = half_at(b, 208);
    for half in 0..2 {
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..128 + 32 * half + 32];
        let sc = &b[192 + 8 * half..192 + 8 * half + 8];
        let out = &mut y[128 * half..128 * half + 128];
        for l in 0..32 {
            let is = l / 16;
            let q = [
                (ql[l] & 0xF) | ((qh[l] & 3) << 4),
                (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4),
                (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
            ];
            for (k, &qk) in q.iter().enumerate() {
                let scale = f32::from(sc[is + 2 * k] as i8);
                out[l + 32 * k] = d * scale * (i32::from(qk) - 32) as f32;
            }
        }
    }
}

fn q1_0(b: &[u8], _: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    for (j, y) in y.iter_mut().enumerate() {
        *y = if (b[2 + j / 8] >> (j % 8)) & 1 == 1 { d } else { -d };
    }
}

fn i8_row(b: &[u8], header: &[u8], y: &mut [f32]) {
    let s = f32::from_le_bytes([header[0], header[1], header[2], header[3]]);
    for (y, &q) in y.iter_mut().zip(b) {
        *y = f32::from(q as i8) * s;
    }
}

/// A cellm int4 group: `d` (and `m` when affine) as f16, then 32-value sub-blocks of 16 bytes,
/// low nibbles first.
fn int4_group(b: &[u8], y: &mut [f32], affine: bool) {
    let (d, m, head) =
        if affine { (half_at(b, 0), half_at(b, 2), 4) } else { (half_at(b, 0), 0.0, 2) };
    let offset = if affine { 0 } else { -8 };
    for (sub, out) in b[head..].chunks_exact(16).zip(y.chunks_exact_mut(32)) {
        for (j, &q) in sub.iter().enumerate() {
            out[j] = (i32::from(q & 0xF) + offset) as f32 * d + m;
            out[j + 16] = (i32::from(q >> 4) + offset) as f32 * d + m;
        }
    }
}

fn i4_sym(b: &[u8], _: &[u8], y: &mut [f32]) {
    int4_group(b, y, false);
}

fn i4_affine(b: &[u8], _: &[u8], y: &mut [f32]) {
    int4_group(b, y, true);
}

/// Value `i` (0..32) of a cellm int2 / int3 sub-block (`docs/format.md`).
pub(super) fn low_bit_value(sub: &[u8], i: usize, three: bool) -> u8 {
    let low = (sub[i % 8] >> (2 * (i / 8))) & 3;
    if three {
        low | (((sub[8 + i / 8] >> (i % 8)) & 1) << 2)
    } else {
        low
    }
}

/// A cellm int2 / int3 affine group: `d`, `m` as f16, then its 32-value sub-blocks.
fn low_bit_group(b: &[u8], y: &mut [f32], three: bool) {
    let (d, m) = (half_at(b, 0), half_at(b, 2));
    let sub_bytes = if three { 12 } else { 8 };
    for (sub, out) in b[4..].chunks_exact(sub_bytes).zip(y.chunks_exact_mut(32)) {
        for (i, y) in out.iter_mut().enumerate() {
            *y = f32::from(low_bit_value(sub, i, three)) * d + m;
        }
    }
}

fn i2_affine(b: &[u8], _: &[u8], y: &mut [f32]) {
    low_bit_group(b, y, false);
}

fn i3_affine(b: &[u8], _: &[u8], y: &mut [f32]) {
    low_bit_group(b, y, true);
}

fn block_decoder(format: TensorFormat) -> Option<DecodeBlock> {
    Some(match format {
        TensorFormat::Q8_0 => q8_0,
        TensorFormat::Q4_0 => q4_0,
        TensorFormat::Q4_1 => q4_1,
        TensorFormat::Q5_0 => q5_0,
        TensorFormat::Q4K => q4_k,
        TensorFormat::Q5K => q5_k,
        TensorFormat::Q6K => q6_k,
        TensorFormat::Q1_0 => q1_0,
        TensorFormat::I8Row => i8_row,
        TensorFormat::I4G64 | TensorFormat::I4G128 => i4_sym,
        TensorFormat::I4AG64 | TensorFormat::I4AG128 => i4_affine,
        TensorFormat::I2AG64 | TensorFormat::I2AG128 => i2_affine,
        TensorFormat::I3AG64 | TensorFormat::I3AG128 => i3_affine,
        TensorFormat::F32
        | TensorFormat::F16
        | TensorFormat::BF16
        | TensorFormat::Q8_0X8
        | TensorFormat::Q4_0X8
        | TensorFormat::Q4_1X8
        | TensorFormat::Q5_0X8
        | TensorFormat::Q4KX8
        | TensorFormat::Q6KX8 => return None,
    })
}

/// Walks a row block by block, handing each decoded block and its element offset to `f`.
#[inline(always)]
fn for_each_block(format: TensorFormat, row: &[u8], mut f: impl FnMut(usize, &[f32])) {
    let decode = block_decoder(format).expect("block format");
    let (n, bytes) = (format.block_len(), format.block_bytes());
    let mut buf = [0.0f32; MAX_BLOCK];
    let (header, blocks) = row.split_at(format.row_header());
    for (i, block) in blocks.chunks_exact(bytes).enumerate() {
        decode(block, header, &mut buf[..n]);
        f(i * n, &buf[..n]);
    }
}

macro_rules! block_kernels {
    ($($name:ident => $format:path),* $(,)?) => {
        $(
            mod $name {
                use super::*;
                pub fn dot(row: &[u8], x: &[f32]) -> f32 {
                    let mut sum = 0.0;
                    for_each_block($format, row, |at, w| {
                        sum += w.iter().zip(&x[at..at + w.len()]).map(|(a, b)| a * b).sum::<f32>();
                    });
                    sum
                }
                pub fn decode(row: &[u8], out: &mut [f32]) {
                    for_each_block($format, row, |at, w| out[at..at + w.len()].copy_from_slice(w));
                }
                pub fn axpy(a: f32, row: &[u8], acc: &mut [f32]) {
                    for_each_block($format, row, |at, w| {
                        acc[at..at + w.len()].iter_mut().zip(w).for_each(|(o, v)| *o += a * v);
                    });
                }
            }
        )*
        /// The scalar kernel table of a block format, or None for plain float formats.
        pub fn kernels(format: TensorFormat) -> Option<RowKernels> {
            match format {
                $($format => Some(RowKernels { dot: $name::dot, decode: $name::decode, axpy: $name::axpy, qdot: None }),)*
                _ => None,
            }
        }
    };
}

block_kernels! {
    k_q8_0 => TensorFormat::Q8_0,
    k_q4_0 => TensorFormat::Q4_0,
    k_q4_1 => TensorFormat::Q4_1,
    k_q5_0 => TensorFormat::Q5_0,
    k_q4_k => TensorFormat::Q4K,
    k_q5_k => TensorFormat::Q5K,
    k_q6_k => TensorFormat::Q6K,
    k_q1_0 => TensorFormat::Q1_0,
    k_i8_row => TensorFormat::I8Row,
    k_i4_g64 => TensorFormat::I4G64,
    k_i4_g128 => TensorFormat::I4G128,
    k_i4a_g64 => TensorFormat::I4AG64,
    k_i4a_g128 => TensorFormat::I4AG128,
    k_i2a_g64 => TensorFormat::I2AG64,
    k_i2a_g128 => TensorFormat::I2AG128,
    k_i3a_g64 => TensorFormat::I3AG64,
    k_i3a_g128 => TensorFormat::I3AG128,
}

#[cfg(test)]
mod tests {
    use super::super::kinds::{QDot4Fn, QDotFn};
    use super::super::{noise, paths, PathKernels};
    use super::*;
    use crate::Isa;

    /// The scalar integer kernel of a block format: the reference for every path's.
    fn scalar_qdot(format: TensorFormat) -> QDotFn {
        PathKernels::of(Isa::Scalar).row_kernels(format).qdot.unwrap().0
    }

    /// Every path's integer kernels of a block format (see `paths::to_test`).
    fn integer_kernels_to_test(format: TensorFormat) -> Vec<(&'static str, (QDotFn, QDot4Fn))> {
        paths::to_test(|k| k.row_kernels(format).qdot.unwrap())
    }

    /// Random blocks with finite scales (f16 d and dmin set to small normal values, i8_row's
    /// f32 row scale too).
    fn random_row(format: TensorFormat, blocks: usize, seed: u64) -> Vec<u8> {
        let header = format.row_header();
        let mut row = noise(header + blocks * format.block_bytes(), seed);
        if header > 0 {
            row[..4].copy_from_slice(&0.0123f32.to_le_bytes());
        }
        let scale_at: &[usize] = match format {
            TensorFormat::Q6K => &[208],
            TensorFormat::Q4_1
            | TensorFormat::Q4K
            | TensorFormat::Q5K
            | TensorFormat::I4AG64
            | TensorFormat::I4AG128
            | TensorFormat::I2AG64
            | TensorFormat::I2AG128
            | TensorFormat::I3AG64
            | TensorFormat::I3AG128 => &[0, 2],
            TensorFormat::I8Row => &[],
            _ => &[0],
        };
        for (b, block) in row[header..].chunks_exact_mut(format.block_bytes()).enumerate() {
            for &at in scale_at {
                let v = f16::from_f32(0.01 + 0.001 * (b + at) as f32).to_bits().to_le_bytes();
                block[at..at + 2].copy_from_slice(&v);
            }
        }
        row
    }

    /// Rows whose scale fields hold `bits` (an f16; i8_row's f32 header gets its value).
    fn row_with_scales(format: TensorFormat, blocks: usize, bits: u16, seed: u64) -> Vec<u8> {
        let mut row = random_row(format, blocks, seed);
        let header = format.row_header();
        if header > 0 {
            row[..4].copy_from_slice(&f16::from_bits(bits).to_f32().to_le_bytes());
        }
        let at: &[usize] = match format {
            TensorFormat::Q6K => &[208],
            TensorFormat::I8Row => &[],
            TensorFormat::Q4_1
            | TensorFormat::Q4K
            | TensorFormat::Q5K
            | TensorFormat::I4AG64
            | TensorFormat::I4AG128
            | TensorFormat::I2AG64
            | TensorFormat::I2AG128
            | TensorFormat::I3AG64
            | TensorFormat::I3AG128 => &[0, 2],
            _ => &[0],
        };
        for block in row[header..].chunks_exact_mut(format.block_bytes()) {
            for &i in at {
                block[i..i + 2].copy_from_slice(&bits.to_le_bytes());
            }
        }
        row
    }

    /// Zero blocks, the largest f16 scale and the smallest subnormal one: every ISA's integer
    /// kernel still equals the scalar reference (relative to the row's magnitude).
    #[test]
    fn adversarial_blocks_match_scalar() {
        use crate::acts::{ActScheme, Q8Acts};
        for format in TensorFormat::BLOCKS {
            let n = 2 * format.block_len().max(256);
            let blocks = n / format.block_len();
            let zero = vec![0u8; format.nbytes(&[1, n]).unwrap()];
            let rows = [
                zero,
                row_with_scales(format, blocks, 0x7BFF, 11), // 65504
                row_with_scales(format, blocks, 0x0001, 12), // 2^-24
            ];
            let x: Vec<f32> = (0..n).map(|i| (((i * 7919) % 251) as f32 - 125.0) / 7.0).collect();
            let acts = Q8Acts::quantize(&x, n, ActScheme::for_format(format));
            for row in &rows {
                let mut w = vec![0.0; n];
                (kernels(format).unwrap().decode)(row, &mut w);
                let mag: f32 = w.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
                let scalar = scalar_qdot(format);
                let want = scalar(row, acts.row(0));
                assert!(want.is_finite(), "{format:?}");
                for (path, (one, _)) in integer_kernels_to_test(format) {
                    let got = one(row, acts.row(0));
                    assert!(
                        (got - want).abs() <= 1e-5 * mag + f32::MIN_POSITIVE,
                        "{format:?} {path}: {got} vs {want}"
                    );
                }
            }
        }
    }

    /// dot and axpy agree with the decoded row, block for block.
    #[test]
    fn dot_and_axpy_agree_with_decode() {
        for format in TensorFormat::BLOCKS {
            let k = kernels(format).unwrap();
            let row = random_row(format, 3, format.block_bytes() as u64);
            let n = 3 * format.block_len();
            let x: Vec<f32> = (0..n).map(|i| ((i * 37) % 11) as f32 - 5.0).collect();
            let mut w = vec![0.0; n];
            (k.decode)(&row, &mut w);
            let want: f32 = w.iter().zip(&x).map(|(a, b)| a * b).sum();
            let got = (k.dot)(&row, &x);
            assert!((want - got).abs() <= 1e-4 * want.abs().max(1.0), "{format:?}: {want} {got}");
            let mut acc = x.clone();
            (k.axpy)(2.0, &row, &mut acc);
            assert!(acc.iter().zip(&x).zip(&w).all(|((a, x), w)| (a - (x + 2.0 * w)).abs() < 1e-4));
        }
    }

    /// Every ISA's integer kernel equals the scalar integer reference, and that reference
    /// equals the float dot of the decoded row with the dequantized activations.
    #[test]
    fn integer_kernels_match_references() {
        use crate::acts::Q8Acts;
        for format in TensorFormat::BLOCKS {
            let n = 2 * format.block_len().max(256);
            let row = random_row(format, n / format.block_len(), 7 + format.block_bytes() as u64);
            let x: Vec<f32> = (0..n).map(|i| (((i * 7919) % 251) as f32 - 125.0) / 31.0).collect();
            let acts = Q8Acts::quantize(&x, n, crate::acts::ActScheme::for_format(format));
            let xq: Vec<f32> = acts
                .qs
                .iter()
                .enumerate()
                .map(|(i, &q)| f32::from(q) * acts.ds[i / 32][0])
                .collect();
            let mut w = vec![0.0; n];
            (kernels(format).unwrap().decode)(&row, &mut w);
            let float_ref: f32 = w.iter().zip(&xq).map(|(a, b)| a * b).sum();
            let mag: f32 = w.iter().zip(&xq).map(|(a, b)| (a * b).abs()).sum();
            let scheme = crate::acts::ActScheme::for_format(format);
            let scalar = scalar_qdot(format)(&row, acts.row(0));
            assert!(
                (scalar - float_ref).abs() <= 1e-5 * mag,
                "{format:?}: {scalar} vs {float_ref}"
            );
            // Four activation rows (the same values scaled) for the four-row kernels.
            let scaled: Vec<Q8Acts> = (1..=4)
                .map(|k| {
                    Q8Acts::quantize(
                        &x.iter().map(|v| v * k as f32 * 0.7).collect::<Vec<_>>(),
                        n,
                        scheme,
                    )
                })
                .collect();
            let rows = [scaled[0].row(0), scaled[1].row(0), scaled[2].row(0), scaled[3].row(0)];
            for (path, (one, four)) in integer_kernels_to_test(format) {
                let got = one(&row, acts.row(0));
                assert!((got - scalar).abs() <= 1e-5 * mag, "{format:?} {path}: {got} vs {scalar}");
                let many = four(&row, &rows);
                // Bitwise: a token's product must not depend on the tokens beside it (a
                // session decoded in a batch gets what it gets alone).
                for (t, r) in rows.iter().enumerate() {
                    let single = one(&row, *r);
                    assert!(
                        many[t] == single,
                        "{format:?} {path} row {t}: {} vs {single}",
                        many[t]
                    );
                }
            }
        }
    }
}
