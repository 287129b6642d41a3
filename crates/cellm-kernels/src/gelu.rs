//! Exact GELU, `x * (1 + erf(x / sqrt 2)) / 2` (HF's `gelu`, Whisper's activation), on an f32
//! erf: a rational approximation on [-4, 4] (the one Eigen and XLA use for f32, within
//! 4e-7 relative of the true erf), held at erf(4) outside. Plain arithmetic that the compiler
//! vectorizes; the AVX2 build of the same loop runs where selected, and long inputs are
//! split over the pool.

use crate::pool;

/// Odd numerator coefficients, x^13 down to x^1.
const P: [f32; 7] = [
    -2.726_142_3e-10,
    2.770_681_4e-8,
    -2.101_024e-6,
    -5.692_506_4e-5,
    -7.349_906_3e-4,
    -2.954_600_1e-3,
    -1.609_603_3e-2,
];
/// Even denominator coefficients, x^8 down to x^0.
const Q: [f32; 5] =
    [-1.456_607_2e-5, -2.133_740_6e-4, -1.682_827e-3, -7.373_329_2e-3, -1.426_474e-2];
/// Below this many elements a call runs on the calling thread.
const PARALLEL_MIN: usize = 1 << 15;

/// erf(x) in f32.
#[inline(always)]
pub fn erf(x: f32) -> f32 {
    let x = x.clamp(-4.0, 4.0);
    let x2 = x * x;
    let p = P.iter().fold(0.0f32, |acc, &c| acc.mul_add(x2, c));
    let q = Q.iter().fold(0.0f32, |acc, &c| acc.mul_add(x2, c));
    x * p / q
}

#[inline(always)]
fn gelu_portable(x: &mut [f32]) {
    for v in x {
        *v = 0.5 * *v * (1.0 + erf(*v * std::f32::consts::FRAC_1_SQRT_2));
    }
}

/// The same loop compiled with AVX2 and FMA, so it runs eight lanes at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gelu_avx2(x: &mut [f32]) {
    gelu_portable(x);
}

fn gelu_serial(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::isa::selected().has_avx2() {
        // SAFETY: the AVX2 path is selected only on CPUs that have AVX2 and FMA.
        return unsafe { gelu_avx2(x) };
    }
    gelu_portable(x);
}

/// `x = gelu(x)` elementwise, on every thread of the pool for long inputs.
pub fn gelu_in_place(x: &mut [f32]) {
    let threads = pool::current_threads();
    if x.len() < PARALLEL_MIN || threads == 1 {
        return gelu_serial(x);
    }
    let per = x.len().div_ceil(threads * 2).next_multiple_of(16);
    let len = x.len();
    let out = pool::SharedOut(x.as_mut_ptr());
    pool::parallel_for(len.div_ceil(per), |i| {
        let range = i * per..((i + 1) * per).min(len);
        // SAFETY: the tasks' ranges are disjoint and inside `x`.
        gelu_serial(unsafe { std::slice::from_raw_parts_mut(out.at(range.start), range.len()) });
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{isa, Isa};

    /// erf by its Taylor series in f64 (converges to 1e-16 for |x| <= 4 with enough terms).
    fn erf_f64(x: f64) -> f64 {
        let (mut term, mut sum) = (x, x);
        for n in 1..200 {
            term *= -x * x / n as f64;
            sum += term / (2 * n + 1) as f64;
        }
        sum * std::f64::consts::FRAC_2_SQRT_PI
    }

    #[test]
    fn erf_is_within_a_few_ulp_of_f64() {
        for i in -4000..=4000 {
            let x = i as f32 / 1000.0;
            let want = erf_f64(f64::from(x));
            let got = f64::from(erf(x));
            assert!(
                (got - want).abs() <= 4e-7 * want.abs().max(1e-3),
                "erf({x}) = {got} vs {want}"
            );
        }
        // Saturated: erf(4) is 1 - 1.5e-8, within an ulp of 1.
        assert!((erf(9.0) - 1.0).abs() <= f32::EPSILON && (erf(-9.0) + 1.0).abs() <= f32::EPSILON);
    }

    #[test]
    fn paths_agree_with_the_portable_loop() {
        let _serial = isa::test_lock();
        let x: Vec<f32> = (0..70_001).map(|i| (i as f32 - 35_000.0) / 3_000.0).collect();
        let mut want = x.clone();
        gelu_portable(&mut want);
        for path in Isa::available() {
            isa::set_override(path).unwrap();
            let mut got = x.clone();
            gelu_serial(&mut got);
            for ((a, b), v) in want.iter().zip(&got).zip(&x) {
                assert!(
                    (a - b).abs() <= 2e-7 * a.abs().max(1e-6),
                    "{path:?} gelu({v}): {a} vs {b}"
                );
            }
        }
        isa::set_override(*Isa::available().last().unwrap()).unwrap();
    }

    #[test]
    fn pooled_equals_serial() {
        let x: Vec<f32> = (0..100_003).map(|i| ((i * 7919) % 2001) as f32 / 250.0 - 4.0).collect();
        let mut want = x.clone();
        gelu_serial(&mut want);
        let pool = crate::pool::ThreadPool::new(3).unwrap();
        let mut got = x;
        pool.install(|| gelu_in_place(&mut got));
        assert_eq!(want, got);
    }
}
