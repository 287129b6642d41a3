//! The unnormalised fast Walsh-Hadamard transform, in place: the compressed KV caches'
//! rotation (`cellm-kv`) runs it on every query head of every page they read, so the
//! scalar butterflies (short inner loops at strides 1, 2 and 4 that do not vectorize) were
//! a sixth of an int4 decode step's attention.
//!
//! Every path computes each butterfly as `(p + q, p - q)` exactly as the scalar one does
//! (AVX2 and NEON inside a vector as `fma(v, +-1, partner)`, whose product is exact), so all
//! paths give the same bits.

/// `x <- H x` with `H` the Sylvester-ordered Hadamard matrix of `x.len()` (a power of two).
pub fn hadamard(x: &mut [f32]) {
    assert!(x.len().is_power_of_two(), "hadamard: length {} is not a power of two", x.len());
    #[cfg(target_arch = "x86_64")]
    if x.len() >= 8 && crate::isa::selected().has_avx2() {
        // SAFETY: the AVX2 path is selected only on CPUs that have AVX2 and FMA; the length
        // is a multiple of 8.
        return unsafe { avx2::hadamard(x) };
    }
    #[cfg(target_arch = "aarch64")]
    if x.len() >= 4 && crate::isa::selected().has_neon() {
        // SAFETY: the NEON paths are selected only on CPUs that have NEON; the length is a
        // multiple of 4.
        return unsafe { neon::hadamard(x) };
    }
    hadamard_scalar(x);
}

fn hadamard_scalar(x: &mut [f32]) {
    let mut h = 1;
    while h < x.len() {
        for pair in x.chunks_exact_mut(2 * h) {
            let (a, b) = pair.split_at_mut(h);
            for (p, q) in a.iter_mut().zip(b) {
                (*p, *q) = (*p + *q, *p - *q);
            }
        }
        h *= 2;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// Strides 1, 2 and 4 inside each 8-lane vector (each lane plus or minus its partner,
    /// the partner brought over by a permute), then the wider strides between vectors.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn hadamard(x: &mut [f32]) {
        let n = x.len();
        let p = x.as_mut_ptr();
        // Lane signs: + where the lane is the butterfly's first element, - where second.
        let s1 = _mm256_setr_ps(1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0);
        let s2 = _mm256_setr_ps(1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0);
        let s4 = _mm256_setr_ps(1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0);
        for i in (0..n).step_by(8) {
            let mut v = _mm256_loadu_ps(p.add(i));
            v = _mm256_fmadd_ps(v, s1, _mm256_permute_ps::<0b10_11_00_01>(v));
            v = _mm256_fmadd_ps(v, s2, _mm256_permute_ps::<0b01_00_11_10>(v));
            v = _mm256_fmadd_ps(v, s4, _mm256_permute2f128_ps::<0x01>(v, v));
            _mm256_storeu_ps(p.add(i), v);
        }
        let mut h = 8;
        while h < n {
            for base in (0..n).step_by(2 * h) {
                for i in (base..base + h).step_by(8) {
                    let (a, b) = (_mm256_loadu_ps(p.add(i)), _mm256_loadu_ps(p.add(i + h)));
                    _mm256_storeu_ps(p.add(i), _mm256_add_ps(a, b));
                    _mm256_storeu_ps(p.add(i + h), _mm256_sub_ps(a, b));
                }
            }
            h *= 2;
        }
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use std::arch::aarch64::*;

    /// Strides 1 and 2 inside each 4-lane vector (the partner brought over by `rev64` and
    /// `ext`), then the wider strides between vectors.
    #[target_feature(enable = "neon")]
    pub unsafe fn hadamard(x: &mut [f32]) {
        let n = x.len();
        let p = x.as_mut_ptr();
        let s1 = vld1q_f32([1.0f32, -1.0, 1.0, -1.0].as_ptr());
        let s2 = vld1q_f32([1.0f32, 1.0, -1.0, -1.0].as_ptr());
        for i in (0..n).step_by(4) {
            let mut v = vld1q_f32(p.add(i));
            v = vfmaq_f32(vrev64q_f32(v), v, s1);
            v = vfmaq_f32(vextq_f32::<2>(v, v), v, s2);
            vst1q_f32(p.add(i), v);
        }
        let mut h = 4;
        while h < n {
            for base in (0..n).step_by(2 * h) {
                for i in (base..base + h).step_by(4) {
                    let (a, b) = (vld1q_f32(p.add(i)), vld1q_f32(p.add(i + h)));
                    vst1q_f32(p.add(i), vaddq_f32(a, b));
                    vst1q_f32(p.add(i + h), vsubq_f32(a, b));
                }
            }
            h *= 2;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{isa, Isa};

    /// Every path gives the scalar transform's bits, for each power of two up to 256.
    #[test]
    fn paths_equal_the_scalar_transform() {
        let _serial = isa::test_lock();
        for len in [1, 2, 4, 8, 16, 32, 64, 128, 256] {
            let x: Vec<f32> = (0..len).map(|i| ((i * 7919) % 211) as f32 / 7.0 - 15.0).collect();
            let mut want = x.clone();
            hadamard_scalar(&mut want);
            // Sylvester's H[i][j] = (-1)^popcount(i & j), directly.
            for (i, w) in want.iter().enumerate() {
                let dense: f64 = (0..len)
                    .map(|j| if (i & j).count_ones() % 2 == 0 { 1.0 } else { -1.0 } * x[j] as f64)
                    .sum();
                assert!((dense - *w as f64).abs() < 1e-3, "len {len} row {i}: {w} vs {dense}");
            }
            for path in Isa::available() {
                isa::set_override(path).unwrap();
                let mut got = x.clone();
                hadamard(&mut got);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{path:?} len {len}");
            }
        }
        isa::set_override(*Isa::available().last().unwrap()).unwrap();
    }
}
