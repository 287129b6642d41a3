//! Group kernels of the interleaved formats (layout in `x8.rs`) for the NEON paths: 8 weight
//! rows times up to 4 token rows. A 32-byte chunk is 4 quants of each of the 8 rows, two
//! 16-byte vectors of 4 rows each; the matching 4 activation bytes are broadcast, so one
//! four-product step (`bytes_neon::NeonDot`) leaves one row's partial sum per i32 lane and the
//! block scales apply to 4 rows per multiply.

use std::arch::aarch64::*;

use cellm_format::{TensorFormat, INTERLEAVE};

use super::bytes_neon::{self, broadcast4, Dotprod, NeonDot, Widening};
use super::neon::widen_f16x8;
use super::x8::{self, check_group_args, QDotX8Fn};
use crate::acts::Q8Row;

/// Eight rows' values: rows 0..4, then rows 4..8.
type Ints = [int32x4_t; 2];
type Floats = [float32x4_t; 2];
type Bytes = [uint8x16_t; 2];

#[inline(always)]
unsafe fn zero() -> Ints {
    [vdupq_n_s32(0); 2]
}

/// The 32-byte chunk at `p`.
#[inline(always)]
unsafe fn chunk(p: *const u8) -> Bytes {
    [vld1q_u8(p), vld1q_u8(p.add(16))]
}

/// The 8 rows' f16 field at `p` as f32.
#[inline(always)]
unsafe fn halves8(p: *const u8) -> Floats {
    widen_f16x8(vld1q_u16(p.cast()))
}

/// The 8 rows' u32 words at `p` (a chunk read as words).
#[inline(always)]
unsafe fn words8(p: *const u8) -> [uint32x4_t; 2] {
    [vld1q_u32(p.cast()), vld1q_u32(p.add(16).cast())]
}

/// Activation bytes `4v..4v + 4` of block `b`, in every lane.
#[inline(always)]
unsafe fn x4(x: &Q8Row, b: usize, v: usize) -> int8x16_t {
    broadcast4(x.qs.as_ptr().add(32 * b + 4 * v))
}

#[inline(always)]
unsafe fn step8<D: NeonDot>(acc: Ints, w: [int8x16_t; 2], x: int8x16_t) -> Ints {
    [D::step(acc[0], w[0], x), D::step(acc[1], w[1], x)]
}

#[inline(always)]
unsafe fn map2<T: Copy, U>(a: [T; 2], f: impl Fn(T) -> U) -> [U; 2] {
    [f(a[0]), f(a[1])]
}

#[inline(always)]
unsafe fn signed(v: Bytes) -> [int8x16_t; 2] {
    map2(v, |h| unsafe { vreinterpretq_s8_u8(h) })
}

/// `acc + scale * ints` for 8 rows, where `scale` is per row times the scalar `k`.
#[inline(always)]
unsafe fn fma_scaled(acc: Floats, scale: Floats, k: f32, ints: Ints) -> Floats {
    [
        vfmaq_f32(acc[0], vmulq_n_f32(scale[0], k), vcvtq_f32_s32(ints[0])),
        vfmaq_f32(acc[1], vmulq_n_f32(scale[1], k), vcvtq_f32_s32(ints[1])),
    ]
}

/// `(w >> shift) & mask` per u32 lane, for 8 rows.
#[inline(always)]
unsafe fn field(w: [uint32x4_t; 2], shift: i32, mask: u32) -> [uint32x4_t; 2] {
    map2(w, |v| unsafe { vandq_u32(vshlq_u32(v, vdupq_n_s32(-shift)), vdupq_n_u32(mask)) })
}

#[inline(always)]
unsafe fn q8_0_x8<D: NeonDot, const N: usize>(group: &[u8], x: &[Q8Row; N]) -> [Floats; N] {
    let bytes = 16 + 256;
    let mut acc = [[vdupq_n_f32(0.0); 2]; N];
    let base = group.as_ptr();
    for b in 0..group.len() / bytes {
        let blk = base.add(bytes * b);
        let d = halves8(blk);
        let mut sums = [zero(); N];
        for c in 0..8 {
            let w = signed(chunk(blk.add(16 + 32 * c)));
            for t in 0..N {
                sums[t] = step8::<D>(sums[t], w, x4(&x[t], b, c));
            }
        }
        for t in 0..N {
            acc[t] = fma_scaled(acc[t], d, x[t].ds[b][0], sums[t]);
        }
    }
    acc
}

/// 0x10 in byte `j` of each lane where bit `first + j` of the lane's word is set: q5_0's
/// fifth bits for 4 consecutive elements of each row.
#[inline(always)]
unsafe fn fifth_bits(qh: [uint32x4_t; 2], first: i32) -> Bytes {
    map2(field(qh, first, 0xF), |nib| unsafe {
        // The 4 bits copied to every byte of the lane, then byte j keeps bit j.
        let spread = vreinterpretq_u8_u32(vmulq_n_u32(nib, 0x0101_0101));
        let masks = vreinterpretq_u8_u32(vdupq_n_u32(0x0804_0201));
        vandq_u8(vtstq_u8(spread, masks), vdupq_n_u8(0x10))
    })
}

/// The 32-value formats, `KIND` 0, 1, 2 = q4_0x8 (`q - 8`), q4_1x8 (`q`, plus the min `m`
/// times the activations' sum), q5_0x8 (`q - 16` with a fifth bit per quant from `qh`).
#[inline(always)]
unsafe fn nibbles_x8<D: NeonDot, const N: usize, const KIND: u8>(
    group: &[u8],
    x: &[Q8Row; N],
) -> [Floats; N] {
    let five = KIND == 2;
    // f16 fields (8 rows x 1 or 2), then q5_0's 8 qh words, then 4 chunks of nibbles.
    let head = if KIND == 1 { 32 } else { 16 } + if five { 32 } else { 0 };
    let bytes = head + 128;
    let offset = vdupq_n_u8(match KIND {
        0 => 8,
        1 => 0,
        _ => 16,
    });
    let mut acc = [[vdupq_n_f32(0.0); 2]; N];
    let base = group.as_ptr();
    for b in 0..group.len() / bytes {
        let blk = base.add(bytes * b);
        let d = halves8(blk);
        let qh = words8(blk.add(16));
        let mut sums = [zero(); N];
        for c in 0..4 {
            let q = chunk(blk.add(head + 32 * c));
            // Low nibbles are values 4c..4c+4 of each row, high nibbles values 16 + 4c...
            let mut lo = map2(q, |v| unsafe { vandq_u8(v, vdupq_n_u8(0x0F)) });
            let mut hi = map2(q, |v| unsafe { vshrq_n_u8::<4>(v) });
            if five {
                let (flo, fhi) = (fifth_bits(qh, 4 * c as i32), fifth_bits(qh, 16 + 4 * c as i32));
                lo = [vorrq_u8(lo[0], flo[0]), vorrq_u8(lo[1], flo[1])];
                hi = [vorrq_u8(hi[0], fhi[0]), vorrq_u8(hi[1], fhi[1])];
            }
            let lo = signed(map2(lo, |v| unsafe { vsubq_u8(v, offset) }));
            let hi = signed(map2(hi, |v| unsafe { vsubq_u8(v, offset) }));
            for t in 0..N {
                sums[t] = step8::<D>(sums[t], lo, x4(&x[t], b, c));
                sums[t] = step8::<D>(sums[t], hi, x4(&x[t], b, c + 4));
            }
        }
        // q4_1's mins, times each token's activation sum.
        let m = (KIND == 1).then(|| halves8(blk.add(16)));
        for t in 0..N {
            acc[t] = fma_scaled(acc[t], d, x[t].ds[b][0], sums[t]);
            if let Some(m) = m {
                let s = x[t].ds[b][1];
                acc[t] = [vfmaq_n_f32(acc[t][0], m[0], s), vfmaq_n_f32(acc[t][1], m[1], s)];
            }
        }
    }
    acc
}

/// q4_kx8: super-blocks of 256 in 8 sub-blocks with 6-bit scales `sc` and mins `m` (packed
/// per row in 12 bytes: chunks 0..3 of the column), value `d * sc * q - dmin * m`. The Q8K
/// activations share one scale per super-block, so sub-block sums are weighted by `sc` as
/// integers and converted once.
#[inline(always)]
unsafe fn q4_k_x8<D: NeonDot, const N: usize>(group: &[u8], x: &[Q8Row; N]) -> [Floats; N] {
    let bytes = 8 * 144;
    let mut acc = [[vdupq_n_f32(0.0); 2]; N];
    let base = group.as_ptr();
    for b in 0..group.len() / bytes {
        let blk = base.add(bytes * b);
        let (d, dmin) = (halves8(blk), halves8(blk.add(16)));
        let packed = [0, 1, 2].map(|i| words8(blk.add(32 + 32 * i)));
        // Byte j of words 0 and 1 holds sub-block j's scale and min (6 bits) for j < 4; for
        // j >= 4, word 2's byte j - 4 holds their low 4 bits, the top bits of words 0 and 1
        // their high 2.
        let scale_min = |j: usize| unsafe {
            let s = 8 * (j % 4) as i32;
            if j < 4 {
                (field(packed[0], s, 63), field(packed[1], s, 63))
            } else {
                let or_high = |low: [uint32x4_t; 2], top: [uint32x4_t; 2]| {
                    map2([0, 1], |h| vorrq_u32(low[h], vshlq_n_u32::<4>(top[h])))
                };
                (
                    or_high(field(packed[2], s, 0xF), field(packed[0], s + 6, 3)),
                    or_high(field(packed[2], s + 4, 0xF), field(packed[1], s + 6, 3)),
                )
            }
        };
        let qs = blk.add(128);
        let mut sums = [zero(); N];
        for pair in 0..4 {
            let (mut lo_sums, mut hi_sums) = ([zero(); N], [zero(); N]);
            for c in 0..8 {
                let q = chunk(qs.add(32 * (8 * pair + c)));
                let lo = signed(map2(q, |v| unsafe { vandq_u8(v, vdupq_n_u8(0x0F)) }));
                let hi = signed(map2(q, |v| unsafe { vshrq_n_u8::<4>(v) }));
                for t in 0..N {
                    lo_sums[t] = step8::<D>(lo_sums[t], lo, x4(&x[t], 8 * b + 2 * pair, c));
                    hi_sums[t] = step8::<D>(hi_sums[t], hi, x4(&x[t], 8 * b + 2 * pair + 1, c));
                }
            }
            let (sc_lo, sc_hi) = (scale_min(2 * pair).0, scale_min(2 * pair + 1).0);
            for t in 0..N {
                sums[t] = map2([0, 1], |h| unsafe {
                    let s = vmlaq_s32(sums[t][h], lo_sums[t][h], vreinterpretq_s32_u32(sc_lo[h]));
                    vmlaq_s32(s, hi_sums[t][h], vreinterpretq_s32_u32(sc_hi[h]))
                });
            }
        }
        for t in 0..N {
            acc[t] = fma_scaled(acc[t], d, x[t].ds[8 * b][0], sums[t]);
        }
        for j in 0..8 {
            let m = scale_min(j).1;
            for t in 0..N {
                let s = x[t].ds[8 * b + j][1];
                acc[t] = map2([0, 1], |h| unsafe {
                    let dm = vmulq_f32(dmin[h], vcvtq_f32_u32(m[h]));
                    vfmsq_f32(acc[t][h], dm, vdupq_n_f32(s))
                });
            }
        }
    }
    acc
}

/// q6_kx8: super-blocks of 256 in 16 sub-blocks of 16 with signed 8-bit scales, value
/// `d * sc * (q - 32)` for 6-bit `q` (4 bits from `ql`, 2 from `qh`). Column layout: `d` of
/// the 8 rows, then 32 chunks of `ql`, 16 of `qh`, 4 of scales.
#[inline(always)]
unsafe fn q6_k_x8<D: NeonDot, const N: usize>(group: &[u8], x: &[Q8Row; N]) -> [Floats; N] {
    let bytes = 8 * 210;
    let (m4, m3, k32) = (vdupq_n_u8(0x0F), vdupq_n_u8(3), vdupq_n_u8(32));
    let mut acc = [[vdupq_n_f32(0.0); 2]; N];
    let base = group.as_ptr();
    for b in 0..group.len() / bytes {
        let blk = base.add(bytes * b);
        let d = halves8(blk);
        let at = |c: usize| unsafe { blk.add(16 + 32 * c) };
        let mut sums = [zero(); N];
        for half in 0..2 {
            for quarter in 0..2 {
                let mut run = [[zero(); 4]; N];
                for i in 4 * quarter..4 * quarter + 4 {
                    let (ql_a, ql_b) = (chunk(at(16 * half + i)), chunk(at(16 * half + 8 + i)));
                    let qh = chunk(at(32 + 8 * half + i));
                    let q: [[int8x16_t; 2]; 4] = std::array::from_fn(|k| {
                        let ql = if k % 2 == 0 { ql_a } else { ql_b };
                        signed(map2([0, 1], |h| unsafe {
                            let nib =
                                if k < 2 { vandq_u8(ql[h], m4) } else { vshrq_n_u8::<4>(ql[h]) };
                            let top = vandq_u8(vshlq_u8(qh[h], vdupq_n_s8(-2 * k as i8)), m3);
                            vsubq_u8(vorrq_u8(nib, vshlq_n_u8::<4>(top)), k32)
                        }))
                    });
                    for t in 0..N {
                        for (k, qk) in q.iter().enumerate() {
                            let xv = x4(&x[t], 8 * b + 4 * half + k, i);
                            run[t][k] = step8::<D>(run[t][k], *qk, xv);
                        }
                    }
                }
                // Element 32k + l of this half, l in 16 * quarter..+16, is in sub-block
                // 8 * half + 2k + quarter. Its scale is byte quarter or 2 + quarter of scale
                // chunk 2 * half (k < 2) or 2 * half + 1.
                let scales = [words8(at(48 + 2 * half)), words8(at(49 + 2 * half))];
                let sc: [[int32x4_t; 2]; 4] = std::array::from_fn(|k| {
                    let byte = (2 * (k % 2) + quarter) as i32;
                    map2(scales[k / 2], |w| unsafe {
                        // The byte moved to the top and shifted back down, sign and all.
                        let top = vshlq_s32(vreinterpretq_s32_u32(w), vdupq_n_s32(24 - 8 * byte));
                        vshrq_n_s32::<24>(top)
                    })
                });
                for t in 0..N {
                    for k in 0..4 {
                        sums[t] = map2([0, 1], |h| unsafe {
                            vmlaq_s32(sums[t][h], run[t][k][h], sc[k][h])
                        });
                    }
                }
            }
        }
        for t in 0..N {
            acc[t] = fma_scaled(acc[t], d, x[t].ds[8 * b][0], sums[t]);
        }
    }
    acc
}

/// The group product of format `F` (index into `TensorFormat::INTERLEAVED`) on path `D`.
#[inline(always)]
unsafe fn body<D: NeonDot, const N: usize, const F: usize>(
    group: &[u8],
    x: &[Q8Row],
    out: &mut [[f32; INTERLEAVE]],
) {
    let x: &[Q8Row; N] = x.try_into().expect("N activation rows");
    let acc = match F {
        0 => q8_0_x8::<D, N>(group, x),
        1 => nibbles_x8::<D, N, 0>(group, x),
        2 => nibbles_x8::<D, N, 1>(group, x),
        3 => nibbles_x8::<D, N, 2>(group, x),
        4 => q4_k_x8::<D, N>(group, x),
        _ => q6_k_x8::<D, N>(group, x),
    };
    for (o, a) in out.iter_mut().zip(acc) {
        vst1q_f32(o.as_mut_ptr(), a[0]);
        vst1q_f32(o.as_mut_ptr().add(4), a[1]);
    }
}

#[target_feature(enable = "neon")]
unsafe fn run_neon<const N: usize, const F: usize>(g: &[u8], x: &[Q8Row], o: &mut [[f32; 8]]) {
    body::<Widening, N, F>(g, x, o)
}

#[target_feature(enable = "neon,dotprod")]
unsafe fn run_dotprod<const N: usize, const F: usize>(g: &[u8], x: &[Q8Row], o: &mut [[f32; 8]]) {
    body::<Dotprod, N, F>(g, x, o)
}

/// Format `F` (index into `TensorFormat::INTERLEAVED`) on path `P` for 1..=8 tokens (4 at a
/// time).
fn entry<const P: u8, const F: usize>(group: &[u8], x: &[Q8Row], out: &mut [[f32; INTERLEAVE]]) {
    check_group_args(TensorFormat::INTERLEAVED[F], group, x, out.len(), false);
    macro_rules! go {
        ($n:literal) => {
            // SAFETY: only the path tables hand this out, and `PathKernels::of` checks the
            // path's CPU features; loads stay inside the group and the activation rows checked
            // above.
            unsafe {
                match P {
                    bytes_neon::NEON_DOTPROD => run_dotprod::<$n, F>(group, x, out),
                    _ => run_neon::<$n, F>(group, x, out),
                }
            }
        };
    }
    match x.len() {
        1 => go!(1),
        2 => go!(2),
        3 => go!(3),
        4 => go!(4),
        5..=8 => {
            let (xa, xb) = x.split_at(4);
            let (oa, ob) = out.split_at_mut(4);
            entry::<P, F>(group, xa, oa);
            entry::<P, F>(group, xb, ob);
        }
        n => panic!("group kernels take 1..=8 tokens, got {n}"),
    }
}

/// The entries of one path, in `TensorFormat::INTERLEAVED` order.
const fn entries<const P: u8>() -> [QDotX8Fn; 6] {
    [entry::<P, 0>, entry::<P, 1>, entry::<P, 2>, entry::<P, 3>, entry::<P, 4>, entry::<P, 5>]
}

/// The group kernel of `format` on path `P`. Only the path tables (`paths`) hand it out, after
/// checking the CPU.
pub(super) fn qdot<const P: u8>(format: TensorFormat) -> Option<QDotX8Fn> {
    x8::by_format(&entries::<P>(), format)
}
