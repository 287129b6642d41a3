//! Attention one query row at a time: decode tokens, and the spans of a batch too short for
//! query tiles. A task takes one row and a chunk of its context's pages, over all heads; a
//! lone token still spreads its context over every thread, and the chunks' partial softmaxes
//! merge at the end.

use std::sync::atomic::{AtomicUsize, Ordering};

use cellm_kernels::cache::prefetch_all_l2;
use cellm_kernels::dot::{CachedRows, HeadKernels};
use cellm_kernels::gating::{exp_shifted_sum, max_of};
use cellm_kernels::ops::dot8;
use cellm_kernels::pool::{current_threads, parallel_for, SharedOut};

use crate::call::{AttentionCall, AttentionShape};
use crate::encoding::{KeyHeader, PageReader};
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
    // Each row's context splits into chunks of whole pages by its own length alone (at
    // least MIN_CHUNK pages each, at most two per thread), never by the other rows of the
    // batch: a session's output, and the order its chunks' partial softmaxes merge in, is
    // then bitwise the same whether it is decoded alone or beside any others. A lone token's
    // long context still spreads over every thread.
    let most = 2 * current_threads();
    let min_pages = (MIN_CHUNK / ps).max(1);
    let page_span = |pos: usize| (shape.first_visible(pos) / ps, pos / ps + 1);
    let split = |pos: usize| {
        let (lo, hi) = page_span(pos);
        let chunks = (hi - lo).div_ceil(min_pages).clamp(1, most);
        (lo, hi, (hi - lo).div_ceil(chunks), chunks)
    };
    // Per (row, pass) unit: its first chunk's index in `partial`, and its chunk count.
    let mut units = Vec::with_capacity(rows * passes);
    let mut total = 0;
    for &(_, _, pos) in &row_of {
        let count = split(pos).3;
        for _ in 0..passes {
            units.push((total, count));
            total += count;
        }
    }
    // Task -> (unit, chunk within the unit).
    // Longest chunks first, so the short ones even out the threads' finish.
    let mut sized: Vec<(usize, (usize, usize))> = Vec::with_capacity(total);
    for (u, &(_, n)) in units.iter().enumerate() {
        let (lo, hi, per, _) = split(row_of[u / passes].2);
        let pages = |c: usize| (lo + (c + 1) * per).min(hi) - (lo + c * per).min(hi);
        sized.extend((0..n).map(|c| (pages(c), (u, c))));
    }
    sized.sort_by_key(|&(pages, _)| std::cmp::Reverse(pages));
    let tasks: Vec<(usize, usize)> = sized.into_iter().map(|(_, t)| t).collect();
    let width = n_heads * hd;
    let pass_width = per_pass.min(n_heads) * hd;
    // The chunks' records and sums live in this thread's scratch, reused from call to call:
    // a fresh pair of buffers every layer cost more in the allocator (freeing coalesced
    // them) than the attention's own bookkeeping. Each task resets its own record and sums
    // (below), on the thread that then fills them: resetting them all here cost a serial
    // memset on the calling thread, and moved the lines to the other threads' caches.
    let (mut partial, mut acc) = SCRATCH.with(|s| s.take());
    if partial.len() < total {
        partial.resize(total, Partial::default());
    }
    if acc.len() < total * pass_width {
        acc.resize(total * pass_width, 0.0);
    }
    let (parts, accs) = (SharedOut(partial.as_mut_ptr()), SharedOut(acc.as_mut_ptr()));
    // Each row's queries times the scale, once for all its chunks instead of in every
    // score.
    let mut scaled = Vec::with_capacity(rows * width);
    for &(r, _, _) in &row_of {
        scaled.extend(call.q[r * width..(r + 1) * width].iter().map(|x| x * shape.scale));
    }
    let reader = pool.config().encoding.reader();
    let kern = match reader {
        PageReader::Stored(k) => k,
        PageReader::Widened { f32, .. } => f32,
    };
    let tasks_of = RowTasks { pool, shape, reader, kern };
    // A unit's chunks count themselves done; the last one merges the unit (in chunk order,
    // whichever thread that is), so the merges run on every thread, not after the loop on
    // the caller's.
    let done: Vec<AtomicUsize> = (0..units.len()).map(|_| AtomicUsize::new(0)).collect();
    assert!(row_of.iter().all(|&(r, _, _)| (r + 1) * width <= out.len()), "attention: out rows");
    let outs = SharedOut(out.as_mut_ptr());
    parallel_for(tasks.len(), |task| {
        let (unit, chunk) = tasks[task];
        let (row, heads) = (unit / passes, pass_heads(unit % passes));
        let (r, si, pos) = row_of[row];
        let first = shape.first_visible(pos);
        let (lo, hi, per, _) = split(pos);
        let pages_of_chunk = (lo + chunk * per).min(hi)..(lo + (chunk + 1) * per).min(hi);
        let o_len = heads.len() * hd;
        let (at, count) = units[unit];
        let slot = at + chunk;
        // SAFETY: chunk `slot` belongs to this task alone: it writes that partial record
        // and accumulator slice only.
        let (part, o) = unsafe {
            (
                &mut *parts.at(slot),
                std::slice::from_raw_parts_mut(accs.at(slot * pass_width), o_len),
            )
        };
        *part = Partial::default();
        o.fill(0.0);
        let q = &scaled[row * width + heads.start * hd..row * width + heads.end * hd];
        let query = Query {
            seq: call.spans[si].kv,
            layer: call.layer,
            q,
            heads: heads.clone(),
            first,
            pos,
        };
        tasks_of.attend_pages(&query, pages_of_chunk, part, o);
        if done[unit].fetch_add(1, Ordering::AcqRel) + 1 < count {
            return;
        }
        // SAFETY: every chunk of the unit has finished (the count's acquire orders their
        // writes before these reads) and no task writes them again; the unit's heads of row
        // `r` in `out` are its alone.
        let (unit_parts, unit_accs, unit_out) = unsafe {
            (
                std::slice::from_raw_parts(parts.at(at).cast_const(), count),
                std::slice::from_raw_parts(
                    accs.at(at * pass_width).cast_const(),
                    count * pass_width,
                ),
                std::slice::from_raw_parts_mut(outs.at(r * width + heads.start * hd), o_len),
            )
        };
        merge(unit_parts, unit_accs, pass_width, hd, unit_out);
    });
    SCRATCH.with(|s| s.set((partial, acc)));
}

thread_local! {
    /// [`attend`]'s chunk records and sums, kept for the thread's next call.
    static SCRATCH: std::cell::Cell<(Vec<Partial>, Vec<f32>)> =
        const { std::cell::Cell::new((Vec::new(), Vec::new())) };
}

thread_local! {
    /// A task's block scores, kept for the thread's next task.
    static BLOCK_SCRATCH: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// What every task of one call reads, with the page kernels chosen once for all.
struct RowTasks<'a> {
    pool: &'a PagePool,
    shape: &'a AttentionShape,
    reader: PageReader,
    /// The head kernels that read rows as `readable` hands them over.
    kern: HeadKernels,
}

impl RowTasks<'_> {
    /// Unnormalised softmax-weighted sums of values over the pages `pages` (clipped to the
    /// query's window) for the query's heads of one row; `part` gets each head's maximum and
    /// denominator. Pages go in blocks: the scores of a whole block first (a page's rows of
    /// one kv head through the page kernels once for all the query heads sharing it, each
    /// head's scores written in place in its run of the block's positions), then one softmax
    /// step per head over the block's positions, then its values, weighted from the same
    /// runs. Per-page maxima and sums over 16 scores cost about as much as the page kernels
    /// themselves.
    fn attend_pages(
        &self,
        query: &Query,
        pages: std::ops::Range<usize>,
        part: &mut Partial,
        out: &mut [f32],
    ) {
        let (shape, hd) = (self.shape, self.shape.head_dim);
        let n_heads = query.heads.len();
        let ps = self.pool.config().page_size;
        let mut keys = KeyScratch::new(self, query);
        // The block's scores, head by head (`cap` apart).
        let per_block = (BLOCK_SCORES / (n_heads * ps)).clamp(1, pages.len().max(1));
        let cap = per_block * ps;
        // Kept in the thread from task to task (every layer of every row has tasks).
        let mut scores = BLOCK_SCRATCH.with(|b| b.take());
        scores.resize(n_heads * cap, 0.0);
        // Pages are read as one stream: a block's keys, then its values, then the next
        // block's keys. While one page multiplies, the page `AHEAD` places further on in that
        // stream comes from memory; the chunk's first pages are asked for whole.
        let block = |b: usize| {
            let start = pages.start + b * per_block;
            (start < pages.end).then(|| start..(start + per_block).min(pages.end))
        };
        let stream = |b: usize, i: usize, values: bool| -> Option<(usize, bool)> {
            let mut at = i + AHEAD + if values { block(b)?.len() } else { 0 };
            for (b, plane) in [(b, false), (b, true), (b + 1, false)] {
                let pages = block(b)?;
                if at < pages.len() {
                    return Some((pages.start + at, plane));
                }
                at -= pages.len();
            }
            None
        };
        for page in pages.start..(pages.start + AHEAD).min(pages.end) {
            prefetch_all_l2(self.pool.page_rows(query.seq, query.layer, page).0);
            self.headers_ahead(query, page);
        }
        for b in 0..pages.len().div_ceil(per_block) {
            let block = block(b).expect("a block of the chunk");
            let mut len = 0;
            for (i, page) in block.clone().enumerate() {
                let slots = self.slots(query, page);
                let count = slots.len();
                let next = stream(b, i, false);
                self.key_scores(query, page, slots, next, &mut keys, (&mut scores[len..], cap));
                len += count;
            }
            for (h, weights) in scores.chunks_exact_mut(cap).enumerate() {
                let (m, d) = (&mut part.max[h], &mut part.denom[h]);
                let o = &mut out[h * hd..(h + 1) * hd];
                softmax_step(&mut weights[..len], shape.softcap, m, d, o);
            }
            let mut at = 0;
            for (i, page) in block.clone().enumerate() {
                let next = stream(b, i, true);
                self.add_values(query, page, next, (&scores[at..], cap), &mut keys, out);
                at += self.slots(query, page).len();
            }
        }
        BLOCK_SCRATCH.with(|b| b.set(scores));
    }

    /// The slots of `page` the query sees (its window and its own position clip them).
    fn slots(&self, query: &Query, page: usize) -> std::ops::Range<usize> {
        let ps = self.pool.config().page_size;
        let slots = page * ps..(page * ps + ps).min(query.pos + 1);
        slots.start.max(query.first) - page * ps..slots.end - page * ps
    }

    /// One kv head's rows of `slots` in `plane` (a page's keys or values).
    fn stored<'a>(
        &self,
        plane: &'a [u8],
        slots: &std::ops::Range<usize>,
        kv: usize,
    ) -> CachedRows<'a> {
        let (rb, hd) = (self.pool.row_bytes(), self.shape.head_dim);
        let head_bytes = self.pool.config().encoding.head_bytes(hd);
        CachedRows { bytes: plane, stride: rb, count: slots.len(), dim: hd }
            .offset_by(slots.start * rb + kv * head_bytes)
    }

    /// Asks for kv head `kv`'s share of the next page's plane (keys or values) while this one
    /// multiplies: the hardware prefetcher does not follow a session's pages, which lie
    /// anywhere in the pool, and one burst of requests for a whole page stalls more than it
    /// saves. Into L2: asked into L1, the burst waited for L1's fill buffers and held up the
    /// page kernel (on a Xeon, decode at 8k tokens of context took 8-12% longer, a step of 8
    /// sessions about 5%).
    fn ahead(&self, query: &Query, next: Option<(usize, bool)>, kv: usize) {
        let Some((page, values)) = next else { return };
        let planes = self.pool.page_rows(query.seq, query.layer, page);
        let plane = if values { planes.1 } else { planes.0 };
        let share = plane.len() / self.shape.n_kv_heads;
        prefetch_all_l2(&plane[kv * share..(kv + 1) * share]);
        if !values && kv == 0 {
            self.headers_ahead(query, page);
        }
    }

    /// Asks for `page`'s key headers (compressed encodings; none for f16 and f32): they lie
    /// past both planes, a line or two that the first key kernel would otherwise wait for.
    fn headers_ahead(&self, query: &Query, page: usize) {
        let refs = self.pool.page_refs(query.seq, query.layer, page);
        if !refs.is_empty() {
            prefetch_all_l2(refs);
        }
    }

    /// The query heads' scores against `page`'s keys of `slots`, `scores[h * stride + slot]`
    /// for `(scores, stride)`.
    fn key_scores(
        &self,
        query: &Query,
        page: usize,
        slots: std::ops::Range<usize>,
        next: Option<(usize, bool)>,
        keys: &mut KeyScratch,
        (scores, stride): (&mut [f32], usize),
    ) {
        let hd = self.shape.head_dim;
        let count = slots.len();
        let (krows, _) = self.pool.page_rows(query.seq, query.layer, page);
        let refs = self.pool.page_refs(query.seq, query.layer, page);
        let head_bytes = self.pool.config().encoding.head_bytes(hd);
        let KeyScratch {
            groups,
            header_bytes: hdr,
            key_scales,
            rotation,
            turned,
            offsets,
            reference,
            scales,
            widened,
        } = keys;
        for kv in groups.kv_heads() {
            let hs = groups.sharing(kv);
            let scores = &mut scores[hs.start * stride..][..(hs.len() - 1) * stride + count];
            self.ahead(query, next, kv);
            let rows = readable(self.reader, self.stored(krows, &slots, kv), head_bytes, widened);
            let q = &query.q[hs.start * hd..hs.end * hd];
            if *hdr == 0 {
                (self.kern.dot)(rows, q, scores, stride);
                continue;
            }
            KeyHeader::decode_into(&refs[kv * *hdr..][..*hdr], reference, scales);
            let turned = &mut turned[hs.start * hd..hs.end * hd];
            let r = rotation.as_ref().expect("a rotating encoding");
            for ((t, qh), c) in
                turned.chunks_exact_mut(hd).zip(q.chunks_exact(hd)).zip(&mut offsets[hs.clone()])
            {
                *c = dot8(qh, reference);
                if *key_scales {
                    t.iter_mut().zip(qh).zip(scales.iter()).for_each(|((t, q), s)| *t = q * s);
                    r.rotate(t);
                }
            }
            (self.kern.dot)(rows, turned, scores, stride);
            for (h, c) in offsets[hs.clone()].iter().enumerate() {
                scores[h * stride..][..count].iter_mut().for_each(|s| *s += c);
            }
        }
    }

    /// Adds `page`'s values, weighted by `weights[h * stride + slot]` for `(weights,
    /// stride)`, into the heads' sums.
    fn add_values(
        &self,
        query: &Query,
        page: usize,
        next: Option<(usize, bool)>,
        (weights, stride): (&[f32], usize),
        keys: &mut KeyScratch,
        out: &mut [f32],
    ) {
        let hd = self.shape.head_dim;
        let slots = self.slots(query, page);
        let count = slots.len();
        let (_, vrows) = self.pool.page_rows(query.seq, query.layer, page);
        let head_bytes = self.pool.config().encoding.head_bytes(hd);
        let (groups, widened) = (&keys.groups, &mut keys.widened);
        for kv in groups.kv_heads() {
            let hs = groups.sharing(kv);
            self.ahead(query, next, kv);
            let rows = readable(self.reader, self.stored(vrows, &slots, kv), head_bytes, widened);
            (self.kern.axpy)(
                &weights[hs.start * stride..][..(hs.len() - 1) * stride + count],
                stride,
                rows,
                &mut out[hs.start * hd..hs.end * hd],
            );
        }
    }
}

/// What a task's pages need beyond the page itself: the kv heads its query heads read, and,
/// where the encoding keeps key headers, the queries turned for a page's kv head
/// (`R (s * q)` per query head) and `q . ref`; plus one kv head's page widened to f32 for
/// compressed encodings (it stays in L1).
struct KeyScratch {
    groups: HeadGroups,
    header_bytes: usize,
    key_scales: bool,
    rotation: Option<crate::rotation::Rotation>,
    turned: Vec<f32>,
    offsets: Vec<f32>,
    reference: Vec<f32>,
    scales: Vec<f32>,
    widened: Vec<f32>,
}

impl KeyScratch {
    fn new(tasks: &RowTasks, query: &Query) -> Self {
        let (cfg, hd) = (tasks.pool.config(), tasks.shape.head_dim);
        let heads = query.heads.clone();
        let group = tasks.shape.n_heads / tasks.shape.n_kv_heads;
        let hdr = cfg.header_bytes(hd);
        // (Empty, so not allocated, for encodings without headers.)
        let keyed = |n: usize| if hdr > 0 { n } else { 0 };
        let rotation = cfg.encoding.rotation(hd);
        let key_scales = cfg.encoding.key_scales();
        let mut turned = vec![0.0f32; keyed(heads.len() * hd)];
        // Without per-channel scales (int8) every page turns the queries alike: once here.
        if hdr > 0 && !key_scales {
            let r = rotation.as_ref().expect("a rotating encoding");
            turned.copy_from_slice(&query.q[..heads.len() * hd]);
            turned.chunks_exact_mut(hd).for_each(|t| r.rotate(t));
        }
        let widened = match tasks.reader {
            PageReader::Widened { .. } => vec![0.0f32; cfg.page_size * hd],
            PageReader::Stored(_) => Vec::new(),
        };
        Self {
            groups: HeadGroups { heads, group },
            header_bytes: hdr,
            key_scales,
            rotation,
            turned,
            offsets: vec![0.0f32; keyed(query.heads.len())],
            reference: vec![0.0f32; keyed(hd)],
            scales: vec![0.0f32; keyed(hd)],
            widened,
        }
    }
}

/// A task's query heads and the kv heads they read (`group` query heads per kv head).
struct HeadGroups {
    heads: std::ops::Range<usize>,
    group: usize,
}

impl HeadGroups {
    fn kv_heads(&self) -> std::ops::Range<usize> {
        self.heads.start / self.group..self.heads.end.div_ceil(self.group)
    }

    /// The task's heads (counted from its first) that read kv head `kv`.
    fn sharing(&self, kv: usize) -> std::ops::Range<usize> {
        let (a, b) =
            ((kv * self.group).max(self.heads.start), ((kv + 1) * self.group).min(self.heads.end));
        a - self.heads.start..b - self.heads.start
    }
}

/// One block of a head's scores into softmax weights against the head's running maximum
/// `max` (raised to the block's, rescaling the sums so far `out` and `denom`), their sum
/// added to `denom`.
fn softmax_step(
    scores: &mut [f32],
    softcap: Option<f32>,
    max: &mut f32,
    denom: &mut f32,
    out: &mut [f32],
) {
    if let Some(cap) = softcap {
        scores.iter_mut().for_each(|s| *s = cap * (*s / cap).tanh());
    }
    let block_max = max_of(scores);
    if block_max > *max {
        let rescale = (*max - block_max).exp();
        out.iter_mut().for_each(|o| *o *= rescale);
        *denom *= rescale;
        *max = block_max;
    }
    *denom += exp_shifted_sum(scores, *max);
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

/// The most scores a task keeps for one block of pages (16 KiB, in L1 beside the page's
/// rows): a page of 16 positions with 9 query heads gives blocks of 28 pages. (Blocks of one
/// page, i.e. a softmax step per page, ran 1.3x slower; of 4 and 8 pages, within noise.)
const BLOCK_SCORES: usize = 4096;

/// How many pages ahead of the one multiplying the page stream is asked for (2 read 4-10%
/// faster than 1 at 512-2k positions; a task on 8 rows of 160 with none ran 1.8x slower).
const AHEAD: usize = 2;

/// The fewest cached positions a row's chunk takes (rounded to whole pages, at least one):
/// shorter chunks cost more in merging than they gain in spreading.
const MIN_CHUNK: usize = 128;

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

#[cfg(test)]
mod tests {
    use crate::{AttentionCall, AttentionShape, KvConfig, KvEncoding, PagePool, SeqKv, SeqSpan};

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n).map(|i| (((i + seed) * 7919) % 997) as f32 / 498.0 - 1.0).collect()
    }

    /// One decode step's attention output for `sessions[0]`, decoded alone and beside the
    /// other sessions: it must not depend on what else is in the batch, bitwise, with and
    /// without threads (the chunks a row's context splits into are the row's own).
    #[test]
    fn a_decode_row_ignores_the_rest_of_the_batch() {
        let (n_heads, n_kv, hd) = (9, 3, 64);
        let shape = AttentionShape {
            n_heads,
            n_kv_heads: n_kv,
            head_dim: hd,
            scale: 0.125,
            window: None,
            softcap: None,
        };
        let (w, kw) = (n_heads * hd, n_kv * hd);
        for encoding in [KvEncoding::F32, KvEncoding::F16, KvEncoding::Int8, KvEncoding::Int4] {
            for threads in [1, 2, 4] {
                let workers = cellm_kernels::pool::ThreadPool::new(threads).unwrap();
                let lens = [1000, 7, 100, 45];
                let mut pool = PagePool::new(KvConfig {
                    num_layers: 1,
                    kv_heads: n_kv,
                    head_dim: hd,
                    page_size: 16,
                    max_pages: 128,
                    encoding,
                    windows: Vec::new(),
                    values_in_keys: false,
                });
                let mut seqs: Vec<SeqKv> = lens.iter().map(|_| pool.new_seq()).collect();
                for (i, (seq, &len)) in seqs.iter_mut().zip(&lens).enumerate() {
                    pool.reserve(seq, len + 1).unwrap();
                    let spans = [SeqSpan { kv: seq, start: 0, len, row0: 0 }];
                    let (q, k, v) =
                        (values(len * w, i), values(len * kw, i + 1), values(len * kw, i + 2));
                    let call = AttentionCall {
                        layer: 0,
                        spans: &spans,
                        q: &q,
                        k: &k,
                        v: &v,
                        shape: &shape,
                    };
                    let mut out = vec![0.0; len * w];
                    workers.install(|| call.run(&mut pool, &mut out));
                }
                let step = |pool: &mut PagePool, members: &[usize]| {
                    let spans: Vec<SeqSpan> = members
                        .iter()
                        .enumerate()
                        .map(|(r, &m)| SeqSpan { kv: &seqs[m], start: lens[m], len: 1, row0: r })
                        .collect();
                    let rows = members.len();
                    let mut q = Vec::new();
                    let (mut k, mut v) = (Vec::new(), Vec::new());
                    for &m in members {
                        q.extend(values(w, 50 + m));
                        k.extend(values(kw, 60 + m));
                        v.extend(values(kw, 70 + m));
                    }
                    let call = AttentionCall {
                        layer: 0,
                        spans: &spans,
                        q: &q,
                        k: &k,
                        v: &v,
                        shape: &shape,
                    };
                    let mut out = vec![0.0; rows * w];
                    workers.install(|| call.run(pool, &mut out));
                    out
                };
                let alone = step(&mut pool, &[0]);
                if encoding == KvEncoding::F32 {
                    check_dense(&shape, lens[0], &alone);
                }
                for others in [&[0, 1][..], &[0, 1, 2, 3], &[2, 0, 3]] {
                    let got = step(&mut pool, others);
                    let at = others.iter().position(|&m| m == 0).unwrap();
                    let same = got[at * w..(at + 1) * w] == alone[..];
                    assert!(same, "{encoding:?} on {threads} threads, batch {others:?}");
                }
            }
        }
    }

    /// Session 0's decode row (its context split into several chunks, on one thread each of
    /// two blocks of pages) against a dense softmax over the same f32 keys and values: sums
    /// of at most 1001 products of magnitude < 1, so within 1e-5.
    fn check_dense(shape: &AttentionShape, len: usize, got: &[f32]) {
        let (hd, group) = (shape.head_dim, shape.n_heads / shape.n_kv_heads);
        let kw = shape.n_kv_heads * hd;
        let (mut k, mut v) = (values(len * kw, 1), values(len * kw, 2));
        k.extend(values(kw, 60));
        v.extend(values(kw, 70));
        let q = values(shape.n_heads * hd, 50);
        for h in 0..shape.n_heads {
            let g = h / group;
            let scores: Vec<f32> = (0..=len)
                .map(|p| {
                    let key = &k[p * kw + g * hd..][..hd];
                    q[h * hd..(h + 1) * hd].iter().zip(key).map(|(a, b)| a * b).sum::<f32>()
                        * shape.scale
                })
                .collect();
            let top = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = scores.iter().map(|s| (s - top).exp()).collect();
            let z: f32 = e.iter().sum();
            for d in 0..hd {
                let want: f32 = (0..=len).map(|p| e[p] / z * v[p * kw + g * hd + d]).sum();
                let g = got[h * hd + d];
                assert!((want - g).abs() < 1e-5, "head {h} dim {d}: {want} vs {g}");
            }
        }
    }
}
