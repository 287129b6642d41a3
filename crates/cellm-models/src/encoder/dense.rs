//! An encoder's linear layers over a block of tokens, with what follows each product done as
//! the GEMM stores its outputs: the bias, then GELU or the residual add. Float weights run
//! on the f32 GEMM (`cellm_kernels::gemm`) with the activations packed once for every weight
//! of the same input (q, k and v), and each output tile goes through the epilogue while it
//! is still in L1; other formats take `matmul` and the epilogue as a pass over its output.
//!
//! Outputs are written into rows of a wider buffer (`stride`, `offset`), so q, k and v land
//! side by side in one `tokens x 3 hidden` buffer that attention reads in place.

use cellm_format::TensorFormat;
use cellm_kernels::gelu::gelu_in_place;
use cellm_kernels::gemm::{pack_tokens, FloatGemm};
use cellm_kernels::panel::PANEL_ROWS;
use cellm_kernels::pool::{parallel_for, SharedOut};
use cellm_kernels::{isa, matmul_raw, WeightRows};

use crate::blocks::Linear;

/// What is done to `x W^T + b` as it is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Epilogue {
    /// `out = y`.
    Store,
    /// `out += y` (a residual connection).
    Add,
    /// `out = gelu(y)` (the exact, erf GELU).
    Gelu,
}

/// Where one linear's outputs go: columns `offset..offset + rows` of rows `stride` wide.
pub(crate) struct Target<'a> {
    pub linear: &'a Linear,
    pub offset: usize,
}

/// `out[t * stride + offset + r] (epilogue)= (x W^T + b)[t, r]` for each target, `x` being
/// `tokens x cols`. `split`: tasks per product for the installed pool (1: this thread only).
pub(crate) fn dense(
    x: &[f32],
    tokens: usize,
    targets: &[Target],
    out: &mut [f32],
    stride: usize,
    epilogue: Epilogue,
    split: usize,
) {
    let Some(first) = targets.first() else { return };
    let cols = first.linear.weight.rows_cols().1;
    assert_eq!(x.len(), tokens * cols, "dense: activations do not match the weight");
    for t in targets {
        let (rows, c) = t.linear.weight.rows_cols();
        assert_eq!(c, cols, "dense: weights of one input differ in width");
        assert!(t.offset + rows <= stride, "dense: output columns past the row");
    }
    assert_eq!(out.len(), tokens * stride, "dense: output is not tokens x stride");
    if tokens == 0 {
        return;
    }
    let float = targets.iter().all(|t| is_float(t.linear.weight.format));
    if !float {
        for t in targets {
            unpacked(x, tokens, t, out, stride, epilogue);
        }
        return;
    }
    let packed = pack_tokens(x, tokens, cols);
    let gemms: Vec<FloatGemm> = targets
        .iter()
        .map(|t| FloatGemm::new(WeightRows::of(&t.linear.weight), isa::selected()))
        .collect();
    // Tasks: (target, rows), row ranges in whole panels.
    let mut tasks = Vec::new();
    for (i, t) in targets.iter().enumerate() {
        let rows = t.linear.weight.rows_cols().0;
        let per = rows.div_ceil(split.max(1)).next_multiple_of(PANEL_ROWS);
        tasks.extend((0..rows).step_by(per).map(|s| (i, s..(s + per).min(rows))));
    }
    let outp = SharedOut(out.as_mut_ptr());
    parallel_for(tasks.len(), |task| {
        let (i, rows) = (tasks[task].0, tasks[task].1.clone());
        let (t, gemm) = (&targets[i], &gemms[i]);
        let bias = bias_of(t.linear);
        gemm.run(&packed, tokens, rows.clone(), |tok, r0, vals| {
            // SAFETY: each task owns distinct rows r0.. of its target, and targets own
            // distinct columns, so these outputs are written by this call alone; they lie in
            // row `tok` (< tokens) at columns below `stride`.
            let dst = unsafe {
                std::slice::from_raw_parts_mut(outp.at(tok * stride + t.offset + r0), vals.len())
            };
            finish(vals, bias.map(|b| &b[r0..r0 + vals.len()]), dst, epilogue);
        });
        if epilogue == Epilogue::Gelu {
            // SAFETY: this task's columns of every row, as above.
            unsafe {
                gelu_columns(outp, tokens, stride, t.offset + rows.start..t.offset + rows.end)
            };
        }
    });
}

fn is_float(format: TensorFormat) -> bool {
    matches!(format, TensorFormat::F32 | TensorFormat::F16 | TensorFormat::BF16)
}

fn bias_of(l: &Linear) -> Option<&[f32]> {
    l.bias.as_ref().map(|b| b.as_f32().expect("checked at load"))
}

/// The epilogue of one run of outputs, GELU aside (it runs over whole rows afterwards, where
/// its long dependency chains overlap). No temporary: a copy through the stack would stall
/// on store forwarding.
#[inline]
fn finish(vals: &[f32], bias: Option<&[f32]>, dst: &mut [f32], epilogue: Epilogue) {
    match (epilogue, bias) {
        (Epilogue::Add, Some(b)) => {
            dst.iter_mut().zip(vals).zip(b).for_each(|((d, v), b)| *d += v + b);
        }
        (Epilogue::Add, None) => dst.iter_mut().zip(vals).for_each(|(d, v)| *d += v),
        (_, Some(b)) => dst.iter_mut().zip(vals).zip(b).for_each(|((d, v), b)| *d = v + b),
        (_, None) => dst.iter_mut().zip(vals).for_each(|(d, v)| *d = *v),
    }
}

/// GELU of columns `cols` of each of `tokens` rows of `out` (rows `stride` apart).
///
/// # Safety
/// Those elements lie inside `out` and no other thread touches them meanwhile.
unsafe fn gelu_columns(out: SharedOut, tokens: usize, stride: usize, cols: std::ops::Range<usize>) {
    for t in 0..tokens {
        let row = std::slice::from_raw_parts_mut(out.at(t * stride + cols.start), cols.len());
        gelu_in_place(row);
    }
}

/// A weight without a float GEMM (integer formats): `matmul`, then the epilogue row by row.
fn unpacked(x: &[f32], tokens: usize, t: &Target, out: &mut [f32], stride: usize, e: Epilogue) {
    let rows = t.linear.weight.rows_cols().0;
    let mut y = vec![0.0; tokens * rows];
    matmul_raw(x, tokens, WeightRows::of(&t.linear.weight), &mut y);
    let bias = bias_of(t.linear);
    for (tok, row) in y.chunks_exact(rows).enumerate() {
        let dst = &mut out[tok * stride + t.offset..][..rows];
        for c0 in (0..rows).step_by(PANEL_ROWS) {
            let c1 = (c0 + PANEL_ROWS).min(rows);
            finish(&row[c0..c1], bias.map(|b| &b[c0..c1]), &mut dst[c0..c1], e);
        }
        if e == Epilogue::Gelu {
            gelu_in_place(dst);
        }
    }
}
