//! Integer row kernels of the NEON paths: weight blocks unpacked to signed bytes, multiplied
//! with int8 activations four products per i32 lane (`bytes_neon::NeonDot`), one float
//! multiply-add per (sub-)block. Twins of `int_scalar`; the K-quants weight each sub-block's
//! integer sum by its integer scale and convert once per super-block, as the AVX2 path does.

use std::arch::aarch64::*;

use cellm_format::TensorFormat;

use super::bytes_neon::{self, load32, nibbles32, Dotprod, NeonDot, Widening};
use super::int_scalar::scale_min_k4;
use super::kinds::{QDot4Fn, QDotFn};
use super::neon::load_f16;
use crate::acts::Q8Row;

#[inline(always)]
unsafe fn xblock(x: &Q8Row, b: usize) -> [int8x16_t; 2] {
    load32(x.qs.as_ptr().add(32 * b))
}

#[inline(always)]
unsafe fn signed(v: [uint8x16_t; 2]) -> [int8x16_t; 2] {
    v.map(|h| vreinterpretq_s8_u8(h))
}

/// 32-value sub-blocks, `subs` to a group of `bytes` bytes, whose values are `d * w + c` for
/// the signed bytes `w` that `unpack(group, j)` gives for sub-block `j`: `d * dx * sum(w * x)
/// + c * s` with `s = dx * sum(x)` from the activations. `scales(group)` gives `(d, c)`.
#[inline(always)]
unsafe fn groups<D: NeonDot, const N: usize>(
    row: &[u8],
    x: &[Q8Row; N],
    bytes: usize,
    subs: usize,
    unpack: impl Fn(*const u8, usize) -> [int8x16_t; 2],
    scales: impl Fn(*const u8) -> (f32, f32),
) -> [f32; N] {
    let mut acc = [vdupq_n_f32(0.0); N];
    let mut offset = [0.0f32; N];
    let base = row.as_ptr();
    for g in 0..row.len() / bytes {
        let blk = base.add(bytes * g);
        let (d, c) = scales(blk);
        for j in 0..subs {
            let (w, b) = (unpack(blk, j), g * subs + j);
            for t in 0..N {
                let [dx, s] = x[t].ds[b];
                offset[t] += c * s;
                let p = vcvtq_f32_s32(D::dot32(w, xblock(&x[t], b)));
                acc[t] = vfmaq_n_f32(acc[t], p, d * dx);
            }
        }
    }
    std::array::from_fn(|t| vaddvq_f32(acc[t]) + offset[t])
}

/// Nibbles minus `k` (q4_0 and symmetric int4: `q - 8`), exact in i8.
#[inline(always)]
unsafe fn nibbles_minus(p: *const u8, k: i8) -> [int8x16_t; 2] {
    signed(nibbles32(p)).map(|v| vsubq_s8(v, vdupq_n_s8(k)))
}

#[inline(always)]
unsafe fn q8_0<D: NeonDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    groups::<D, N>(row, x, 34, 1, |b, _| load32(b.add(2).cast()), |b| (load_f16(b), 0.0))
}

#[inline(always)]
unsafe fn q4_0<D: NeonDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    groups::<D, N>(row, x, 18, 1, |b, _| nibbles_minus(b.add(2), 8), |b| (load_f16(b), 0.0))
}

#[inline(always)]
unsafe fn q4_1<D: NeonDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    groups::<D, N>(
        row,
        x,
        20,
        1,
        |b, _| signed(nibbles32(b.add(4))),
        |b| (load_f16(b), load_f16(b.add(2))),
    )
}

/// 0xFF in byte `i` where bit `i` of `bits` is set, else 0.
#[inline(always)]
unsafe fn bit_mask16(bits: u16) -> uint8x16_t {
    let spread = vcombine_u8(vdup_n_u8(bits as u8), vdup_n_u8((bits >> 8) as u8));
    vtstq_u8(spread, vreinterpretq_u8_u64(vdupq_n_u64(0x8040_2010_0804_0201)))
}

/// 0x10 in byte `i` where bit `i` of the 16 bits at `bits` is set: q5_0's fifth bits.
#[inline(always)]
unsafe fn fifth_bits16(bits: u16) -> uint8x16_t {
    vandq_u8(bit_mask16(bits), vdupq_n_u8(0x10))
}

/// The 32 bits at `p` (LSB first) as +1 where set and -1 where clear: q1_0's weights.
#[inline(always)]
unsafe fn signs32(p: *const u8) -> [int8x16_t; 2] {
    let bits = p.cast::<u32>().read_unaligned();
    [bits as u16, (bits >> 16) as u16].map(|h| {
        let set = vreinterpretq_s8_u8(bit_mask16(h)); // -1 where set
        vsubq_s8(vdupq_n_s8(-1), vaddq_s8(set, set))
    })
}

/// 1-bit blocks of 128: four 32-value sub-blocks of signs sharing the block's `d`.
#[inline(always)]
unsafe fn q1_0<D: NeonDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    groups::<D, N>(row, x, 18, 4, |g, j| signs32(g.add(2 + 4 * j)), |g| (load_f16(g), 0.0))
}

#[inline(always)]
unsafe fn q5_0<D: NeonDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    let unpack = |b: *const u8, _| unsafe {
        let qh = b.add(2).cast::<u32>().read_unaligned();
        let [lo, hi] = nibbles32(b.add(6));
        let q =
            [vorrq_u8(lo, fifth_bits16(qh as u16)), vorrq_u8(hi, fifth_bits16((qh >> 16) as u16))];
        signed(q).map(|v| vsubq_s8(v, vdupq_n_s8(16)))
    };
    groups::<D, N>(row, x, 22, 1, unpack, |b| (load_f16(b), 0.0))
}

/// cellm int8 per row: the f32 row scale, then 32-value blocks without scales of their own.
#[inline(always)]
unsafe fn i8_row<D: NeonDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    let scale = f32::from_le_bytes([row[0], row[1], row[2], row[3]]);
    let sums = groups::<D, N>(&row[4..], x, 32, 1, |b, _| load32(b.cast()), |_| (1.0, 0.0));
    sums.map(|s| scale * s)
}

/// cellm int4 groups of `GROUP` (symmetric: `q - 8`; affine: `q` and the min `m`).
#[inline(always)]
unsafe fn int4_groups<D: NeonDot, const N: usize, const GROUP: usize, const AFFINE: bool>(
    row: &[u8],
    x: &[Q8Row; N],
) -> [f32; N] {
    let head = if AFFINE { 4 } else { 2 };
    groups::<D, N>(
        row,
        x,
        head + GROUP / 2,
        GROUP / 32,
        |g, j| unsafe {
            let p = g.add(head + 16 * j);
            if AFFINE {
                signed(nibbles32(p))
            } else {
                nibbles_minus(p, 8)
            }
        },
        |g| unsafe { (load_f16(g), if AFFINE { load_f16(g.add(2)) } else { 0.0 }) },
    )
}

#[inline(always)]
unsafe fn i4_g64<D: NeonDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    int4_groups::<D, N, 64, false>(row, x)
}

#[inline(always)]
unsafe fn i4_g128<D: NeonDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    int4_groups::<D, N, 128, false>(row, x)
}

#[inline(always)]
unsafe fn i4a_g64<D: NeonDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    int4_groups::<D, N, 64, true>(row, x)
}

#[inline(always)]
unsafe fn i4a_g128<D: NeonDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    int4_groups::<D, N, 128, true>(row, x)
}

/// 8 bytes of 2-bit values -> 32 values: value `j + 8k` is bits `2k..2k + 2` of byte `j`
/// (a cellm int2 / int3 sub-block).
#[inline(always)]
unsafe fn crumbs32(p: *const u8) -> [uint8x16_t; 2] {
    let (v, m) = (vld1_u8(p), vdup_n_u8(3));
    [
        vcombine_u8(vand_u8(v, m), vand_u8(vshr_n_u8::<2>(v), m)),
        vcombine_u8(vand_u8(vshr_n_u8::<4>(v), m), vshr_n_u8::<6>(v)),
    ]
}

/// cellm int2 / int3 affine groups of `GROUP`: values 0..3 / 0..7 (exact as i8), `d` and `m`.
#[inline(always)]
unsafe fn low_bit_groups<D: NeonDot, const N: usize, const GROUP: usize, const THREE: bool>(
    row: &[u8],
    x: &[Q8Row; N],
) -> [f32; N] {
    let sub = if THREE { 12 } else { 8 };
    groups::<D, N>(
        row,
        x,
        4 + GROUP / 32 * sub,
        GROUP / 32,
        |g, j| unsafe {
            let p = g.add(4 + sub * j);
            let mut q = crumbs32(p);
            if THREE {
                let bits = p.add(8).cast::<u32>().read_unaligned();
                let third = |h: u16| vandq_u8(bit_mask16(h), vdupq_n_u8(4));
                q = [
                    vorrq_u8(q[0], third(bits as u16)),
                    vorrq_u8(q[1], third((bits >> 16) as u16)),
                ];
            }
            signed(q)
        },
        |g| unsafe { (load_f16(g), load_f16(g.add(2))) },
    )
}

#[inline(always)]
unsafe fn i2a_g64<D: NeonDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    low_bit_groups::<D, N, 64, false>(row, x)
}

#[inline(always)]
unsafe fn i2a_g128<D: NeonDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    low_bit_groups::<D, N, 128, false>(row, x)
}

#[inline(always)]
unsafe fn i3a_g64<D: NeonDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    low_bit_groups::<D, N, 64, true>(row, x)
}

#[inline(always)]
unsafe fn i3a_g128<D: NeonDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    low_bit_groups::<D, N, 128, true>(row, x)
}

/// q4_k and q5_k: the Q8K activations share one scale per super-block, so each sub-block's
/// integer sum is weighted by its 6-bit scale as an integer and converted once.
#[inline(always)]
unsafe fn k_quant<D: NeonDot, const N: usize>(
    row: &[u8],
    x: &[Q8Row; N],
    bytes: usize,
    five: bool,
) -> [f32; N] {
    let mut acc = [vdupq_n_f32(0.0); N];
    let mut mins = [0.0f32; N];
    let base = row.as_ptr();
    for b in 0..row.len() / bytes {
        let blk = std::slice::from_raw_parts(base.add(bytes * b), bytes);
        let (d, dmin) = (load_f16(blk.as_ptr()), load_f16(blk.as_ptr().add(2)));
        let qs = blk.as_ptr().add(if five { 48 } else { 16 });
        let qh = five.then(|| [vld1q_u8(blk.as_ptr().add(16)), vld1q_u8(blk.as_ptr().add(32))]);
        let mut sumi = [vdupq_n_s32(0); N];
        for j in 0..8 {
            let (sc, m) = scale_min_k4(j, &blk[4..16]);
            // Sub-block j: the low (even j) or high nibbles of the 32 bytes of chunk j / 2.
            let mut q = sub_block_k(qs.add(32 * (j / 2)), j % 2 == 1);
            if let Some(qh) = qh {
                let bit = vdupq_n_u8(1 << j);
                q = [0, 1].map(|h| vorrq_u8(q[h], vandq_u8(vtstq_u8(qh[h], bit), vdupq_n_u8(16))));
            }
            let q = signed(q);
            for t in 0..N {
                let p = D::dot32(q, xblock(&x[t], 8 * b + j));
                sumi[t] = vmlaq_n_s32(sumi[t], p, i32::from(sc));
            }
            for t in 0..N {
                mins[t] += dmin * f32::from(m) * x[t].ds[8 * b + j][1];
            }
        }
        for t in 0..N {
            acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(sumi[t]), d * x[t].ds[8 * b][0]);
        }
    }
    std::array::from_fn(|t| vaddvq_f32(acc[t]) - mins[t])
}

/// The 32 nibbles of a K-quant sub-block: the low (`high == false`) or high nibbles of the
/// 32 bytes at `p`.
#[inline(always)]
unsafe fn sub_block_k(p: *const u8, high: bool) -> [uint8x16_t; 2] {
    let v = [vld1q_u8(p), vld1q_u8(p.add(16))];
    if high {
        v.map(|h| vshrq_n_u8::<4>(h))
    } else {
        v.map(|h| vandq_u8(h, vdupq_n_u8(0x0F)))
    }
}

#[inline(always)]
unsafe fn q4_k<D: NeonDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    k_quant::<D, N>(row, x, 144, false)
}

#[inline(always)]
unsafe fn q5_k<D: NeonDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    k_quant::<D, N>(row, x, 176, true)
}

/// q6_k: quarter `k` of a half holds elements `32k..32k + 32`: the low (k < 2) or high
/// nibbles of `ql[32 * (k % 2)..]`, with bits `2k..2k + 2` of `qh` as bits 4 and 5, minus 32.
/// Each 16 of them share a signed 8-bit scale.
#[inline(always)]
unsafe fn q6_k<D: NeonDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    let mut acc = [vdupq_n_f32(0.0); N];
    let (m4, m3, k32) = (vdupq_n_u8(0x0F), vdupq_n_u8(3), vdupq_n_s8(32));
    let base = row.as_ptr();
    for b in 0..row.len() / 210 {
        let blk = base.add(210 * b);
        let d = load_f16(blk.add(208));
        let mut sumi = [vdupq_n_s32(0); N];
        for h in 0..2 {
            let ql = blk.add(64 * h);
            let qh = [vld1q_u8(blk.add(128 + 32 * h)), vld1q_u8(blk.add(144 + 32 * h))];
            let sc = blk.add(192 + 8 * h).cast::<i8>();
            for k in 0..4 {
                let q: [int8x16_t; 2] = std::array::from_fn(|g| {
                    let bytes = vld1q_u8(ql.add(32 * (k % 2) + 16 * g));
                    let nib = if k < 2 { vandq_u8(bytes, m4) } else { vshrq_n_u8::<4>(bytes) };
                    let top = vandq_u8(vshlq_u8(qh[g], vdupq_n_s8(-2 * k as i8)), m3);
                    vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(nib, vshlq_n_u8::<4>(top))), k32)
                });
                for t in 0..N {
                    let xv = xblock(&x[t], 8 * b + 4 * h + k);
                    for g in 0..2 {
                        let p = D::step(vdupq_n_s32(0), q[g], xv[g]);
                        sumi[t] = vmlaq_n_s32(sumi[t], p, i32::from(*sc.add(2 * k + g)));
                    }
                }
            }
        }
        for t in 0..N {
            acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(sumi[t]), d * x[t].ds[8 * b][0]);
        }
    }
    acc.map(|a| vaddvq_f32(a))
}

/// Per kernel, a module with the kernel compiled once per path (each with its path's target
/// features) and safe entries for one and four activation rows, generic over the path.
macro_rules! safe_entry {
    ($($name:ident => $inner:ident, $format:path);* $(;)?) => {
        $(
            mod $name {
                use super::*;

                #[target_feature(enable = "neon")]
                unsafe fn neon<const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
                    $inner::<Widening, N>(row, x)
                }

                #[target_feature(enable = "neon,dotprod")]
                unsafe fn dotprod<const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
                    $inner::<Dotprod, N>(row, x)
                }

                unsafe fn run<const P: u8, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
                    match P {
                        bytes_neon::NEON_DOTPROD => dotprod::<N>(row, x),
                        _ => neon::<N>(row, x),
                    }
                }

                integer_entry_points!($format);
            }
        )*

        integer_entries_table!($($name => $format),*);
    };
}

with_integer_kernels!(safe_entry);
