//! Causal attention over paged keys and values.

use cellm_kernels::dot::kernels;
use cellm_kernels::isa;
use cellm_kernels::pool::{parallel_for, SharedOut};

use crate::pool::{PagePool, SeqKv};

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
    /// Shapes: `q`/`out` are `rows x n_heads*head_dim`, `k`/`v` are `rows x n_kv_heads*head_dim`.
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
        let mut row_of = Vec::with_capacity(q.len() / (shape.n_heads * hd));
        for (si, s) in spans.iter().enumerate() {
            for i in 0..s.len {
                let r = s.row0 + i;
                self.write(
                    s.kv,
                    layer,
                    s.start + i,
                    &k[r * kv_width..][..kv_width],
                    &v[r * kv_width..][..kv_width],
                );
                row_of.push((r, si, s.start + i));
            }
        }
        row_of.sort_unstable();
        let pages = &*self;
        let dst = SharedOut(out.as_mut_ptr());
        let group = shape.n_heads / shape.n_kv_heads;
        // One task per (token, kv head): the query heads sharing a kv head read its keys and
        // values once.
        parallel_for(row_of.len() * shape.n_kv_heads, |idx| {
            let (row, kv_head) = (idx / shape.n_kv_heads, idx % shape.n_kv_heads);
            let (_, si, pos) = row_of[row];
            let at = (row * shape.n_heads + kv_head * group) * hd;
            // SAFETY: task `idx` alone writes these `group` heads of `out`.
            let o = unsafe { std::slice::from_raw_parts_mut(dst.at(at), group * hd) };
            pages.attend_group(
                spans[si].kv,
                layer,
                &q[at..at + group * hd],
                kv_head,
                pos,
                shape,
                o,
            );
        });
    }

    /// Softmax-weighted sums of values for the query heads of one kv head at `pos`, a page at
    /// a time, with a running maximum per head (no score buffer beyond one page).
    #[allow(clippy::too_many_arguments)]
    fn attend_group(
        &self,
        seq: &SeqKv,
        layer: usize,
        q: &[f32],
        kv_head: usize,
        pos: usize,
        shape: &AttentionShape,
        out: &mut [f32],
    ) {
        let hd = shape.head_dim;
        let group = q.len() / hd;
        let kern = kernels(self.config().encoding.format(), isa::selected());
        let head_bytes = self.config().encoding.format().nbytes(&[hd]).expect("small");
        let (rb, ps) = (self.row_bytes(), self.config().page_size);
        let first = shape.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        out.fill(0.0);
        let mut max = vec![f32::NEG_INFINITY; group];
        let mut denom = vec![0.0f32; group];
        let mut scores = vec![0.0f32; ps];
        for page in first / ps..=pos / ps {
            let (krows, vrows) = self.page_rows(seq, layer, page);
            let slots = page * ps..(page * ps + ps).min(pos + 1);
            let slots = slots.start.max(first) - page * ps..slots.end - page * ps;
            let head = |rows, slot| head_of(rows, slot * rb + kv_head * head_bytes, head_bytes);
            for h in 0..group {
                let (qh, oh) = (&q[h * hd..(h + 1) * hd], &mut out[h * hd..(h + 1) * hd]);
                let mut page_max = f32::NEG_INFINITY;
                for slot in slots.clone() {
                    let mut s = (kern.dot)(head(krows, slot), qh) * shape.scale;
                    if let Some(cap) = shape.softcap {
                        s = cap * (s / cap).tanh();
                    }
                    scores[slot] = s;
                    page_max = page_max.max(s);
                }
                if page_max > max[h] {
                    let rescale = (max[h] - page_max).exp();
                    oh.iter_mut().for_each(|o| *o *= rescale);
                    denom[h] *= rescale;
                    max[h] = page_max;
                }
                for slot in slots.clone() {
                    let w = (scores[slot] - max[h]).exp();
                    denom[h] += w;
                    (kern.axpy)(w, head(vrows, slot), oh);
                }
            }
        }
        for (oh, d) in out.chunks_exact_mut(hd).zip(&denom) {
            let inv = 1.0 / d;
            oh.iter_mut().for_each(|o| *o *= inv);
        }
    }
}

/// `len` bytes of `rows` from `at`: one head of one cached row.
fn head_of(rows: &[u8], at: usize, len: usize) -> &[u8] {
    &rows[at..at + len]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{KvConfig, KvEncoding};

    /// Paged attention equals a dense softmax(q.K^T * scale) V computed directly, for a
    /// sequence spanning several pages and with grouped heads, with and without a sliding
    /// window that starts inside a page.
    #[test]
    fn matches_dense_attention() {
        for window in [None, Some(6)] {
            check_dense(window);
        }
    }

    fn check_dense(window: Option<usize>) {
        let (n_heads, n_kv, hd, len) = (4, 2, 8, 11);
        let mut pool = PagePool::new(KvConfig {
            num_layers: 1,
            kv_heads: n_kv,
            head_dim: hd,
            page_size: 4,
            max_pages: 16,
            encoding: KvEncoding::F32,
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
            softcap: None,
        };
        let mut out = vec![0.0; q.len()];
        let spans = [SeqSpan { kv: &seq, start: 0, len, row0: 0 }];
        pool.attention(0, &spans, &q, &k, &v, &mut out, &shape);
        for t in 0..len {
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
