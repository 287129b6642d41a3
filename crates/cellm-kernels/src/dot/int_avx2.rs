//! Integer row kernels of the AVX2 family: weight blocks unpacked to bytes, multiplied with
//! int8 activations by a byte product step (`bytes::ByteDot`), one float multiply-add per
//! (sub-)block. Twins of `int_scalar`. The K-quant kernels weight each sub-block's sum by its
//! integer scale in the same `vpmaddwd` that widens it, which `vpdpbusd` would not shorten, so
//! they keep `vpmaddubsw` on every path.

use std::arch::x86_64::*;

use cellm_format::TensorFormat;

use super::bytes::{self, Avx2, Avx512Vnni, AvxVnni, ByteDot};
use super::int_scalar::scale_min_k4;
use super::kinds::{QDot4Fn, QDotFn};
use super::prefetch;
use crate::acts::Q8Row;

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
}

/// 16 bytes of nibbles -> 32 bytes: low nibbles, then high nibbles (ggml's element order).
/// A broadcast load and a per-lane shift avoid the shuffle port an insert would need.
#[inline(always)]
unsafe fn nibbles32(p: *const u8) -> __m256i {
    let both = _mm256_broadcastsi128_si256(_mm_loadu_si128(p.cast()));
    let shifted = _mm256_srlv_epi32(both, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    _mm256_and_si256(shifted, _mm256_set1_epi8(0x0F))
}

/// 32 bits -> 32 bytes, 0xFF where the bit is set.
#[inline(always)]
unsafe fn bits32(b: &[u8]) -> __m256i {
    let x32 = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i32;
    let shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x32), shuf);
    let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1))
}

#[inline(always)]
unsafe fn xblock(x: &Q8Row, b: usize) -> __m256i {
    _mm256_loadu_si256(x.qs.as_ptr().add(32 * b).cast())
}

/// Blocks of 32 that unpack to unsigned bytes `u` with value `d * u + c` (c = -8d for q4_0,
/// the min m for q4_1, -16d for q5_0): `d * dx * sum(u * x) + c * s`, where `s = dx * sum(x)`.
/// `scales(blk)` gives `[d, c]` in lanes 0 and 1.
#[inline(always)]
unsafe fn unsigned_blocks<D: ByteDot, const N: usize>(
    row: &[u8],
    x: &[Q8Row; N],
    bytes: usize,
    unpack: impl Fn(*const u8) -> __m256i,
    scales: impl Fn(*const u8) -> __m128,
) -> [f32; N] {
    unsigned_groups::<D, N>(row, x, bytes, 1, |blk, _| unpack(blk), scales)
}

/// As [`unsigned_blocks`] for groups of `subs` 32-value sub-blocks sharing one `[d, c]`;
/// `unpack(group, j)` gives sub-block `j`.
#[inline(always)]
unsafe fn unsigned_groups<D: ByteDot, const N: usize>(
    row: &[u8],
    x: &[Q8Row; N],
    bytes: usize,
    subs: usize,
    unpack: impl Fn(*const u8, usize) -> __m256i,
    scales: impl Fn(*const u8) -> __m128,
) -> [f32; N] {
    let mut acc = [_mm256_setzero_ps(); N];
    // Lane 1 of `offset` sums c * s.
    let mut offset = [_mm_setzero_ps(); N];
    let base = row.as_ptr();
    for g in 0..row.len() / bytes {
        let blk = base.add(bytes * g);
        prefetch::ahead(blk, bytes);
        let dc = scales(blk);
        for j in 0..subs {
            let (u, b) = (unpack(blk, j), g * subs + j);
            for t in 0..N {
                let xt = &x[t];
                // (d * dx, c * s) in one multiply.
                let ds = _mm_castsi128_ps(_mm_loadl_epi64(xt.ds.as_ptr().add(b).cast()));
                let prod = _mm_mul_ps(dc, ds);
                offset[t] = _mm_add_ps(offset[t], prod);
                let p = _mm256_cvtepi32_ps(D::dot(u, xblock(xt, b)));
                acc[t] = _mm256_fmadd_ps(_mm256_broadcastss_ps(prod), p, acc[t]);
            }
        }
    }
    let mut out = [0.0; N];
    for t in 0..N {
        out[t] = hsum(acc[t]) + _mm_cvtss_f32(_mm_shuffle_ps::<1>(offset[t], offset[t]));
    }
    out
}

/// `[d, k * d]` from the f16 scale at `p`.
#[inline(always)]
unsafe fn scale_and_multiple(p: *const u8, k: f32) -> __m128 {
    let bits = i32::from(p.cast::<u16>().read_unaligned());
    let dd = _mm_cvtph_ps(_mm_cvtsi32_si128(bits | (bits << 16)));
    _mm_mul_ps(dd, _mm_setr_ps(1.0, k, 0.0, 0.0))
}

#[inline(always)]
unsafe fn q8_0<D: ByteDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    let mut acc = [_mm256_setzero_ps(); N];
    let base = row.as_ptr();
    for b in 0..row.len() / 34 {
        let blk = base.add(34 * b);
        prefetch::ahead(blk, 34);
        let w = _mm256_loadu_si256(blk.add(2).cast());
        let wabs = _mm256_sign_epi8(w, w);
        let d = _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(blk.cast::<u16>().read_unaligned())));
        for t in 0..N {
            let xt = &x[t];
            let scale = _mm_mul_ss(d, _mm_load_ss(xt.ds.as_ptr().add(b).cast()));
            let p = _mm256_cvtepi32_ps(D::dot(wabs, _mm256_sign_epi8(xblock(xt, b), w)));
            acc[t] = _mm256_fmadd_ps(_mm256_broadcastss_ps(scale), p, acc[t]);
        }
    }
    hsums(acc, 1.0)
}

/// cellm int8 per row: q8_0's block product without per-block weight scales, times the f32
/// row scale at the end.
#[inline(always)]
unsafe fn i8_row<D: ByteDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    let mut acc = [_mm256_setzero_ps(); N];
    let scale = f32::from_le_bytes([row[0], row[1], row[2], row[3]]);
    let base = row.as_ptr().add(4);
    for b in 0..(row.len() - 4) / 32 {
        prefetch::ahead(base.add(32 * b), 32);
        let w = _mm256_loadu_si256(base.add(32 * b).cast());
        let wabs = _mm256_sign_epi8(w, w);
        for t in 0..N {
            let xt = &x[t];
            let dx = _mm256_set1_ps(xt.ds[b][0]);
            let p = _mm256_cvtepi32_ps(D::dot(wabs, _mm256_sign_epi8(xblock(xt, b), w)));
            acc[t] = _mm256_fmadd_ps(dx, p, acc[t]);
        }
    }
    hsums(acc, scale)
}

/// cellm int4 groups of `GROUP` (symmetric: `c = -8d`; affine: `c = m`).
#[inline(always)]
unsafe fn int4_groups<D: ByteDot, const N: usize, const GROUP: usize, const AFFINE: bool>(
    row: &[u8],
    x: &[Q8Row; N],
) -> [f32; N] {
    let head = if AFFINE { 4 } else { 2 };
    unsigned_groups::<D, N>(
        row,
        x,
        head + GROUP / 2,
        GROUP / 32,
        |g, j| unsafe { nibbles32(g.add(head + 16 * j)) },
        |g| unsafe {
            if AFFINE {
                _mm_cvtph_ps(_mm_cvtsi32_si128(g.cast::<i32>().read_unaligned()))
            } else {
                scale_and_multiple(g, -8.0)
            }
        },
    )
}

#[inline(always)]
unsafe fn i4_g64<D: ByteDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    int4_groups::<D, N, 64, false>(row, x)
}

#[inline(always)]
unsafe fn i4_g128<D: ByteDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    int4_groups::<D, N, 128, false>(row, x)
}

#[inline(always)]
unsafe fn i4a_g64<D: ByteDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    int4_groups::<D, N, 64, true>(row, x)
}

#[inline(always)]
unsafe fn i4a_g128<D: ByteDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    int4_groups::<D, N, 128, true>(row, x)
}

#[inline(always)]
unsafe fn q4_0<D: ByteDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    unsigned_blocks::<D, N>(
        row,
        x,
        18,
        |b| unsafe { nibbles32(b.add(2)) },
        |b| unsafe { scale_and_multiple(b, -8.0) },
    )
}

#[inline(always)]
unsafe fn q4_1<D: ByteDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    // d and m are adjacent f16s: one load, one conversion.
    unsigned_blocks::<D, N>(
        row,
        x,
        20,
        |b| unsafe { nibbles32(b.add(4)) },
        |b| unsafe { _mm_cvtph_ps(_mm_cvtsi32_si128(b.cast::<i32>().read_unaligned())) },
    )
}

#[inline(always)]
unsafe fn q5_0<D: ByteDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    let unpack = |b: *const u8| unsafe {
        let high = std::slice::from_raw_parts(b.add(2), 4);
        let fifth = _mm256_and_si256(bits32(high), _mm256_set1_epi8(16));
        _mm256_or_si256(nibbles32(b.add(6)), fifth)
    };
    unsigned_blocks::<D, N>(row, x, 22, unpack, |b| unsafe { scale_and_multiple(b, -16.0) })
}

/// 1-bit blocks of 128: each 32-value sub-block unpacks to its bits `u` (1 where set), and
/// `w = 2d * u - d`, so the block is `[2d, -d]` in the unsigned form.
#[inline(always)]
unsafe fn q1_0<D: ByteDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    unsigned_groups::<D, N>(
        row,
        x,
        18,
        4,
        |g, j| unsafe {
            let bits = std::slice::from_raw_parts(g.add(2 + 4 * j), 4);
            _mm256_and_si256(bits32(bits), _mm256_set1_epi8(1))
        },
        // [d, -d/2] doubled: exact, powers of two.
        |g| unsafe { _mm_mul_ps(scale_and_multiple(g, -0.5), _mm_set1_ps(2.0)) },
    )
}

/// 8 bytes of 2-bit values -> 32 bytes: byte `j` of 8-byte lane `k` is bits `2k..2k + 2` of
/// byte `j` (value `j + 8k` of a cellm int2 / int3 sub-block). A 64-bit shift per lane moves
/// bits across bytes, but the mask keeps only each byte's own two.
#[inline(always)]
unsafe fn crumbs32(p: *const u8) -> __m256i {
    let v = _mm256_set1_epi64x(p.cast::<i64>().read_unaligned());
    let shifted = _mm256_srlv_epi64(v, _mm256_setr_epi64x(0, 2, 4, 6));
    _mm256_and_si256(shifted, _mm256_set1_epi8(3))
}

/// cellm int2 / int3 affine groups of `GROUP`: unsigned values 0..3 / 0..7 and `[d, m]`.
#[inline(always)]
unsafe fn low_bit_groups<D: ByteDot, const N: usize, const GROUP: usize, const THREE: bool>(
    row: &[u8],
    x: &[Q8Row; N],
) -> [f32; N] {
    let sub = if THREE { 12 } else { 8 };
    unsigned_groups::<D, N>(
        row,
        x,
        4 + GROUP / 32 * sub,
        GROUP / 32,
        |g, j| unsafe {
            let p = g.add(4 + sub * j);
            if THREE {
                let high = bits32(std::slice::from_raw_parts(p.add(8), 4));
                _mm256_or_si256(crumbs32(p), _mm256_and_si256(high, _mm256_set1_epi8(4)))
            } else {
                crumbs32(p)
            }
        },
        |g| unsafe { _mm_cvtph_ps(_mm_cvtsi32_si128(g.cast::<i32>().read_unaligned())) },
    )
}

#[inline(always)]
unsafe fn i2a_g64<D: ByteDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    low_bit_groups::<D, N, 64, false>(row, x)
}

#[inline(always)]
unsafe fn i2a_g128<D: ByteDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    low_bit_groups::<D, N, 128, false>(row, x)
}

#[inline(always)]
unsafe fn i3a_g64<D: ByteDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    low_bit_groups::<D, N, 64, true>(row, x)
}

#[inline(always)]
unsafe fn i3a_g128<D: ByteDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    low_bit_groups::<D, N, 128, true>(row, x)
}

/// K-quant activations (the Q8K scheme) share one scale per 256 values, so a super-block's
/// sub-block products can be summed as integers, weighted by their integer 6-bit scales
/// (`vpmaddwd` with the scale in place of ones), and turned into floats once.
#[inline(always)]
unsafe fn k_quant<const N: usize>(
    row: &[u8],
    x: &[Q8Row; N],
    bytes: usize,
    five: bool,
) -> [f32; N] {
    let mut acc = [_mm256_setzero_ps(); N];
    let mut mins = [0.0f32; N];
    let low = _mm256_set1_epi8(0x0F);
    let base = row.as_ptr();
    for b in 0..row.len() / bytes {
        prefetch::ahead(base.add(bytes * b), bytes);
        let blk = std::slice::from_raw_parts(base.add(bytes * b), bytes);
        let dd = _mm_cvtph_ps(_mm_cvtsi32_si128(blk.as_ptr().cast::<i32>().read_unaligned()));
        let (d, dmin) = (_mm_cvtss_f32(dd), _mm_cvtss_f32(_mm_shuffle_ps::<1>(dd, dd)));
        let mut sc = [0i16; 8];
        let mut m = [0.0f32; 8];
        for j in 0..8 {
            let (s_j, m_j) = scale_min_k4(j, &blk[4..16]);
            sc[j] = i16::from(s_j);
            m[j] = dmin * f32::from(m_j);
        }
        let qs = blk.as_ptr().add(if five { 48 } else { 16 });
        let qh = if five {
            _mm256_loadu_si256(blk.as_ptr().add(16).cast())
        } else {
            _mm256_setzero_si256()
        };
        let mut sumi = [_mm256_setzero_si256(); N];
        for c in 0..4 {
            let q4 = _mm256_loadu_si256(qs.add(32 * c).cast());
            let halves =
                [_mm256_and_si256(q4, low), _mm256_and_si256(_mm256_srli_epi16::<4>(q4), low)];
            for (i, mut q) in halves.into_iter().enumerate() {
                let j = 2 * c + i;
                if five {
                    let bit = _mm256_set1_epi8((1u8 << j) as i8);
                    let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
                    q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(16)));
                }
                let scale = _mm256_set1_epi16(sc[j]);
                for t in 0..N {
                    let p = _mm256_maddubs_epi16(q, xblock(&x[t], 8 * b + j));
                    sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(p, scale));
                }
            }
        }
        for t in 0..N {
            let ds = &x[t].ds[8 * b..8 * b + 8];
            acc[t] =
                _mm256_fmadd_ps(_mm256_set1_ps(d * ds[0][0]), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
            mins[t] += m.iter().zip(ds).map(|(m, ds)| m * ds[1]).sum::<f32>();
        }
    }
    let mut out = [0.0; N];
    for t in 0..N {
        out[t] = hsum(acc[t]) - mins[t];
    }
    out
}

#[inline(always)]
unsafe fn q4_k<D: ByteDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    k_quant(row, x, 144, false)
}

#[inline(always)]
unsafe fn q5_k<D: ByteDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    k_quant(row, x, 176, true)
}

/// Bits `S..S+2` of each byte of `qh`, moved to bits 4..6.
#[inline(always)]
unsafe fn high2<const S: i32>(qh: __m256i, m3: __m256i) -> __m256i {
    _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<S>(qh), m3))
}

#[inline(always)]
unsafe fn q6_k<D: ByteDot, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    let mut acc = [_mm256_setzero_ps(); N];
    let (m3, m4, k32) = (_mm256_set1_epi8(3), _mm256_set1_epi8(0x0F), _mm256_set1_epi8(32));
    let base = row.as_ptr();
    for b in 0..row.len() / 210 {
        let blk = base.add(210 * b);
        prefetch::ahead(blk, 210);
        let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(
            blk.add(208).cast::<u16>().read_unaligned(),
        ))));
        let mut sumi = [_mm256_setzero_si256(); N];
        for h in 0..2 {
            let ql0 = _mm256_loadu_si256(blk.add(64 * h).cast());
            let ql1 = _mm256_loadu_si256(blk.add(64 * h + 32).cast());
            let qh = _mm256_loadu_si256(blk.add(128 + 32 * h).cast());
            let (lo0, lo1) = (_mm256_srli_epi16::<4>(ql0), _mm256_srli_epi16::<4>(ql1));
            let q = [
                _mm256_or_si256(_mm256_and_si256(ql0, m4), high2::<0>(qh, m3)),
                _mm256_or_si256(_mm256_and_si256(ql1, m4), high2::<2>(qh, m3)),
                _mm256_or_si256(_mm256_and_si256(lo0, m4), high2::<4>(qh, m3)),
                _mm256_or_si256(_mm256_and_si256(lo1, m4), high2::<6>(qh, m3)),
            ];
            let sc = blk.add(192 + 8 * h).cast::<i8>();
            for (k, qk) in q.into_iter().enumerate() {
                let scales = _mm256_set_m128i(
                    _mm_set1_epi16(i16::from(*sc.add(2 * k + 1))),
                    _mm_set1_epi16(i16::from(*sc.add(2 * k))),
                );
                for t in 0..N {
                    let xv = xblock(&x[t], 8 * b + 4 * h + k);
                    // (q - 32) * x as q * x - 32 * x, both within i16.
                    let p = _mm256_sub_epi16(
                        _mm256_maddubs_epi16(qk, xv),
                        _mm256_maddubs_epi16(k32, xv),
                    );
                    sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(p, scales));
                }
            }
        }
        for t in 0..N {
            let scale = _mm256_set1_ps(d * x[t].ds[8 * b][0]);
            acc[t] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sumi[t]), acc[t]);
        }
    }
    hsums(acc, 1.0)
}

/// Per kernel, a module with the kernel compiled once per path (each with its path's target
/// features) and safe entries for one and four activation rows, generic over the path.
macro_rules! safe_entry {
    ($($name:ident => $inner:ident, $format:path);* $(;)?) => {
        $(
            mod $name {
                use super::*;

                #[target_feature(enable = "avx2,fma,f16c")]
                unsafe fn avx2<const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
                    $inner::<Avx2, N>(row, x)
                }

                #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
                unsafe fn avx_vnni<const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
                    $inner::<AvxVnni, N>(row, x)
                }

                #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
                unsafe fn avx512_vnni<const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
                    $inner::<Avx512Vnni, N>(row, x)
                }

                #[cfg(test)]
                #[target_feature(enable = "avx2,fma,f16c")]
                unsafe fn emulated_vnni<const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
                    $inner::<bytes::EmulatedVnni, N>(row, x)
                }

                unsafe fn run<const P: u8, const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
                    match P {
                        bytes::AVX2 => avx2::<N>(row, x),
                        bytes::AVX_VNNI => avx_vnni::<N>(row, x),
                        #[cfg(test)]
                        bytes::EMULATED_VNNI => emulated_vnni::<N>(row, x),
                        _ => avx512_vnni::<N>(row, x),
                    }
                }

                integer_entry_points!($format);
            }
        )*

        integer_entries_table!($($name => $format),*);
    };
}

with_integer_kernels!(safe_entry);

/// `scale` times each accumulator's horizontal sum. A loop, not `array::map`: the closure
/// would not inherit the caller's target features, and its intrinsics became calls.
#[inline(always)]
unsafe fn hsums<const N: usize>(acc: [__m256; N], scale: f32) -> [f32; N] {
    let mut out = [0.0f32; N];
    for (o, a) in out.iter_mut().zip(acc) {
        *o = scale * hsum(a);
    }
    out
}
