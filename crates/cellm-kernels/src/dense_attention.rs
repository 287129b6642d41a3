//! Bidirectional (unmasked) attention over a short sequence held whole in memory, such as
//! one image's patches in a vision tower, in the GEMM's register tile (`panel`), without
//! forming any `n x n` matrix. (Cached, causal attention over KV pages is `cellm-kv`'s.)
//!
//! A task takes one head and a block of PANEL_ROWS queries, which form the tile's panel:
//! - scores: the queries (rows) times groups of PANEL_TOKENS keys, summed over the head
//!   dimension; the tile's output is already the layout of the next product's panel,
//!   `scores[key][query]` (n x 16 floats, in L2);
//! - softmax per query, a lane of every score row;
//! - weighted values: the probabilities (rows: queries, columns: keys) times groups of
//!   PANEL_TOKENS value dimensions, summed over the keys.
//!
//! Each head's keys and values are packed once into those groups; a task reads them once
//! (2 n hd floats), and every multiply-add of both products runs in the register tile.

use crate::gating::exp_in_place;
use crate::gemm::GemmTile;
use crate::pool::{parallel_for, SharedOut};

/// Softmax attention of every position to every position: `q`, `k`, `v` are
/// `n x (heads * hd)`; returns the context rows in the same layout. Tasks (head, block of
/// queries) run on the installed pool.
pub fn bidirectional_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n: usize,
    heads: usize,
    hd: usize,
    scale: f32,
) -> Vec<f32> {
    let shape = Shape { n, heads, hd, width: heads * hd };
    attend(GemmTile::selected(), [q, k, v], shape, scale)
}

#[derive(Clone, Copy)]
struct Shape {
    n: usize,
    heads: usize,
    hd: usize,
    width: usize,
}

impl Shape {
    /// Floats of one head's packed keys: groups of `group` keys, each `hd x group`.
    fn keys_len(self, group: usize) -> usize {
        self.n.div_ceil(group) * self.hd * group
    }

    /// Floats of one head's packed values: groups of `group` dimensions, each `n x group`.
    fn values_len(self, group: usize) -> usize {
        self.hd.div_ceil(group) * self.n * group
    }
}

fn attend(tile: GemmTile, [q, k, v]: [&[f32]; 3], s: Shape, scale: f32) -> Vec<f32> {
    for x in [q, k, v] {
        assert_eq!(x.len(), s.n * s.width, "attention: q, k, v must be n x heads*hd");
    }
    let (kl, vl) = (s.keys_len(tile.tokens), s.values_len(tile.tokens));
    let (keys, values) = pack_heads(k, v, s, tile.tokens);
    let blocks = s.n.div_ceil(tile.rows);
    let mut ctx = vec![0.0; s.n * s.width];
    let out = SharedOut(ctx.as_mut_ptr());
    parallel_for(s.heads * blocks, |task| {
        let (h, b) = (task / blocks, task % blocks);
        let head_keys = &keys[h * kl..][..kl];
        let head_values = &values[h * vl..][..vl];
        let queries = b * tile.rows..((b + 1) * tile.rows).min(s.n);
        let block = QueryBlock { tile, s, h, queries: queries.clone() };
        SCRATCH.with_borrow_mut(|scratch| {
            let Scratch { panel, probs } = scratch;
            block.query_panel(q, scale, panel);
            block.scores(panel, head_keys, probs);
            let sums = softmax_numerators(&mut probs[..s.n * tile.rows], tile.rows);
            block.weighted_values(probs, head_values, |query, dims, vals| {
                let at = query * s.width + h * s.hd + dims;
                let inv = 1.0 / sums[query - queries.start];
                // SAFETY: (query, head h) belongs to this task alone, and `at + vals.len()`
                // stays within the query's row of `ctx` (dims + vals.len() <= hd).
                let dst = unsafe { std::slice::from_raw_parts_mut(out.at(at), vals.len()) };
                dst.iter_mut().zip(vals).for_each(|(o, &x)| *o = x * inv);
            });
        });
    });
    ctx
}

/// A worker's buffers for its tasks: a task's query panel and scores (n x the tile's rows,
/// 128 KiB at 1024 patches) are reused instead of allocated, zeroed and freed per task.
#[derive(Default)]
struct Scratch {
    panel: Vec<f32>,
    probs: Vec<f32>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

/// Every head's keys as `[group][dim][key in group]` and values as
/// `[group of dims][key][dim in group]` (groups of `group`), zero-padded to whole groups;
/// heads run in parallel.
fn pack_heads<'a>(k: &'a [f32], v: &'a [f32], s: Shape, group: usize) -> (Vec<f32>, Vec<f32>) {
    let (kl, vl) = (s.keys_len(group), s.values_len(group));
    let mut keys = vec![0.0f32; s.heads * kl];
    let mut values = vec![0.0f32; s.heads * vl];
    let (ko, vo) = (SharedOut(keys.as_mut_ptr()), SharedOut(values.as_mut_ptr()));
    parallel_for(s.heads, |h| {
        // SAFETY: head h owns these two ranges of the buffers.
        let kh = unsafe { std::slice::from_raw_parts_mut(ko.at(h * kl), kl) };
        let vh = unsafe { std::slice::from_raw_parts_mut(vo.at(h * vl), vl) };
        let row =
            |x: &'a [f32], key: usize| -> &'a [f32] { &x[key * s.width + h * s.hd..][..s.hd] };
        // Written in order: a key group's columns, read from its rows at once.
        for (g, out) in kh.chunks_exact_mut(s.hd * group).enumerate() {
            let keys: Vec<&[f32]> =
                (g * group..((g + 1) * group).min(s.n)).map(|j| row(k, j)).collect();
            for (d, col) in out.chunks_exact_mut(group).enumerate() {
                col.iter_mut().zip(&keys).for_each(|(o, key)| *o = key[d]);
            }
        }
        // A group of dimensions at a time, each key's run of them copied whole.
        for (dims, out) in vh.chunks_exact_mut(s.n * group).enumerate() {
            let (d0, width) = (dims * group, group.min(s.hd - dims * group));
            for (key, dst) in out.chunks_exact_mut(group).enumerate() {
                dst[..width].copy_from_slice(&row(v, key)[d0..d0 + width]);
            }
        }
    });
    (keys, values)
}

/// One task: up to a tile's rows of consecutive queries of head `h`.
struct QueryBlock {
    tile: GemmTile,
    s: Shape,
    h: usize,
    queries: std::ops::Range<usize>,
}

impl QueryBlock {
    /// The block's queries times `scale` as a panel: `[dim][query]`, missing queries zero.
    fn query_panel(&self, q: &[f32], scale: f32, panel: &mut Vec<f32>) {
        let (s, rows) = (self.s, self.tile.rows);
        panel.clear();
        panel.resize(s.hd * rows, 0.0);
        for (r, query) in self.queries.clone().enumerate() {
            let row = &q[query * s.width + self.h * s.hd..][..s.hd];
            for (d, &x) in row.iter().enumerate() {
                panel[d * rows + r] = x * scale;
            }
        }
    }

    /// `scores[key][query]` for every key (rows past `n` are padding).
    fn scores(&self, panel: &[f32], keys: &[f32], scores: &mut Vec<f32>) {
        let (n, hd, group) = (self.s.n, self.s.hd, self.tile.tokens);
        let groups = n.div_ceil(group);
        // Each tile is zeroed just before its product, in L1, not the whole buffer at once.
        scores.resize(groups * self.tile.len(), 0.0);
        for (g, out) in
            scores[..groups * self.tile.len()].chunks_exact_mut(self.tile.len()).enumerate()
        {
            let x = &keys[g * hd * group..][..hd * group];
            let live = (n - g * group).min(group);
            out.fill(0.0);
            self.tile.run(panel, x, hd, live, out);
        }
    }

    /// For each group of the tile's tokens of dimensions, `sum over keys of
    /// probs[key][query] * value[key][dim]`, handed to `store(query, first dim, values)`.
    fn weighted_values(
        &self,
        probs: &[f32],
        values: &[f32],
        mut store: impl FnMut(usize, usize, &[f32]),
    ) {
        let (n, hd, rows, group) = (self.s.n, self.s.hd, self.tile.rows, self.tile.tokens);
        let panel = &probs[..n * rows];
        let mut acc = vec![0.0f32; self.tile.len()];
        let mut vals = vec![0.0f32; group];
        for (g, x) in values.chunks_exact(n * group).enumerate() {
            let live = (hd - g * group).min(group);
            acc.fill(0.0);
            self.tile.run(panel, x, n, live, &mut acc);
            for (r, query) in self.queries.clone().enumerate() {
                vals.iter_mut().enumerate().for_each(|(d, v)| *v = acc[d * rows + r]);
                store(query, g * group, &vals[..live]);
            }
        }
    }
}

/// `scores[key][lane] = exp(score - max over keys of the lane)` over rows of `lanes`
/// scores; returns each lane's sum.
fn softmax_numerators(scores: &mut [f32], lanes: usize) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    if lanes == avx512::LANES && crate::isa::selected() == crate::Isa::Avx512Vnni {
        // SAFETY: the AVX-512 path is selected only on CPUs with AVX-512F.
        return unsafe { avx512::softmax_numerators(scores) }.to_vec();
    }
    let mut max = vec![f32::NEG_INFINITY; lanes];
    for row in scores.chunks_exact(lanes) {
        max.iter_mut().zip(row).for_each(|(m, &x)| *m = m.max(x));
    }
    let mut sums = vec![0.0f32; lanes];
    // Subtract, exponentiate and sum a block of rows while it is in L1 (the whole score
    // matrix is n x lanes floats, 128 KiB at 1024 patches); n x lanes exponentials per task
    // on the vectorized exp, not libm's.
    for block in scores.chunks_mut(SOFTMAX_ROWS * lanes) {
        for row in block.chunks_exact_mut(lanes) {
            row.iter_mut().zip(&max).for_each(|(x, m)| *x -= m);
        }
        exp_in_place(block);
        for row in block.chunks_exact(lanes) {
            sums.iter_mut().zip(row).for_each(|(s, &x)| *s += x);
        }
    }
    sums
}

/// Score rows per softmax block (8 KiB of 32-query rows).
const SOFTMAX_ROWS: usize = 64;

/// The softmax of the wide tile's 32 query lanes in AVX-512: one pass for the maxima, one
/// that exponentiates, stores and sums each row in registers.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    pub const LANES: usize = 32;

    /// [`super::softmax_numerators`] for rows of 32 lanes.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn softmax_numerators(scores: &mut [f32]) -> [f32; LANES] {
        assert!(scores.len().is_multiple_of(LANES));
        let rows = scores.len() / LANES;
        let p = scores.as_mut_ptr();
        let mut max = [_mm512_set1_ps(f32::NEG_INFINITY); 2];
        for r in 0..rows {
            for (h, m) in max.iter_mut().enumerate() {
                *m = _mm512_max_ps(*m, _mm512_loadu_ps(p.add(r * LANES + 16 * h)));
            }
        }
        let mut sum = [_mm512_setzero_ps(); 2];
        for r in 0..rows {
            for h in 0..2 {
                let at = p.add(r * LANES + 16 * h);
                let e = crate::gating::exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(at), max[h]));
                _mm512_storeu_ps(at, e);
                sum[h] = _mm512_add_ps(sum[h], e);
            }
        }
        let mut out = [0.0f32; LANES];
        _mm512_storeu_ps(out.as_mut_ptr(), sum[0]);
        _mm512_storeu_ps(out.as_mut_ptr().add(16), sum[1]);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Isa;

    /// softmax(Q K^T * scale) V in f64, one head and query at a time.
    fn reference([q, k, v]: [&[f32]; 3], s: Shape, scale: f64) -> Vec<f64> {
        let mut out = vec![0.0; s.n * s.width];
        for h in 0..s.heads {
            let col = |x: &[f32], row: usize, d: usize| f64::from(x[row * s.width + h * s.hd + d]);
            for i in 0..s.n {
                let scores: Vec<f64> = (0..s.n)
                    .map(|j| (0..s.hd).map(|d| col(q, i, d) * col(k, j, d)).sum::<f64>() * scale)
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                for d in 0..s.hd {
                    let acc: f64 = (0..s.n).map(|j| weights[j] * col(v, j, d)).sum();
                    out[i * s.width + h * s.hd + d] = acc / total;
                }
            }
        }
        out
    }

    /// Every path's tile, sizes that leave partial query blocks, key groups and dimension
    /// groups (and a single patch), pooled and not: within f32 rounding of the f64
    /// reference.
    #[test]
    fn attention_matches_a_float64_reference() {
        let pool = crate::pool::ThreadPool::new(3).unwrap();
        for (n, heads, hd) in [(1, 2, 16), (7, 1, 20), (17, 3, 16), (40, 2, 64), (101, 2, 8)] {
            let s = Shape { n, heads, hd, width: heads * hd };
            let fill = |seed: usize| -> Vec<f32> {
                (0..n * s.width).map(|i| ((i * 7919 + seed) % 201) as f32 / 50.0 - 2.0).collect()
            };
            let (q, k, v) = (fill(1), fill(2), fill(3));
            let scale = 1.0 / (hd as f32).sqrt();
            let want = reference([&q, &k, &v], s, f64::from(scale));
            for isa in Isa::available() {
                let tile = GemmTile::of(isa);
                for pooled in [false, true] {
                    let run = || attend(tile, [&q, &k, &v], s, scale);
                    let got = if pooled { pool.install(run) } else { run() };
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        // Scores up to ~hd * 4 * scale in magnitude, summed in f32: 1e-5
                        // relative rounding shows as a few 1e-6 on outputs of magnitude 2;
                        // a key or dimension group shifted by one is off by O(1).
                        assert!(
                            (f64::from(*g) - w).abs() < 2e-5,
                            "{isa:?} n={n} heads={heads} hd={hd} [{i}]: {g} vs {w}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn attention_of_one_patch_is_its_value() {
        let v = [1.0, 2.0, 3.0, 4.0];
        let ctx = bidirectional_attention(&[0.5; 4], &[0.3; 4], &v, 1, 2, 2, 0.7);
        assert_eq!(ctx, v);
    }
}
