//! The machine's float multiply-add peak: independent FMA chains in the widest vectors the
//! selected path has (AVX-512 on the `Avx512Vnni` path, AVX2, NEON; plain floats on the
//! scalar path), no memory operand. Benchmarks report GEMM rates against it.

use crate::isa::{self, Isa};
use crate::pool::parallel_for;

/// Independent accumulators per thread: more than FMA latency x FMA ports on any current
/// core (4 x 2 on Zen 5 and Sapphire Rapids), so the chains never wait.
const CHAINS: usize = 16;

/// Multiply-adds per loop step of `isa`'s chains (vector lanes x CHAINS).
fn lanes(isa: Isa) -> usize {
    let width = match isa {
        Isa::Avx512Vnni => 16,
        Isa::Avx2 | Isa::AvxVnni => 8,
        Isa::Neon | Isa::NeonDotprod => 4,
        Isa::Scalar => 1,
    };
    width * CHAINS
}

/// Runs `steps` steps of the selected path's FMA chains on every thread of the installed
/// pool (`threads` tasks); returns the floating-point operations done (2 per multiply-add).
pub fn fma_chains(threads: usize, steps: usize) -> f64 {
    let isa = isa::selected();
    parallel_for(threads, |_| {
        let sink = run(isa, steps);
        std::hint::black_box(sink);
    });
    2.0 * (threads * steps * lanes(isa)) as f64
}

fn run(isa: Isa, steps: usize) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: the selected path is supported by this CPU (`isa::selected`), and the
        // AVX-512 path implies AVX-512F, the AVX2 paths AVX2 + FMA.
        if isa == Isa::Avx512Vnni {
            return unsafe { x86::chains_avx512(steps) };
        }
        if isa.has_avx2() {
            return unsafe { x86::chains_avx2(steps) };
        }
    }
    #[cfg(target_arch = "aarch64")]
    if isa.has_neon() {
        // SAFETY: as above, NEON is supported.
        return unsafe { arm::chains_neon(steps) };
    }
    chains_scalar(steps)
}

fn chains_scalar(steps: usize) -> f32 {
    let mut acc = [0.0f32; CHAINS];
    let (a, b) = std::hint::black_box((0.999f32, 1e-3f32));
    for _ in 0..steps {
        acc.iter_mut().for_each(|x| *x = x.mul_add(a, b));
    }
    acc.iter().sum()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::CHAINS;

    #[target_feature(enable = "avx512f")]
    pub unsafe fn chains_avx512(steps: usize) -> f32 {
        let (a, b) = std::hint::black_box((0.999f32, 1e-3f32));
        let (a, b) = (_mm512_set1_ps(a), _mm512_set1_ps(b));
        let mut acc = [_mm512_setzero_ps(); CHAINS];
        for _ in 0..steps {
            for x in acc.iter_mut() {
                *x = _mm512_fmadd_ps(*x, a, b);
            }
        }
        let sum = acc.iter().fold(_mm512_setzero_ps(), |s, x| _mm512_add_ps(s, *x));
        _mm512_reduce_add_ps(sum)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn chains_avx2(steps: usize) -> f32 {
        let (a, b) = std::hint::black_box((0.999f32, 1e-3f32));
        let (a, b) = (_mm256_set1_ps(a), _mm256_set1_ps(b));
        let mut acc = [_mm256_setzero_ps(); CHAINS];
        for _ in 0..steps {
            for x in acc.iter_mut() {
                *x = _mm256_fmadd_ps(*x, a, b);
            }
        }
        let sum = acc.iter().fold(_mm256_setzero_ps(), |s, x| _mm256_add_ps(s, *x));
        let mut out = [0.0f32; 8];
        _mm256_storeu_ps(out.as_mut_ptr(), sum);
        out.iter().sum()
    }
}

#[cfg(target_arch = "aarch64")]
mod arm {
    use std::arch::aarch64::*;

    use super::CHAINS;

    #[target_feature(enable = "neon")]
    pub unsafe fn chains_neon(steps: usize) -> f32 {
        let (a, b) = std::hint::black_box((0.999f32, 1e-3f32));
        let (a, b) = (vdupq_n_f32(a), vdupq_n_f32(b));
        let mut acc = [vdupq_n_f32(0.0); CHAINS];
        for _ in 0..steps {
            for x in acc.iter_mut() {
                *x = vfmaq_f32(b, *x, a);
            }
        }
        let sum = acc.iter().fold(vdupq_n_f32(0.0), |s, x| vaddq_f32(s, *x));
        vaddvq_f32(sum)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every path's chains compute the same recurrence x <- 0.999 x + 0.001 from 0: each
    /// lane tends to 1 - 0.999^steps, so all paths agree with the scalar chains (a chain
    /// skipped or a lane lost changes the sum by a whole lane's value).
    #[test]
    fn chains_compute_the_recurrence() {
        let steps = 1000;
        let one = 1.0 - 0.999f64.powi(steps as i32);
        for path in Isa::available() {
            let got = f64::from(run(path, steps));
            let lanes = (lanes(path)) as f64;
            assert!((got - lanes * one).abs() < 1e-3 * lanes, "{path:?}: {got} vs {}", lanes * one);
        }
    }
}
