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

use crate::dot::PathKernels;
use crate::gating::exp_in_place;
use crate::panel::{TileFn, PANEL_ROWS, PANEL_TOKENS};
use crate::pool::{parallel_for, SharedOut};

type Tile = [[f32; PANEL_ROWS]; PANEL_TOKENS];

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
    attend(PathKernels::selected().tile_kernel(), [q, k, v], shape, scale)
}

#[derive(Clone, Copy)]
struct Shape {
    n: usize,
    heads: usize,
    hd: usize,
    width: usize,
}

impl Shape {
    /// Floats of one head's packed keys: groups of PANEL_TOKENS keys, each `hd x 6`.
    fn keys_len(self) -> usize {
        self.n.div_ceil(PANEL_TOKENS) * self.hd * PANEL_TOKENS
    }

    /// Floats of one head's packed values: groups of PANEL_TOKENS dimensions, each `n x 6`.
    fn values_len(self) -> usize {
        self.hd.div_ceil(PANEL_TOKENS) * self.n * PANEL_TOKENS
    }
}

fn attend(tile: TileFn, [q, k, v]: [&[f32]; 3], s: Shape, scale: f32) -> Vec<f32> {
    for x in [q, k, v] {
        assert_eq!(x.len(), s.n * s.width, "attention: q, k, v must be n x heads*hd");
    }
    let (keys, values) = pack_heads(k, v, s);
    let blocks = s.n.div_ceil(PANEL_ROWS);
    let mut ctx = vec![0.0; s.n * s.width];
    let out = SharedOut(ctx.as_mut_ptr());
    parallel_for(s.heads * blocks, |task| {
        let (h, b) = (task / blocks, task % blocks);
        let head_keys = &keys[h * s.keys_len()..][..s.keys_len()];
        let head_values = &values[h * s.values_len()..][..s.values_len()];
        let queries = b * PANEL_ROWS..((b + 1) * PANEL_ROWS).min(s.n);
        let block = QueryBlock { tile, s, h, queries: queries.clone() };
        let panel = block.query_panel(q, scale);
        let mut probs = block.scores(&panel, head_keys);
        let sums = softmax_numerators(&mut probs[..s.n * PANEL_ROWS]);
        block.weighted_values(&probs, head_values, |query, dims, vals| {
            let at = query * s.width + h * s.hd + dims;
            let inv = 1.0 / sums[query - queries.start];
            // SAFETY: (query, head h) belongs to this task alone, and `at + vals.len()` stays
            // within the query's row of `ctx` (dims + vals.len() <= hd).
            let dst = unsafe { std::slice::from_raw_parts_mut(out.at(at), vals.len()) };
            dst.iter_mut().zip(vals).for_each(|(o, &x)| *o = x * inv);
        });
    });
    ctx
}

/// Every head's keys as `[group][dim][key in group]` and values as
/// `[group of dims][key][dim in group]`, zero-padded to whole groups; heads run in parallel.
fn pack_heads(k: &[f32], v: &[f32], s: Shape) -> (Vec<f32>, Vec<f32>) {
    let (kl, vl) = (s.keys_len(), s.values_len());
    let mut keys = vec![0.0f32; s.heads * kl];
    let mut values = vec![0.0f32; s.heads * vl];
    let (ko, vo) = (SharedOut(keys.as_mut_ptr()), SharedOut(values.as_mut_ptr()));
    parallel_for(s.heads, |h| {
        // SAFETY: head h owns these two ranges of the buffers.
        let kh = unsafe { std::slice::from_raw_parts_mut(ko.at(h * kl), kl) };
        let vh = unsafe { std::slice::from_raw_parts_mut(vo.at(h * vl), vl) };
        for key in 0..s.n {
            let (group, lane) = (key / PANEL_TOKENS, key % PANEL_TOKENS);
            let k_row = &k[key * s.width + h * s.hd..][..s.hd];
            for (d, &x) in k_row.iter().enumerate() {
                kh[(group * s.hd + d) * PANEL_TOKENS + lane] = x;
            }
            let v_row = &v[key * s.width + h * s.hd..][..s.hd];
            for (d, &x) in v_row.iter().enumerate() {
                let (dims, lane) = (d / PANEL_TOKENS, d % PANEL_TOKENS);
                vh[(dims * s.n + key) * PANEL_TOKENS + lane] = x;
            }
        }
    });
    (keys, values)
}

/// One task: up to PANEL_ROWS consecutive queries of head `h`.
struct QueryBlock {
    tile: TileFn,
    s: Shape,
    h: usize,
    queries: std::ops::Range<usize>,
}

impl QueryBlock {
    /// The block's queries times `scale` as a panel: `[dim][query]`, missing queries zero.
    fn query_panel(&self, q: &[f32], scale: f32) -> Vec<f32> {
        let s = self.s;
        let mut panel = vec![0.0f32; s.hd * PANEL_ROWS];
        for (r, query) in self.queries.clone().enumerate() {
            let row = &q[query * s.width + self.h * s.hd..][..s.hd];
            for (d, &x) in row.iter().enumerate() {
                panel[d * PANEL_ROWS + r] = x * scale;
            }
        }
        panel
    }

    /// `scores[key][query]` for every key (rows past `n` are padding).
    fn scores(&self, panel: &[f32], keys: &[f32]) -> Vec<f32> {
        let (n, hd) = (self.s.n, self.s.hd);
        let groups = n.div_ceil(PANEL_TOKENS);
        let mut scores = vec![0.0f32; groups * PANEL_TOKENS * PANEL_ROWS];
        for (g, out) in scores.chunks_exact_mut(PANEL_TOKENS * PANEL_ROWS).enumerate() {
            let x = &keys[g * hd * PANEL_TOKENS..][..hd * PANEL_TOKENS];
            let live = (n - g * PANEL_TOKENS).min(PANEL_TOKENS);
            (self.tile)(panel, x, hd, live, as_tile(out));
        }
        scores
    }

    /// For each group of PANEL_TOKENS dimensions, `sum over keys of probs[key][query] *
    /// value[key][dim]`, handed to `store(query, first dim, values)`.
    fn weighted_values(
        &self,
        probs: &[f32],
        values: &[f32],
        mut store: impl FnMut(usize, usize, &[f32]),
    ) {
        let (n, hd) = (self.s.n, self.s.hd);
        let panel = &probs[..n * PANEL_ROWS];
        for (g, x) in values.chunks_exact(n * PANEL_TOKENS).enumerate() {
            let live = (hd - g * PANEL_TOKENS).min(PANEL_TOKENS);
            let mut acc: Tile = [[0.0; PANEL_ROWS]; PANEL_TOKENS];
            (self.tile)(panel, x, n, live, &mut acc);
            for (r, query) in self.queries.clone().enumerate() {
                let vals: [f32; PANEL_TOKENS] = std::array::from_fn(|d| acc[d][r]);
                store(query, g * PANEL_TOKENS, &vals[..live]);
            }
        }
    }
}

/// `scores[key][lane] = exp(score - max over keys of the lane)`; returns each lane's sum.
fn softmax_numerators(scores: &mut [f32]) -> [f32; PANEL_ROWS] {
    let mut max = [f32::NEG_INFINITY; PANEL_ROWS];
    for row in scores.chunks_exact(PANEL_ROWS) {
        max.iter_mut().zip(row).for_each(|(m, &x)| *m = m.max(x));
    }
    for row in scores.chunks_exact_mut(PANEL_ROWS) {
        row.iter_mut().zip(&max).for_each(|(x, m)| *x -= m);
    }
    // n x 16 exponentials per task: the vectorized exp, not libm's.
    exp_in_place(scores);
    let mut sums = [0.0f32; PANEL_ROWS];
    for row in scores.chunks_exact(PANEL_ROWS) {
        sums.iter_mut().zip(row).for_each(|(s, &x)| *s += x);
    }
    sums
}

/// PANEL_TOKENS x PANEL_ROWS floats as one register tile's accumulators.
fn as_tile(out: &mut [f32]) -> &mut Tile {
    let out: &mut [f32; PANEL_TOKENS * PANEL_ROWS] = out.try_into().expect("one tile");
    // SAFETY: [f32; 6 * 16] and [[f32; 16]; 6] have the same size, alignment and layout.
    unsafe { &mut *(out as *mut [f32; PANEL_TOKENS * PANEL_ROWS]).cast::<Tile>() }
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
                let tile = PathKernels::of(isa).tile_kernel();
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
