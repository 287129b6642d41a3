//! Activations quantized to int8 once per matmul, in blocks of 32 with one f32 scale `d` and
//! the block's scaled sum `s = d * sum(q)` (for formats with an offset term). Weight formats with
//! integer kernels then run on integer dot products.
//!
//! The quantization follows llama.cpp's activation formats for the same weight format, so a
//! GGUF model computes what llama.cpp computes: q8_0 (f16 scale) for q4_0/q5_0/q8_0 weights,
//! q8_1 (f16 scale and sum) for q4_1, and q8_K (one f32 scale per 256 values, set by the
//! signed extreme) for the K-quants.

use cellm_format::TensorFormat;
use half::f16;

use crate::pool;

#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
const _: () = assert!(avx512::QBLOCK == QBLOCK);

/// Elements per activation block; every integer-kernel format's blocks are multiples of it.
pub const QBLOCK: usize = 32;

/// How activations are quantized for a weight format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActScheme {
    /// Per 32: d = max|x| / 127 rounded to f16 (s = d * sum(q) in f32).
    Q8_0,
    /// As Q8_0, and s = d * sum(q) rounded to f16.
    Q8_1,
    /// Per 256: d = -max/127 for the value of largest magnitude (so it maps to -127), f32.
    Q8K,
}

impl ActScheme {
    pub fn for_format(format: TensorFormat) -> Self {
        match format {
            TensorFormat::Q4_1 => Self::Q8_1,
            TensorFormat::Q4K | TensorFormat::Q5K | TensorFormat::Q6K => Self::Q8K,
            _ => Self::Q8_0,
        }
    }
}

/// `rows x cols` activations as int8 blocks.
#[derive(Debug, Default, Clone)]
pub struct Q8Acts {
    pub cols: usize,
    pub qs: Vec<i8>,
    /// Per block: the scale `d` and the scaled sum `s`, side by side so one load gets both.
    pub ds: Vec<[f32; 2]>,
    /// K scheme only: the integer sum of every 16 values, for q6_k's `-32` offset (its
    /// sub-blocks are 16 long). Empty for the other schemes.
    pub sums16: Vec<i16>,
    /// Per-32 schemes: the integer sum of every block (at most 32 * 127 in magnitude), for
    /// kernels that multiply offset bytes (q8_0's pair kernel). Empty for the K scheme.
    pub sums32: Vec<i16>,
}

/// One row of quantized activations.
#[derive(Clone, Copy)]
pub struct Q8Row<'a> {
    pub qs: &'a [i8],
    pub ds: &'a [[f32; 2]],
    /// As [`Q8Acts::sums16`].
    pub sums16: &'a [i16],
    /// As [`Q8Acts::sums32`].
    pub sums32: &'a [i16],
}

/// `dst = round(src * inv)`, ties to even as llama.cpp's SIMD quantizers round; the K
/// scheme's +128 clamps to 127.
fn round_block(src: &[f32], inv: f32, dst: &mut [i8]) {
    #[cfg(target_arch = "x86_64")]
    if crate::Isa::Avx2.supported() {
        // SAFETY: AVX2 was just checked.
        return unsafe { round_block_avx2(src, inv, dst) };
    }
    round_block_portable(src, inv, dst);
}

#[inline(always)]
fn round_block_portable(src: &[f32], inv: f32, dst: &mut [i8]) {
    for (q, v) in dst.iter_mut().zip(src) {
        *q = (v * inv).round_ties_even().min(127.0) as i8;
    }
}

/// The same loop, compiled with AVX2 so it vectorizes (`vroundps`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn round_block_avx2(src: &[f32], inv: f32, dst: &mut [i8]) {
    round_block_portable(src, inv, dst);
}

fn round_f16(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

/// Below this many values a batch is quantized on the calling thread. A split costs a
/// fork-join, and each task moves its f32 rows to another core and its int8 rows back,
/// which the products then read on every thread anyway. Where the cores are far apart that
/// dominates: on session 31's VM (two vCPUs ~400 ns apart, a cache line's round trip) a
/// product's setup for 8 decoding sessions (8 x 576 values) took 8.5 us with them split over
/// two threads against 5.8 us on the caller, and a SmolLM2 step of 8 sessions went 9.3 ->
/// 8.6 ms (processes alternated). An earlier VM had measured the split ~3% faster at this
/// size. Prefill batches (from 64 tokens of 576) still split.
const PARALLEL_MIN: usize = 1 << 15;

/// Where one batch of rows is quantized to.
struct Dst<'a> {
    qs: &'a mut [i8],
    ds: &'a mut [[f32; 2]],
    sums16: &'a mut [i16],
    sums32: &'a mut [i16],
}

/// Quantizes `x` in groups of `group` (32, or 256 for the K scheme) into `qs`, per-32 `ds` and
/// (K scheme) per-16 sums.
fn quantize_rows(x: &[f32], group: usize, scheme: ActScheme, out: Dst) {
    #[cfg(target_arch = "x86_64")]
    if scheme != ActScheme::Q8K && crate::Isa::Avx2.supported() {
        // SAFETY: AVX2 and FMA (every AVX2 path's baseline) were just checked.
        let q8_1 = scheme == ActScheme::Q8_1;
        let Dst { qs, ds, sums32, .. } = out;
        // Whole groups of 16 blocks on AVX-512, the rest on AVX2 (the same arithmetic).
        let wide = if is_x86_feature_detected!("avx512f") {
            x.len() / (avx512::BLOCKS * QBLOCK) * avx512::BLOCKS
        } else {
            0
        };
        let (x0, x1) = x.split_at(wide * QBLOCK);
        let (qs0, qs1) = qs.split_at_mut(wide * QBLOCK);
        let (ds0, ds1) = ds.split_at_mut(wide);
        let (sums0, sums1) = sums32.split_at_mut(wide);
        // SAFETY: AVX-512F was just checked for the first part (the split keeps the four
        // slices' lengths in step).
        unsafe {
            if wide > 0 {
                avx512::quantize_blocks(x0, q8_1, qs0, ds0, sums0);
            }
            return quantize_rows_avx2(x1, q8_1, qs1, ds1, sums1);
        }
    }
    let Dst { qs, ds, sums16, sums32 } = out;
    let mut sums32 = sums32.iter_mut();
    let blocks = ds.chunks_exact_mut(group / QBLOCK);
    for ((src, dst), ds) in x.chunks_exact(group).zip(qs.chunks_exact_mut(group)).zip(blocks) {
        let (d, inv) = match scheme {
            ActScheme::Q8K => {
                let max = src.iter().fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
                if max == 0.0 {
                    (0.0, 0.0)
                } else {
                    let iscale = -127.0 / max;
                    (1.0 / iscale, iscale)
                }
            }
            _ => {
                let amax = src.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                (d, if d > 0.0 { 1.0 / d } else { 0.0 })
            }
        };
        round_block(src, inv, dst);
        for (block, out) in dst.chunks_exact(QBLOCK).zip(ds.iter_mut()) {
            let sum: i32 = block.iter().map(|&q| i32::from(q)).sum();
            if let Some(s) = sums32.next() {
                *s = sum as i16;
            }
            *out = match scheme {
                // llama.cpp's q8_0 has no sum; the unsigned kernels use it for offsets.
                ActScheme::Q8_0 => [round_f16(d), round_f16(d) * sum as f32],
                ActScheme::Q8_1 => [round_f16(d), round_f16(d * sum as f32)],
                ActScheme::Q8K => [d, d * sum as f32],
            };
        }
    }
    if scheme == ActScheme::Q8K {
        for (sum, q) in sums16.iter_mut().zip(qs.chunks_exact(16)) {
            // |sum| <= 16 * 128, well inside i16.
            *sum = q.iter().map(|&v| i16::from(v)).sum();
        }
    }
}

/// [`quantize_rows`] for the two per-32 schemes in AVX2: the same arithmetic (the largest
/// magnitude, `1 / (amax / 127)`, products rounded ties-to-even, an integer sum), eight
/// lanes at a time instead of a scalar loop per block.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_rows_avx2(
    x: &[f32],
    q8_1: bool,
    qs: &mut [i8],
    ds: &mut [[f32; 2]],
    sums32: &mut [i16],
) {
    use std::arch::x86_64::*;
    debug_assert!(x.len() == qs.len() && x.len() == ds.len() * QBLOCK);
    let sign = _mm256_set1_ps(-0.0);
    let top = _mm256_set1_ps(127.0);
    let blocks = x.chunks_exact(QBLOCK).zip(qs.chunks_exact_mut(QBLOCK));
    for (((src, dst), out), isum) in blocks.zip(ds).zip(sums32) {
        // (No closures: they would not inherit the target features.)
        let p = src.as_ptr();
        let v = [
            _mm256_loadu_ps(p),
            _mm256_loadu_ps(p.add(8)),
            _mm256_loadu_ps(p.add(16)),
            _mm256_loadu_ps(p.add(24)),
        ];
        let m = _mm256_max_ps(
            _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
            _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])),
        );
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        let d = amax / 127.0;
        let inv = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
        let mut q = [_mm256_setzero_si256(); 4];
        for (q, v) in q.iter_mut().zip(v) {
            let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm256_mul_ps(v, inv),
            );
            *q = _mm256_cvtps_epi32(_mm256_min_ps(r, top));
        }
        let s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        let sum = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s)));
        // Packing works per 128-bit lane: words come out as q0.lo q1.lo q0.hi q1.hi, bytes
        // as (q01, q23) interleaved by lane; one permute of dwords restores the order.
        let w01 = _mm256_packs_epi32(q[0], q[1]);
        let w23 = _mm256_packs_epi32(q[2], q[3]);
        let b = _mm256_packs_epi16(w01, w23);
        let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(dst.as_mut_ptr().cast(), b);
        let dh = round_f16(d);
        *isum = sum as i16;
        *out = if q8_1 { [dh, round_f16(d * sum as f32)] } else { [dh, dh * sum as f32] };
    }
}

impl Q8Acts {
    /// Quantizes each `cols`-wide row of `x`; `cols` must be a multiple of 32, and of 256 for
    /// the K scheme. A long batch (prefill) is split over the thread pool by rows.
    pub fn quantize(x: &[f32], cols: usize, scheme: ActScheme) -> Self {
        let group = if scheme == ActScheme::Q8K { 256 } else { QBLOCK };
        assert!(cols.is_multiple_of(group) && x.len().is_multiple_of(cols.max(1)));
        let rows = x.len() / cols.max(1);
        let per_row = cols / QBLOCK;
        let sums_per_row = if scheme == ActScheme::Q8K { cols / 16 } else { 0 };
        let sums32_per_row = if scheme == ActScheme::Q8K { 0 } else { per_row };
        let mut acts = Self {
            cols,
            qs: vec![0; x.len()],
            ds: vec![[0.0; 2]; x.len() / QBLOCK],
            sums16: vec![0; rows * sums_per_row],
            sums32: vec![0; rows * sums32_per_row],
        };
        let threads = pool::current_threads();
        if rows < 2 || x.len() < PARALLEL_MIN || threads == 1 {
            let dst = Dst {
                qs: &mut acts.qs,
                ds: &mut acts.ds,
                sums16: &mut acts.sums16,
                sums32: &mut acts.sums32,
            };
            quantize_rows(x, group, scheme, dst);
            return acts;
        }
        let per = rows.div_ceil(threads * 2);
        let (qs, ds, sums) = (
            pool::SharedOut(acts.qs.as_mut_ptr()),
            pool::SharedOut(acts.ds.as_mut_ptr()),
            pool::SharedOut(acts.sums16.as_mut_ptr()),
        );
        let sums32 = pool::SharedOut(acts.sums32.as_mut_ptr());
        pool::parallel_for(rows.div_ceil(per), |i| {
            let r = i * per..((i + 1) * per).min(rows);
            // SAFETY: the tasks' row ranges are disjoint and inside the four buffers.
            let dst = unsafe {
                Dst {
                    qs: std::slice::from_raw_parts_mut(qs.at(r.start * cols), r.len() * cols),
                    ds: std::slice::from_raw_parts_mut(ds.at(r.start * per_row), r.len() * per_row),
                    sums16: std::slice::from_raw_parts_mut(
                        sums.at(r.start * sums_per_row),
                        r.len() * sums_per_row,
                    ),
                    sums32: std::slice::from_raw_parts_mut(
                        sums32.at(r.start * sums32_per_row),
                        r.len() * sums32_per_row,
                    ),
                }
            };
            quantize_rows(&x[r.start * cols..r.end * cols], group, scheme, dst);
        });
        acts
    }

    pub fn row(&self, r: usize) -> Q8Row<'_> {
        let b = self.cols / QBLOCK;
        let s = if self.sums16.is_empty() { 0 } else { self.cols / 16 };
        let s32 = if self.sums32.is_empty() { 0 } else { b };
        Q8Row {
            qs: &self.qs[r * self.cols..(r + 1) * self.cols],
            ds: &self.ds[r * b..(r + 1) * b],
            sums16: &self.sums16[r * s..(r + 1) * s],
            sums32: &self.sums32[r * s32..(r + 1) * s32],
        }
    }
}

// The one test is of the x86 quantizer.
#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// `blocks` blocks of mixed signs and magnitudes, the second all zero, the third with a
    /// tie at .5 after scaling.
    fn test_blocks(blocks: usize) -> Vec<f32> {
        let mut x: Vec<f32> = (0..blocks * QBLOCK)
            .map(|i| (((i * 2654435761usize) >> 9) % 2001) as f32 / 1000.0 - 1.0)
            .map(|v| v * (1 + (v.to_bits() % 7)) as f32)
            .collect();
        x[QBLOCK..2 * QBLOCK].fill(0.0);
        // 127 and -63.5 scale to 127 and -63.5: a tie.
        x[2 * QBLOCK] = 127.0;
        x[2 * QBLOCK + 1] = -63.5;
        x
    }

    /// The AVX-512 quantizer (sixteen blocks at a time) gives bitwise what the AVX2 loop
    /// gives, over five groups of sixteen blocks whose magnitudes differ block to block, with
    /// zero blocks and a tie.
    #[test]
    fn avx512_quantizer_equals_the_avx2_loop() {
        if !crate::Isa::Avx2.supported() || !is_x86_feature_detected!("avx512f") {
            return;
        }
        let blocks = 5 * avx512::BLOCKS;
        let mut x = test_blocks(blocks);
        // Rescaled block by block, except block 2, which keeps its tie.
        for (b, block) in x.chunks_exact_mut(QBLOCK).enumerate().filter(|(b, _)| *b != 2) {
            block.iter_mut().for_each(|v| *v *= (b % 11) as f32 * 0.37 + 0.01);
        }
        x[5 * QBLOCK..6 * QBLOCK].fill(0.0);
        for q8_1 in [false, true] {
            let run = |wide: bool| {
                let mut qs = vec![0i8; x.len()];
                let mut ds = vec![[0.0f32; 2]; blocks];
                let mut sums = vec![0i16; blocks];
                // SAFETY: AVX2 and AVX-512F checked above.
                unsafe {
                    if wide {
                        avx512::quantize_blocks(&x, q8_1, &mut qs, &mut ds, &mut sums);
                    } else {
                        quantize_rows_avx2(&x, q8_1, &mut qs, &mut ds, &mut sums);
                    }
                }
                let bits: Vec<u32> = ds.iter().flatten().map(|f| f.to_bits()).collect();
                (qs, bits, sums)
            };
            assert!(run(true) == run(false), "q8_1 {q8_1}");
        }
    }

    /// The AVX2 quantizer of the per-32 schemes gives bitwise what the scalar loop gives:
    /// blocks of mixed signs and magnitudes, an all-zero block, ties at .5 after scaling.
    #[test]
    fn avx2_quantizer_equals_the_scalar_loop() {
        if !crate::Isa::Avx2.supported() {
            return;
        }
        let blocks = 64;
        let x = test_blocks(blocks);
        for scheme in [ActScheme::Q8_0, ActScheme::Q8_1] {
            let mut qs = vec![0i8; x.len()];
            let mut ds = vec![[0.0f32; 2]; blocks];
            let mut sums = vec![0i16; blocks];
            let q8_1 = scheme == ActScheme::Q8_1;
            // SAFETY: AVX2 checked above.
            unsafe { quantize_rows_avx2(&x, q8_1, &mut qs, &mut ds, &mut sums) };
            let (mut want_qs, mut want_ds) = (vec![0i8; x.len()], vec![[0.0f32; 2]; blocks]);
            let mut want_sums = Vec::new();
            for ((src, dst), out) in
                x.chunks_exact(QBLOCK).zip(want_qs.chunks_exact_mut(QBLOCK)).zip(&mut want_ds)
            {
                let amax = src.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                round_block_portable(src, if d > 0.0 { 1.0 / d } else { 0.0 }, dst);
                let sum: i32 = dst.iter().map(|&q| i32::from(q)).sum();
                want_sums.push(sum as i16);
                *out = match scheme {
                    ActScheme::Q8_1 => [round_f16(d), round_f16(d * sum as f32)],
                    _ => [round_f16(d), round_f16(d) * sum as f32],
                };
            }
            assert_eq!(qs, want_qs, "{scheme:?}");
            assert_eq!(sums, want_sums, "{scheme:?}");
            let bits = |v: &[[f32; 2]]| v.iter().flatten().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&ds), bits(&want_ds), "{scheme:?}");
        }
    }
}
