//! Matrix products against stored weights: `out[t, n] = dot(x[t, :], W[n, :])`.
//!
//! Work is split over blocks of weight rows so each row is read from memory once per block of
//! tokens and reused for each of them while it sits in L1 (float weights: once per call, see
//! `gemm`). Several products of the same activations (a layer's q/k/v, or gate/up) go to the
//! pool as one job, with the activations quantized (or packed) once.

use cellm_format::{Interleaved, Tensor, INTERLEAVE};

use crate::acts::{ActScheme, Q8Acts, Q8Row, QBLOCK};
use crate::dot::x8::{self, QDotX16Fn, QDotX8Fn};
use crate::dot::{
    DotFn, DotTileFn, DotTokensFn, PathKernels, QDot4Fn, QDotFn, GEMM_TILE_ROWS, TILE_ROWS,
    TILE_TOKENS,
};
use crate::gemm::{pack_tokens, FloatGemm};
use crate::i8_gemm::{self, I8RowGemm};
use crate::isa;
use crate::pool::{self, SharedOut};
use crate::rows::WeightRows;

/// The int8 activations one block of tokens may take: a quarter of a 1 MiB L2, so they stay
/// there while every row of a task passes (at 512 tokens, `ffn_down`'s 1536-column
/// activations otherwise spill from L2 once per group of 8 rows).
const ACT_BLOCK_BYTES: usize = 256 << 10;

/// Below this many multiply-adds a call runs on the calling thread: fork-join costs more.
const PARALLEL_MIN_WORK: usize = 1 << 15;

/// Pieces per thread and product of a decode-sized step ([`Product::pieces`]).
const PIECES_PER_THREAD: usize = 16;

/// Multiply-adds a piece holds at least: about a microsecond at 8 tokens.
const MIN_PIECE_WORK: usize = 1 << 18;

/// How float-weight products choose their kernel, and so the order in which each output's
/// products are summed. By count (the default), one token takes one row dot at a time (four
/// accumulators), 2-3 tokens a register tile and more a GEMM, each summing in its own order,
/// so a token's outputs depend on how many tokens share the product. An engine step sets
/// [`FloatOrder::Decode`] for a step whose every session brings one token (each output one
/// row dot, whatever the count) and [`FloatOrder::Batch`] for a step that prefills (the GEMM,
/// whatever the count): a decode token's outputs are then the same bits alone or beside any
/// other decoding sessions, and those of a prompt's tokens the same in any chunk. The rows
/// whose logits a prefill step returns (one per session) may take row dots for the products
/// after the model gathers them ([`for_logit_rows`]): a GEMM of one row is slow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FloatOrder {
    ByCount,
    Decode,
    Batch,
}

thread_local! {
    /// The order, and whether the logit rows of a step take row dots.
    static FLOAT_ORDER: std::cell::Cell<(FloatOrder, bool)> =
        const { std::cell::Cell::new((FloatOrder::ByCount, false)) };
}

/// Runs `f` with float products on this thread in `order` ([`FloatOrder`]); with
/// `logit_rows_by_row`, products inside [`for_logit_rows`] take row dots (as in
/// [`FloatOrder::Decode`]): for steps that return one logit row per session, whose gathered
/// rows are then summed in one order whatever their count.
pub fn with_float_order<R>(order: FloatOrder, logit_rows_by_row: bool, f: impl FnOnce() -> R) -> R {
    struct Restore((FloatOrder, bool));
    impl Drop for Restore {
        fn drop(&mut self) {
            FLOAT_ORDER.with(|o| o.set(self.0));
        }
    }
    let _restore = Restore(FLOAT_ORDER.with(|o| o.replace((order, logit_rows_by_row))));
    f()
}

/// Runs `f`, a model's products over the rows it gathered for logits, in row dots if the
/// step asked for that ([`with_float_order`]).
pub fn for_logit_rows<R>(f: impl FnOnce() -> R) -> R {
    match FLOAT_ORDER.with(|o| o.get()) {
        (FloatOrder::Batch, true) => with_float_order(FloatOrder::Decode, true, f),
        _ => f(),
    }
}

/// `out` (`tokens x rows(w)`) = `x` (`tokens x cols(w)`) times `w` transposed. Formats with an
/// integer kernel get `x` quantized to int8 blocks once, here, for all their rows.
pub fn matmul(x: &[f32], tokens: usize, w: &Tensor, out: &mut [f32]) {
    matmul_raw(x, tokens, WeightRows::of(w), out);
}

/// [`matmul`] for several weights of the same input width at once: `outs[i] = x W_i^T`.
pub fn matmul_many(x: &[f32], tokens: usize, ws: &[&Tensor], outs: &mut [&mut [f32]]) {
    let rows: Vec<WeightRows> = ws.iter().map(|w| WeightRows::of(w)).collect();
    matmul_many_raw(x, tokens, &rows, outs);
}

/// [`matmul`] on raw stored rows (`bytes` must hold exactly `rows` rows).
pub fn matmul_raw(x: &[f32], tokens: usize, w: WeightRows, out: &mut [f32]) {
    matmul_many_raw(x, tokens, &[w], &mut [out]);
}

/// [`matmul_many`] on raw stored rows.
pub fn matmul_many_raw(x: &[f32], tokens: usize, ws: &[WeightRows], outs: &mut [&mut [f32]]) {
    let outs: Vec<Out> = outs.iter_mut().map(|o| (o.as_mut_ptr(), o.len())).collect();
    run_products(x, tokens, ws, &outs);
}

/// [`matmul_many`] into new vectors, which are not zeroed first: the products write every
/// output (each kernel every token of the rows it is given, and the pieces cover every
/// row), so the caller would only wait on a memset (a step's logits are megabytes).
pub fn matmul_many_new(x: &[f32], tokens: usize, ws: &[&Tensor]) -> Vec<Vec<f32>> {
    let rows: Vec<WeightRows> = ws.iter().map(|w| WeightRows::of(w)).collect();
    let mut ys: Vec<Vec<f32>> = rows.iter().map(|w| Vec::with_capacity(tokens * w.rows)).collect();
    into_spare(x, tokens, &rows, &mut ys);
    ys
}

/// [`matmul`] into a new vector ([`matmul_many_new`]).
pub fn matmul_new(x: &[f32], tokens: usize, w: &Tensor) -> Vec<f32> {
    matmul_many_new(x, tokens, &[w]).pop().expect("one output")
}

/// The products of `ws` written into the spare capacity of the empty vectors `ys`, which
/// then hold them.
fn into_spare(x: &[f32], tokens: usize, ws: &[WeightRows], ys: &mut [Vec<f32>]) {
    for (y, w) in ys.iter().zip(ws) {
        assert!(y.is_empty() && y.capacity() >= tokens * w.rows, "matmul: output room");
    }
    let outs: Vec<Out> =
        ys.iter_mut().zip(ws).map(|(y, w)| (y.as_mut_ptr(), tokens * w.rows)).collect();
    run_products(x, tokens, ws, &outs);
    for (y, w) in ys.iter_mut().zip(ws) {
        // SAFETY: `run_products` returned, so every one of the `tokens * rows` outputs in
        // the capacity (checked above) has been written (see `matmul_many_new`).
        unsafe { y.set_len(tokens * w.rows) };
    }
}

/// An output: where a product writes its `tokens x rows` values, and how many floats that is.
type Out = (*mut f32, usize);

/// Runs the products of `ws` into `outs`, on the pool where large enough.
fn run_products(x: &[f32], tokens: usize, ws: &[WeightRows], outs: &[Out]) {
    with_products(x, tokens, ws, outs, |products| {
        let threads = pool::current_threads();
        if runs_serially(ws, tokens, threads) {
            products.iter().for_each(|p| p.run(0..p.units()));
            return;
        }
        // Pieces of every product, in order: a thread's share runs through neighbouring
        // rows of one product, then the next.
        let pieces: Vec<(usize, std::ops::Range<usize>)> = products
            .iter()
            .enumerate()
            .flat_map(|(i, p)| p.pieces(threads).map(move |r| (i, r)))
            .collect();
        pool::parallel_ranges(pieces.len(), |r| {
            pieces[r].iter().for_each(|(i, units)| products[*i].run(units.clone()))
        });
    });
}

/// `combine(rows, a, b)` of [`matmul_combined`]: one token's outputs of `rows` of both
/// products, to rewrite in place.
pub type CombineRows<'a> = dyn Fn(std::ops::Range<usize>, &mut [f32], &mut [f32]) + Sync + 'a;

/// Two products of the same input whose outputs are combined row by row (the MLP's
/// `act(gate) * up`): each task runs its rows of both products and then calls
/// `combine(rows, a, b)` once per token with that token's outputs of those rows (to
/// rewrite in place), while they are still in its cache. The elementwise pass then runs on
/// every thread instead of on the caller alone after the product. Weights of different
/// formats or heights take [`matmul_many`] and one combine per token over all rows.
pub fn matmul_combined(
    x: &[f32],
    tokens: usize,
    [a, b]: [&Tensor; 2],
    combine: &CombineRows<'_>,
) -> [Vec<f32>; 2] {
    let ws = [WeightRows::of(a), WeightRows::of(b)];
    let mut ys = ws.map(|w| Vec::with_capacity(tokens * w.rows));
    let outs = [0, 1].map(|i| (ys[i].as_mut_ptr(), tokens * ws[i].rows));
    combined_into(x, tokens, ws, outs, combine);
    for (y, w) in ys.iter_mut().zip(ws) {
        // SAFETY: as in `into_spare`: every output in the capacity has been written.
        unsafe { y.set_len(tokens * w.rows) };
    }
    ys
}

/// [`matmul_combined`] on raw stored rows, into `outs`.
pub fn matmul_combined_raw(
    x: &[f32],
    tokens: usize,
    ws: [WeightRows; 2],
    [out_a, out_b]: [&mut [f32]; 2],
    combine: &CombineRows<'_>,
) {
    let outs = [(out_a.as_mut_ptr(), out_a.len()), (out_b.as_mut_ptr(), out_b.len())];
    combined_into(x, tokens, ws, outs, combine);
}

fn combined_into(
    x: &[f32],
    tokens: usize,
    ws: [WeightRows; 2],
    outs: [Out; 2],
    combine: &CombineRows<'_>,
) {
    let n = ws[0].rows;
    let (ptr_a, ptr_b) = (SharedOut(outs[0].0), SharedOut(outs[1].0));
    let combine_rows = |rows: std::ops::Range<usize>| {
        for t in 0..tokens {
            // SAFETY: the caller of `combine_rows` owns `rows` of both outputs (tokens x n,
            // as `with_products` checks), and no product writes them any more.
            let (ya, yb) = unsafe {
                (
                    std::slice::from_raw_parts_mut(ptr_a.at(t * n + rows.start), rows.len()),
                    std::slice::from_raw_parts_mut(ptr_b.at(t * n + rows.start), rows.len()),
                )
            };
            combine(rows.clone(), ya, yb);
        }
    };
    if ws[0].format != ws[1].format || ws[1].rows != n {
        run_products(x, tokens, &ws, &outs);
        return combine_rows(0..n);
    }
    with_products(x, tokens, &ws, &outs, |products| {
        let [pa, pb] = products else { unreachable!("two products") };
        let rows_per_unit = n / pa.units();
        let run = |units: std::ops::Range<usize>| {
            pa.run(units.clone());
            pb.run(units.clone());
            combine_rows(units.start * rows_per_unit..units.end * rows_per_unit);
        };
        let threads = pool::current_threads();
        if runs_serially(&ws, tokens, threads) {
            return run(0..pa.units());
        }
        let pieces: Vec<std::ops::Range<usize>> = pa.pieces(threads).collect();
        pool::parallel_ranges(pieces.len(), |r| pieces[r].iter().for_each(|u| run(u.clone())));
    });
}

/// Whether products of `ws` over `tokens` tokens are too small to pay for a fork-join.
fn runs_serially(ws: &[WeightRows], tokens: usize, threads: usize) -> bool {
    let work: usize = ws.iter().map(|w| w.rows * w.cols * tokens).sum();
    work < PARALLEL_MIN_WORK || threads == 1
}

/// Checks the shapes, quantizes (or packs) `x` once for every weight that needs it, and
/// hands `f` each weight's product, ready to run over any of its rows.
fn with_products<R>(
    x: &[f32],
    tokens: usize,
    ws: &[WeightRows],
    outs: &[Out],
    f: impl FnOnce(&[Product]) -> R,
) -> R {
    assert_eq!(ws.len(), outs.len(), "matmul: one output per weight");
    for (w, out) in ws.iter().zip(outs.iter()) {
        assert_eq!(w.format.nbytes(&[w.rows, w.cols]), Some(w.bytes.len()), "matmul: weight size");
        assert_eq!(x.len(), tokens * w.cols, "matmul: activations do not match the weight");
        assert_eq!(out.1, tokens * w.rows, "matmul: output does not match the weight");
    }
    // The activations in each int8 scheme some weight needs, quantized once.
    let mut quantized: Vec<(ActScheme, Q8Acts)> = Vec::new();
    for w in ws {
        if let Some(scheme) = act_scheme(*w) {
            if !quantized.iter().any(|(s, _)| *s == scheme) {
                quantized.push((scheme, Q8Acts::quantize(x, w.cols, scheme)));
            }
        }
    }
    let acts_for = |scheme| &quantized.iter().find(|(s, _)| *s == scheme).expect("quantized").1;
    // A batch times float weights runs as a GEMM over activations packed once, here.
    let order = FLOAT_ORDER.with(|o| o.get().0);
    // Batch order: a GEMM, or for 1..=3 tokens the GEMM-order tiles (the same sums).
    let gemm_order = match order {
        FloatOrder::ByCount | FloatOrder::Batch => tokens > TILE_TOKENS,
        FloatOrder::Decode => false,
    };
    let batch_gemm = gemm_order && ws.iter().any(|w| act_scheme(*w).is_none());
    let packed = batch_gemm.then(|| pack_tokens(x, tokens, ws[0].cols));
    let products: Vec<Product> = ws
        .iter()
        .zip(outs)
        .map(|(&w, out)| Product::new(w, x, packed.as_deref(), order, tokens, out.0, &acts_for))
        .collect();
    f(&products)
}

/// The activation scheme a weight's integer kernel needs, or None for float kernels.
fn act_scheme(w: WeightRows) -> Option<ActScheme> {
    if let Some(Interleaved { base, .. }) = w.format.interleaved() {
        return Some(ActScheme::for_format(base));
    }
    let integer = PathKernels::selected().row_kernels(w.format).qdot.is_some()
        && w.cols.is_multiple_of(w.format.block_len().max(QBLOCK));
    integer.then(|| ActScheme::for_format(w.format))
}

/// One weight's product, ready to run over any range of its rows (or groups of 8 rows).
struct Product<'a> {
    w: WeightRows<'a>,
    tokens: usize,
    out: SharedOut,
    kernel: Kernel<'a>,
}

enum Kernel<'a> {
    /// The group kernel, the path's pair kernel where it has one (with the fewest tokens it
    /// takes), the token rows.
    Groups(QDotX8Fn, Option<(QDotX16Fn, usize)>, Vec<Q8Row<'a>>),
    Integer((QDotFn, QDot4Fn), &'a Q8Acts),
    /// int8 rows times a batch: the blocked integer GEMM (`i8_gemm`).
    I8Gemm(I8RowGemm<'a>),
    /// Float rows: decode in register tiles of rows x tokens, a batch as a GEMM over the
    /// packed activations.
    Float(DotTileFn, &'a [f32], Option<&'a [f32]>, usize),
    /// Float rows, one row dot per (row, token) whatever the count ([`FloatOrder::Decode`]):
    /// each row is read from memory once and stays in L1 for the other tokens.
    FloatRows(DotFn, Option<DotTokensFn>, &'a [f32]),
}

impl<'a> Product<'a> {
    fn new(
        w: WeightRows<'a>,
        x: &'a [f32],
        packed: Option<&'a [f32]>,
        order: FloatOrder,
        tokens: usize,
        out: *mut f32,
        acts_for: &impl Fn(ActScheme) -> &'a Q8Acts,
    ) -> Self {
        let path = PathKernels::selected();
        let kernel = match act_scheme(w) {
            Some(scheme) if w.format.interleaved().is_some() => {
                let acts = acts_for(scheme);
                let kern = path.group_kernel(w.format).expect("interleaved kernel");
                let pair = path.pair_kernel(w.format);
                Kernel::Groups(kern, pair, (0..tokens).map(|t| acts.row(t)).collect())
            }
            Some(scheme) if i8_gemm::applies(w, tokens) => {
                Kernel::I8Gemm(I8RowGemm::new(w, acts_for(scheme)))
            }
            Some(scheme) => {
                let qdot = path.row_kernels(w.format).qdot.expect("integer kernel");
                Kernel::Integer(qdot, acts_for(scheme))
            }
            None if order == FloatOrder::Decode => {
                Kernel::FloatRows(path.row_kernels(w.format).dot, path.dot_tokens(w.format), x)
            }
            None if order == FloatOrder::Batch && packed.is_none() => {
                Kernel::Float(path.gemm_tiles(w.format), x, None, GEMM_TILE_ROWS)
            }
            None => Kernel::Float(path.dot_tiles(w.format), x, packed, TILE_ROWS),
        };
        Self { w, tokens, out: SharedOut(out), kernel }
    }

    /// Rows, or groups of rows for interleaved formats.
    fn units(&self) -> usize {
        match self.kernel {
            Kernel::Groups(..) => self.w.rows / INTERLEAVE,
            _ => self.w.rows,
        }
    }

    /// Units whose outputs fill a 64-byte line (or a GEMM's tile): a task's writes stay
    /// apart from its neighbours'.
    fn units_per_line(&self) -> usize {
        match self.kernel {
            Kernel::Groups(..) => 2,
            // Whole panels: a task's last panel is not padded.
            Kernel::I8Gemm(..) => i8_gemm::PANEL_ROWS,
            // Whole GEMM tiles.
            Kernel::Float(_, _, Some(_), _) => FloatGemm::new(self.w, isa::selected()).tile_rows(),
            _ => 8,
        }
    }

    /// The pieces [`pool::parallel_ranges`] hands out: a thread's share is worked through
    /// one at a time, so pieces only need to be short enough for the threads to finish
    /// close together, and long enough that taking one (an atomic) costs nothing next to
    /// it. Each is a multiple of [`Self::units_per_line`].
    fn pieces(&self, threads: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
        let units = self.units();
        let work_per_unit = (self.w.rows / units.max(1)) * self.w.cols * self.tokens;
        // A batch's piece is a GEMM pass over all its activations, long anyway: fewer
        // pieces read them fewer times.
        let per_thread = if self.tokens > 2 * x8::MAX_TOKENS { 4 } else { PIECES_PER_THREAD };
        let per = units
            .div_ceil(threads * per_thread)
            .max(MIN_PIECE_WORK.div_ceil(work_per_unit.max(1)))
            .next_multiple_of(self.units_per_line());
        (0..units).step_by(per).map(move |s| s..(s + per).min(units))
    }

    /// `out[t, r]` for every token and the rows of `units`. Tokens run in blocks whose int8
    /// activations fit in L2 (`ACT_BLOCK_BYTES`); within a block each row (or group) is read
    /// once per 8 tokens (the group kernels take them 8 at a time on AVX-512, 4 elsewhere).
    fn run(&self, units: std::ops::Range<usize>) {
        if let Kernel::Float(tile, x, packed, tile_rows) = self.kernel {
            return self.run_float(tile, x, packed, tile_rows, units);
        }
        if let Kernel::FloatRows(dot, many, x) = self.kernel {
            let (n, cols) = (self.w.rows, self.w.cols);
            let stride = self.w.bytes.len() / n.max(1);
            let mut vals = vec![0.0f32; self.tokens];
            for r in units {
                let row = &self.w.bytes[r * stride..(r + 1) * stride];
                match many {
                    Some(many) if self.tokens > 1 => many(row, &x[..self.tokens * cols], &mut vals),
                    _ => {
                        let xs = x.chunks_exact(cols);
                        vals.iter_mut().zip(xs).for_each(|(v, x)| *v = dot(row, x));
                    }
                }
                for (t, v) in vals.iter().enumerate() {
                    // SAFETY: each task owns distinct rows, so output (t, r) is written by
                    // it alone, and it lies inside `out` (tokens x n).
                    unsafe { *self.out.at(t * n + r) = *v };
                }
            }
            return;
        }
        if let Kernel::I8Gemm(gemm) = &self.kernel {
            let n = self.w.rows;
            // SAFETY: each task owns distinct rows, so outputs (t, r0..r0 + len) are written
            // by it alone, and they lie inside `out` (tokens x n).
            return gemm.run(units, |t, r0, vals| unsafe {
                std::ptr::copy_nonoverlapping(vals.as_ptr(), self.out.at(t * n + r0), vals.len())
            });
        }
        let (n, tokens) = (self.w.rows, self.tokens);
        // At least one step of x8::MAX_TOKENS tokens, however wide the rows.
        let block = (ACT_BLOCK_BYTES / self.w.cols.max(1)).max(1).next_multiple_of(x8::MAX_TOKENS);
        for t_lo in (0..tokens).step_by(block) {
            self.run_block(units.clone(), t_lo..(t_lo + block).min(tokens), n);
        }
    }

    fn run_block(&self, units: std::ops::Range<usize>, toks: std::ops::Range<usize>, n: usize) {
        let stride = self.w.bytes.len() / self.units().max(1);
        let mut units = units;
        if let Kernel::Groups(kern, Some((pair, min_tokens)), rows) = &self.kernel {
            // Two groups a call while two are left; an odd last one, and steps of fewer
            // tokens than pay for the pair kernel, take the group kernel.
            let mut vals = [[0.0f32; 2 * INTERLEAVE]; x8::MAX_TOKENS];
            while units.len() >= 2 {
                let u = units.start;
                let bytes = &self.w.bytes[u * stride..(u + 2) * stride];
                for t in toks.clone().step_by(x8::MAX_TOKENS) {
                    let count = (toks.end - t).min(x8::MAX_TOKENS);
                    let x = &rows[t..t + count];
                    if count >= *min_tokens {
                        pair(bytes, x, &mut vals[..count]);
                    } else {
                        let mut half = [[0.0f32; INTERLEAVE]; x8::MAX_TOKENS];
                        for (g, group) in bytes.chunks_exact(stride).enumerate() {
                            kern(group, x, &mut half[..count]);
                            for (v, h) in vals.iter_mut().zip(&half[..count]) {
                                v[g * INTERLEAVE..(g + 1) * INTERLEAVE].copy_from_slice(h);
                            }
                        }
                    }
                    for (i, v) in vals[..count].iter().enumerate() {
                        // SAFETY: as below, for the task's units `u` and `u + 1`.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                v.as_ptr(),
                                self.out.at((t + i) * n + u * INTERLEAVE),
                                2 * INTERLEAVE,
                            )
                        };
                    }
                }
                units.start += 2;
            }
        }
        let mut vals = [[0.0f32; INTERLEAVE]; x8::MAX_TOKENS];
        for u in units {
            let bytes = &self.w.bytes[u * stride..(u + 1) * stride];
            for t in toks.clone().step_by(x8::MAX_TOKENS) {
                let count = (toks.end - t).min(x8::MAX_TOKENS);
                let width = match &self.kernel {
                    Kernel::Groups(kern, _, rows) => {
                        kern(bytes, &rows[t..t + count], &mut vals[..count]);
                        INTERLEAVE
                    }
                    Kernel::Integer((one, four), acts) => {
                        let mut i = 0;
                        while i + 4 <= count {
                            let at = t + i;
                            let x = [
                                acts.row(at),
                                acts.row(at + 1),
                                acts.row(at + 2),
                                acts.row(at + 3),
                            ];
                            let v = four(bytes, &x);
                            (0..4).for_each(|k| vals[i + k][0] = v[k]);
                            i += 4;
                        }
                        (i..count).for_each(|k| vals[k][0] = one(bytes, acts.row(t + k)));
                        1
                    }
                    Kernel::Float(..) | Kernel::FloatRows(..) | Kernel::I8Gemm(..) => {
                        unreachable!("float and i8 GEMM products run in tiles")
                    }
                };
                for (i, v) in vals[..count].iter().enumerate() {
                    // SAFETY: each task owns distinct units `u`, so these `width` outputs of
                    // row block `u * width` are written by it alone, and they end at
                    // (t + i) * n + (u + 1) * width <= tokens * n, the length of `out`.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            v.as_ptr(),
                            self.out.at((t + i) * n + u * width),
                            width,
                        )
                    };
                }
            }
        }
    }
}

impl Product<'_> {
    /// The float product over `rows`. Up to one tile's worth of tokens (decode) streams the
    /// stored rows through 4-row x 3-token tiles; a batch runs as a GEMM (`gemm`).
    fn run_float(
        &self,
        tile: DotTileFn,
        x: &[f32],
        packed: Option<&[f32]>,
        tile_rows: usize,
        rows: std::ops::Range<usize>,
    ) {
        let (n, tokens) = (self.w.rows, self.tokens);
        // SAFETY (both stores): each task owns distinct rows, so output (t, r) is written by
        // it alone, and it lies inside `out` (tokens x n).
        if let Some(packed) = packed {
            let gemm = FloatGemm::new(self.w, isa::selected());
            return gemm.run(packed, tokens, rows, |t, r0, vals| unsafe {
                std::ptr::copy_nonoverlapping(vals.as_ptr(), self.out.at(t * n + r0), vals.len())
            });
        }
        let stride = self.w.bytes.len() / n.max(1);
        let mut vals = [0.0f32; GEMM_TILE_ROWS * TILE_TOKENS];
        for r0 in rows.clone().step_by(tile_rows) {
            let r_count = (rows.end - r0).min(tile_rows);
            let mut w: [&[u8]; GEMM_TILE_ROWS] = [&[]; GEMM_TILE_ROWS];
            for (i, r) in (r0..r0 + r_count).enumerate() {
                w[i] = &self.w.bytes[r * stride..(r + 1) * stride];
            }
            let v = &mut vals[..r_count * tokens];
            tile(&w[..r_count], x, v);
            for (t, r) in (0..tokens).flat_map(|t| (0..r_count).map(move |r| (t, r))) {
                unsafe { *self.out.at(t * n + r0 + r) = v[r * tokens + t] };
            }
        }
    }
}

/// Decodes row `r` of `w` into `out` (embedding lookup).
pub fn decode_row(w: &Tensor, r: usize, out: &mut [f32]) {
    decode_row_raw(WeightRows::of(w), r, out);
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
        return (PathKernels::selected().row_kernels(base).decode)(&row, out);
    }
    let stride = w.bytes.len() / w.rows;
    (PathKernels::selected().row_kernels(w.format).decode)(
        &w.bytes[r * stride..(r + 1) * stride],
        out,
    );
}

#[cfg(test)]
mod tests {
    use cellm_format::TensorFormat;

    use super::*;
    use crate::pool::ThreadPool;

    /// A batch longer than one token block (ACT_BLOCK_BYTES of int8 activations) gives what
    /// two calls over its halves give, for a row-integer and an interleaved weight.
    #[test]
    fn token_blocks_equal_separate_calls() {
        let _serial = crate::isa::test_lock();
        let cols = 256;
        let tokens = ACT_BLOCK_BYTES / cols + 76;
        let x: Vec<f32> = (0..tokens * cols).map(|i| ((i * 31) % 17) as f32 * 0.1 - 0.8).collect();
        for format in [TensorFormat::Q8_0, TensorFormat::Q4_0X8] {
            let rows = 16;
            let n = format.nbytes(&[rows, cols]).unwrap();
            let mut bytes: Vec<u8> = (0..n).map(|i| ((i * 2654435761usize) >> 7) as u8).collect();
            scales_finite(format, &mut bytes);
            let w = WeightRows { format, bytes: &bytes, rows, cols };
            let mut whole = vec![0.0; tokens * rows];
            matmul_raw(&x, tokens, w, &mut whole);
            let half = 600; // a multiple of the 8-token step, inside the first block
            let mut parts = vec![0.0; tokens * rows];
            let (lo, hi) = parts.split_at_mut(half * rows);
            matmul_raw(&x[..half * cols], half, w, lo);
            matmul_raw(&x[half * cols..], tokens - half, w, hi);
            assert_eq!(whole, parts, "{format:?}");
        }
    }

    /// Under the engine's float orders a token's outputs do not depend on the other tokens
    /// of the product, bit for bit: decode order (row dots, several tokens a row) and batch
    /// order (the GEMM), 1 to 9 tokens against the first tokens of 9, on a pool of 2.
    #[test]
    fn float_orders_do_not_depend_on_the_token_count() {
        let _serial = crate::isa::test_lock();
        let (rows, cols, all) = (40, 200, 9);
        let vals: Vec<f32> =
            (0..rows * cols).map(|i| ((i * 7919) % 211) as f32 / 100.0 - 1.05).collect();
        let x: Vec<f32> = (0..all * cols).map(|i| ((i * 31) % 17) as f32 * 0.1 - 0.8).collect();
        let pool = ThreadPool::new(2).unwrap();
        for format in [TensorFormat::F32, TensorFormat::F16, TensorFormat::BF16] {
            let bytes = crate::dot::encode(format, &vals);
            let w = WeightRows { format, bytes: &bytes, rows, cols };
            for order in [FloatOrder::Decode, FloatOrder::Batch] {
                let run = |tokens: usize| {
                    let mut out = vec![0.0f32; tokens * rows];
                    pool.install(|| {
                        with_float_order(order, false, || {
                            matmul_raw(&x[..tokens * cols], tokens, w, &mut out)
                        })
                    });
                    out.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
                };
                let whole = run(all);
                for tokens in 1..all {
                    assert_eq!(
                        run(tokens),
                        whole[..tokens * rows],
                        "{format:?} {order:?} {tokens}"
                    );
                }
            }
        }
    }

    /// Finite f16 scales where each format keeps them: the front of each block, or the 8
    /// rows' scales at the front of an interleaved column.
    fn scales_finite(format: TensorFormat, bytes: &mut [u8]) {
        let (column, scales) = match format.interleaved() {
            Some(_) => (INTERLEAVE * format.block_bytes(), INTERLEAVE),
            None => (format.block_bytes(), 1),
        };
        for col in bytes.chunks_exact_mut(column) {
            (0..scales).for_each(|f| col[2 * f + 1] = 0x20);
        }
    }

    /// Outputs made in a new vector's spare capacity are every one written: capacity
    /// filled with NaN first, then the product must equal the one into a zeroed slice, bit
    /// for bit, for float (row dots and GEMM), row-integer, interleaved and K-block weights
    /// (the blocked int8 GEMM from 16 tokens), serial and pooled.
    #[test]
    fn new_outputs_are_fully_written() {
        let _serial = crate::isa::test_lock();
        let (rows, cols) = (64, 256);
        let vals: Vec<f32> = (0..rows * cols).map(|i| ((i * 7) % 13) as f32 * 0.01).collect();
        let blocks = |format: TensorFormat| -> Vec<u8> {
            let n = format.nbytes(&[rows, cols]).unwrap();
            let mut b: Vec<u8> = (0..n).map(|i| ((i * 2654435761usize) >> 7) as u8).collect();
            scales_finite(format, &mut b);
            b
        };
        let stored = [
            (TensorFormat::F16, crate::dot::encode(TensorFormat::F16, &vals)),
            (TensorFormat::Q8_0, blocks(TensorFormat::Q8_0)),
            (TensorFormat::Q4_0X8, blocks(TensorFormat::Q4_0X8)),
            (TensorFormat::Q4K, blocks(TensorFormat::Q4K)),
        ];
        let pool = ThreadPool::new(2).unwrap();
        for (format, bytes) in &stored {
            let w = WeightRows { format: *format, bytes, rows, cols };
            for tokens in [1, 3, 8, 40] {
                let x: Vec<f32> =
                    (0..tokens * cols).map(|i| ((i * 31) % 17) as f32 * 0.1 - 0.8).collect();
                let mut want = vec![0.0; tokens * rows];
                matmul_raw(&x, tokens, w, &mut want);
                for pooled in [false, true] {
                    let mut y: Vec<f32> = Vec::with_capacity(tokens * rows);
                    // SAFETY: the capacity holds tokens * rows floats; all-ones bits are NaN.
                    unsafe { std::ptr::write_bytes(y.as_mut_ptr(), 0xFF, tokens * rows) };
                    let mut ys = [y];
                    match pooled {
                        true => pool.install(|| into_spare(&x, tokens, &[w], &mut ys)),
                        false => into_spare(&x, tokens, &[w], &mut ys),
                    }
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&ys[0]), bits(&want), "{format:?} {tokens} {pooled}");
                }
            }
        }
    }

    /// Two products combined row by row as each task finishes them give what the two
    /// products and one combine over every row give, bit for bit: interleaved and float
    /// weights (fused) and two formats (the fallback), one token, a group kernel's 8 and
    /// more, serial and pooled; every output is combined exactly once (`a = 2a + b` twice
    /// would differ).
    #[test]
    fn combined_products_equal_products_then_combine() {
        let _serial = crate::isa::test_lock();
        let (rows, cols) = (48, 256);
        let blocks = |format: TensorFormat| -> Vec<u8> {
            let n = format.nbytes(&[rows, cols]).unwrap();
            let mut b: Vec<u8> = (0..n).map(|i| ((i * 2654435761usize) >> 7) as u8).collect();
            scales_finite(format, &mut b);
            b
        };
        let vals: Vec<f32> = (0..rows * cols).map(|i| ((i * 7) % 13) as f32 * 0.01).collect();
        let (f16, q8, q4x8) = (
            crate::dot::encode(TensorFormat::F16, &vals),
            blocks(TensorFormat::Q8_0),
            blocks(TensorFormat::Q4_0X8),
        );
        let w = |format, bytes: &'static [u8]| WeightRows { format, bytes, rows, cols };
        let (f16, q8, q4x8) = (f16.leak(), q8.leak(), q4x8.leak());
        let pairs = [
            [w(TensorFormat::Q4_0X8, q4x8), w(TensorFormat::Q4_0X8, q4x8)],
            [w(TensorFormat::F16, f16), w(TensorFormat::F16, f16)],
            [w(TensorFormat::Q8_0, q8), w(TensorFormat::Q4_0X8, q4x8)],
        ];
        let combine = |_: std::ops::Range<usize>, a: &mut [f32], b: &mut [f32]| {
            a.iter_mut().zip(b.iter()).for_each(|(a, b)| *a = 2.0 * *a + b)
        };
        let pool = ThreadPool::new(2).unwrap();
        for ws in pairs {
            for tokens in [1, 8, 13] {
                let x: Vec<f32> =
                    (0..tokens * cols).map(|i| ((i * 31) % 17) as f32 * 0.1 - 0.8).collect();
                let mut want = [vec![0.0; tokens * rows], vec![0.0; tokens * rows]];
                let [wa, wb] = &mut want;
                matmul_many_raw(&x, tokens, &ws, &mut [wa, wb]);
                combine(0..rows, wa, wb);
                for pooled in [false, true] {
                    let mut got = [vec![0.0; tokens * rows], vec![0.0; tokens * rows]];
                    let [ga, gb] = &mut got;
                    let (x, combine) = (&x, &combine);
                    let mut run = || matmul_combined_raw(x, tokens, ws, [ga, gb], combine);
                    if pooled {
                        pool.install(&mut run);
                    } else {
                        run();
                    }
                    assert_eq!(got[0], want[0], "{:?} {tokens} {pooled}", ws[0].format);
                }
            }
        }
    }

    /// One call over weights of different formats (float, row-integer, interleaved; two
    /// activation schemes) gives exactly what separate calls give, serial and pooled.
    #[test]
    fn many_products_equal_separate_calls() {
        let _serial = crate::isa::test_lock();
        let (cols, tokens) = (256, 6);
        let x: Vec<f32> = (0..tokens * cols).map(|i| ((i * 31) % 17) as f32 * 0.1 - 0.8).collect();
        let f16: Vec<u8> = (0..40 * cols)
            .flat_map(|i| half::f16::from_f32(((i * 7) % 13) as f32 * 0.01).to_bits().to_le_bytes())
            .collect();
        let blocks = |format: TensorFormat, rows: usize| -> Vec<u8> {
            let n = format.nbytes(&[rows, cols]).unwrap();
            let mut b: Vec<u8> = (0..n).map(|i| ((i * 2654435761usize) >> 7) as u8).collect();
            scales_finite(format, &mut b);
            b
        };
        let (q8, q4x8) = (blocks(TensorFormat::Q8_0, 24), blocks(TensorFormat::Q4_0X8, 64));
        let ws = [
            WeightRows { format: TensorFormat::F16, bytes: &f16, rows: 40, cols },
            WeightRows { format: TensorFormat::Q8_0, bytes: &q8, rows: 24, cols },
            WeightRows { format: TensorFormat::Q4_0X8, bytes: &q4x8, rows: 64, cols },
        ];
        let separate: Vec<Vec<f32>> = ws
            .iter()
            .map(|&w| {
                let mut out = vec![0.0; tokens * w.rows];
                matmul_raw(&x, tokens, w, &mut out);
                out
            })
            .collect();
        let pool = ThreadPool::new(2).unwrap();
        for pooled in [false, true] {
            let mut outs: Vec<Vec<f32>> = ws.iter().map(|w| vec![0.0; tokens * w.rows]).collect();
            let mut views: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
            if pooled {
                pool.install(|| matmul_many_raw(&x, tokens, &ws, &mut views));
            } else {
                matmul_many_raw(&x, tokens, &ws, &mut views);
            }
            assert_eq!(outs, separate, "pooled: {pooled}");
        }
    }
}
