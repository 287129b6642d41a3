//! Attention for runs of consecutive query rows of one session (prefill), in register tiles.
//!
//! The row path (`query_rows.rs`) reads and widens every cached key and value once per query
//! row and multiplies them one row at a time. Here a task takes up to QUERY_ROWS consecutive
//! rows of a session and one kv head: the tile's rows times the query heads sharing that kv
//! head form `m` query vectors that meet each cached block together. A block of KEY_BLOCK
//! keys and values is widened to f32 once per task, then both products run in `gemm`'s
//! register tile (PANEL_ROWS x PANEL_TOKENS):
//! - scores: PANEL_ROWS keys x PANEL_TOKENS query vectors, summed over the head dimension;
//! - weighted values: PANEL_ROWS value dimensions x PANEL_TOKENS query vectors, summed over
//!   the block's keys.
//!
//! The softmax runs online over blocks with a running maximum per query vector, as in the
//! row path.

use std::ops::Range;

use cellm_kernels::dot::{DecodeFn, PathKernels};
use cellm_kernels::gating::exp_in_place;
use cellm_kernels::panel::{TileFn, PANEL_ROWS, PANEL_TOKENS};
use cellm_kernels::pool::{parallel_for, SharedOut};

use crate::call::{AttentionCall, AttentionShape, SeqSpan};
use crate::encoding::KeyHeader;
use crate::pool::PagePool;

/// Consecutive query positions per task: their query vectors share each widened block.
const QUERY_ROWS: usize = 16;
/// Cached positions widened per step (a multiple of PANEL_ROWS); with a 64-wide head a
/// block's keys and values take 32 KiB.
const KEY_BLOCK: usize = 64;
/// Writes into `out` the attention of every row of `call`'s spans, whose keys and values
/// `pool` already holds. Rows of `q`/`out` are `n_heads * head_dim` wide.
pub(crate) fn attend(pool: &PagePool, call: &AttentionCall, out: &mut [f32]) {
    let tile = PathKernels::selected().tile_kernel();
    let tiles = Tiles { pool, call, tile, decode: pool.config().encoding.decoder() };
    tiles.run(out);
}

/// One call's tile tasks: what every task reads, with the kernels chosen once for all.
struct Tiles<'a> {
    pool: &'a PagePool,
    call: &'a AttentionCall<'a>,
    tile: TileFn,
    decode: DecodeFn,
}

impl Tiles<'_> {
    /// One task per (tile of up to QUERY_ROWS rows, kv head), each writing its rows' outputs
    /// for that kv head's group of query heads.
    fn run(&self, out: &mut [f32]) {
        let (spans, shape) = (self.call.spans, self.call.shape);
        // (span, tile) pairs, the longest contexts first so the last tasks are short ones.
        let mut tiles: Vec<(usize, Range<usize>)> = spans
            .iter()
            .enumerate()
            .flat_map(|(si, s)| {
                (0..s.len).step_by(QUERY_ROWS).map(move |i| (si, i..(i + QUERY_ROWS).min(s.len)))
            })
            .collect();
        tiles.sort_by_key(|(si, rows)| std::cmp::Reverse(spans[*si].start + rows.end));
        let kv_heads = shape.n_kv_heads;
        let out_ptr = SharedOut(out.as_mut_ptr());
        let out_len = out.len();
        parallel_for(tiles.len() * kv_heads, |task| {
            let (si, rows) = &tiles[task / kv_heads];
            let tile = QueryTile { span: &spans[*si], rows: rows.clone() };
            let kv_head = task % kv_heads;
            let width = shape.n_heads * shape.head_dim;
            let group = shape.n_heads / kv_heads;
            let mut acc = TileState::new(&tile, kv_head, self.call.q, shape);
            self.accumulate(&tile, kv_head, &mut acc);
            for m in 0..acc.count {
                let (i, h) = (m / group, kv_head * group + m % group);
                let at = (tile.span.row0 + tile.rows.start + i) * width + h * shape.head_dim;
                assert!(at + shape.head_dim <= out_len, "attention: output row out of range");
                // SAFETY: in bounds (checked above); each (row, query head) belongs to one
                // task: its tile's rows and its kv head's group of query heads.
                let o = unsafe { std::slice::from_raw_parts_mut(out_ptr.at(at), shape.head_dim) };
                acc.finish(m, o);
            }
        });
    }

    /// Runs every cached block the tile's rows can see through the scores, the online
    /// softmax and the weighted values.
    fn accumulate(&self, tile: &QueryTile, kv_head: usize, acc: &mut TileState) {
        let shape = self.call.shape;
        let mut block = Block::new(shape.head_dim);
        let seen = tile.first_key(shape)..tile.position(tile.rows.len() - 1) + 1;
        // Blocks end at the last row's position, so only the diagonal tile is partly masked.
        let mut end = seen.end;
        while end > seen.start {
            let keys = end.saturating_sub(KEY_BLOCK).max(seen.start)..end;
            self.widen_block(tile, kv_head, keys.clone(), &mut block);
            acc.add_block(&block, keys.clone(), tile, shape, self.tile);
            end = keys.start;
        }
    }

    /// Widens the cached keys and values of `keys` for `kv_head` into `block`.
    fn widen_block(&self, tile: &QueryTile, kv_head: usize, keys: Range<usize>, block: &mut Block) {
        let (hd, decode) = (self.call.shape.head_dim, self.decode);
        let (rb, ps) = (self.pool.row_bytes(), self.pool.config().page_size);
        let head_bytes = self.pool.config().encoding.head_bytes(hd);
        let mut row = vec![0.0f32; hd];
        block.keys = keys.len();
        // Key headers (where the encoding keeps them): keys decode to the model's own
        // (queries come unrotated); the header of page `page_ref`, decoded once per page.
        let hdr = self.pool.config().header_bytes(hd);
        let rotation = self.pool.config().encoding.rotation(hd);
        let (mut header, mut page_ref) = ((Vec::new(), Vec::new()), usize::MAX);
        // Keys past the block's end keep their last values: their scores are masked and
        // their weights are zero, but they must be finite, so the buffers start zeroed.
        for (j, pos) in keys.enumerate() {
            let (krows, vrows) = self.pool.page_rows(tile.span.kv, self.call.layer, pos / ps);
            let at = (pos % ps) * rb + kv_head * head_bytes;
            if hdr == 0 {
                (decode)(&krows[at..at + head_bytes], &mut row);
            } else {
                if page_ref != pos / ps {
                    let refs = self.pool.page_refs(tile.span.kv, self.call.layer, pos / ps);
                    header = KeyHeader::decode(&refs[kv_head * hdr..][..hdr], hd);
                    page_ref = pos / ps;
                }
                let r = rotation.as_ref().expect("a rotating encoding");
                let stored = &krows[at..at + head_bytes];
                KeyHeader::decode_key((&header.0, &header.1), (r, decode), stored, &mut row);
            }
            let (b, r) = (j / PANEL_ROWS, j % PANEL_ROWS);
            let panel = &mut block.k[b * hd * PANEL_ROWS..(b + 1) * hd * PANEL_ROWS];
            for (d, &v) in row.iter().enumerate() {
                panel[d * PANEL_ROWS + r] = v;
            }
            (decode)(&vrows[at..at + head_bytes], &mut row);
            for (b, dims) in row.chunks(PANEL_ROWS).enumerate() {
                let at = (b * KEY_BLOCK + j) * PANEL_ROWS;
                block.v[at..at + dims.len()].copy_from_slice(dims);
            }
        }
    }
}

/// One task's query rows: `rows` of `span` (indices within the span).
struct QueryTile<'a> {
    span: &'a SeqSpan<'a>,
    rows: Range<usize>,
}

impl QueryTile<'_> {
    /// The position of the tile's `i`-th row.
    fn position(&self, i: usize) -> usize {
        self.span.start + self.rows.start + i
    }

    /// The first key the first row (the one reaching furthest back) can see.
    fn first_key(&self, shape: &AttentionShape) -> usize {
        shape.first_visible(self.position(0))
    }
}

type OutTile = [[f32; PANEL_ROWS]; PANEL_TOKENS];

/// One block of cached positions widened to f32: keys as panels of PANEL_ROWS keys
/// (column-major over the head dimension), values as panels of PANEL_ROWS value dimensions
/// (column-major over the block's keys).
struct Block {
    k: Vec<f32>,
    v: Vec<f32>,
    keys: usize,
}

impl Block {
    fn new(hd: usize) -> Self {
        let dim_panels = hd.div_ceil(PANEL_ROWS);
        Self {
            k: vec![0.0; KEY_BLOCK * hd],
            v: vec![0.0; dim_panels * KEY_BLOCK * PANEL_ROWS],
            keys: 0,
        }
    }
}

/// A task's packed queries and running softmax state. Query vector `m` is row
/// `m / group`, query head `m % group` of the kv head's group.
struct TileState {
    /// Scaled queries, PANEL_TOKENS vectors per group, column-major over the head dimension.
    q: Vec<f32>,
    /// Vectors in use (the rest of the last group is zero padding).
    count: usize,
    group: usize,
    /// Scores of the current block, a row of KEY_BLOCK per vector, then its weights.
    scores: Vec<f32>,
    /// The weights again, packed like `q` but over the block's keys.
    weights: Vec<f32>,
    /// Unnormalised outputs as register tiles: `dim_panels` tiles per group of vectors, each
    /// PANEL_TOKENS vectors x PANEL_ROWS dimensions.
    out: Vec<OutTile>,
    dim_panels: usize,
    max: Vec<f32>,
    denom: Vec<f32>,
}

impl TileState {
    fn new(tile: &QueryTile, kv_head: usize, q: &[f32], shape: &AttentionShape) -> Self {
        let (hd, group) = (shape.head_dim, shape.n_heads / shape.n_kv_heads);
        let count = tile.rows.len() * group;
        let padded = count.div_ceil(PANEL_TOKENS) * PANEL_TOKENS;
        let width = shape.n_heads * hd;
        let dim_panels = hd.div_ceil(PANEL_ROWS);
        let mut packed = vec![0.0f32; padded * hd];
        for m in 0..count {
            let (i, h) = (m / group, kv_head * group + m % group);
            let row = tile.span.row0 + tile.rows.start + i;
            let qv = &q[row * width + h * hd..][..hd];
            let (g, t) = (m / PANEL_TOKENS, m % PANEL_TOKENS);
            let dst = &mut packed[g * hd * PANEL_TOKENS..(g + 1) * hd * PANEL_TOKENS];
            for (d, &v) in qv.iter().enumerate() {
                dst[d * PANEL_TOKENS + t] = v * shape.scale;
            }
        }
        Self {
            q: packed,
            count,
            group,
            scores: vec![0.0; padded * KEY_BLOCK],
            weights: vec![0.0; padded * KEY_BLOCK],
            out: vec![[[0.0; PANEL_ROWS]; PANEL_TOKENS]; padded / PANEL_TOKENS * dim_panels],
            dim_panels,
            max: vec![f32::NEG_INFINITY; padded],
            denom: vec![0.0; padded],
        }
    }

    /// Folds one block into the running sums.
    fn add_block(
        &mut self,
        block: &Block,
        keys: Range<usize>,
        tile: &QueryTile,
        shape: &AttentionShape,
        tile_fn: TileFn,
    ) {
        let hd = shape.head_dim;
        let groups = self.q.len() / (hd * PANEL_TOKENS);
        let key_panels = block.keys.div_ceil(PANEL_ROWS);
        for g in 0..groups {
            let qg = &self.q[g * hd * PANEL_TOKENS..(g + 1) * hd * PANEL_TOKENS];
            for b in 0..key_panels {
                let mut t = [[0.0; PANEL_ROWS]; PANEL_TOKENS];
                tile_fn(
                    &block.k[b * hd * PANEL_ROWS..][..hd * PANEL_ROWS],
                    qg,
                    hd,
                    PANEL_TOKENS,
                    &mut t,
                );
                for (v, s) in t.iter().enumerate() {
                    let row = (g * PANEL_TOKENS + v) * KEY_BLOCK + b * PANEL_ROWS;
                    self.scores[row..row + PANEL_ROWS].copy_from_slice(s);
                }
            }
        }
        self.softmax_block(keys, tile, shape);
        let n = block.keys;
        for (g, out) in self.out.chunks_exact_mut(self.dim_panels).enumerate() {
            let wg = &self.weights[g * KEY_BLOCK * PANEL_TOKENS..][..n * PANEL_TOKENS];
            for (b, out) in out.iter_mut().enumerate() {
                let panel = &block.v[b * KEY_BLOCK * PANEL_ROWS..][..n * PANEL_ROWS];
                tile_fn(panel, wg, n, PANEL_TOKENS, out);
            }
        }
    }

    /// Turns the block's scores into weights against each vector's running maximum
    /// (rescaling its sums when the maximum grows), then packs them for the value tile.
    /// Keys a vector cannot see (later positions, outside its window) weigh zero.
    fn softmax_block(&mut self, keys: Range<usize>, tile: &QueryTile, shape: &AttentionShape) {
        let n = keys.len();
        for m in 0..self.max.len() {
            let row = &mut self.scores[m * KEY_BLOCK..m * KEY_BLOCK + n];
            let visible = if m < self.count {
                let pos = tile.position(m / self.group);
                let clip = |p: usize| p.clamp(keys.start, keys.end) - keys.start;
                let (lo, hi) = (clip(shape.first_visible(pos)), clip(pos + 1));
                lo..hi.max(lo)
            } else {
                0..0
            };
            let seen = &mut row[visible.clone()];
            if let Some(cap) = shape.softcap {
                seen.iter_mut().for_each(|s| *s = cap * (*s / cap).tanh());
            }
            let top = seen.iter().fold(f32::NEG_INFINITY, |a, &s| a.max(s));
            if top > self.max[m] {
                let rescale = (self.max[m] - top).exp();
                let (g, t) = (m / PANEL_TOKENS, m % PANEL_TOKENS);
                for tile in &mut self.out[g * self.dim_panels..(g + 1) * self.dim_panels] {
                    tile[t].iter_mut().for_each(|o| *o *= rescale);
                }
                self.denom[m] *= rescale;
                self.max[m] = top;
            }
            if !seen.is_empty() {
                let max = self.max[m];
                seen.iter_mut().for_each(|s| *s -= max);
                exp_in_place(seen);
                self.denom[m] += seen.iter().sum::<f32>();
            }
            row[..visible.start].fill(0.0);
            row[visible.end..].fill(0.0);
        }
        for m in 0..self.max.len() {
            let (g, t) = (m / PANEL_TOKENS, m % PANEL_TOKENS);
            let packed = &mut self.weights[g * KEY_BLOCK * PANEL_TOKENS..][..n * PANEL_TOKENS];
            for (j, &w) in self.scores[m * KEY_BLOCK..m * KEY_BLOCK + n].iter().enumerate() {
                packed[j * PANEL_TOKENS + t] = w;
            }
        }
    }

    /// Writes vector `m`'s normalised output (one head's `out.len()` values).
    fn finish(&self, m: usize, out: &mut [f32]) {
        let (g, t) = (m / PANEL_TOKENS, m % PANEL_TOKENS);
        let inv = 1.0 / self.denom[m];
        let tiles = &self.out[g * self.dim_panels..(g + 1) * self.dim_panels];
        for (o, v) in out.iter_mut().zip(tiles.iter().flat_map(|tile| tile[t])) {
            *o = v * inv;
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::encoding::{stored_keys, stored_values};
    use crate::{AttentionCall, AttentionShape, KvConfig, KvEncoding, PagePool, SeqSpan};

    /// Exact in f16 (multiples of 1/32 below 2), so both cache encodings hold the same values;
    /// hashed, so no two stretches of the cache repeat each other (split contexts' chunks
    /// then have different maxima, which their merge must reconcile).
    fn val(i: usize) -> f32 {
        (((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) % 97) as f32 / 32.0 - 1.5
    }

    /// softmax(q.K^T * scale) V over positions `lo..=pos`, for query head `h`.
    fn dense(
        qh: &[f32],
        k: &[f32],
        v: &[f32],
        pos: usize,
        h: usize,
        s: &AttentionShape,
    ) -> Vec<f32> {
        let (hd, kv) = (s.head_dim, s.n_kv_heads);
        let g = h / (s.n_heads / kv);
        let lo = s.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let scores: Vec<f32> = (lo..=pos)
            .map(|p| {
                let dot: f32 =
                    qh.iter().zip(&k[(p * kv + g) * hd..][..hd]).map(|(a, b)| a * b).sum();
                let x = dot * s.scale;
                s.softcap.map_or(x, |cap| cap * (x / cap).tanh())
            })
            .collect();
        let top = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = scores.iter().map(|x| (x - top).exp()).collect();
        let z: f32 = e.iter().sum();
        (0..hd)
            .map(|d| (lo..=pos).map(|p| e[p - lo] / z * v[(p * kv + g) * hd + d]).sum())
            .collect()
    }

    /// Prefill spans by query tiles agree with dense attention: a session fed in two chunks
    /// (the second starting inside a page, more than one tile and key block long), a short
    /// session prefilled in the same batch, and a decode token on the row path beside them;
    /// seven query heads per kv head (vectors do not fill whole register tiles) and a head
    /// size that is not a multiple of the tile's 16 dimensions (nor of int4's 32); every
    /// cache encoding (the compressed ones against dense attention over the values they
    /// hold); with and without a window and soft-capping.
    #[test]
    fn prefill_tiles_match_dense_attention() {
        let (n_heads, n_kv, ps) = (14, 2, 16);
        let lens = [150, 9, 30];
        for encoding in [KvEncoding::F32, KvEncoding::F16, KvEncoding::Int8, KvEncoding::Int4] {
            // Not a multiple of 32: int4's last group is partial.
            let hd = 24;
            for (window, softcap) in [(None, None), (Some(37), None), (None, Some(0.5))] {
                let shape = AttentionShape {
                    n_heads,
                    n_kv_heads: n_kv,
                    head_dim: hd,
                    scale: 0.2,
                    window,
                    softcap,
                };
                let mut pool = PagePool::new(KvConfig {
                    num_layers: 1,
                    kv_heads: n_kv,
                    head_dim: hd,
                    page_size: ps,
                    max_pages: 64,
                    encoding,
                    windows: Vec::new(),
                    values_in_keys: false,
                });
                let (w, kw) = (n_heads * hd, n_kv * hd);
                // Per session: its q, k, v for every position.
                let data: Vec<[Vec<f32>; 3]> = lens
                    .iter()
                    .enumerate()
                    .map(|(s, &len)| {
                        let at = |c: usize, i: usize| val(i + 1000 * (3 * s + c));
                        [
                            (0..len * w).map(|i| at(0, i)).collect(),
                            (0..len * kw).map(|i| at(1, i)).collect(),
                            (0..len * kw).map(|i| at(2, i)).collect(),
                        ]
                    })
                    .collect();
                // The keys and values the cache holds (what the encoding keeps of them).
                let held: Vec<[Vec<f32>; 2]> = data
                    .iter()
                    .map(|[q, k, v]| {
                        [
                            stored_keys(encoding, hd, (n_kv, ps), q, k),
                            stored_values(encoding, hd, v),
                        ]
                    })
                    .collect();
                let mut seqs: Vec<_> = lens.iter().map(|_| pool.new_seq()).collect();
                for (seq, &len) in seqs.iter_mut().zip(&lens) {
                    pool.reserve(seq, len).unwrap();
                }
                // First call: session 0 up to 70 and session 2 up to 29. Second call: session 0
                // from 70, all of session 1, session 2's last position alone.
                let calls: [&[(usize, std::ops::Range<usize>)]; 2] =
                    [&[(0, 0..70), (2, 0..29)], &[(0, 70..150), (1, 0..9), (2, 29..30)]];
                for parts in calls {
                    let mut spans = Vec::new();
                    let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
                    for (s, pos) in parts {
                        spans.push(SeqSpan {
                            kv: &seqs[*s],
                            start: pos.start,
                            len: pos.len(),
                            row0: q.len() / w,
                        });
                        q.extend_from_slice(&data[*s][0][pos.start * w..pos.end * w]);
                        k.extend_from_slice(&data[*s][1][pos.start * kw..pos.end * kw]);
                        v.extend_from_slice(&data[*s][2][pos.start * kw..pos.end * kw]);
                    }
                    let mut out = vec![f32::NAN; q.len()];
                    let call = AttentionCall {
                        layer: 0,
                        spans: &spans,
                        q: &q,
                        k: &k,
                        v: &v,
                        shape: &shape,
                    };
                    call.run(&mut pool, &mut out);
                    for (s, pos) in parts {
                        let row0 = spans
                            .iter()
                            .find(|sp| sp.start == pos.start && std::ptr::eq(sp.kv, &seqs[*s]))
                            .unwrap()
                            .row0;
                        for (i, p) in pos.clone().enumerate() {
                            for h in 0..n_heads {
                                let qh = &data[*s][0][(p * n_heads + h) * hd..][..hd];
                                let want = dense(qh, &held[*s][0], &held[*s][1], p, h, &shape);
                                let got = &out[(row0 + i) * w + h * hd..][..hd];
                                for (d, (g, e)) in got.iter().zip(&want).enumerate() {
                                    // f32 sums of at most 150 terms of magnitude < 4: rounding
                                    // stays near 1e-6; a wrong mask or a stale weight moves
                                    // outputs by far more.
                                    assert!((g - e).abs() < 1e-4, "{encoding:?} {window:?} {softcap:?} session {s} pos {p} head {h} dim {d}: {g} vs {e}");
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}
