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
use crate::isa::{self, Isa};
use crate::panel::{TileFn, WideTileFn, PANEL_ROWS, PANEL_TOKENS, WIDE_ROWS, WIDE_TOKENS};
use crate::pool::{parallel_for, SharedOut};
use crate::rows::WeightRows;

/// Columns multiplied per pass over the token groups: the panel's slice stays in L1 (16 KiB
/// for 16 rows, 32 KiB for 32).
const BLOCK_COLS: usize = 256;
/// Tokens per token block (whole groups): their packed slice of a column block (384 KiB)
/// stays in L2 while the row block's panels pass, and a panel is widened once per 384 tokens.
const TOKEN_BLOCK_TOKENS: usize = 384;
/// Rows per row block (whole panels): their accumulators for a token block take 192 KiB of L2.
const ROW_BLOCK_ROWS: usize = 128;
/// Columns widened per step by the row-by-row (scalar) widening, into a small row-major
/// buffer before they are transposed into the panel.
const WIDEN_COLS: usize = 64;
/// The most rows of any tile.
const MAX_ROWS: usize = WIDE_ROWS;

/// The register tile a path's GEMM (and dense attention) runs: its shape and kernel. The
/// `Avx512Vnni` path has the 32-row x 8-token AVX-512 tile; the other paths the 16 x 6 tile of
/// their table (`PathKernels::tile_kernel`, which cached attention uses too).
#[derive(Clone, Copy)]
pub struct GemmTile {
    /// Rows of a panel column (the tile's rows).
    pub rows: usize,
    /// Tokens of a packed group (the tile's columns).
    pub tokens: usize,
    kernel: TileKernel,
}

#[derive(Clone, Copy)]
enum TileKernel {
    Narrow(TileFn),
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // the wide tile is AVX-512 only
    Wide(WideTileFn),
}

impl GemmTile {
    pub fn of(isa: Isa) -> Self {
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Avx512Vnni && crate::panel::avx512_wide::supported() {
            return Self::wide(crate::panel::avx512_wide::tile);
        }
        Self::narrow(PathKernels::of(isa).tile_kernel())
    }

    /// The selected path's tile.
    pub fn selected() -> Self {
        Self::of(isa::selected())
    }

    fn narrow(tile: TileFn) -> Self {
        Self { rows: PANEL_ROWS, tokens: PANEL_TOKENS, kernel: TileKernel::Narrow(tile) }
    }

    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // the wide tile is AVX-512 only
    fn wide(tile: WideTileFn) -> Self {
        Self { rows: WIDE_ROWS, tokens: WIDE_TOKENS, kernel: TileKernel::Wide(tile) }
    }

    /// Floats of one tile's accumulators.
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        self.rows * self.tokens
    }

    /// `acc[t * rows + r] += sum_c panel[c * rows + r] * x[c * tokens + t]` over `cols`
    /// columns, for the first `live` tokens (a path may compute the padded rest too).
    #[inline]
    pub fn run(&self, panel: &[f32], x: &[f32], cols: usize, live: usize, acc: &mut [f32]) {
        match self.kernel {
            TileKernel::Narrow(tile) => {
                let acc: &mut [f32; PANEL_ROWS * PANEL_TOKENS] = acc.try_into().expect("a tile");
                // SAFETY: [f32; 16 * 6] and [[f32; 16]; 6] have the same size and layout.
                let acc = unsafe {
                    &mut *(acc as *mut [f32; PANEL_ROWS * PANEL_TOKENS])
                        .cast::<[[f32; PANEL_ROWS]; PANEL_TOKENS]>()
                };
                tile(panel, x, cols, live, acc)
            }
            TileKernel::Wide(tile) => tile(panel, x, cols, live, acc.try_into().expect("a tile")),
        }
    }
}

/// The column blocks of a `cols`-wide product.
fn column_blocks(cols: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    (0..cols).step_by(BLOCK_COLS).map(move |c0| c0..(c0 + BLOCK_COLS).min(cols))
}

/// Packs `tokens` activation rows of `cols` for [`FloatGemm::run`] on the selected path.
pub fn pack_tokens(x: &[f32], tokens: usize, cols: usize) -> Vec<f32> {
    pack_groups(x, tokens, cols, GemmTile::selected().tokens)
}

/// Packs `tokens` activation rows of `cols`: column blocks of BLOCK_COLS, within a block
/// groups of `group` tokens, column-major within a group; a short last group is padded with
/// zeros. (block, group) pairs run on the installed pool.
fn pack_groups(x: &[f32], tokens: usize, cols: usize, group: usize) -> Vec<f32> {
    assert_eq!(x.len(), tokens * cols, "gemm: activations are not tokens x cols");
    let groups = tokens.div_ceil(group);
    let mut packed = vec![0.0f32; groups * group * cols];
    let blocks: Vec<_> = column_blocks(cols).collect();
    let out = SharedOut(packed.as_mut_ptr());
    parallel_for(blocks.len() * groups, |task| {
        let (block, g) = (&blocks[task / groups], task % groups);
        let width = block.len();
        let at = (block.start * groups + g * width) * group;
        // SAFETY: each (block, group) pair owns these `group * width` elements, and the last
        // pair's end is the buffer's.
        let dst = unsafe { std::slice::from_raw_parts_mut(out.at(at), group * width) };
        let live = (tokens - g * group).min(group);
        let src: Vec<&[f32]> =
            (0..live).map(|lane| &x[(g * group + lane) * cols + block.start..][..width]).collect();
        // Written in order, read from `live` rows at once: stores stream, loads stay
        // sequential.
        for (c, out) in dst.chunks_exact_mut(group).enumerate() {
            out.iter_mut().zip(&src).for_each(|(o, s)| *o = s[c]);
        }
    });
    packed
}

/// Where each (token, column) of `tokens x cols` activations lies once packed for a tile of
/// `group` tokens ([`pack_tokens`]'s layout), for producers that write packed activations
/// directly (a LayerNorm, an activation function fused into the previous product's output).
#[derive(Clone, Copy, Debug)]
pub struct PackedLayout {
    pub cols: usize,
    groups: usize,
    group: usize,
}

impl PackedLayout {
    pub fn new(tokens: usize, cols: usize, group: usize) -> Self {
        Self { cols, groups: tokens.div_ceil(group), group }
    }

    /// Floats of the packed buffer (whole groups, padding included).
    pub fn len(&self) -> usize {
        self.groups * self.group * self.cols
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Index of token `t`'s column `c`.
    #[inline]
    pub fn at(&self, t: usize, c: usize) -> usize {
        let b0 = c / BLOCK_COLS * BLOCK_COLS;
        let width = BLOCK_COLS.min(self.cols - b0);
        (b0 * self.groups + t / self.group * width + (c - b0)) * self.group + t % self.group
    }

    /// Writes `vals` as token `t`'s columns `c0..` into `out` (a buffer of [`Self::len`]
    /// floats): one index computation per column block, then a fixed stride.
    ///
    /// # Safety
    /// `out` must point to `self.len()` writable floats that no one else writes at these
    /// places, and `c0 + vals.len() <= cols`.
    #[inline]
    pub unsafe fn write(&self, out: *mut f32, t: usize, c0: usize, vals: &[f32]) {
        debug_assert!(c0 + vals.len() <= self.cols);
        let (mut c, mut rest) = (c0, vals);
        while !rest.is_empty() {
            let run = (c / BLOCK_COLS * BLOCK_COLS + BLOCK_COLS - c).min(rest.len());
            let base = out.add(self.at(t, c));
            for (i, &v) in rest[..run].iter().enumerate() {
                *base.add(i * self.group) = v;
            }
            (c, rest) = (c + run, &rest[run..]);
        }
    }
}

/// `out[i] = gelu_tanh(vals[i] + bias[i])`, the epilogue of a product followed by gelu-tanh
/// (`x / (1 + e^(-2z))`, z = sqrt(2/pi) (x + 0.044715 x^3), as `gating`'s): AVX-512 on the
/// `Avx512Vnni` path, else `gating`'s kernel.
pub fn bias_gelu_tanh(vals: &[f32], bias: &[f32], out: &mut [f32]) {
    assert!(vals.len() == out.len() && bias.len() >= vals.len(), "bias_gelu_tanh: lengths");
    #[cfg(target_arch = "x86_64")]
    if isa::selected() == Isa::Avx512Vnni {
        // SAFETY: the AVX-512 path is selected only on CPUs with AVX-512F.
        return unsafe { epilogue_avx512::bias_gelu_tanh(vals, bias, out) };
    }
    out.iter_mut().zip(vals).zip(bias).for_each(|((o, v), b)| *o = v + b);
    crate::gating::Gate::GeluTanh.apply(out, None);
}

#[cfg(target_arch = "x86_64")]
mod epilogue_avx512 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    pub unsafe fn bias_gelu_tanh(vals: &[f32], bias: &[f32], out: &mut [f32]) {
        let n = vals.len();
        let (v, b, o) = (vals.as_ptr(), bias.as_ptr(), out.as_mut_ptr());
        let k = _mm512_set1_ps(-2.0 * 0.797_884_6);
        for i in (0..n).step_by(16) {
            let mask: __mmask16 = if n - i >= 16 { 0xffff } else { (1u16 << (n - i)) - 1 };
            let x = _mm512_add_ps(
                _mm512_maskz_loadu_ps(mask, v.add(i)),
                _mm512_maskz_loadu_ps(mask, b.add(i)),
            );
            let x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
            let a = _mm512_mul_ps(_mm512_fmadd_ps(x3, _mm512_set1_ps(0.044715), x), k);
            let y =
                _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0), crate::gating::exp_avx512(a)));
            _mm512_mask_storeu_ps(o.add(i), mask, y);
        }
    }
}

/// Stored float rows with the kernels of one ISA path.
pub struct FloatGemm<'a> {
    w: WeightRows<'a>,
    tile: GemmTile,
    decode: DecodeFn,
    widen: Option<PanelFn>,
}

impl<'a> FloatGemm<'a> {
    pub fn new(w: WeightRows<'a>, isa: Isa) -> Self {
        let path = PathKernels::of(isa);
        Self {
            w,
            tile: GemmTile::of(isa),
            decode: path.row_kernels(w.format).decode,
            widen: path.panel_widener(w.format),
        }
    }

    /// Tokens per packed group of this GEMM's tile.
    pub fn group(&self) -> usize {
        self.tile.tokens
    }

    /// Rows of this GEMM's tile (a task's row range should be a multiple of it).
    pub fn tile_rows(&self) -> usize {
        self.tile.rows
    }

    /// The packed layout of `tokens` activation rows for this GEMM.
    pub fn layout(&self, tokens: usize) -> PackedLayout {
        PackedLayout::new(tokens, self.w.cols, self.tile.tokens)
    }

    /// `tokens` activation rows packed for this GEMM's tile ([`pack_tokens`] on the selected
    /// path).
    pub fn pack(&self, x: &[f32], tokens: usize) -> Vec<f32> {
        pack_groups(x, tokens, self.w.cols, self.tile.tokens)
    }

    /// For every token of `packed` ([`FloatGemm::pack`] of `tokens` rows) and the stored rows
    /// `rows`, calls `store(t, r0, vals)` with `vals[i] = dot(x[t], row r0 + i)`.
    ///
    /// Loops, outermost first: blocks of TOKEN_BLOCK_TOKENS tokens, blocks of ROW_BLOCK_ROWS
    /// rows, column blocks, panels of the tile's rows, token groups. A panel's slice of one
    /// column block is widened into L1 and meets every group of the token block there; the
    /// token block's packed slice of that column block and the row block's accumulators stay
    /// in L2, so no operand of the register tile comes from memory however many tokens there
    /// are.
    pub fn run(
        &self,
        packed: &[f32],
        tokens: usize,
        rows: std::ops::Range<usize>,
        store: impl FnMut(usize, usize, &[f32]),
    ) {
        self.run_tokens(packed, tokens, 0..tokens, rows, store)
    }

    /// [`FloatGemm::run`] for the tokens `part` of the packed ones only (`part.start` a
    /// multiple of [`FloatGemm::group`]): tasks may split a product over tokens as well as
    /// rows.
    pub fn run_tokens(
        &self,
        packed: &[f32],
        tokens: usize,
        part: std::ops::Range<usize>,
        rows: std::ops::Range<usize>,
        mut store: impl FnMut(usize, usize, &[f32]),
    ) {
        let k = self.w.cols;
        let (tile_rows, group) = (self.tile.rows, self.tile.tokens);
        let tile_len = self.tile.len();
        let groups = tokens.div_ceil(group);
        assert_eq!(packed.len(), groups * group * k, "gemm: packed activations");
        assert!(rows.end <= self.w.rows, "gemm: rows out of range");
        let token_block = TOKEN_BLOCK_TOKENS / group;
        let row_block = ROW_BLOCK_ROWS / tile_rows;
        let stride = self.w.bytes.len() / self.w.rows.max(1);
        let elem = stride / k.max(1);
        let mut slice = vec![0.0f32; tile_rows * BLOCK_COLS];
        let mut half = vec![0.0f32; PANEL_ROWS * BLOCK_COLS];
        assert!(part.start.is_multiple_of(group) && part.end <= tokens, "gemm: token part");
        let part_groups = part.start / group..part.end.div_ceil(group);
        // Accumulators for the groups a token block really has: a step of a few tokens needs
        // a row block's tiles for one group, not for a full token block (192 KiB to zero).
        let block_groups = token_block.min(part_groups.len());
        let mut acc = vec![0.0f32; row_block * block_groups * tile_len];
        // Stored rows r0.. (at most a panel's, up to `end`), each cut to `cols`.
        let stored_rows = |r0: usize, end: usize, cols: &std::ops::Range<usize>| {
            let mut stored: [&[u8]; MAX_ROWS] = [&[]; MAX_ROWS];
            let count = end.saturating_sub(r0).min(tile_rows);
            for (r, s) in stored.iter_mut().enumerate().take(count) {
                *s = &self.w.bytes[(r0 + r) * stride..][cols.start * elem..cols.end * elem];
            }
            (stored, count)
        };
        for g0 in part_groups.clone().step_by(token_block) {
            let token_groups = g0..(g0 + token_block).min(part_groups.end);
            let n_groups = token_groups.len();
            for row_start in rows.clone().step_by(row_block * tile_rows) {
                let block_end = (row_start + row_block * tile_rows).min(rows.end);
                let panels: Vec<usize> = (row_start..block_end).step_by(tile_rows).collect();
                acc.fill(0.0);
                for block in column_blocks(k) {
                    let width = block.len();
                    let xs = &packed[block.start * groups * group..][..groups * group * width];
                    for (p, &r0) in panels.iter().enumerate() {
                        let (stored, count) = stored_rows(r0, block_end, &block);
                        self.widen_rows(&stored[..count], width, &mut slice, &mut half);
                        // The next panel's slice is requested while this one multiplies.
                        let (next, next_count) = stored_rows(r0 + tile_rows, block_end, &block);
                        let mut ahead = RowPrefetch::new(next, next_count, n_groups);
                        let slice = &slice[..width * tile_rows];
                        for g in token_groups.clone() {
                            ahead.step();
                            let x = &xs[g * group * width..][..group * width];
                            // The last group's padding is not multiplied.
                            let live = (tokens - g * group).min(group);
                            let at = (p * block_groups + g - g0) * tile_len;
                            self.tile.run(slice, x, width, live, &mut acc[at..at + tile_len]);
                        }
                    }
                }
                for (p, &r0) in panels.iter().enumerate() {
                    let count = (block_end - r0).min(tile_rows);
                    for g in token_groups.clone() {
                        let t0 = g * group;
                        let at = (p * block_groups + g - g0) * tile_len;
                        let tile = &acc[at..at + tile_len];
                        for (t, vals) in tile.chunks_exact(tile_rows).enumerate().take(tokens - t0)
                        {
                            store(t0 + t, r0, &vals[..count]);
                        }
                    }
                }
            }
        }
    }

    /// Widens `stored` (at most the tile's rows, of `cols` elements) into `panel`,
    /// column-major with the tile's rows per column; rows past the stored ones are zeros.
    /// A 32-row panel is widened as two 16-row halves (through `half`), interleaved.
    fn widen_rows(&self, stored: &[&[u8]], cols: usize, panel: &mut [f32], half: &mut [f32]) {
        let rows = self.tile.rows;
        if rows == PANEL_ROWS {
            return self.widen_panel(stored, cols, panel);
        }
        for (h, part) in stored.chunks(PANEL_ROWS).enumerate() {
            self.widen_panel(part, cols, half);
            for (c, col) in half[..cols * PANEL_ROWS].chunks_exact(PANEL_ROWS).enumerate() {
                panel[c * rows + h * PANEL_ROWS..][..PANEL_ROWS].copy_from_slice(col);
            }
        }
        // Halves with no stored rows are zeros.
        for h in stored.len().div_ceil(PANEL_ROWS)..rows / PANEL_ROWS {
            for c in 0..cols {
                panel[c * rows + h * PANEL_ROWS..][..PANEL_ROWS].fill(0.0);
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

/// Requests the cache lines of up to MAX_ROWS stored rows, an even share per `step` over
/// `steps` steps: spread out, the requests stream in behind the arithmetic instead of
/// queueing at once.
struct RowPrefetch<'a> {
    rows: [&'a [u8]; MAX_ROWS],
    count: usize,
    per_step: usize,
    row: usize,
    offset: usize,
}

impl<'a> RowPrefetch<'a> {
    fn new(rows: [&'a [u8]; MAX_ROWS], count: usize, steps: usize) -> Self {
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
    /// format and path (both tile shapes), with token counts that leave each size of last
    /// token group, row counts that leave partial tiles, and a column count that is not a
    /// multiple of the widening step.
    #[test]
    fn gemm_matches_row_dots() {
        // Two column blocks, the second not a multiple of the SIMD widener's 8 columns.
        let cols = BLOCK_COLS + 2 * WIDEN_COLS + 13;
        for tokens in PANEL_TOKENS + 1..=2 * WIDE_TOKENS {
            gemm_matches_row_dots_at(tokens, 37, cols);
        }
    }

    /// The bias + gelu epilogue equals `gating`'s scalar gelu-tanh of the sum within a few
    /// ulp-scaled units, lengths with and without a partial vector, on every path.
    #[test]
    fn bias_gelu_matches_the_scalar_gelu() {
        let _serial = crate::isa::test_lock();
        let vals: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) / 3.0).collect();
        let bias: Vec<f32> = (0..37).map(|i| ((i * 7) % 5) as f32 / 4.0 - 0.5).collect();
        for len in [0, 5, 16, 37] {
            let mut want: Vec<f32> = vals.iter().zip(&bias).map(|(v, b)| v + b).take(len).collect();
            crate::gating::Gate::GeluTanh.apply_scalar(&mut want, None);
            for path in Isa::available() {
                crate::isa::set_override(path).unwrap();
                let mut got = vec![0.0; len];
                bias_gelu_tanh(&vals[..len], &bias, &mut got);
                for (g, w) in got.iter().zip(&want) {
                    // gelu of |x| <= 7: e^a rounding gives relative errors near 1e-6.
                    assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "{path:?}: {g} vs {w}");
                }
            }
        }
        crate::isa::set_override(*Isa::available().last().unwrap()).unwrap();
    }

    /// Several token blocks and row blocks, each with a partial last one (a last panel of
    /// fewer than 16 rows, and one of more).
    #[test]
    fn gemm_blocks_match_row_dots() {
        let tokens = TOKEN_BLOCK_TOKENS + 7;
        gemm_matches_row_dots_at(tokens, ROW_BLOCK_ROWS + 21, BLOCK_COLS + 44);
        gemm_matches_row_dots_at(tokens, ROW_BLOCK_ROWS + 7, 40);
    }

    fn gemm_matches_row_dots_at(tokens: usize, rows: usize, cols: usize) {
        let x: Vec<f32> =
            (0..tokens * cols).map(|i| ((i * 7919) % 251) as f32 / 125.0 - 1.0).collect();
        for format in [TensorFormat::F32, TensorFormat::F16, TensorFormat::BF16] {
            let vals: Vec<f32> =
                (0..rows * cols).map(|i| ((i * 104729) % 211) as f32 / 100.0 - 1.05).collect();
            let bytes = crate::dot::encode(format, &vals);
            let stride = bytes.len() / rows;
            let dot = PathKernels::of(Isa::Scalar).row_kernels(format).dot;
            for path in Isa::available() {
                let gemm = FloatGemm::new(WeightRows { format, bytes: &bytes, rows, cols }, path);
                let packed = gemm.pack(&x, tokens);
                let layout = gemm.layout(tokens);
                assert_eq!(layout.len(), packed.len());
                let mut written = vec![f32::NAN; layout.len()];
                for (t, c) in (0..tokens).flat_map(|t| (0..cols).map(move |c| (t, c))) {
                    assert_eq!(packed[layout.at(t, c)], x[t * cols + c], "layout of ({t}, {c})");
                }
                for t in 0..tokens {
                    // Two runs per row, the first ending inside a column block.
                    let (row, split) = (&x[t * cols..(t + 1) * cols], cols / 3);
                    // SAFETY: `written` holds the layout's floats; the columns are in range.
                    unsafe {
                        layout.write(written.as_mut_ptr(), t, 0, &row[..split]);
                        layout.write(written.as_mut_ptr(), t, split, &row[split..]);
                    }
                }
                for (w, p) in written.iter().zip(&packed) {
                    assert!(w.to_bits() == p.to_bits() || (w.is_nan() && *p == 0.0));
                }
                // Packing on a pool (tasks over column blocks and token groups) gives the
                // same layout.
                let pool = crate::pool::ThreadPool::new(3).unwrap();
                assert_eq!(pool.install(|| gemm.pack(&x, tokens)), packed);
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
