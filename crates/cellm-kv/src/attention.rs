//! Causal attention over paged keys and values: a call stores its new keys and values, then
//! sends runs of new rows (prefill) through query tiles (`query_tiles`) and the rest (decode)
//! row by row (`query_rows`).

use crate::call::{AttentionCall, SeqSpan};
use crate::pool::PagePool;
use crate::{query_rows, query_tiles};

/// Spans with fewer new rows take the row path, which also splits a long context over
/// threads (a lone decode token would otherwise be a single task per kv head).
const MIN_TILED_ROWS: usize = 8;

/// The most new rows of one session whose lines [`prefetch_new_rows`] asks for.
const PREFETCHED_ROWS: usize = 16;

/// Asks for the cache lines that storing the new rows of `spans` in `layer` will write. A
/// model calls it before the layer's q/k/v product, so that the lines come from memory while
/// the product runs: a new row's lines were never read, and its stores otherwise wait on
/// memory on the calling thread alone while the others idle (a step of 8 decoding sessions,
/// DRAM-bound, spent 1% less time outside its parallel loops). Long prefill spans are
/// skipped: their rows would not stay in cache that long.
pub fn prefetch_new_rows(pool: &PagePool, spans: &[SeqSpan], layer: usize) {
    for s in spans.iter().filter(|s| s.len <= PREFETCHED_ROWS) {
        for pos in s.start..s.start + s.len {
            pool.prefetch_row(s.kv, layer, pos);
        }
    }
}

impl AttentionCall<'_> {
    /// Stores each span's new keys and values for the layer in `pool`, then writes into `out`
    /// (`rows x n_heads*head_dim`, as `q`) the causal attention of every query row over its
    /// own session's cache.
    pub fn run(&self, pool: &mut PagePool, out: &mut [f32]) {
        let kv_width = self.kv_width(pool);
        for s in self.spans {
            for i in 0..s.len {
                let r = s.row0 + i;
                let q_width = self.shape.n_heads * self.shape.head_dim;
                pool.write(
                    s.kv,
                    (self.layer, self.shape.head_dim),
                    s.start + i,
                    &self.q[r * q_width..(r + 1) * q_width],
                    &self.k[r * kv_width..][..kv_width],
                    self.v.get(r * kv_width..(r + 1) * kv_width).unwrap_or(&[]),
                );
            }
        }
        self.attend(pool, out);
    }

    /// Writes into `out` the attention of every query row over keys and values the layer's
    /// cache already holds for positions up to the row's own (`k` and `v` are not read):
    /// layers that read the cache another layer wrote (Gemma 4's KV-shared layers).
    pub fn attend(&self, pool: &PagePool, out: &mut [f32]) {
        self.kv_width(pool);
        // A rotated cache holds R k and R v: attention takes R q and gives R out.
        let Some(r) = pool.config().encoding.rotation(self.shape.head_dim) else {
            return self.attend_stored(pool, out);
        };
        // Unless keys are stored against page headers: then queries turn page by page.
        let mut q = self.q.to_vec();
        if !pool.config().key_headers() {
            r.rotate(&mut q);
        }
        AttentionCall { q: &q, ..*self }.attend_stored(pool, out);
        let width = self.shape.n_heads * self.shape.head_dim;
        for s in self.spans {
            r.unrotate(&mut out[s.row0 * width..(s.row0 + s.len) * width]);
        }
    }

    /// [`Self::attend`] with queries and outputs as the cache stores rows (rotated or not).
    fn attend_stored(&self, pool: &PagePool, out: &mut [f32]) {
        let mut row_of = Vec::new();
        for (si, s) in self.spans.iter().enumerate() {
            if s.len < MIN_TILED_ROWS {
                row_of.extend((0..s.len).map(|i| (s.row0 + i, si, s.start + i)));
            }
        }
        let tiled: Vec<SeqSpan> =
            self.spans.iter().filter(|s| s.len >= MIN_TILED_ROWS).copied().collect();
        if !tiled.is_empty() {
            query_tiles::attend(pool, &AttentionCall { spans: &tiled, ..*self }, out);
        }
        if !row_of.is_empty() {
            query_rows::attend(pool, self, row_of, out);
        }
    }

    /// The layer's key row width, which must fit the pool's rows (a pool shared by layers
    /// of several head widths has rows as wide as the widest; narrower layers use a prefix).
    fn kv_width(&self, pool: &PagePool) -> usize {
        let kv_width = self.shape.n_kv_heads * self.shape.head_dim;
        assert!(kv_width <= pool.config().kv_heads * pool.config().head_dim, "KV shape");
        kv_width
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::encoding::{stored_keys, stored_values};
    use crate::{AttentionShape, KvConfig, KvEncoding};

    /// Paged attention equals a dense softmax(q.K^T * scale) V computed directly, for a
    /// sequence spanning several pages and with grouped heads, with and without a sliding
    /// window that starts inside a page, and with and without soft-capped scores.
    #[test]
    fn matches_dense_attention() {
        for (window, softcap) in [(None, None), (Some(6), None), (None, Some(0.5))] {
            check_dense(window, softcap, false, (4, 2));
            // Rows of a pool wider than the layer's (a model with wider layers elsewhere).
            check_dense_in(window, softcap, false, (4, 2), 24);
            // The last token alone on four threads: its context is split into page chunks.
            let pool = cellm_kernels::pool::ThreadPool::new(4).unwrap();
            pool.install(|| check_dense(window, softcap, true, (4, 2)));
        }
    }

    /// More query heads than one row task holds (64), as valid HF configs may have: split
    /// into passes of whole kv groups (72 = 8 groups of 9), inside one group (72 sharing one
    /// kv head), and into three passes (130 heads, two groups of 65). This used to panic at
    /// the first decode.
    #[test]
    fn more_heads_than_a_task_holds() {
        let pool = cellm_kernels::pool::ThreadPool::new(4).unwrap();
        for heads in [(72, 8), (72, 1), (130, 2)] {
            for (window, softcap) in [(None, None), (Some(6), Some(0.5))] {
                check_dense(window, softcap, false, heads);
                check_dense(window, softcap, true, heads);
                pool.install(|| check_dense(window, softcap, true, heads));
            }
        }
    }

    /// Compressed pages (int8 and int4, with their rotation of q, k, v and the output) give
    /// dense attention over the values they hold: the stored rows decoded by the scalar
    /// reference (`stored_values`). Row path (the last token alone, with and without threads
    /// splitting its context) and query tiles, grouped heads, window and soft-capping, head
    /// sizes with a partial int4 group (40), and a layer narrower than the pool's rows.
    #[test]
    fn compressed_pages_match_dense_attention_over_their_values() {
        let pool = cellm_kernels::pool::ThreadPool::new(4).unwrap();
        for encoding in [KvEncoding::Int8, KvEncoding::Int4, KvEncoding::F16] {
            for (window, softcap) in [(None, None), (Some(6), Some(0.5))] {
                for heads in [(4, 2), (6, 1)] {
                    check_dense_as(window, softcap, false, heads, (encoding, 64, 64));
                    check_dense_as(window, softcap, true, heads, (encoding, 40, 64));
                    let layer = (encoding, 32, 128);
                    pool.install(|| check_dense_as(window, softcap, true, heads, layer));
                }
            }
        }
    }

    fn check_dense(
        window: Option<usize>,
        softcap: Option<f32>,
        last_alone: bool,
        heads: (usize, usize),
    ) {
        check_dense_in(window, softcap, last_alone, heads, 8);
    }

    /// As [`check_dense`], the layer's heads 8 wide in a pool whose heads are `pool_hd` wide.
    fn check_dense_in(
        window: Option<usize>,
        softcap: Option<f32>,
        last_alone: bool,
        heads: (usize, usize),
        pool_hd: usize,
    ) {
        check_dense_as(window, softcap, last_alone, heads, (KvEncoding::F32, 8, pool_hd));
    }

    /// As [`check_dense`], in a cache of `encoding`, the layer's heads `hd` wide in a pool
    /// whose heads are `pool_hd` wide.
    fn check_dense_as(
        window: Option<usize>,
        softcap: Option<f32>,
        last_alone: bool,
        (n_heads, n_kv): (usize, usize),
        (encoding, hd, pool_hd): (KvEncoding, usize, usize),
    ) {
        let len = 11;
        let mut pool = PagePool::new(KvConfig {
            num_layers: 1,
            kv_heads: n_kv,
            head_dim: pool_hd,
            page_size: 4,
            max_pages: 16,
            encoding,
            windows: Vec::new(),
            values_in_keys: false,
        });
        let val = |i: usize| ((i * 7919) % 97) as f32 / 48.0 - 1.0;
        let q: Vec<f32> = (0..len * n_heads * hd).map(|i| val(i + 3)).collect();
        let k: Vec<f32> = (0..len * n_kv * hd).map(|i| val(i + 11)).collect();
        let v: Vec<f32> = (0..len * n_kv * hd).map(|i| val(i + 29)).collect();
        let k_held = stored_keys(encoding, hd, (n_kv, 4), &q, &k);
        let v_held = stored_values(encoding, hd, &v);
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
            let call =
                AttentionCall { layer: 0, spans: &spans, q: q0, k: k0, v: v0, shape: &shape };
            call.run(&mut pool, &mut scratch);
            let spans = [SeqSpan { kv: &seq, start: len - 1, len: 1, row0: 0 }];
            let (ql, kl, vl) = (&q[(len - 1) * w..], &k[(len - 1) * kw..], &v[(len - 1) * kw..]);
            let call =
                AttentionCall { layer: 0, spans: &spans, q: ql, k: kl, v: vl, shape: &shape };
            call.run(&mut pool, &mut out[(len - 1) * w..]);
        } else {
            let spans = [SeqSpan { kv: &seq, start: 0, len, row0: 0 }];
            let call =
                AttentionCall { layer: 0, spans: &spans, q: &q, k: &k, v: &v, shape: &shape };
            call.run(&mut pool, &mut out);
        }
        for t in first_row..len {
            for h in 0..n_heads {
                let g = h / (n_heads / n_kv);
                let qh = &q[(t * n_heads + h) * hd..][..hd];
                let lo = window.map_or(0, |w| (t + 1).saturating_sub(w));
                let scores: Vec<f32> = (lo..=t)
                    .map(|p| {
                        qh.iter()
                            .zip(&k_held[(p * n_kv + g) * hd..][..hd])
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
                        (lo..=t).map(|p| e[p - lo] / z * v_held[(p * n_kv + g) * hd + d]).sum();
                    let got = out[(t * n_heads + h) * hd + d];
                    // f32 sums of at most 11 products of magnitude < 1 per step; a rotation
                    // adds a few roundings of sums of at most 64 such terms.
                    let tol = if encoding.rotation(hd).is_some() { 1e-4 } else { 1e-5 };
                    assert!(
                        (want - got).abs() < tol,
                        "{encoding:?} t={t} h={h} d={d}: {want} vs {got}"
                    );
                }
            }
        }
        // A layer that reads this cache without writing (a KV-shared layer) sees the same.
        let spans = [SeqSpan { kv: &seq, start: 0, len, row0: 0 }];
        let call = AttentionCall { layer: 0, spans: &spans, q: &q, k: &[], v: &[], shape: &shape };
        let mut again = vec![0.0; q.len()];
        call.attend(&pool, &mut again);
        let w = n_heads * hd;
        for (a, b) in again[first_row * w..].iter().zip(&out[first_row * w..]) {
            assert!((a - b).abs() < 1e-5, "attend alone: {a} vs {b}");
        }
    }
}
