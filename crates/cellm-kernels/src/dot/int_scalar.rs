//! Scalar reference of the integer kernels: weight blocks times int8 activation blocks, with
//! integer sums per block and one float multiply-add per (sub-)block, as the SIMD paths do.

use cellm_format::TensorFormat;

use super::blocks::low_bit_value;
use super::kinds::{QDot4Fn, QDotFn};
use crate::acts::Q8Row;

fn half(b: &[u8], i: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

fn idot(w: impl Iterator<Item = i32>, x: &[i8]) -> i32 {
    w.zip(x).map(|(a, &b)| a * i32::from(b)).sum()
}

/// Unpacks a 32-element nibble block in ggml order: low nibbles first, then high nibbles.
fn nibbles(qs: &[u8]) -> impl Iterator<Item = i32> + '_ {
    qs.iter().map(|q| i32::from(q & 0xF)).chain(qs.iter().map(|q| i32::from(q >> 4)))
}

pub fn q8_0(row: &[u8], x: Q8Row) -> f32 {
    let mut sum = 0.0;
    for (b, blk) in row.chunks_exact(34).enumerate() {
        let s = idot(blk[2..].iter().map(|&q| i32::from(q as i8)), &x.qs[32 * b..32 * b + 32]);
        sum += half(blk, 0) * x.ds[b][0] * s as f32;
    }
    sum
}

pub fn q4_0(row: &[u8], x: Q8Row) -> f32 {
    let mut sum = 0.0;
    for (b, blk) in row.chunks_exact(18).enumerate() {
        let s = idot(nibbles(&blk[2..18]).map(|q| q - 8), &x.qs[32 * b..32 * b + 32]);
        sum += half(blk, 0) * x.ds[b][0] * s as f32;
    }
    sum
}

pub fn q4_1(row: &[u8], x: Q8Row) -> f32 {
    let mut sum = 0.0;
    for (b, blk) in row.chunks_exact(20).enumerate() {
        let s = idot(nibbles(&blk[4..20]), &x.qs[32 * b..32 * b + 32]);
        sum += half(blk, 0) * x.ds[b][0] * s as f32 + half(blk, 2) * x.ds[b][1];
    }
    sum
}

pub fn q5_0(row: &[u8], x: Q8Row) -> f32 {
    let mut sum = 0.0;
    for (b, blk) in row.chunks_exact(22).enumerate() {
        let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
        let q = nibbles(&blk[6..22]).enumerate().map(|(j, q)| q | (((qh >> j) & 1) << 4) as i32);
        let s = idot(q.map(|q| q - 16), &x.qs[32 * b..32 * b + 32]);
        sum += half(blk, 0) * x.ds[b][0] * s as f32;
    }
    sum
}

/// The 6-bit scale and min of sub-block `j` of a q4_k/q5_k block.
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// q4_k and q5_k: 8 sub-blocks of 32 with 6-bit scales and mins; q5_k adds a high bit.
fn k_quant(row: &[u8], x: Q8Row, bytes: usize, five: bool) -> f32 {
    let mut sum = 0.0;
    for (b, blk) in row.chunks_exact(bytes).enumerate() {
        let (d, dmin) = (half(blk, 0), half(blk, 2));
        let scales = &blk[4..16];
        let (qh, qs) =
            if five { (&blk[16..48], &blk[48..176]) } else { (&blk[0..0], &blk[16..144]) };
        for j in 0..8 {
            let (sc, m) = scale_min_k4(j, scales);
            let chunk = &qs[32 * (j / 2)..32 * (j / 2) + 32];
            let q = chunk.iter().enumerate().map(|(l, &v)| {
                let nib = if j % 2 == 0 { v & 0xF } else { v >> 4 };
                let hi = if five { (qh[l] >> j) & 1 } else { 0 };
                i32::from(nib | (hi << 4))
            });
            let xb = 8 * b + j;
            let s = idot(q, &x.qs[32 * xb..32 * xb + 32]);
            sum += x.ds[xb][0] * d * f32::from(sc) * s as f32 - dmin * f32::from(m) * x.ds[xb][1];
        }
    }
    sum
}

pub fn q4_k(row: &[u8], x: Q8Row) -> f32 {
    k_quant(row, x, 144, false)
}

pub fn q5_k(row: &[u8], x: Q8Row) -> f32 {
    k_quant(row, x, 176, true)
}

/// The 6-bit value of element `32k + l` of half `h` of a q6_k block (0..64, offset 32).
pub fn q6_k_value(ql: &[u8], qh: &[u8], k: usize, l: usize) -> i32 {
    // Quarters 0 and 2 read ql[l], 1 and 3 read ql[l + 32]; quarters 0 and 1 the low nibble.
    let byte = ql[l + 32 * (k % 2)];
    let nib = if k < 2 { byte & 0xF } else { byte >> 4 };
    i32::from(nib | (((qh[l] >> (2 * k)) & 3) << 4))
}

pub fn q6_k(row: &[u8], x: Q8Row) -> f32 {
    let mut sum = 0.0;
    for (b, blk) in row.chunks_exact(210).enumerate() {
        let d = half(blk, 208);
        for h in 0..2 {
            let (ql, qh) = (&blk[64 * h..64 * h + 64], &blk[128 + 32 * h..128 + 32 * h + 32]);
            let sc = &blk[192 + 8 * h..200 + 8 * h];
            for k in 0..4 {
                let xb = 8 * b + 4 * h + k;
                let xq = &x.qs[32 * xb..32 * xb + 32];
                let mut total = 0i32;
                for g in 0..2 {
                    let q = (16 * g..16 * g + 16).map(|l| q6_k_value(ql, qh, k, l) - 32);
                    total += i32::from(sc[2 * k + g] as i8) * idot(q, &xq[16 * g..16 * g + 16]);
                }
                sum += d * x.ds[xb][0] * total as f32;
            }
        }
    }
    sum
}

/// 1-bit blocks of 128: per 32-value sub-block, `d * dx * sum(+-x)` (+ where the bit is set).
pub fn q1_0(row: &[u8], x: Q8Row) -> f32 {
    let mut sum = 0.0;
    for (g, blk) in row.chunks_exact(18).enumerate() {
        for (j, bits) in blk[2..].chunks_exact(4).enumerate() {
            let xb = 4 * g + j;
            let w = (0..32).map(|i| if (bits[i / 8] >> (i % 8)) & 1 == 1 { 1 } else { -1 });
            let s = idot(w, &x.qs[32 * xb..32 * xb + 32]);
            sum += half(blk, 0) * x.ds[xb][0] * s as f32;
        }
    }
    sum
}

/// cellm int8 per row: the f32 row scale, then 32-value blocks.
pub fn i8_row(row: &[u8], x: Q8Row) -> f32 {
    let (scale, blocks) = row.split_at(4);
    let mut sum = 0.0;
    for (b, blk) in blocks.chunks_exact(32).enumerate() {
        let s = idot(blk.iter().map(|&q| i32::from(q as i8)), &x.qs[32 * b..32 * b + 32]);
        sum += x.ds[b][0] * s as f32;
    }
    f32::from_le_bytes([scale[0], scale[1], scale[2], scale[3]]) * sum
}

/// cellm int4 groups of `group` values sharing `d` (and `m` when affine): per 32-value
/// sub-block, `d * dx * sum((q - 8) x)` or `d * dx * sum(q x) + m * s`.
fn int4_groups(row: &[u8], x: Q8Row, group: usize, affine: bool) -> f32 {
    let head = if affine { 4 } else { 2 };
    let mut sum = 0.0;
    for (g, blk) in row.chunks_exact(head + group / 2).enumerate() {
        let (d, m) = (half(blk, 0), if affine { half(blk, 2) } else { 0.0 });
        for (j, qs) in blk[head..].chunks_exact(16).enumerate() {
            let xb = g * group / 32 + j;
            let q = nibbles(qs).map(|q| if affine { q } else { q - 8 });
            let s = idot(q, &x.qs[32 * xb..32 * xb + 32]);
            sum += d * x.ds[xb][0] * s as f32 + m * x.ds[xb][1];
        }
    }
    sum
}

pub fn i4_g64(row: &[u8], x: Q8Row) -> f32 {
    int4_groups(row, x, 64, false)
}

pub fn i4_g128(row: &[u8], x: Q8Row) -> f32 {
    int4_groups(row, x, 128, false)
}

pub fn i4a_g64(row: &[u8], x: Q8Row) -> f32 {
    int4_groups(row, x, 64, true)
}

pub fn i4a_g128(row: &[u8], x: Q8Row) -> f32 {
    int4_groups(row, x, 128, true)
}

/// cellm int2 / int3 affine groups of `group`: per 32-value sub-block,
/// `d * dx * sum(q x) + m * s`.
fn low_bit_groups(row: &[u8], x: Q8Row, group: usize, three: bool) -> f32 {
    let sub_bytes = if three { 12 } else { 8 };
    let mut sum = 0.0;
    for (g, blk) in row.chunks_exact(4 + group / 32 * sub_bytes).enumerate() {
        let (d, m) = (half(blk, 0), half(blk, 2));
        for (j, sub) in blk[4..].chunks_exact(sub_bytes).enumerate() {
            let xb = g * group / 32 + j;
            let q = (0..32).map(|i| i32::from(low_bit_value(sub, i, three)));
            let s = idot(q, &x.qs[32 * xb..32 * xb + 32]);
            sum += d * x.ds[xb][0] * s as f32 + m * x.ds[xb][1];
        }
    }
    sum
}

pub fn i2a_g64(row: &[u8], x: Q8Row) -> f32 {
    low_bit_groups(row, x, 64, false)
}

pub fn i2a_g128(row: &[u8], x: Q8Row) -> f32 {
    low_bit_groups(row, x, 128, false)
}

pub fn i3a_g64(row: &[u8], x: Q8Row) -> f32 {
    low_bit_groups(row, x, 64, true)
}

pub fn i3a_g128(row: &[u8], x: Q8Row) -> f32 {
    low_bit_groups(row, x, 128, true)
}

/// The single-row kernels, in `TensorFormat::BLOCKS` order.
const ONE: [QDotFn; 17] = [
    q8_0, q4_0, q4_1, q5_0, q4_k, q5_k, q6_k, q1_0, i8_row, i4_g64, i4_g128, i4a_g64, i4a_g128,
    i2a_g64, i2a_g128, i3a_g64, i3a_g128,
];

/// Four rows as four single-row calls: the reference the SIMD four-row kernels match.
fn four<const I: usize>(row: &[u8], x: &[Q8Row; 4]) -> [f32; 4] {
    x.map(|r| ONE[I](row, r))
}

const FOUR: [QDot4Fn; 17] = [
    four::<0>, four::<1>, four::<2>, four::<3>, four::<4>, four::<5>, four::<6>, four::<7>,
    four::<8>, four::<9>, four::<10>, four::<11>, four::<12>, four::<13>, four::<14>, four::<15>,
    four::<16>,
];

pub fn qdot(format: TensorFormat) -> Option<(QDotFn, QDot4Fn)> {
    let i = TensorFormat::BLOCKS.iter().position(|&f| f == format)?;
    Some((ONE[i], FOUR[i]))
}
