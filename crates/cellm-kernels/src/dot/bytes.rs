//! How the integer kernels multiply bytes: every i32 lane gets sums of four adjacent u8 x i8
//! products. AVX2 needs `vpmaddubsw` (into i16 pairs, which saturate) and then `vpmaddwd`;
//! VNNI's `vpdpbusd` does both in one instruction, straight into i32. The kernels are written
//! once, generic over [`ByteDot`], and compiled once per path with that path's features.

use std::arch::x86_64::*;

pub(super) trait ByteDot {
    /// Whether a run's sums are i16 pairs that the caller must widen before they saturate.
    const NARROW: bool;

    /// `run` plus the products of `u` (unsigned) and `s` (signed): i16 pairs for AVX2, i32
    /// for VNNI.
    unsafe fn step(run: __m256i, u: __m256i, s: __m256i) -> __m256i;

    /// A run's sums as i32 lanes (already so unless NARROW).
    #[inline(always)]
    unsafe fn widen(run: __m256i) -> __m256i {
        run
    }

    /// A run's i32 sums times `m`, an i16 multiplier repeated in both halves of each lane.
    #[inline(always)]
    unsafe fn widen_times(run: __m256i, m: __m256i) -> __m256i {
        _mm256_mullo_epi32(run, _mm256_srai_epi32::<16>(m))
    }

    /// Four-product sums of `u` and `s` per i32 lane, from nothing.
    #[inline(always)]
    unsafe fn dot(u: __m256i, s: __m256i) -> __m256i {
        Self::widen(Self::step(_mm256_setzero_si256(), u, s))
    }

    /// How many chunks one run may sum (at most `wanted`) when each chunk adds, to every i16
    /// pair, two products of at most `max_u * 127` (activations are within +-127): AVX2's
    /// pairs saturate past 32767, VNNI's i32 sums do not come close.
    fn run_chunks(max_u: i32, wanted: usize) -> usize {
        if Self::NARROW {
            let fits = (32767 / (2 * max_u * 127)) as usize;
            assert!(fits >= 1, "products of {max_u} x 127 overflow i16 pairs in one chunk");
            fits.min(wanted)
        } else {
            wanted
        }
    }
}

/// `vpmaddubsw` + `vpmaddwd`.
pub(super) struct Avx2;

impl ByteDot for Avx2 {
    const NARROW: bool = true;

    #[inline(always)]
    unsafe fn step(run: __m256i, u: __m256i, s: __m256i) -> __m256i {
        _mm256_add_epi16(run, _mm256_maddubs_epi16(u, s))
    }

    #[inline(always)]
    unsafe fn widen(run: __m256i) -> __m256i {
        _mm256_madd_epi16(run, _mm256_set1_epi16(1))
    }

    #[inline(always)]
    unsafe fn widen_times(run: __m256i, m: __m256i) -> __m256i {
        _mm256_madd_epi16(run, m)
    }
}

/// The VEX `vpdpbusd` (AVX-VNNI).
pub(super) struct AvxVnni;

impl ByteDot for AvxVnni {
    const NARROW: bool = false;

    #[inline(always)]
    unsafe fn step(run: __m256i, u: __m256i, s: __m256i) -> __m256i {
        _mm256_dpbusd_avx_epi32(run, u, s)
    }
}

/// The EVEX `vpdpbusd` on 256-bit registers (AVX-512 VL + VNNI).
pub(super) struct Avx512Vnni;

impl ByteDot for Avx512Vnni {
    const NARROW: bool = false;

    #[inline(always)]
    unsafe fn step(run: __m256i, u: __m256i, s: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(run, u, s)
    }
}

/// `vpdpbusd`'s exact arithmetic in AVX2 instructions (bytes widened to i16, no saturating
/// step), for tests: it runs the VNNI paths' kernel code on a CPU without VNNI, so that code
/// is checked here and not only where the real instruction exists.
#[cfg(test)]
pub(super) struct EmulatedVnni;

#[cfg(test)]
impl ByteDot for EmulatedVnni {
    const NARROW: bool = false;

    #[inline(always)]
    unsafe fn step(run: __m256i, u: __m256i, s: __m256i) -> __m256i {
        let (u_even, u_odd) =
            (_mm256_and_si256(u, _mm256_set1_epi16(0xFF)), _mm256_srli_epi16::<8>(u));
        let (s_even, s_odd) =
            (_mm256_srai_epi16::<8>(_mm256_slli_epi16::<8>(s)), _mm256_srai_epi16::<8>(s));
        let p =
            _mm256_add_epi32(_mm256_madd_epi16(u_even, s_even), _mm256_madd_epi16(u_odd, s_odd));
        _mm256_add_epi32(run, p)
    }
}

/// The paths as const-generic parameters (an enum cannot be one): entries are instantiated
/// per path and each dispatches to a function compiled with that path's features.
pub(super) const AVX2: u8 = 0;
pub(super) const AVX_VNNI: u8 = 1;
pub(super) const AVX512_VNNI: u8 = 2;
#[cfg(test)]
pub(super) const EMULATED_VNNI: u8 = 3;
