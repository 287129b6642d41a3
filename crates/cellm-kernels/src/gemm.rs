//! Float weights times a batch of tokens (prefill), as a GEMM in register tiles (`panel`).
//!
//! The activations are packed once per product: in blocks of BLOCK_COLS columns, and within
//! a block six tokens side by side per column. A task widens 16 stored rows at a time to f32
//! into a panel, 16 rows side by side per column, and multiplies it with packed groups of
//! tokens: a register tile of 16 rows x 6 tokens takes a panel column (two vectors) times six
//! broadcast activations, 12 multiply-adds per 8 loads and no horizontal sums.
//!
//! The operands are blocked as in BLIS so that none comes from memory in the inner loop: a
//! panel's slice of one column block (16 KiB) is widened into L1 and meets every group of a
//! block of tokens, whose packed slice of that column block (192 KiB) stays in L2 while the
//! panels of a block of rows pass; their accumulators (96 KiB) stay in L2 too. A stored row
//! is read and widened once per token block; the next panel's slice is prefetched while this
//! one multiplies, and the last token group multiplies only the tokens it has.

use crate::cache::prefetch_line;
use crate::dot::{DecodeFn, PanelFn, PathKernels};
use crate::isa::Isa;
use crate::panel::{TileFn, PANEL_ROWS, PANEL_TOKENS};
use crate::pool::{parallel_for, SharedOut};
use crate::rows::WeightRows;

/// Columns multiplied per pass over the token groups: the panel's slice stays in L1.
const BLOCK_COLS: usize = 256;
/// Token groups (of PANEL_TOKENS) per token block: their packed slice of a column block
/// (192 KiB) stays in L2 while the row block's panels pass.
const TOKEN_BLOCK: usize = 32;
/// Panels per row block: their accumulators for a token block take 96 KiB of L2.
const ROW_BLOCK_PANELS: usize = 8;
/// Columns widened per step by the row-by-row (scalar) widening, into a small row-major
/// buffer before they are transposed into the panel.
const WIDEN_COLS: usize = 64;

/// The column blocks of a `cols`-wide product.
fn column_blocks(cols: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    (0..cols).step_by(BLOCK_COLS).map(move |c0| c0..(c0 + BLOCK_COLS).min(cols))
}

/// Packs `tokens` activation rows of `cols` for [`FloatGemm::run`]: column blocks of
/// BLOCK_COLS, within a block groups of PANEL_TOKENS tokens, column-major within a group; a
/// short last group is padded with zeros. (block, group) pairs run on the installed pool.
pub fn pack_tokens(x: &[f32], tokens: usize, cols: usize) -> Vec<f32> {
    assert_eq!(x.len(), tokens * cols, "gemm: activations are not tokens x cols");
    let groups = tokens.div_ceil(PANEL_TOKENS);
    let mut packed = vec![0.0f32; groups * PANEL_TOKENS * cols];
    let blocks: Vec<_> = column_blocks(cols).collect();
    let out = SharedOut(packed.as_mut_ptr());
    parallel_for(blocks.len() * groups, |task| {
        let (block, g) = (&blocks[task / groups], task % groups);
        let width = block.len();
        let at = (block.start * groups + g * width) * PANEL_TOKENS;
        // SAFETY: each (block, group) pair owns these PANEL_TOKENS * width elements, and the
        // last pair's end is the buffer's.
        let dst = unsafe { std::slice::from_raw_parts_mut(out.at(at), PANEL_TOKENS * width) };
        let live = (tokens - g * PANEL_TOKENS).min(PANEL_TOKENS);
        let src: [&[f32]; PANEL_TOKENS] = std::array::from_fn(|lane| {
            let t = g * PANEL_TOKENS + lane.min(live - 1);
            &x[t * cols + block.start..][..width]
        });
        // Written in order, read from six rows at once: stores stream, loads stay sequential.
        if live == PANEL_TOKENS {
            for (c, out) in dst.chunks_exact_mut(PANEL_TOKENS).enumerate() {
                out.iter_mut().zip(&src).for_each(|(o, s)| *o = s[c]);
            }
        } else {
            for (c, out) in dst.chunks_exact_mut(PANEL_TOKENS).enumerate() {
                for (lane, o) in out.iter_mut().enumerate().take(live) {
                    *o = src[lane][c];
                }
            }
        }
    });
    packed
}

/// Stored float rows with the kernels of one ISA path.
pub struct FloatGemm<'a> {
    w: WeightRows<'a>,
    tile: TileFn,
    decode: DecodeFn,
    widen: Option<PanelFn>,
}

impl<'a> FloatGemm<'a> {
    pub fn new(w: WeightRows<'a>, isa: Isa) -> Self {
        let path = PathKernels::of(isa);
        Self {
            w,
            tile: path.tile_kernel(),
            decode: path.row_kernels(w.format).decode,
            widen: path.panel_widener(w.format),
        }
    }

    /// For every token of `packed` ([`pack_tokens`] of `tokens` rows) and the stored rows
    /// `rows`, calls `store(t, r0, vals)` with `vals[i] = dot(x[t], row r0 + i)`.
    ///
    /// Loops, outermost first: blocks of ROW_BLOCK rows, blocks of TOKEN_BLOCK tokens,
    /// column blocks, panels of PANEL_ROWS rows, token groups. A panel's slice of one column
    /// block is widened into L1 and meets every group of the token block there; the token
    /// block's packed slice of that column block and the row block's accumulators stay in
    /// L2, so no operand of the register tile comes from memory however many tokens there
    /// are.
    pub fn run(
        &self,
        packed: &[f32],
        tokens: usize,
        rows: std::ops::Range<usize>,
        mut store: impl FnMut(usize, usize, &[f32]),
    ) {
        let k = self.w.cols;
        let groups = tokens.div_ceil(PANEL_TOKENS);
        assert_eq!(packed.len(), groups * PANEL_TOKENS * k, "gemm: packed activations");
        assert!(rows.end <= self.w.rows, "gemm: rows out of range");
        let stride = self.w.bytes.len() / self.w.rows.max(1);
        let elem = stride / k.max(1);
        let mut slice = vec![0.0f32; PANEL_ROWS * BLOCK_COLS];
        let mut acc = vec![[[0.0f32; PANEL_ROWS]; PANEL_TOKENS]; ROW_BLOCK_PANELS * TOKEN_BLOCK];
        // Stored rows r0.. (at most PANEL_ROWS, up to `end`), each cut to `cols`.
        let stored_rows = |r0: usize, end: usize, cols: &std::ops::Range<usize>| {
            let mut stored: [&[u8]; PANEL_ROWS] = [&[]; PANEL_ROWS];
            let count = end.saturating_sub(r0).min(PANEL_ROWS);
            for (r, s) in stored.iter_mut().enumerate().take(count) {
                *s = &self.w.bytes[(r0 + r) * stride..][cols.start * elem..cols.end * elem];
            }
            (stored, count)
        };
        for g0 in (0..groups).step_by(TOKEN_BLOCK) {
            let token_groups = g0..(g0 + TOKEN_BLOCK).min(groups);
            let n_groups = token_groups.len();
            for row_block in rows.clone().step_by(ROW_BLOCK_PANELS * PANEL_ROWS) {
                let block_end = (row_block + ROW_BLOCK_PANELS * PANEL_ROWS).min(rows.end);
                let panels: Vec<usize> = (row_block..block_end).step_by(PANEL_ROWS).collect();
                acc.iter_mut().for_each(|a| *a = [[0.0; PANEL_ROWS]; PANEL_TOKENS]);
                for block in column_blocks(k) {
                    let width = block.len();
                    let xs = &packed[block.start * groups * PANEL_TOKENS..]
                        [..groups * PANEL_TOKENS * width];
                    for (p, &r0) in panels.iter().enumerate() {
                        let (stored, count) = stored_rows(r0, block_end, &block);
                        self.widen_panel(&stored[..count], width, &mut slice);
                        // The next panel's slice is requested while this one multiplies.
                        let (next, next_count) = stored_rows(r0 + PANEL_ROWS, block_end, &block);
                        let mut ahead = RowPrefetch::new(next, next_count, n_groups);
                        let slice = &slice[..width * PANEL_ROWS];
                        for g in token_groups.clone() {
                            ahead.step();
                            let x = &xs[g * PANEL_TOKENS * width..][..PANEL_TOKENS * width];
                            // The last group's padding is not multiplied.
                            let live = (tokens - g * PANEL_TOKENS).min(PANEL_TOKENS);
                            (self.tile)(slice, x, width, live, &mut acc[p * TOKEN_BLOCK + g - g0]);
                        }
                    }
                }
                for (p, &r0) in panels.iter().enumerate() {
                    let count = (block_end - r0).min(PANEL_ROWS);
                    for g in token_groups.clone() {
                        let t0 = g * PANEL_TOKENS;
                        let tile = &acc[p * TOKEN_BLOCK + g - g0];
                        for (t, vals) in tile.iter().enumerate().take(tokens - t0) {
                            store(t0 + t, r0, &vals[..count]);
                        }
                    }
                }
            }
        }
    }

    /// Widens `stored` (at most PANEL_ROWS rows of `cols` elements) into `panel`,
    /// column-major with PANEL_ROWS rows per column; rows past the stored ones are zeros.
    /// The SIMD widener takes whole steps of 8 columns, the row decoder the rest.
    fn widen_panel(&self, stored: &[&[u8]], cols: usize, panel: &mut [f32]) {
        let simd = match self.widen {
            Some(widen) => {
                let simd = cols / 8 * 8;
                widen(stored, simd, panel);
                simd
            }
            None => 0,
        };
        let elem = self.w.bytes.len() / (self.w.rows * self.w.cols).max(1);
        let mut rows = [[0.0f32; WIDEN_COLS]; PANEL_ROWS];
        for c0 in (simd..cols).step_by(WIDEN_COLS) {
            let kc = (cols - c0).min(WIDEN_COLS);
            for (row, s) in rows.iter_mut().zip(stored) {
                (self.decode)(&s[c0 * elem..(c0 + kc) * elem], &mut row[..kc]);
            }
            rows[stored.len()..].iter_mut().for_each(|r| r.fill(0.0));
            for (c, col) in panel[c0 * PANEL_ROWS..(c0 + kc) * PANEL_ROWS]
                .chunks_exact_mut(PANEL_ROWS)
                .enumerate()
            {
                for (r, v) in col.iter_mut().enumerate() {
                    *v = rows[r][c];
                }
            }
        }
    }
}

/// Requests the cache lines of up to PANEL_ROWS stored rows, an even share per `step` over
/// `steps` steps: spread out, the requests stream in behind the arithmetic instead of
/// queueing at once.
struct RowPrefetch<'a> {
    rows: [&'a [u8]; PANEL_ROWS],
    count: usize,
    per_step: usize,
    row: usize,
    offset: usize,
}

impl<'a> RowPrefetch<'a> {
    fn new(rows: [&'a [u8]; PANEL_ROWS], count: usize, steps: usize) -> Self {
        let lines: usize = rows[..count].iter().map(|r| r.len().div_ceil(64)).sum();
        Self { rows, count, per_step: lines.div_ceil(steps.max(1)), row: 0, offset: 0 }
    }

    #[inline]
    fn step(&mut self) {
        for _ in 0..self.per_step {
            let Some(row) = self.rows[..self.count].get(self.row) else { return };
            prefetch_line(row[self.offset..].as_ptr());
            self.offset += 64;
            if self.offset >= row.len() {
                (self.row, self.offset) = (self.row + 1, 0);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use cellm_format::TensorFormat;

    use super::*;

    /// The GEMM equals one row-kernel dot per (token, row) within rounding, for every float
    /// format and path, with token counts that leave each size of last token group, row
    /// counts that leave partial tiles, and a column count that is not a multiple of the
    /// widening step.
    #[test]
    fn gemm_matches_row_dots() {
        // Two column blocks, the second not a multiple of the SIMD widener's 8 columns.
        let cols = BLOCK_COLS + 2 * WIDEN_COLS + 13;
        for tokens in PANEL_TOKENS + 1..=2 * PANEL_TOKENS {
            gemm_matches_row_dots_at(tokens, 37, cols);
        }
    }

    /// Several token blocks and row blocks, each with a partial last one.
    #[test]
    fn gemm_blocks_match_row_dots() {
        let tokens = TOKEN_BLOCK * PANEL_TOKENS + 7;
        gemm_matches_row_dots_at(tokens, ROW_BLOCK_PANELS * PANEL_ROWS + 21, BLOCK_COLS + 44);
    }

    fn gemm_matches_row_dots_at(tokens: usize, rows: usize, cols: usize) {
        let x: Vec<f32> =
            (0..tokens * cols).map(|i| ((i * 7919) % 251) as f32 / 125.0 - 1.0).collect();
        let packed = pack_tokens(&x, tokens, cols);
        // Packing on a pool (tasks over column blocks and token groups) gives the same layout.
        let pool = crate::pool::ThreadPool::new(3).unwrap();
        assert_eq!(pool.install(|| pack_tokens(&x, tokens, cols)), packed);
        for format in [TensorFormat::F32, TensorFormat::F16, TensorFormat::BF16] {
            let vals: Vec<f32> =
                (0..rows * cols).map(|i| ((i * 104729) % 211) as f32 / 100.0 - 1.05).collect();
            let bytes = crate::dot::encode(format, &vals);
            let stride = bytes.len() / rows;
            let dot = PathKernels::of(Isa::Scalar).row_kernels(format).dot;
            for path in Isa::available() {
                let gemm = FloatGemm::new(WeightRows { format, bytes: &bytes, rows, cols }, path);
                let mut got = vec![f32::NAN; tokens * rows];
                // Rows 3.. only: a range that does not start at a panel boundary.
                gemm.run(&packed, tokens, 3..rows, |t, r0, vals| {
                    got[t * rows + r0..][..vals.len()].copy_from_slice(vals);
                });
                for t in 0..tokens {
                    for r in 0..rows {
                        let g = got[t * rows + r];
                        if r < 3 {
                            assert!(g.is_nan(), "row {r} is outside the range");
                            continue;
                        }
                        let row = &bytes[r * stride..(r + 1) * stride];
                        let want = dot(row, &x[t * cols..(t + 1) * cols]);
                        // f32 sums of 397 products of magnitude <= 1.05, added in another
                        // order than the reference: rounding stays near 1e-6. A panel
                        // column shifted by one, or a last group cut short by one token,
                        // fails this (mutation checks).
                        let tol = 1e-4 * (1.0 + want.abs());
                        assert!(
                            (g - want).abs() <= tol,
                            "{format:?} {path:?} tokens={tokens} t={t} r={r}: {g} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
