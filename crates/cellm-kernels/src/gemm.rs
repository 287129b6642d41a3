//! Float weights times a batch of tokens (prefill), as a GEMM in register tiles (`panel`).
//!
//! The activations are packed once per product: in blocks of BLOCK_COLS columns, and within
//! a block six tokens side by side per column. Each task widens 16 stored rows at a time to
//! f32 into a panel, 16 rows side by side per column, and multiplies it with every packed
//! group of tokens: a register tile of 16 rows x 6 tokens takes a panel column (two vectors)
//! times six broadcast activations, 12 multiply-adds per 8 loads and no horizontal sums.
//! The panel is widened whole (rows read start to end, as the prefetcher likes) and then
//! multiplied a column block at a time: the block's slice of the panel (16 KiB) stays in L1
//! while the token groups' slices stream past it from L2, as in BLIS. Each stored row is read
//! and widened once per product; the next panel's rows are prefetched while this one
//! multiplies, and the last token group multiplies only the tokens it has.

use crate::cache::prefetch_line;
use crate::dot::{DecodeFn, PanelFn, PathKernels};
use crate::isa::Isa;
use crate::panel::{TileFn, PANEL_ROWS, PANEL_TOKENS};
use crate::pool::{parallel_for, SharedOut};
use crate::rows::WeightRows;

/// Columns multiplied per pass over the token groups: the panel's slice stays in L1.
const BLOCK_COLS: usize = 256;
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
        for (lane, t) in (g * PANEL_TOKENS..((g + 1) * PANEL_TOKENS).min(tokens)).enumerate() {
            let src = &x[t * cols + block.start..][..width];
            for (c, &v) in src.iter().enumerate() {
                dst[c * PANEL_TOKENS + lane] = v;
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
        let mut panel = vec![0.0f32; PANEL_ROWS * k];
        let mut acc = vec![[[0.0f32; PANEL_ROWS]; PANEL_TOKENS]; groups];
        let tile_calls = column_blocks(k).count() * groups;
        for r0 in rows.clone().step_by(PANEL_ROWS) {
            let count = (rows.end - r0).min(PANEL_ROWS);
            let stored_rows = |r0: usize, count: usize| {
                let mut stored: [&[u8]; PANEL_ROWS] = [&[]; PANEL_ROWS];
                for (r, s) in stored.iter_mut().enumerate().take(count) {
                    *s = &self.w.bytes[(r0 + r) * stride..][..stride];
                }
                stored
            };
            let stored = stored_rows(r0, count);
            self.widen_panel(&stored[..count], &mut panel);
            // The next panel's rows are requested while this one multiplies, so the widening
            // finds them in cache instead of waiting on memory.
            let next = (r0 + PANEL_ROWS).min(rows.end);
            let next_count = (rows.end - next).min(PANEL_ROWS);
            let mut ahead = RowPrefetch::new(stored_rows(next, next_count), next_count, tile_calls);
            acc.iter_mut().for_each(|a| *a = [[0.0; PANEL_ROWS]; PANEL_TOKENS]);
            for block in column_blocks(k) {
                let width = block.len();
                let slice = &panel[block.start * PANEL_ROWS..block.end * PANEL_ROWS];
                let xs =
                    &packed[block.start * groups * PANEL_TOKENS..][..groups * PANEL_TOKENS * width];
                for (g, (x, a)) in xs.chunks_exact(PANEL_TOKENS * width).zip(&mut acc).enumerate() {
                    ahead.step();
                    // The last group's padding is not multiplied (128 tokens: 2 of 6 used).
                    let live = (tokens - g * PANEL_TOKENS).min(PANEL_TOKENS);
                    (self.tile)(slice, x, width, live, a);
                }
            }
            for (g, a) in acc.iter().enumerate() {
                let t0 = g * PANEL_TOKENS;
                for (t, vals) in a.iter().enumerate().take(tokens - t0) {
                    store(t0 + t, r0, &vals[..count]);
                }
            }
        }
    }

    /// Widens `stored` (at most PANEL_ROWS rows) into `panel`, column-major with PANEL_ROWS
    /// rows per column; rows past the stored ones are zeros. The SIMD widener takes whole
    /// steps of 8 columns, the row decoder the rest.
    fn widen_panel(&self, stored: &[&[u8]], panel: &mut [f32]) {
        let k = self.w.cols;
        let simd = match self.widen {
            Some(widen) => {
                let cols = k / 8 * 8;
                widen(stored, cols, panel);
                cols
            }
            None => 0,
        };
        let elem = self.w.bytes.len() / (self.w.rows * k).max(1);
        let mut rows = [[0.0f32; WIDEN_COLS]; PANEL_ROWS];
        for c0 in (simd..k).step_by(WIDEN_COLS) {
            let kc = (k - c0).min(WIDEN_COLS);
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
        for tokens in PANEL_TOKENS + 1..=2 * PANEL_TOKENS {
            gemm_matches_row_dots_at(tokens);
        }
    }

    fn gemm_matches_row_dots_at(tokens: usize) {
        // Two column blocks, the second not a multiple of the SIMD widener's 8 columns.
        let (rows, cols) = (37, BLOCK_COLS + 2 * WIDEN_COLS + 13);
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
