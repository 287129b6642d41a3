//! Matrix products against stored weights: `out[t, n] = dot(x[t, :], W[n, :])`.
//!
//! Work is split over blocks of weight rows so each row is read from memory once per call and
//! reused for every token of the batch while it sits in L1.

use cellm_format::Tensor;
use rayon::prelude::*;

use crate::dot::{kernels, RowKernels};
use crate::isa;

/// Below this many multiply-adds a call runs on the calling thread: fork-join costs more.
const PARALLEL_MIN_WORK: usize = 1 << 15;

/// A raw output pointer that blocks of disjoint rows may write through in parallel.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: each parallel task writes only the columns of its own row block.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// Taking `self` whole makes closures capture the Send wrapper, not the raw field.
    fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

/// `out` (`tokens x rows(w)`) = `x` (`tokens x cols(w)`) times `w` transposed.
pub fn matmul(x: &[f32], tokens: usize, w: &Tensor, out: &mut [f32]) {
    let (n, k) = w.rows_cols();
    assert_eq!(x.len(), tokens * k, "matmul: activations do not match {w:?}");
    assert_eq!(out.len(), tokens * n, "matmul: output does not match {w:?}");
    let kern = kernels(w.format, isa::selected());
    let bytes = w.bytes();
    let stride = bytes.len() / n.max(1);
    let dst = SharedOut(out.as_mut_ptr());
    let run_block = |rows: std::ops::Range<usize>| {
        // SAFETY: `rows` is a distinct block for each task and every index stays below
        // tokens * n, the length of `out`.
        block(&kern, bytes, stride, rows, x, k, tokens, n, |i, v| unsafe { *dst.at(i) = v });
    };
    if n * k * tokens < PARALLEL_MIN_WORK || rayon::current_num_threads() == 1 {
        run_block(0..n);
        return;
    }
    let tasks = rayon::current_num_threads() * 4;
    let per = n.div_ceil(tasks).next_multiple_of(8).max(8);
    (0..n.div_ceil(per)).into_par_iter().for_each(|b| run_block(b * per..((b + 1) * per).min(n)));
}

#[allow(clippy::too_many_arguments)]
#[inline]
fn block(
    kern: &RowKernels,
    bytes: &[u8],
    stride: usize,
    rows: std::ops::Range<usize>,
    x: &[f32],
    k: usize,
    tokens: usize,
    n: usize,
    mut store: impl FnMut(usize, f32),
) {
    for r in rows {
        let row = &bytes[r * stride..(r + 1) * stride];
        for t in 0..tokens {
            store(t * n + r, (kern.dot)(row, &x[t * k..(t + 1) * k]));
        }
    }
}

/// Decodes row `r` of `w` into `out` (embedding lookup).
pub fn decode_row(w: &Tensor, r: usize, out: &mut [f32]) {
    let (n, k) = w.rows_cols();
    assert!(r < n && out.len() == k, "decode_row: row {r} of {w:?}");
    let bytes = w.bytes();
    let stride = bytes.len() / n;
    (kernels(w.format, isa::selected()).decode)(&bytes[r * stride..(r + 1) * stride], out);
}
