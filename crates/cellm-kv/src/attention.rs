//! Causal attention over paged keys and values.

use cellm_kernels::cache::prefetch_all;
use cellm_kernels::dot::{CachedRows, PathKernels};
use cellm_kernels::gating::exp_in_place;
use cellm_kernels::pool::{current_threads, parallel_for, SharedOut};

use crate::pool::{PagePool, SeqKv};
use crate::query_tiles::MIN_TILED_ROWS;

/// One session's part of a batch: its new tokens are rows `row0..row0 + len` of q/k/v and
/// take positions `start..start + len`.
#[derive(Clone, Copy)]
pub struct SeqSpan<'a> {
    pub kv: &'a SeqKv,
    pub start: usize,
    pub len: usize,
    pub row0: usize,
}

/// The per-layer attention parameters a model declares.
#[derive(Debug, Clone)]
pub struct AttentionShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Multiplies q.k before the softmax.
    pub scale: f32,
    /// Sliding window: attend to at most this many most recent positions (self included).
    pub window: Option<usize>,
    /// Soft-capping of scores: `cap * tanh(s / cap)`.
    pub softcap: Option<f32>,
}

impl PagePool {
    /// Stores each span's new keys and values for `layer`, then writes into `out` the causal
    /// attention of every query row over its own session's cache.
    ///
    /// Shapes: `q`/`out` are `rows x n_heads*head_dim`, `k`/`v` are `rows x n_kv_heads*head_dim`
    /// (`v` is ignored when the pool keeps values in the keys).
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &mut self,
        layer: usize,
        spans: &[SeqSpan],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
        shape: &AttentionShape,
    ) {
        let hd = shape.head_dim;
        let kv_width = shape.n_kv_heads * hd;
        assert_eq!(kv_width, self.config().kv_heads * self.config().head_dim, "KV shape");
        let mut row_of = Vec::new();
        for (si, s) in spans.iter().enumerate() {
            for i in 0..s.len {
                let r = s.row0 + i;
                self.write(
                    s.kv,
                    layer,
                    s.start + i,
                    &k[r * kv_width..][..kv_width],
                    v.get(r * kv_width..(r + 1) * kv_width).unwrap_or(&[]),
                );
                if s.len < MIN_TILED_ROWS {
                    row_of.push((r, si, s.start + i));
                }
            }
        }
        // Runs of new rows (prefill) go by query tiles, the rest (decode) row by row.
        let tiled: Vec<SeqSpan> =
            spans.iter().filter(|s| s.len >= MIN_TILED_ROWS).copied().collect();
        if !tiled.is_empty() {
            self.attend_query_tiles(layer, &tiled, q, out, shape);
        }
        if row_of.is_empty() {
            return;
        }
        row_of.sort_unstable();
        let pages = &*self;
        let ps = self.config().page_size;
        assert!(
            shape.n_heads <= MAX_HEADS && ps <= MAX_PAGE,
            "attention: {} heads or pages of {ps} are more than a task holds ({MAX_HEADS}, {MAX_PAGE})",
            shape.n_heads
        );
        // Tasks are (token, chunk of pages) over all heads: cached rows hold every kv head side
        // by side, so a chunk's pages stream from memory once, in order. A lone decode token
        // still splits its context over every thread (each chunk keeps its own softmax
        // maximum; chunks merge below).
        let rows = row_of.len();
        let longest = row_of.iter().map(|&(_, _, pos)| pos / ps + 1).max().unwrap_or(1);
        let chunks = (2 * current_threads()).div_ceil(rows).clamp(1, longest);
        let width = shape.n_heads * hd;
        let mut partial = vec![Partial::default(); rows * chunks];
        let mut acc = vec![0.0f32; rows * chunks * width];
        let (parts, accs) = (SharedOut(partial.as_mut_ptr()), SharedOut(acc.as_mut_ptr()));
        // Each row's queries times the scale, once for all its chunks instead of in every
        // score.
        let scaled: Vec<f32> = row_of
            .iter()
            .flat_map(|&(r, _, _)| q[r * width..(r + 1) * width].iter().map(|x| x * shape.scale))
            .collect();
        parallel_for(rows * chunks, |task| {
            let (row, chunk) = (task / chunks, task % chunks);
            let (_, si, pos) = row_of[row];
            let first = shape.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let (lo, hi) = (first / ps, pos / ps + 1);
            let per = (hi - lo).div_ceil(chunks);
            let pages_of_chunk = (lo + chunk * per).min(hi)..(lo + (chunk + 1) * per).min(hi);
            // SAFETY: task `task` alone writes its partial record and accumulator slice.
            let (part, o) = unsafe {
                (&mut *parts.at(task), std::slice::from_raw_parts_mut(accs.at(task * width), width))
            };
            let q = &scaled[row * width..(row + 1) * width];
            let query = Query { seq: spans[si].kv, layer, q, first, pos };
            pages.attend_pages(&query, pages_of_chunk, shape, part, o);
        });
        for (row, &(r, _, _)) in row_of.iter().enumerate() {
            merge(
                &partial[row * chunks..(row + 1) * chunks],
                &acc[row * chunks * width..(row + 1) * chunks * width],
                hd,
                &mut out[r * width..(r + 1) * width],
            );
        }
    }

    /// Unnormalised softmax-weighted sums of values over the pages `pages` (clipped to the
    /// query's window) for every head of one query row, a page at a time with a running
    /// maximum per head; `part` gets each head's maximum and denominator. A page's rows of one
    /// kv head go through the page kernels once for all the query heads sharing it.
    fn attend_pages(
        &self,
        query: &Query,
        pages: std::ops::Range<usize>,
        shape: &AttentionShape,
        part: &mut Partial,
        out: &mut [f32],
    ) {
        let (hd, n_heads) = (shape.head_dim, shape.n_heads);
        let group = n_heads / shape.n_kv_heads;
        let kern = PathKernels::selected().head_kernels(self.config().encoding.format());
        let head_bytes = self.config().encoding.format().nbytes(&[hd]).expect("small");
        let (rb, ps) = (self.row_bytes(), self.config().page_size);
        let (max, denom) = (&mut part.max, &mut part.denom);
        // scores[h * count + slot] for the page's `count` live slots, then the softmax
        // weights in place.
        let mut scores = vec![0.0f32; n_heads * ps];
        for page in pages.clone() {
            let (krows, vrows) = self.page_rows(query.seq, query.layer, page);
            // A chunk's first page was not requested ahead: ask for all of it at once rather
            // than meet its misses one kv head's strided rows at a time.
            if page == pages.start {
                prefetch_all(krows);
                prefetch_all(vrows);
            }
            // The next page comes from memory while this one multiplies, a share of each of
            // its planes before each kernel call: the hardware prefetcher does not follow a
            // session's pages, which lie anywhere in the pool, and one burst of requests for
            // a whole page stalls more than it saves.
            let next = match page + 1 < pages.end {
                true => self.page_rows(query.seq, query.layer, page + 1),
                false => (&[][..], &[][..]),
            };
            let ahead = |plane: &[u8], kv: usize| {
                let share = plane.len() / shape.n_kv_heads;
                prefetch_all(&plane[kv * share..(kv + 1) * share]);
            };
            let slots = page * ps..(page * ps + ps).min(query.pos + 1);
            let slots = slots.start.max(query.first) - page * ps..slots.end - page * ps;
            let count = slots.len();
            let scores = &mut scores[..n_heads * count];
            let run = |plane, kv: usize| {
                CachedRows { bytes: plane, stride: rb, count, dim: hd }
                    .offset_by(slots.start * rb + kv * head_bytes)
            };
            for kv in 0..shape.n_kv_heads {
                let heads = kv * group..(kv + 1) * group;
                let scores = &mut scores[heads.start * count..heads.end * count];
                ahead(next.0, kv);
                (kern.dot)(run(krows, kv), &query.q[heads.start * hd..heads.end * hd], scores);
            }
            if let Some(cap) = shape.softcap {
                scores.iter_mut().for_each(|s| *s = cap * (*s / cap).tanh());
            }
            for (h, weights) in scores.chunks_exact_mut(count).enumerate() {
                let page_max = weights.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
                if page_max > max[h] {
                    let rescale = (max[h] - page_max).exp();
                    out[h * hd..(h + 1) * hd].iter_mut().for_each(|o| *o *= rescale);
                    denom[h] *= rescale;
                    max[h] = page_max;
                }
                weights.iter_mut().for_each(|s| *s -= max[h]);
                exp_in_place(weights);
                denom[h] += weights.iter().sum::<f32>();
            }
            for kv in 0..shape.n_kv_heads {
                let heads = kv * group..(kv + 1) * group;
                let weights = &scores[heads.start * count..heads.end * count];
                ahead(next.1, kv);
                (kern.axpy)(weights, run(vrows, kv), &mut out[heads.start * hd..heads.end * hd]);
            }
        }
    }
}

/// The largest page and head count one attention task handles on its stack.
const MAX_PAGE: usize = 64;
const MAX_HEADS: usize = 64;

/// One query row (all its heads) and its view of its session's cache.
struct Query<'a> {
    seq: &'a SeqKv,
    layer: usize,
    /// Its queries, already times the scale.
    q: &'a [f32],
    first: usize,
    pos: usize,
}

/// A chunk's running softmax state per query head.
#[derive(Clone, Copy)]
struct Partial {
    max: [f32; MAX_HEADS],
    denom: [f32; MAX_HEADS],
}

impl Default for Partial {
    fn default() -> Self {
        Self { max: [f32::NEG_INFINITY; MAX_HEADS], denom: [0.0; MAX_HEADS] }
    }
}

/// Combines the chunks of one token into normalised outputs: each chunk's sums are
/// rescaled to the overall maximum.
fn merge(parts: &[Partial], accs: &[f32], hd: usize, out: &mut [f32]) {
    let width = out.len();
    for (h, oh) in out.chunks_exact_mut(hd).enumerate() {
        let top = parts.iter().map(|p| p.max[h]).fold(f32::NEG_INFINITY, f32::max);
        oh.fill(0.0);
        let mut denom = 0.0;
        for (p, acc) in parts.iter().zip(accs.chunks_exact(width)) {
            if p.denom[h] == 0.0 {
                continue; // a chunk with no positions in the window
            }
            let scale = (p.max[h] - top).exp();
            denom += p.denom[h] * scale;
            oh.iter_mut().zip(&acc[h * hd..(h + 1) * hd]).for_each(|(o, a)| *o += scale * a);
        }
        let inv = 1.0 / denom;
        oh.iter_mut().for_each(|o| *o *= inv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{KvConfig, KvEncoding};

    /// Paged attention equals a dense softmax(q.K^T * scale) V computed directly, for a
    /// sequence spanning several pages and with grouped heads, with and without a sliding
    /// window that starts inside a page, and with and without soft-capped scores.
    #[test]
    fn matches_dense_attention() {
        for (window, softcap) in [(None, None), (Some(6), None), (None, Some(0.5))] {
            check_dense(window, softcap, false);
            // The last token alone on four threads: its context is split into page chunks.
            let pool = cellm_kernels::pool::ThreadPool::new(4).unwrap();
            pool.install(|| check_dense(window, softcap, true));
        }
    }

    fn check_dense(window: Option<usize>, softcap: Option<f32>, last_alone: bool) {
        let (n_heads, n_kv, hd, len) = (4, 2, 8, 11);
        let mut pool = PagePool::new(KvConfig {
            num_layers: 1,
            kv_heads: n_kv,
            head_dim: hd,
            page_size: 4,
            max_pages: 16,
            encoding: KvEncoding::F32,
            windows: Vec::new(),
            values_in_keys: false,
        });
        let val = |i: usize| ((i * 7919) % 97) as f32 / 48.0 - 1.0;
        let q: Vec<f32> = (0..len * n_heads * hd).map(|i| val(i + 3)).collect();
        let k: Vec<f32> = (0..len * n_kv * hd).map(|i| val(i + 11)).collect();
        let v: Vec<f32> = (0..len * n_kv * hd).map(|i| val(i + 29)).collect();
        let mut seq = pool.new_seq();
        pool.reserve(&mut seq, len).unwrap();
        let shape = AttentionShape {
            n_heads,
            n_kv_heads: n_kv,
            head_dim: hd,
            scale: 0.35,
            window,
            softcap,
        };
        let mut out = vec![0.0; q.len()];
        let first_row = if last_alone { len - 1 } else { 0 };
        if last_alone {
            let w = n_heads * hd;
            let kw = n_kv * hd;
            let spans = [SeqSpan { kv: &seq, start: 0, len: len - 1, row0: 0 }];
            let mut scratch = vec![0.0; (len - 1) * w];
            let (q0, k0, v0) = (&q[..(len - 1) * w], &k[..(len - 1) * kw], &v[..(len - 1) * kw]);
            pool.attention(0, &spans, q0, k0, v0, &mut scratch, &shape);
            let spans = [SeqSpan { kv: &seq, start: len - 1, len: 1, row0: 0 }];
            let (ql, kl, vl) = (&q[(len - 1) * w..], &k[(len - 1) * kw..], &v[(len - 1) * kw..]);
            pool.attention(0, &spans, ql, kl, vl, &mut out[(len - 1) * w..], &shape);
        } else {
            let spans = [SeqSpan { kv: &seq, start: 0, len, row0: 0 }];
            pool.attention(0, &spans, &q, &k, &v, &mut out, &shape);
        }
        for t in first_row..len {
            for h in 0..n_heads {
                let g = h / 2;
                let qh = &q[(t * n_heads + h) * hd..][..hd];
                let lo = window.map_or(0, |w| (t + 1).saturating_sub(w));
                let scores: Vec<f32> = (lo..=t)
                    .map(|p| {
                        qh.iter()
                            .zip(&k[(p * n_kv + g) * hd..][..hd])
                            .map(|(a, b)| a * b)
                            .sum::<f32>()
                            * 0.35
                    })
                    .map(|s| softcap.map_or(s, |cap| cap * (s / cap).tanh()))
                    .collect();
                let m = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f32 = e.iter().sum();
                for d in 0..hd {
                    let want: f32 =
                        (lo..=t).map(|p| e[p - lo] / z * v[(p * n_kv + g) * hd + d]).sum();
                    let got = out[(t * n_heads + h) * hd + d];
                    assert!((want - got).abs() < 1e-5, "t={t} h={h} d={d}: {want} vs {got}");
                }
            }
        }
    }
}
