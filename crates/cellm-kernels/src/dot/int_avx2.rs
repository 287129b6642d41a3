//! AVX2 integer kernels: weight blocks unpacked to bytes, multiplied with int8 activations by
//! `vpmaddubsw` + `vpmaddwd`, one float multiply-add per (sub-)block. Twins of `int_scalar`.

use std::arch::x86_64::*;

use cellm_format::TensorFormat;

use super::int_scalar::scale_min_k4;
use super::{QDot4Fn, QDotFn};
use crate::acts::Q8Row;

#[inline(always)]
unsafe fn half(b: &[u8], i: usize) -> f32 {
    let bits = u16::from_le_bytes([b[i], b[i + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
}

/// Eight i32 sums of four adjacent u8 x i8 products.
#[inline(always)]
unsafe fn dot_u8_i8(u: __m256i, s: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
}

/// 16 bytes of nibbles -> 32 bytes: low nibbles, then high nibbles (ggml's element order).
#[inline(always)]
unsafe fn nibbles32(p: *const u8) -> __m256i {
    let t = _mm_loadu_si128(p.cast());
    let both = _mm256_insertf128_si256::<1>(_mm256_castsi128_si256(t), _mm_srli_epi16::<4>(t));
    _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
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

/// Accumulators for `N` tokens multiplied with the same weight row: each weight block is
/// unpacked once and used `N` times (prefill), which is where a GEMM beats repeated GEMVs.
struct Acc<const N: usize> {
    v: [__m256; N],
    scalar: [f32; N],
}

impl<const N: usize> Acc<N> {
    #[inline(always)]
    unsafe fn new() -> Self {
        Self { v: [_mm256_setzero_ps(); N], scalar: [0.0; N] }
    }

    /// `acc[t] += scale * float(p)` for an i32x8 partial sum `p`.
    #[inline(always)]
    unsafe fn add(&mut self, t: usize, scale: f32, p: __m256i) {
        self.v[t] = _mm256_fmadd_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(p), self.v[t]);
    }

    #[inline(always)]
    unsafe fn finish(self) -> [f32; N] {
        let mut out = self.scalar;
        for (o, v) in out.iter_mut().zip(self.v) {
            *o += hsum(v);
        }
        out
    }
}

/// Formats whose 32-value blocks unpack to signed bytes with one f16 scale at offset 0.
#[inline(always)]
unsafe fn signed_blocks<const N: usize>(
    row: &[u8],
    x: &[Q8Row; N],
    bytes: usize,
    unpack: impl Fn(&[u8]) -> __m256i,
) -> [f32; N] {
    let mut acc = Acc::<N>::new();
    for (b, blk) in row.chunks_exact(bytes).enumerate() {
        let w = unpack(blk);
        let (wabs, d) = (_mm256_sign_epi8(w, w), half(blk, 0));
        for (t, xt) in x.iter().enumerate() {
            let p = dot_u8_i8(wabs, _mm256_sign_epi8(xblock(xt, b), w));
            acc.add(t, d * xt.d[b], p);
        }
    }
    acc.finish()
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0<const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    signed_blocks(row, x, 34, |blk| unsafe { _mm256_loadu_si256(blk.as_ptr().add(2).cast()) })
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_0<const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    signed_blocks(row, x, 18, |blk| unsafe {
        _mm256_sub_epi8(nibbles32(blk.as_ptr().add(2)), _mm256_set1_epi8(8))
    })
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_0<const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    signed_blocks(row, x, 22, |blk| unsafe {
        // A clear high bit makes the byte negative (nibble - 16); a set one leaves the nibble.
        let hi = _mm256_andnot_si256(bits32(&blk[2..6]), _mm256_set1_epi8(0xF0u8 as i8));
        _mm256_or_si256(nibbles32(blk.as_ptr().add(6)), hi)
    })
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_1<const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    let mut acc = Acc::<N>::new();
    for (b, blk) in row.chunks_exact(20).enumerate() {
        let u = nibbles32(blk.as_ptr().add(4));
        let (d, m) = (half(blk, 0), half(blk, 2));
        for (t, xt) in x.iter().enumerate() {
            acc.add(t, d * xt.d[b], dot_u8_i8(u, xblock(xt, b)));
            acc.scalar[t] += m * xt.s[b];
        }
    }
    acc.finish()
}

#[inline(always)]
unsafe fn k_quant<const N: usize>(
    row: &[u8],
    x: &[Q8Row; N],
    bytes: usize,
    five: bool,
) -> [f32; N] {
    let mut acc = Acc::<N>::new();
    let low = _mm256_set1_epi8(0x0F);
    for (b, blk) in row.chunks_exact(bytes).enumerate() {
        let (d, dmin) = (half(blk, 0), half(blk, 2));
        let qs = if five { &blk[48..176] } else { &blk[16..144] };
        let qh = if five {
            _mm256_loadu_si256(blk.as_ptr().add(16).cast())
        } else {
            _mm256_setzero_si256()
        };
        for c in 0..4 {
            let q4 = _mm256_loadu_si256(qs.as_ptr().add(32 * c).cast());
            let halves =
                [_mm256_and_si256(q4, low), _mm256_and_si256(_mm256_srli_epi16::<4>(q4), low)];
            for (i, mut q) in halves.into_iter().enumerate() {
                let j = 2 * c + i;
                if five {
                    let bit = _mm256_set1_epi8((1u8 << j) as i8);
                    let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
                    q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(16)));
                }
                let (sc, m) = scale_min_k4(j, &blk[4..16]);
                let (dsc, dm) = (d * f32::from(sc), dmin * f32::from(m));
                let xb = 8 * b + j;
                for (t, xt) in x.iter().enumerate() {
                    acc.add(t, dsc * xt.d[xb], dot_u8_i8(q, xblock(xt, xb)));
                    acc.scalar[t] -= dm * xt.s[xb];
                }
            }
        }
    }
    acc.finish()
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k<const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    k_quant(row, x, 144, false)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_k<const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    k_quant(row, x, 176, true)
}

/// Bits `S..S+2` of each byte of `qh`, moved to bits 4..6.
#[inline(always)]
unsafe fn high2<const S: i32>(qh: __m256i, m3: __m256i) -> __m256i {
    _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<S>(qh), m3))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k<const N: usize>(row: &[u8], x: &[Q8Row; N]) -> [f32; N] {
    let mut acc = Acc::<N>::new();
    let (m3, m4, k32) = (_mm256_set1_epi8(3), _mm256_set1_epi8(0x0F), _mm256_set1_epi8(32));
    for (b, blk) in row.chunks_exact(210).enumerate() {
        let d = half(blk, 208);
        for h in 0..2 {
            let ql0 = _mm256_loadu_si256(blk.as_ptr().add(64 * h).cast());
            let ql1 = _mm256_loadu_si256(blk.as_ptr().add(64 * h + 32).cast());
            let qh = _mm256_loadu_si256(blk.as_ptr().add(128 + 32 * h).cast());
            let (lo0, lo1) = (_mm256_srli_epi16::<4>(ql0), _mm256_srli_epi16::<4>(ql1));
            let q = [
                _mm256_or_si256(_mm256_and_si256(ql0, m4), high2::<0>(qh, m3)),
                _mm256_or_si256(_mm256_and_si256(ql1, m4), high2::<2>(qh, m3)),
                _mm256_or_si256(_mm256_and_si256(lo0, m4), high2::<4>(qh, m3)),
                _mm256_or_si256(_mm256_and_si256(lo1, m4), high2::<6>(qh, m3)),
            ];
            let sc = &blk[192 + 8 * h..200 + 8 * h];
            for (k, qk) in q.into_iter().enumerate() {
                let scales = _mm256_set_m128i(
                    _mm_set1_epi16(i16::from(sc[2 * k + 1] as i8)),
                    _mm_set1_epi16(i16::from(sc[2 * k] as i8)),
                );
                let xb = 8 * b + 4 * h + k;
                for (t, xt) in x.iter().enumerate() {
                    let xv = xblock(xt, xb);
                    // (q - 32) * x as q * x - 32 * x, both within i16.
                    let p = _mm256_sub_epi16(
                        _mm256_maddubs_epi16(qk, xv),
                        _mm256_maddubs_epi16(k32, xv),
                    );
                    acc.add(t, d * xt.d[xb], _mm256_madd_epi16(p, scales));
                }
            }
        }
    }
    acc.finish()
}

macro_rules! safe_entry {
    ($($name:ident, $name4:ident => $inner:ident, $format:path);* $(;)?) => {
        $(
            fn $name(row: &[u8], x: Q8Row) -> f32 {
                check(row, &[x], $format);
                // SAFETY: `qdot` hands these out only after checking AVX2, FMA and F16C; every
                // activation load stays inside the rows checked above.
                unsafe { $inner::<1>(row, &[x])[0] }
            }
            fn $name4(row: &[u8], x: &[Q8Row; 4]) -> [f32; 4] {
                check(row, x, $format);
                // SAFETY: as above.
                unsafe { $inner::<4>(row, x) }
            }
        )*
        pub fn qdot(format: TensorFormat) -> Option<(QDotFn, QDot4Fn)> {
            assert!(crate::Isa::Avx2.supported(), "AVX2 kernels requested on a CPU without AVX2");
            match format {
                $($format => Some(($name, $name4)),)*
                _ => None,
            }
        }
    };
}

/// Every activation row covers the weight row.
fn check(row: &[u8], x: &[Q8Row], f: TensorFormat) {
    let elems = row.len() / f.block_bytes() * f.block_len();
    for r in x {
        assert!(r.qs.len() >= elems && r.d.len() * 32 >= elems && r.s.len() * 32 >= elems);
    }
}

safe_entry! {
    safe_q8_0, safe4_q8_0 => q8_0, TensorFormat::Q8_0;
    safe_q4_0, safe4_q4_0 => q4_0, TensorFormat::Q4_0;
    safe_q4_1, safe4_q4_1 => q4_1, TensorFormat::Q4_1;
    safe_q5_0, safe4_q5_0 => q5_0, TensorFormat::Q5_0;
    safe_q4_k, safe4_q4_k => q4_k, TensorFormat::Q4K;
    safe_q5_k, safe4_q5_k => q5_k, TensorFormat::Q5K;
    safe_q6_k, safe4_q6_k => q6_k, TensorFormat::Q6K;
}
