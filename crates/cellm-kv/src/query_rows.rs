//! Attention one query row at a time: decode tokens, and the spans of a batch too short for
//! query tiles. A task takes one row and a chunk of its context's pages, over all heads; a
//! lone token still spreads its context over every thread, and the chunks' partial softmaxes
//! merge at the end.

use cellm_kernels::cache::prefetch_all;
use cellm_kernels::dot::CachedRows;
use cellm_kernels::gating::exp_in_place;
use cellm_kernels::pool::{current_threads, parallel_for, SharedOut};

use crate::call::{AttentionCall, AttentionShape};
use crate::encoding::PageReader;
use crate::pool::{PagePool, SeqKv};

/// Writes into `out` the attention of `row_of`'s rows, each `(row of q and out, span,
/// position)`, whose keys and values `pool` already holds.
pub(crate) fn attend(
    pool: &PagePool,
    call: &AttentionCall,
    mut row_of: Vec<(usize, usize, usize)>,
    out: &mut [f32],
) {
    row_of.sort_unstable();
    let (shape, hd) = (call.shape, call.shape.head_dim);
    let ps = pool.config().page_size;
    assert!(ps <= MAX_PAGE, "attention: pages of {ps} are more than a task holds ({MAX_PAGE})");
    // Tasks are (token, heads, chunk of pages): cached rows hold every kv head side by side,
    // so a chunk's pages stream from memory once, in order. A lone decode token still splits
    // its context over every thread (each chunk keeps its own softmax maximum; chunks merge
    // below). A task holds at most MAX_HEADS query heads: more go in passes of whole kv
    // groups where a group fits (each pass reads the pages again).
    let n_heads = shape.n_heads;
    let group = n_heads / shape.n_kv_heads;
    let per_pass = if group <= MAX_HEADS { MAX_HEADS / group * group } else { MAX_HEADS };
    let passes = n_heads.div_ceil(per_pass);
    let pass_heads = |p: usize| p * per_pass..((p + 1) * per_pass).min(n_heads);
    let rows = row_of.len();
    let longest = row_of.iter().map(|&(_, _, pos)| pos / ps + 1).max().unwrap_or(1);
    let chunks = (2 * current_threads()).div_ceil(rows * passes).clamp(1, longest);
    let width = n_heads * hd;
    let pass_width = per_pass.min(n_heads) * hd;
    let mut partial = vec![Partial::default(); rows * passes * chunks];
    let mut acc = vec![0.0f32; rows * passes * chunks * pass_width];
    let (parts, accs) = (SharedOut(partial.as_mut_ptr()), SharedOut(acc.as_mut_ptr()));
    // Each row's queries times the scale, once for all its chunks instead of in every
    // score.
    let scaled: Vec<f32> = row_of
        .iter()
        .flat_map(|&(r, _, _)| call.q[r * width..(r + 1) * width].iter().map(|x| x * shape.scale))
        .collect();
    let tasks = RowTasks { pool, shape, reader: pool.config().encoding.reader() };
    parallel_for(rows * passes * chunks, |task| {
        let (unit, chunk) = (task / chunks, task % chunks);
        let (row, heads) = (unit / passes, pass_heads(unit % passes));
        let (_, si, pos) = row_of[row];
        let first = shape.first_visible(pos);
        let (lo, hi) = (first / ps, pos / ps + 1);
        let per = (hi - lo).div_ceil(chunks);
        let pages_of_chunk = (lo + chunk * per).min(hi)..(lo + (chunk + 1) * per).min(hi);
        let o_len = heads.len() * hd;
        // SAFETY: task `task` alone writes its partial record and accumulator slice.
        let (part, o) = unsafe {
            (
                &mut *parts.at(task),
                std::slice::from_raw_parts_mut(accs.at(task * pass_width), o_len),
            )
        };
        let q = &scaled[row * width + heads.start * hd..row * width + heads.end * hd];
        let query = Query { seq: call.spans[si].kv, layer: call.layer, q, heads, first, pos };
        tasks.attend_pages(&query, pages_of_chunk, part, o);
    });
    for (row, &(r, _, _)) in row_of.iter().enumerate() {
        for pass in 0..passes {
            let heads = pass_heads(pass);
            let unit = row * passes + pass;
            merge(
                &partial[unit * chunks..(unit + 1) * chunks],
                &acc[unit * chunks * pass_width..(unit + 1) * chunks * pass_width],
                pass_width,
                hd,
                &mut out[r * width + heads.start * hd..r * width + heads.end * hd],
            );
        }
    }
}

/// What every task of one call reads, with the page kernels chosen once for all.
struct RowTasks<'a> {
    pool: &'a PagePool,
    shape: &'a AttentionShape,
    reader: PageReader,
}

impl RowTasks<'_> {
    /// Unnormalised softmax-weighted sums of values over the pages `pages` (clipped to the
    /// query's window) for the query's heads of one row, a page at a time with a running
    /// maximum per head; `part` gets each head's maximum and denominator. A page's rows of one
    /// kv head go through the page kernels once for all the query heads sharing it.
    fn attend_pages(
        &self,
        query: &Query,
        pages: std::ops::Range<usize>,
        part: &mut Partial,
        out: &mut [f32],
    ) {
        let (shape, pool) = (self.shape, self.pool);
        let kern = match self.reader {
            PageReader::Float(k) => k,
            PageReader::Widened { f32, .. } => f32,
        };
        let hd = shape.head_dim;
        let (heads, n_heads) = (query.heads.clone(), query.heads.len());
        let group = shape.n_heads / shape.n_kv_heads;
        // The kv heads these query heads read, and the task's heads (counted from the first)
        // that read kv head `kv`.
        let kv_heads = heads.start / group..heads.end.div_ceil(group);
        let sharing = |kv: usize| {
            let (a, b) = ((kv * group).max(heads.start), ((kv + 1) * group).min(heads.end));
            a - heads.start..b - heads.start
        };
        let head_bytes = pool.config().encoding.head_bytes(hd);
        let (rb, ps) = (pool.row_bytes(), pool.config().page_size);
        // A compressed page's rows of one kv head, widened to f32 (they stay in L1).
        let mut widened = vec![0.0f32; ps * hd];
        let (max, denom) = (&mut part.max, &mut part.denom);
        // scores[h * count + slot] for the page's `count` live slots, then the softmax
        // weights in place.
        let mut scores = vec![0.0f32; n_heads * ps];
        for page in pages.clone() {
            let (krows, vrows) = pool.page_rows(query.seq, query.layer, page);
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
                true => pool.page_rows(query.seq, query.layer, page + 1),
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
            let stored = |plane, kv: usize| {
                CachedRows { bytes: plane, stride: rb, count, dim: hd }
                    .offset_by(slots.start * rb + kv * head_bytes)
            };
            let reader = self.reader;
            for kv in kv_heads.clone() {
                let hs = sharing(kv);
                let scores = &mut scores[hs.start * count..hs.end * count];
                ahead(next.0, kv);
                let rows = readable(reader, stored(krows, kv), head_bytes, &mut widened);
                (kern.dot)(rows, &query.q[hs.start * hd..hs.end * hd], scores);
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
            for kv in kv_heads.clone() {
                let hs = sharing(kv);
                let weights = &scores[hs.start * count..hs.end * count];
                ahead(next.1, kv);
                let rows = readable(reader, stored(vrows, kv), head_bytes, &mut widened);
                (kern.axpy)(weights, rows, &mut out[hs.start * hd..hs.end * hd]);
            }
        }
    }
}

/// `rows` as the reader's head kernels take them: as stored, or widened into `widened`.
fn readable<'a>(
    reader: PageReader,
    rows: CachedRows<'a>,
    head_bytes: usize,
    widened: &'a mut [f32],
) -> CachedRows<'a> {
    let PageReader::Widened { decode, .. } = reader else { return rows };
    let (count, hd) = (rows.count, rows.dim);
    let wide = &mut widened[..count * hd];
    for (s, out) in wide.chunks_exact_mut(hd).enumerate() {
        decode(&rows.bytes[s * rows.stride..][..head_bytes], out);
    }
    CachedRows { bytes: f32_bytes(wide), stride: hd * 4, count, dim: hd }
}

fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: any f32 storage is valid as bytes; the slice covers the same memory.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// The largest page and head count one attention task handles on its stack.
const MAX_PAGE: usize = 64;
const MAX_HEADS: usize = 64;

/// One query row (some of its heads) and its view of its session's cache.
struct Query<'a> {
    seq: &'a SeqKv,
    layer: usize,
    /// The queries of `heads`, already times the scale.
    q: &'a [f32],
    /// The query heads this task attends for (at most MAX_HEADS).
    heads: std::ops::Range<usize>,
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

/// Combines the chunks of one token's heads into normalised outputs: each chunk's sums
/// (`stride` floats apart in `accs`) are rescaled to the overall maximum.
fn merge(parts: &[Partial], accs: &[f32], stride: usize, hd: usize, out: &mut [f32]) {
    for (h, oh) in out.chunks_exact_mut(hd).enumerate() {
        let top = parts.iter().map(|p| p.max[h]).fold(f32::NEG_INFINITY, f32::max);
        oh.fill(0.0);
        let mut denom = 0.0;
        for (p, acc) in parts.iter().zip(accs.chunks_exact(stride)) {
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
