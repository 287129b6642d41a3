//! The per-32 activation quantizer sixteen blocks at a time on AVX-512. The AVX2 loop spends
//! most of a block on its horizontal maximum and sum and on two scalar divisions and two f16
//! roundings, one block after another; here sixteen blocks' maxima and sums reduce together
//! (a 16 x 16 transpose folded into the reduction) and their scales divide and round as one
//! vector. The arithmetic is the AVX2 loop's, so the output is bitwise the same (for finite
//! inputs: a NaN's place in the maxima's order differs).

use std::arch::x86_64::*;

/// Values a block: the parent's `QBLOCK` (checked there at compile time), not imported so
/// that this module stays a leaf.
pub const QBLOCK: usize = 32;

/// Blocks one pass handles.
pub const BLOCKS: usize = 16;

/// Folds sixteen vectors into one whose lane `b` is `op` over all sixteen lanes of `v[b]`.
/// Each level halves the vectors and the lanes per block: 256-bit halves, then 128-bit
/// quarters, then pairs, then single lanes; the result comes out with block `L + 4m` in lane
/// `4L + m`, which one permute (a 4 x 4 transpose) puts back in order.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn reduce16<const MAX: bool>(v: &[__m512; BLOCKS]) -> __m512 {
    let op = |a, b| if MAX { _mm512_max_ps(a, b) } else { _mm512_add_ps(a, b) };
    let mut halves = [_mm512_setzero_ps(); 8];
    for (i, h) in halves.iter_mut().enumerate() {
        let (x, y) = (v[2 * i], v[2 * i + 1]);
        *h = op(_mm512_shuffle_f32x4::<0x44>(x, y), _mm512_shuffle_f32x4::<0xEE>(x, y));
    }
    let mut quarters = [_mm512_setzero_ps(); 4];
    for (j, q) in quarters.iter_mut().enumerate() {
        let (x, y) = (halves[2 * j], halves[2 * j + 1]);
        *q = op(_mm512_shuffle_f32x4::<0x88>(x, y), _mm512_shuffle_f32x4::<0xDD>(x, y));
    }
    let mut pairs = [_mm512_setzero_ps(); 2];
    for (k, p) in pairs.iter_mut().enumerate() {
        let (x, y) = (quarters[2 * k], quarters[2 * k + 1]);
        *p = op(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
    }
    let (x, y) = (pairs[0], pairs[1]);
    let lanes = op(_mm512_shuffle_ps::<0x44>(x, y), _mm512_shuffle_ps::<0xEE>(x, y));
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_permutexvar_ps(order, lanes)
}

/// `v` rounded to f16 and back, lane by lane (what `half`'s conversions do, ties to even).
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn round_f16(v: __m512) -> __m512 {
    _mm512_cvtph_ps(_mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v))
}

/// Quantizes `x` (a multiple of 16 blocks of 32) as [`super::quantize_rows_avx2`] does.
#[target_feature(enable = "avx512f")]
pub unsafe fn quantize_blocks(
    x: &[f32],
    q8_1: bool,
    qs: &mut [i8],
    ds: &mut [[f32; 2]],
    sums32: &mut [i16],
) {
    let group = BLOCKS * QBLOCK;
    assert!(x.len().is_multiple_of(group) && qs.len() == x.len());
    assert!(ds.len() * QBLOCK == x.len() && sums32.len() == ds.len());
    let top = _mm512_set1_ps(127.0);
    // ds interleaves the scale and the scaled sum of each block.
    let first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    let second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (g, src) in x.chunks_exact(group).enumerate() {
        let p = src.as_ptr();
        let load = |b: usize, half: usize| _mm512_loadu_ps(p.add(b * QBLOCK + 16 * half));
        let mut v = [_mm512_setzero_ps(); BLOCKS];
        for (b, m) in v.iter_mut().enumerate() {
            *m = _mm512_max_ps(_mm512_abs_ps(load(b, 0)), _mm512_abs_ps(load(b, 1)));
        }
        let amax = reduce16::<true>(&v);
        let d = _mm512_div_ps(amax, _mm512_set1_ps(127.0));
        let positive = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(d, _mm512_setzero_ps());
        let mut inv = [0.0f32; BLOCKS];
        _mm512_storeu_ps(inv.as_mut_ptr(), _mm512_maskz_div_ps(positive, _mm512_set1_ps(1.0), d));
        let dst = qs.as_mut_ptr().add(g * group);
        for (b, s) in v.iter_mut().enumerate() {
            let scale = _mm512_set1_ps(inv[b]);
            let mut sum = _mm512_setzero_ps();
            for half in 0..2 {
                let r = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                    _mm512_mul_ps(load(b, half), scale),
                );
                let r = _mm512_min_ps(r, top);
                // Whole numbers of at most 127 in magnitude: their sum is exact in f32.
                sum = _mm512_add_ps(sum, r);
                let bytes = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r));
                _mm_storeu_si128(dst.add(b * QBLOCK + 16 * half).cast(), bytes);
            }
            *s = sum;
        }
        let sum = reduce16::<false>(&v);
        let isum = _mm512_cvtps_epi32(sum);
        _mm256_storeu_si256(
            sums32.as_mut_ptr().add(g * BLOCKS).cast(),
            _mm512_cvtepi32_epi16(isum),
        );
        let dh = round_f16(d);
        let scaled = if q8_1 { round_f16(_mm512_mul_ps(d, sum)) } else { _mm512_mul_ps(dh, sum) };
        let out = ds.as_mut_ptr().add(g * BLOCKS).cast::<f32>();
        _mm512_storeu_ps(out, _mm512_permutex2var_ps(dh, first, scaled));
        _mm512_storeu_ps(out.add(16), _mm512_permutex2var_ps(dh, second, scaled));
    }
}
