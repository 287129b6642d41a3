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
}

/// One row of quantized activations.
#[derive(Clone, Copy)]
pub struct Q8Row<'a> {
    pub qs: &'a [i8],
    pub ds: &'a [[f32; 2]],
    /// As [`Q8Acts::sums16`].
    pub sums16: &'a [i16],
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

/// Below this many values a batch is quantized on the calling thread.
const PARALLEL_MIN: usize = 1 << 14;

/// Where one batch of rows is quantized to.
struct Dst<'a> {
    qs: &'a mut [i8],
    ds: &'a mut [[f32; 2]],
    sums16: &'a mut [i16],
}

/// Quantizes `x` in groups of `group` (32, or 256 for the K scheme) into `qs`, per-32 `ds` and
/// (K scheme) per-16 sums.
fn quantize_rows(x: &[f32], group: usize, scheme: ActScheme, out: Dst) {
    let Dst { qs, ds, sums16 } = out;
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

impl Q8Acts {
    /// Quantizes each `cols`-wide row of `x`; `cols` must be a multiple of 32, and of 256 for
    /// the K scheme. A long batch (prefill) is split over the thread pool by rows.
    pub fn quantize(x: &[f32], cols: usize, scheme: ActScheme) -> Self {
        let group = if scheme == ActScheme::Q8K { 256 } else { QBLOCK };
        assert!(cols.is_multiple_of(group) && x.len().is_multiple_of(cols.max(1)));
        let rows = x.len() / cols.max(1);
        let per_row = cols / QBLOCK;
        let sums_per_row = if scheme == ActScheme::Q8K { cols / 16 } else { 0 };
        let mut acts = Self {
            cols,
            qs: vec![0; x.len()],
            ds: vec![[0.0; 2]; x.len() / QBLOCK],
            sums16: vec![0; rows * sums_per_row],
        };
        let threads = pool::current_threads();
        if rows < 2 || x.len() < PARALLEL_MIN || threads == 1 {
            let dst = Dst { qs: &mut acts.qs, ds: &mut acts.ds, sums16: &mut acts.sums16 };
            quantize_rows(x, group, scheme, dst);
            return acts;
        }
        let per = rows.div_ceil(threads * 2);
        let (qs, ds, sums) = (
            pool::SharedOut(acts.qs.as_mut_ptr()),
            pool::SharedOut(acts.ds.as_mut_ptr()),
            pool::SharedOut(acts.sums16.as_mut_ptr()),
        );
        pool::parallel_for(rows.div_ceil(per), |i| {
            let r = i * per..((i + 1) * per).min(rows);
            // SAFETY: the tasks' row ranges are disjoint and inside the three buffers.
            let dst = unsafe {
                Dst {
                    qs: std::slice::from_raw_parts_mut(qs.at(r.start * cols), r.len() * cols),
                    ds: std::slice::from_raw_parts_mut(ds.at(r.start * per_row), r.len() * per_row),
                    sums16: std::slice::from_raw_parts_mut(
                        sums.at(r.start * sums_per_row),
                        r.len() * sums_per_row,
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
        Q8Row {
            qs: &self.qs[r * self.cols..(r + 1) * self.cols],
            ds: &self.ds[r * b..(r + 1) * b],
            sums16: &self.sums16[r * s..(r + 1) * s],
        }
    }
}
