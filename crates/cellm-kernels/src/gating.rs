//! The MLP's gated activations, `gate = act(gate) * up`, on a vectorized `exp`.
//!
//! Both are a scaled sigmoid: `silu(x) = x / (1 + e^-x)`, and HF's tanh-approximated GELU is
//! `0.5 x (1 + tanh(z)) = x / (1 + e^(-2z))` with `z = sqrt(2/pi) (x + 0.044715 x^3)`. libm's
//! scalar `expf`/`tanhf` cost a large share of a prefill, so the AVX2 path evaluates `exp`
//! eight lanes at a time (Cephes' range reduction and polynomial, within 2 ulp of libm), the
//! AVX-512 path sixteen, and long batches are split over the thread pool.

use crate::pool;

/// The gate's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    Silu,
    GeluTanh,
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
/// Below this many elements a call runs on the calling thread.
const PARALLEL_MIN: usize = 1 << 15;

impl Gate {
    /// The exponent `a` with `act(x) = x / (1 + e^a)`.
    #[inline(always)]
    fn exponent(self, x: f32) -> f32 {
        match self {
            Gate::Silu => -x,
            Gate::GeluTanh => -2.0 * SQRT_2_OVER_PI * (x + 0.044715 * x * x * x),
        }
    }

    /// The scalar reference.
    pub fn apply_scalar(self, gate: &mut [f32], up: Option<&[f32]>) {
        match up {
            Some(up) => gate.iter_mut().zip(up).for_each(|(g, u)| {
                *g = *g / (1.0 + self.exponent(*g).exp()) * u;
            }),
            None => gate.iter_mut().for_each(|g| *g /= 1.0 + self.exponent(*g).exp()),
        }
    }

    fn apply_serial(self, gate: &mut [f32], up: Option<&[f32]>) {
        #[cfg(target_arch = "x86_64")]
        if crate::isa::selected() == crate::Isa::Avx512Vnni {
            // SAFETY: the AVX-512 path is selected only on CPUs that have AVX-512F.
            return unsafe { apply_512(self, gate, up) };
        }
        #[cfg(target_arch = "x86_64")]
        if crate::isa::selected().has_avx2() {
            // SAFETY: the AVX2 path is selected only on CPUs that have AVX2 and FMA.
            return unsafe { avx2::apply(self, gate, up) };
        }
        self.apply_scalar(gate, up);
    }

    /// `gate = act(gate) * up` (or `act(gate)` without `up`), on every thread for long inputs.
    pub fn apply(self, gate: &mut [f32], up: Option<&[f32]>) {
        if let Some(up) = up {
            assert_eq!(gate.len(), up.len(), "gate and up differ in length");
        }
        let threads = pool::current_threads();
        if gate.len() < PARALLEL_MIN || threads == 1 {
            return self.apply_serial(gate, up);
        }
        // Whole cache lines per task.
        let per = gate.len().div_ceil(threads * 2).next_multiple_of(16);
        let out = pool::SharedOut(gate.as_mut_ptr());
        let len = gate.len();
        pool::parallel_for(len.div_ceil(per), |i| {
            let range = i * per..((i + 1) * per).min(len);
            // SAFETY: the tasks' ranges are disjoint and inside `gate`.
            let g = unsafe { std::slice::from_raw_parts_mut(out.at(range.start), range.len()) };
            self.apply_serial(g, up.map(|u| &u[range]));
        });
    }
}

/// `x = e^x` elementwise (softmax weights), on the AVX2 `exp` where selected.
pub fn exp_in_place(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::isa::selected().has_avx2() {
        // SAFETY: the AVX2 path is selected only on CPUs that have AVX2 and FMA.
        return unsafe { avx2::exp_in_place(x) };
    }
    x.iter_mut().for_each(|v| *v = v.exp());
}

/// The largest value of `x` (-inf for none): a softmax's shift.
pub fn max_of(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::isa::selected().has_avx2() {
        // SAFETY: the AVX2 path is selected only on CPUs that have AVX2 and FMA.
        return unsafe { avx2::max_of(x) };
    }
    x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v))
}

/// `x = e^(x - shift)` elementwise and their sum: a softmax's weights and denominator in one
/// pass (the sum in eight interleaved lanes on AVX2, a fixed order for a given length).
pub fn exp_shifted_sum(x: &mut [f32], shift: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::isa::selected() == crate::Isa::Avx512Vnni {
        // SAFETY: the AVX-512 path is selected only on CPUs that have AVX-512F.
        return unsafe { exp_shifted_sum_512(x, shift) };
    }
    #[cfg(target_arch = "x86_64")]
    if crate::isa::selected().has_avx2() {
        // SAFETY: the AVX2 path is selected only on CPUs that have AVX2 and FMA.
        return unsafe { avx2::exp_shifted_sum(x, shift) };
    }
    x.iter_mut().fold(0.0, |sum, v| {
        *v = (*v - shift).exp();
        sum + *v
    })
}

/// `e^x` per lane in AVX-512, for the kernels that exponentiate 16 lanes at a time (softmax,
/// gelu-tanh): `x = n ln2 + r` with |r| <= ln2/2, the AVX2 `exp`'s degree-7 polynomial for
/// `e^r`, then `scalef` by `2^n`. x is clamped to [-87.3, 88.37]: the result stays finite and
/// never subnormal (e^-87.3, about 1e-38, is nothing beside a softmax sum of at least 1).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn exp_avx512(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3)), _mm512_set1_ps(88.37));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
    );
    // ln 2 in two parts, so `n * ln2_hi` is exact.
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm512_set1_ps(1.987_569_1e-4);
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0)));
    _mm512_scalef_ps(p, n)
}

/// [`exp_shifted_sum`] 16 lanes at a time, the last partial 16 under a mask (decode
/// attention's blocks are whole pages of 16 but for the last): half the instructions of the
/// AVX2 loop and no scalar `exp` for the tail. The sum runs in 16 lanes, then a fixed tree.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_shifted_sum_512(x: &mut [f32], shift: f32) -> f32 {
    use std::arch::x86_64::*;
    let (s, mut sum) = (_mm512_set1_ps(shift), _mm512_setzero_ps());
    for start in (0..x.len()).step_by(16) {
        let p = x.as_mut_ptr().add(start);
        let live: __mmask16 = (1u32 << (x.len() - start).min(16)).wrapping_sub(1) as u16;
        let e = exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, p), s));
        _mm512_mask_storeu_ps(p, live, e);
        sum = _mm512_mask_add_ps(sum, live, sum, e);
    }
    _mm512_reduce_add_ps(sum)
}

/// [`Gate::apply`]'s AVX2 loop 16 lanes at a time: [`exp_avx512`] (`scalef` for `2^n`, where
/// AVX2 builds it from the exponent bits and masks the low tail), and the last partial 16
/// under a mask instead of scalar `exp`. The same values as AVX2's but in the clamped tails;
/// on a Zen 4, 12288 values (8 tokens of SmolLM2's MLP) in 3.9 us instead of 6.1.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn apply_512(gate: Gate, g: &mut [f32], up: Option<&[f32]>) {
    use std::arch::x86_64::*;
    if let Some(u) = up {
        assert!(u.len() >= g.len(), "up shorter than the gate");
    }
    let one = _mm512_set1_ps(1.0);
    for start in (0..g.len()).step_by(16) {
        let p = g.as_mut_ptr().add(start);
        let live: __mmask16 = (1u32 << (g.len() - start).min(16)).wrapping_sub(1) as u16;
        let x = _mm512_maskz_loadu_ps(live, p);
        let a = match gate {
            Gate::Silu => _mm512_sub_ps(_mm512_setzero_ps(), x),
            Gate::GeluTanh => {
                let x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
                let inner = _mm512_fmadd_ps(x3, _mm512_set1_ps(0.044715), x);
                _mm512_mul_ps(inner, _mm512_set1_ps(-2.0 * SQRT_2_OVER_PI))
            }
        };
        let mut y = _mm512_div_ps(x, _mm512_add_ps(one, exp_avx512(a)));
        if let Some(u) = up {
            y = _mm512_mul_ps(y, _mm512_maskz_loadu_ps(live, u.as_ptr().add(start)));
        }
        _mm512_mask_storeu_ps(p, live, y);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::Gate;

    /// `e^x` per lane: `x = n ln2 + r` with |r| <= ln2/2, a degree-7 polynomial for `e^r`,
    /// then `2^n` added to the exponent. Above 88.37 the result stays at e^88.37 (finite);
    /// below -87.3, where it would be subnormal, it is 0.
    #[inline(always)]
    unsafe fn exp(x: __m256) -> __m256 {
        let lowest = _mm256_set1_ps(-87.3);
        let normal = _mm256_cmp_ps::<_CMP_GE_OQ>(x, lowest);
        let x = _mm256_min_ps(_mm256_max_ps(x, lowest), _mm256_set1_ps(88.37));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
        // ln 2 in two parts, so `n * ln2_hi` is exact.
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.987_569_1e-4);
        for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0)));
        let scale = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(scale)), normal)
    }

    #[inline(always)]
    unsafe fn exponent(gate: Gate, x: __m256) -> __m256 {
        match gate {
            Gate::Silu => _mm256_sub_ps(_mm256_setzero_ps(), x),
            Gate::GeluTanh => {
                let x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
                let inner = _mm256_fmadd_ps(x3, _mm256_set1_ps(0.044715), x);
                _mm256_mul_ps(inner, _mm256_set1_ps(-2.0 * super::SQRT_2_OVER_PI))
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_in_place(x: &mut [f32]) {
        let n = x.len() / 8 * 8;
        for i in (0..n).step_by(8) {
            let p = x.as_mut_ptr().add(i);
            _mm256_storeu_ps(p, exp(_mm256_loadu_ps(p)));
        }
        x[n..].iter_mut().for_each(|v| *v = v.exp());
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn max_of(x: &[f32]) -> f32 {
        let n = x.len() / 8 * 8;
        let mut top = _mm256_set1_ps(f32::NEG_INFINITY);
        for i in (0..n).step_by(8) {
            top = _mm256_max_ps(top, _mm256_loadu_ps(x.as_ptr().add(i)));
        }
        let mut lanes = [0.0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), top);
        lanes.iter().chain(&x[n..]).fold(f32::NEG_INFINITY, |m, &v| m.max(v))
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_shifted_sum(x: &mut [f32], shift: f32) -> f32 {
        let n = x.len() / 8 * 8;
        let (s, mut sum) = (_mm256_set1_ps(shift), _mm256_setzero_ps());
        for i in (0..n).step_by(8) {
            let p = x.as_mut_ptr().add(i);
            let e = exp(_mm256_sub_ps(_mm256_loadu_ps(p), s));
            _mm256_storeu_ps(p, e);
            sum = _mm256_add_ps(sum, e);
        }
        let mut lanes = [0.0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), sum);
        let mut total: f32 = lanes.iter().sum();
        for v in &mut x[n..] {
            *v = (*v - shift).exp();
            total += *v;
        }
        total
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn apply(gate: Gate, g: &mut [f32], up: Option<&[f32]>) {
        let n = g.len() / 8 * 8;
        let one = _mm256_set1_ps(1.0);
        for i in (0..n).step_by(8) {
            let x = _mm256_loadu_ps(g.as_ptr().add(i));
            let mut y = _mm256_div_ps(x, _mm256_add_ps(one, exp(exponent(gate, x))));
            if let Some(u) = up {
                y = _mm256_mul_ps(y, _mm256_loadu_ps(u[i..i + 8].as_ptr()));
            }
            _mm256_storeu_ps(g.as_mut_ptr().add(i), y);
        }
        gate.apply_scalar(&mut g[n..], up.map(|u| &u[n..]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{isa, Isa};

    /// Every path within a few ulp of the libm reference (plus the exponent's conditioning),
    /// over the whole useful range, tails included (large |x| saturates to 0 or x).
    #[test]
    fn paths_match_the_scalar_reference() {
        let _serial = crate::isa::test_lock();
        let x: Vec<f32> = (0..20_011).map(|i| (i as f32 - 10_000.0) / 97.0).collect();
        let up: Vec<f32> = (0..x.len()).map(|i| ((i * 37) % 11) as f32 - 5.0).collect();
        for gate in [Gate::Silu, Gate::GeluTanh] {
            for with_up in [false, true] {
                let u = with_up.then_some(&up[..]);
                let mut want = x.clone();
                gate.apply_scalar(&mut want, u);
                for path in Isa::available() {
                    isa::set_override(path).unwrap();
                    let mut got = x.clone();
                    gate.apply_serial(&mut got, u);
                    for ((a, b), v) in want.iter().zip(&got).zip(&x) {
                        // e^a turns the exponent's last-bit rounding (fused or not) into a
                        // relative error of |a| ulp; below 1e-30 both are zero for any
                        // purpose (the clamped tails).
                        let ulps = 4.0 + 2.0 * gate.exponent(*v).abs();
                        let tol = ulps * f32::EPSILON * a.abs() + 1e-30;
                        assert!((a - b).abs() <= tol, "{gate:?} {path:?} x={v}: {a} vs {b}");
                    }
                }
            }
        }
        isa::set_override(*Isa::available().last().unwrap()).unwrap();
    }

    #[test]
    fn exp_matches_libm() {
        let _serial = crate::isa::test_lock();
        let x: Vec<f32> = (0..4001).map(|i| (i as f32 - 3000.0) / 33.0).collect();
        for path in Isa::available() {
            isa::set_override(path).unwrap();
            let mut got = x.clone();
            exp_in_place(&mut got);
            for (v, g) in x.iter().zip(&got) {
                let want = v.exp();
                // Results near or below the smallest normal may flush to zero.
                let tol = 4.0 * f32::EPSILON * want + 2.0 * f32::MIN_POSITIVE;
                assert!((g - want).abs() <= tol, "{path:?} e^{v}: {g}");
            }
        }
        isa::set_override(*Isa::available().last().unwrap()).unwrap();
    }

    /// The softmax helpers on every path: the maximum exactly, the weights within exp's
    /// tolerance, and their sum within that plus the rounding of 1000 additions.
    #[test]
    fn softmax_helpers_match_the_scalar_reference() {
        let _serial = crate::isa::test_lock();
        for len in [0, 1, 7, 8, 13, 1000] {
            let x: Vec<f32> = (0..len).map(|i| ((i * 7919) % 211) as f32 / 9.0 - 20.0).collect();
            let want_max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let want: Vec<f32> = x.iter().map(|v| (v - want_max).exp()).collect();
            let want_sum: f32 = want.iter().sum();
            for path in Isa::available() {
                isa::set_override(path).unwrap();
                assert_eq!(max_of(&x), want_max, "{path:?} {len}");
                let mut got = x.clone();
                let sum = exp_shifted_sum(&mut got, want_max);
                for (w, g) in want.iter().zip(&got) {
                    assert!((w - g).abs() <= 4.0 * f32::EPSILON * w + 1e-37, "{path:?}: {w} {g}");
                }
                let tol = (4.0 + len as f32) * f32::EPSILON * want_sum;
                assert!((sum - want_sum).abs() <= tol, "{path:?} {len}: {sum} vs {want_sum}");
            }
        }
        isa::set_override(*Isa::available().last().unwrap()).unwrap();
    }

    #[test]
    fn gelu_is_hf_tanh_form() {
        for x in [-3.0f32, -0.5, 0.0, 0.7, 2.5] {
            let want = 0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh()) * 2.0;
            let mut g = [x];
            Gate::GeluTanh.apply_scalar(&mut g, Some(&[2.0]));
            assert!((g[0] - want).abs() <= 1e-6 * want.abs().max(1.0), "{x}: {} vs {want}", g[0]);
        }
    }
}
