//! Matrix products against stored weights: `out[t, n] = dot(x[t, :], W[n, :])`.
//!
//! Work is split over blocks of weight rows so each row is read from memory once per call and
//! reused for every token of the batch while it sits in L1.

use cellm_format::{Interleaved, Tensor, TensorFormat, INTERLEAVE};

use crate::acts::{ActScheme, Q8Acts, Q8Row, QBLOCK};
use crate::dot::x8::{self, QDotX8Fn};
use crate::dot::{group_kernel, kernels};
use crate::isa;
use crate::pool::{self, SharedOut};

/// Below this many multiply-adds a call runs on the calling thread: fork-join costs more.
const PARALLEL_MIN_WORK: usize = 1 << 15;

/// `out` (`tokens x rows(w)`) = `x` (`tokens x cols(w)`) times `w` transposed. Formats with an
/// integer kernel get `x` quantized to int8 blocks once, here, for all their rows.
pub fn matmul(x: &[f32], tokens: usize, w: &Tensor, out: &mut [f32]) {
    let (n, k) = w.rows_cols();
    matmul_raw(x, tokens, WeightRows { format: w.format, bytes: w.bytes(), rows: n, cols: k }, out);
}

/// A weight matrix as stored: `rows` rows of `cols` elements in `format`.
#[derive(Clone, Copy)]
pub struct WeightRows<'a> {
    pub format: TensorFormat,
    pub bytes: &'a [u8],
    pub rows: usize,
    pub cols: usize,
}

/// [`matmul`] on raw stored rows (`bytes` must hold exactly `rows` rows).
pub fn matmul_raw(x: &[f32], tokens: usize, w: WeightRows, out: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    assert_eq!(w.format.nbytes(&[n, k]), Some(w.bytes.len()), "matmul: weight size");
    assert_eq!(x.len(), tokens * k, "matmul: activations do not match the weight");
    assert_eq!(out.len(), tokens * n, "matmul: output does not match the weight");
    if let Some(Interleaved { base, .. }) = w.format.interleaved() {
        let kern = group_kernel(w.format, isa::selected()).expect("interleaved kernel");
        let acts = Q8Acts::quantize(x, k, ActScheme::for_format(base));
        return groups_times_tokens(w, &acts, tokens, out, kern);
    }
    let kern = kernels(w.format, isa::selected());
    match kern.qdot {
        Some((one, four)) if k.is_multiple_of(w.format.block_len().max(QBLOCK)) => {
            let acts = Q8Acts::quantize(x, k, ActScheme::for_format(w.format));
            rows_times_tokens(w, tokens, out, |row, t, n, dst| {
                if n == 4 {
                    *dst = four(
                        row,
                        &[acts.row(t), acts.row(t + 1), acts.row(t + 2), acts.row(t + 3)],
                    );
                } else {
                    (0..n).for_each(|i| dst[i] = one(row, acts.row(t + i)));
                }
            });
        }
        _ => rows_times_tokens(w, tokens, out, |row, t, n, dst| {
            (0..n).for_each(|i| dst[i] = (kern.dot)(row, &x[(t + i) * k..(t + i + 1) * k]));
        }),
    }
}

/// `out[t, r]` for every token and weight row: `f(row, t, n, dst)` fills `dst[..n]` with the
/// results of tokens `t..t + n` (n <= 4). Split over blocks of weight rows so each row is read
/// from memory once and reused for every token while it sits in L1.
fn rows_times_tokens(
    w: WeightRows,
    tokens: usize,
    out: &mut [f32],
    f: impl Fn(&[u8], usize, usize, &mut [f32; 4]) + Sync,
) {
    let (n, k, bytes) = (w.rows, w.cols, w.bytes);
    let stride = bytes.len() / n.max(1);
    let dst = SharedOut(out.as_mut_ptr());
    let run_block = |rows: std::ops::Range<usize>| {
        for r in rows {
            let row = &bytes[r * stride..(r + 1) * stride];
            let mut vals = [0.0f32; 4];
            for t in (0..tokens).step_by(4) {
                let count = (tokens - t).min(4);
                f(row, t, count, &mut vals);
                for (i, v) in vals[..count].iter().enumerate() {
                    // SAFETY: each task owns a distinct block of rows `r`, and (t + i) * n + r
                    // is below tokens * n, the length of `out`.
                    unsafe { *dst.at((t + i) * n + r) = *v };
                }
            }
        }
    };
    let threads = pool::current_threads();
    if n * k * tokens < PARALLEL_MIN_WORK || threads == 1 {
        run_block(0..n);
        return;
    }
    // A few blocks per thread evens out uneven progress; whole 8-row blocks keep writes to
    // `out` in separate cache lines.
    let per = n.div_ceil(threads * 4).next_multiple_of(8);
    pool::parallel_for(n.div_ceil(per), |b| run_block(b * per..((b + 1) * per).min(n)));
}

/// `out[t, r]` for an interleaved format: each task takes whole groups of 8 rows, and each
/// group is read once per 4 tokens.
fn groups_times_tokens(
    w: WeightRows,
    acts: &Q8Acts,
    tokens: usize,
    out: &mut [f32],
    kern: QDotX8Fn,
) {
    let (n, k) = (w.rows, w.cols);
    let groups = n / INTERLEAVE;
    let stride = w.bytes.len() / groups.max(1);
    let dst = SharedOut(out.as_mut_ptr());
    let rows: Vec<Q8Row> = (0..tokens).map(|t| acts.row(t)).collect();
    let run_groups = |range: std::ops::Range<usize>| {
        let mut vals = [[0.0f32; INTERLEAVE]; x8::MAX_TOKENS];
        for g in range {
            let group = &w.bytes[g * stride..(g + 1) * stride];
            for t in (0..tokens).step_by(x8::MAX_TOKENS) {
                let count = (tokens - t).min(x8::MAX_TOKENS);
                kern(group, &rows[t..t + count], &mut vals[..count]);
                for (i, v) in vals[..count].iter().enumerate() {
                    // SAFETY: each task owns distinct groups `g`, and the 8 values end at
                    // (t + i) * n + 8g + 8 <= tokens * n, the length of `out`.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            v.as_ptr(),
                            dst.at((t + i) * n + g * INTERLEAVE),
                            INTERLEAVE,
                        )
                    };
                }
            }
        }
    };
    let threads = pool::current_threads();
    if n * k * tokens < PARALLEL_MIN_WORK || threads == 1 {
        run_groups(0..groups);
        return;
    }
    // Pairs of groups keep each task's writes to `out` in whole cache lines.
    let per = groups.div_ceil(threads * 4).next_multiple_of(2);
    pool::parallel_for(groups.div_ceil(per), |b| run_groups(b * per..((b + 1) * per).min(groups)));
}

/// Decodes row `r` of `w` into `out` (embedding lookup).
pub fn decode_row(w: &Tensor, r: usize, out: &mut [f32]) {
    let (n, k) = w.rows_cols();
    assert!(r < n && out.len() == k, "decode_row: row {r} of {w:?}");
    decode_row_raw(WeightRows { format: w.format, bytes: w.bytes(), rows: n, cols: k }, r, out);
}

/// [`decode_row`] on raw stored rows; an interleaved row is first taken out of its group.
pub fn decode_row_raw(w: WeightRows, r: usize, out: &mut [f32]) {
    assert!(r < w.rows && out.len() == w.cols, "decode_row: row {r} of {} rows", w.rows);
    if let Some(Interleaved { base, .. }) = w.format.interleaved() {
        let stride = w.bytes.len() / (w.rows / INTERLEAVE);
        let g = r / INTERLEAVE;
        let mut row = Vec::with_capacity(stride / INTERLEAVE);
        x8::row_of_group(
            w.format,
            &w.bytes[g * stride..(g + 1) * stride],
            r % INTERLEAVE,
            &mut row,
        );
        return (kernels(base, isa::selected()).decode)(&row, out);
    }
    let stride = w.bytes.len() / w.rows;
    (kernels(w.format, isa::selected()).decode)(&w.bytes[r * stride..(r + 1) * stride], out);
}
