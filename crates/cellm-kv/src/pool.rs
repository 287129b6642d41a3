//! The page pool and the per-session page tables.

use std::borrow::Cow;

use cellm_format::{Error, Result};
use cellm_kernels::cache::prefetch_all_l2;

use crate::encoding::{KeyHeader, KvEncoding};
use crate::prefix::{chain_key, PrefixCache};
use crate::rotation::Rotation;

#[derive(Debug, Clone)]
pub struct KvConfig {
    pub num_layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// The pool never holds more pages than this (pages are allocated on first use).
    pub max_pages: usize,
    pub encoding: KvEncoding,
    /// Per layer, the sliding window of its attention (None: full). Pages that fall wholly out
    /// of a layer's window go back to the pool. Empty means no layer slides.
    pub windows: Vec<Option<usize>>,
    /// Values are read from the key rows, which are stored alone (MLA caches one latent row
    /// per token that serves as both).
    pub values_in_keys: bool,
}

impl KvConfig {
    /// Whether pages keep a key header per kv head ([`crate::encoding::KeyHeader`]); not
    /// where values are read from the keys (which then stay plain rotated rows).
    pub(crate) fn key_headers(&self) -> bool {
        self.encoding.key_header() && !self.values_in_keys
    }

    /// Bytes of one kv head's key header for heads of `hd` (0 without headers).
    pub(crate) fn header_bytes(&self, hd: usize) -> usize {
        if self.key_headers() {
            self.encoding.header_bytes(hd)
        } else {
            0
        }
    }

    fn window(&self, layer: usize) -> Option<usize> {
        self.windows.get(layer).copied().flatten()
    }
}

/// A page-table entry whose page went back to the pool (out of a sliding window).
const RELEASED: u32 = u32::MAX;
/// The most pages a pool holds: every id below [`RELEASED`].
pub const MAX_PAGES: usize = RELEASED as usize;

/// One session's view of the cache: how many positions are filled, and its page tables.
#[derive(Debug, Default)]
pub struct SeqKv {
    len: usize,
    pages: Vec<Vec<u32>>,
    /// Per layer, how many leading pages were released (sliding layers only).
    released: Vec<usize>,
    /// The token ids of the leading positions whose rows follow from ids alone (all of them
    /// unless a step gave some positions' embeddings): what the prefix cache keys pages by.
    tokens: Vec<u32>,
    /// The chain keys of the full pages within `tokens`, in order.
    keys: Vec<u64>,
}

impl SeqKv {
    /// Positions whose keys and values are stored.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The page ids of `layer`, in position order (a page released from a sliding window
    /// reads `u32::MAX`).
    pub fn page_table(&self, layer: usize) -> &[u32] {
        &self.pages[layer]
    }

    pub(crate) fn page(&self, layer: usize, index: usize) -> u32 {
        let id = self.pages[layer][index];
        debug_assert_ne!(id, RELEASED, "page {index} of layer {layer} is out of the window");
        id
    }
}

pub struct PagePool {
    cfg: KvConfig,
    row_bytes: usize,
    /// Page storage as u32 words so f32 rows are aligned; K rows then V rows.
    pages: Vec<Box<[u32]>>,
    free: Vec<u32>,
    /// False: pages are ids only and their rows live elsewhere (on a GPU).
    host_storage: bool,
    /// Per page id: how many page tables hold it. A page held by none is on `free`, or idle
    /// in the prefix cache.
    refs: Vec<u32>,
    /// Full pages shared between sessions by their ids' hash chain (None: off).
    prefix: Option<PrefixCache>,
}

impl PagePool {
    /// `max_pages` is capped at [`MAX_PAGES`] (page ids are 32-bit).
    pub fn new(mut cfg: KvConfig) -> Self {
        cfg.max_pages = cfg.max_pages.min(MAX_PAGES);
        let row_bytes = cfg.kv_heads * cfg.encoding.head_bytes(cfg.head_dim);
        Self {
            cfg,
            row_bytes,
            pages: Vec::new(),
            free: Vec::new(),
            host_storage: true,
            refs: Vec::new(),
            prefix: None,
        }
    }

    /// Turns the prefix cache on: each full page whose positions follow from token ids alone
    /// is kept after its sessions let it go, keyed by the hash chain of its ids, for
    /// [`PagePool::reuse_prefix`] to hand to later sessions (read-only, shared); the least
    /// recently used of those no session holds make room when the pool is full, or when
    /// more than `max_idle_pages` are idle (which bounds what an idle engine holds beyond its
    /// sessions' pages). A pool without host storage cannot copy a page on write and keeps
    /// it off.
    pub fn enable_prefix_cache(&mut self, max_idle_pages: usize) {
        if self.host_storage && self.prefix.is_none() {
            let mut cache = PrefixCache::default();
            cache.max_idle = max_idle_pages;
            cache.grow(self.pages.len());
            self.prefix = Some(cache);
        }
    }

    pub fn prefix_cache_enabled(&self) -> bool {
        self.prefix.is_some()
    }

    /// Pages the prefix cache lists (held by sessions or idle).
    pub fn cached_pages(&self) -> usize {
        self.prefix.as_ref().map_or(0, PrefixCache::cached_pages)
    }

    /// Positions [`PagePool::reuse_prefix`] has handed out instead of their prefill.
    pub fn prefix_hit_tokens(&self) -> u64 {
        self.prefix.as_ref().map_or(0, |c| c.hit_tokens)
    }

    /// A pool that hands out page ids and keeps page tables but stores no rows: a GPU model
    /// keeps them in its own memory ([`PagePool::write`] and attention on it are not for
    /// such a pool).
    pub fn without_storage(cfg: KvConfig) -> Self {
        Self { host_storage: false, ..Self::new(cfg) }
    }

    #[inline]
    pub fn config(&self) -> &KvConfig {
        &self.cfg
    }

    pub fn new_seq(&self) -> SeqKv {
        let layers = self.cfg.num_layers;
        SeqKv { pages: vec![Vec::new(); layers], released: vec![0; layers], ..SeqKv::default() }
    }

    /// Pages held by sessions right now (a page shared by several counts once).
    pub fn pages_in_use(&self) -> usize {
        self.pages.len() - self.free.len() - self.prefix.as_ref().map_or(0, |c| c.idle_pages())
    }

    /// Pages a reserve can still get: free, never allocated, or idle in the prefix cache.
    fn available(&self) -> usize {
        let idle = self.prefix.as_ref().map_or(0, PrefixCache::idle_pages);
        self.free.len() + idle + self.cfg.max_pages.saturating_sub(self.pages.len())
    }

    /// A page for new rows: a free one, a new one, else the least recently used idle cached
    /// one. Callers check [`Self::available`] first.
    fn take_page(&mut self) -> u32 {
        let id = match self.free.pop() {
            Some(id) => id,
            None if self.pages.len() < self.cfg.max_pages => {
                let words = if self.host_storage { self.page_bytes().div_ceil(4) } else { 0 };
                self.pages.push(vec![0u32; words].into_boxed_slice());
                self.refs.push(0);
                if let Some(c) = &mut self.prefix {
                    c.grow(self.pages.len());
                }
                (self.pages.len() - 1) as u32
            }
            None => self.prefix.as_mut().and_then(PrefixCache::evict).expect("checked available"),
        };
        self.refs[id as usize] = 1;
        // A page used before keeps its old key headers until its first position is written;
        // zero them, so rows written without one (never in the engine) are read against a
        // zero reference rather than another session's.
        if self.host_storage {
            let at = self.refs_at();
            words_as_bytes_mut(&mut self.pages[id as usize])[at..].fill(0);
        }
        id
    }

    /// A page table lets `id` go: back to the free list, or idle in the prefix cache.
    fn unref(&mut self, id: u32) {
        let refs = &mut self.refs[id as usize];
        *refs -= 1;
        if *refs > 0 {
            return;
        }
        match &mut self.prefix {
            Some(c) if c.is_cached(id) => {
                if let Some(evicted) = c.park(id) {
                    self.free.push(evicted);
                }
            }
            _ => self.free.push(id),
        }
    }

    /// Pages that exist (in use or on the free list): the pool's memory high-water mark.
    pub fn pages_allocated(&self) -> usize {
        self.pages.len()
    }

    /// A page's rows (keys, then values) and, where the encoding keeps them, its key
    /// headers (one per kv head, after the rows).
    pub fn page_bytes(&self) -> usize {
        self.refs_at() + self.cfg.kv_heads * self.cfg.header_bytes(self.cfg.head_dim)
    }

    /// Where a page's key headers start: after its row planes.
    fn refs_at(&self) -> usize {
        self.planes() * self.cfg.page_size * self.row_bytes
    }

    /// Row planes per page: keys, and values unless they live in the keys.
    fn planes(&self) -> usize {
        if self.cfg.values_in_keys {
            1
        } else {
            2
        }
    }

    /// Makes room for positions `0..new_len` in every layer. On failure nothing changes.
    ///
    /// A cached page is read-only: when the session's next position falls inside one (it
    /// was cut back into it) the session gets its own copy first, or takes the page out of
    /// the cache when it is the only holder.
    pub fn reserve(&mut self, seq: &mut SeqKv, new_len: usize) -> Result<()> {
        let want = new_len.div_ceil(self.cfg.page_size);
        let have = seq.pages.first().map_or(0, Vec::len);
        let copies = match new_len > seq.len {
            true => self.shared_tail(seq).len(),
            false => 0,
        };
        let needed = want.saturating_sub(have) * self.cfg.num_layers + copies;
        let available = self.available();
        if needed > available {
            return Err(Error::ContextOverflow(format!(
                "KV cache is full: {needed} more pages needed, {available} free \
                 (raise context_length or free sessions)"
            )));
        }
        if new_len > seq.len {
            self.own_tail(seq);
        }
        for layer in 0..seq.pages.len() {
            while seq.pages[layer].len() < want {
                let id = self.take_page();
                seq.pages[layer].push(id);
            }
        }
        Ok(())
    }

    /// The layers whose page at the session's next position is cached (a write would
    /// change the rows other sessions read), with whether other tables hold it too.
    fn shared_tail(&self, seq: &SeqKv) -> Vec<(usize, bool)> {
        let (Some(cache), index) = (&self.prefix, seq.len / self.cfg.page_size) else {
            return Vec::new();
        };
        if seq.len.is_multiple_of(self.cfg.page_size) {
            return Vec::new(); // the next write starts a page of its own
        }
        (0..self.cfg.num_layers)
            .filter_map(|layer| {
                let id = *seq.pages[layer].get(index)?;
                (id != RELEASED && cache.is_cached(id)).then(|| (layer, self.refs[id as usize] > 1))
            })
            .collect()
    }

    /// Copy-on-write of the cached pages [`Self::shared_tail`] lists (room was checked).
    fn own_tail(&mut self, seq: &mut SeqKv) {
        let index = seq.len / self.cfg.page_size;
        for (layer, shared) in self.shared_tail(seq) {
            let old = seq.pages[layer][index];
            if !shared {
                self.prefix.as_mut().expect("cached").forget(old);
                continue;
            }
            let new = self.take_page();
            let rows = self.pages[old as usize].clone();
            self.pages[new as usize].copy_from_slice(&rows);
            seq.pages[layer][index] = new;
            self.unref(old);
        }
    }

    /// Marks positions `..new_len` filled (after their keys and values were written), then
    /// returns the pages of sliding layers that no later query can reach. The new positions'
    /// ids are not known, so their pages are never cached.
    pub fn commit(&mut self, seq: &mut SeqKv, new_len: usize) {
        self.commit_tokens(seq, new_len, &[]);
    }

    /// [`Self::commit`] where `known` holds the ids of the leading new positions whose rows
    /// follow from their ids alone (all of them, or those before the first one stepped with
    /// a given embedding): the full pages within them are cached (before a sliding layer
    /// lets them go) when the whole prefix before them was known by ids too.
    pub fn commit_tokens(&mut self, seq: &mut SeqKv, new_len: usize, known: &[u32]) {
        debug_assert!(seq.pages.iter().all(|t| t.len() * self.cfg.page_size >= new_len));
        if self.prefix.is_some() && seq.tokens.len() == seq.len {
            debug_assert!(seq.len + known.len() <= new_len);
            seq.tokens.extend_from_slice(known);
        }
        seq.len = new_len;
        self.cache_full_pages(seq);
        for layer in 0..self.cfg.num_layers {
            let Some(window) = self.cfg.window(layer) else { continue };
            // The next query sits at `new_len` and reads from `new_len + 1 - window` on.
            let dead = (new_len + 1).saturating_sub(window) / self.cfg.page_size;
            let (table, released) = (&mut seq.pages[layer], &mut seq.released[layer]);
            while *released < dead {
                let id = std::mem::replace(&mut table[*released], RELEASED);
                *released += 1;
                self.unref(id);
            }
        }
    }

    /// Keys the session's full pages past those already keyed and lists them in the cache.
    fn cache_full_pages(&mut self, seq: &mut SeqKv) {
        let Some(cache) = &mut self.prefix else { return };
        let (ps, layers) = (self.cfg.page_size, self.cfg.num_layers);
        for index in seq.keys.len()..seq.tokens.len() / ps {
            let parent = seq.keys.last().copied().unwrap_or(0);
            let ids = &seq.tokens[index * ps..(index + 1) * ps];
            let key = chain_key(parent, ids);
            for layer in 0..layers {
                let id = seq.pages[layer][index];
                if id != RELEASED && !cache.is_cached(id) {
                    cache.insert((key, parent, ids), layers, layer, id);
                }
            }
            seq.keys.push(key);
        }
    }

    /// Starts the empty `seq` with the longest cached prefix of `tokens` that leaves at
    /// least one token to step (whose logits the caller wants), in whole pages, and returns
    /// its length in positions (0 with the cache off or nothing cached). The pages are
    /// shared: the session reads them and never writes them. A sliding layer needs only the
    /// pages the next position's window reaches.
    pub fn reuse_prefix(&mut self, seq: &mut SeqKv, tokens: &[u32]) -> usize {
        let Some(cache) = &mut self.prefix else { return 0 };
        if seq.len != 0 || seq.pages.iter().any(|t| !t.is_empty()) {
            return 0;
        }
        let (ps, layers) = (self.cfg.page_size, self.cfg.num_layers);
        // The chain of cached entries along `tokens`, each entry's pages.
        let mut chain: Vec<(u64, &[u32])> = Vec::new();
        for ids in tokens[..tokens.len().saturating_sub(1)].chunks_exact(ps) {
            let parent = chain.last().map_or(0, |c| c.0);
            let key = chain_key(parent, ids);
            match cache.get(key, parent, ids) {
                Some(entry) => chain.push((key, &entry.pages)),
                None => break,
            }
        }
        // The most pages whose every layer has what the next position reads.
        let first_needed = |layer: usize, n: usize| match self.cfg.window(layer) {
            Some(w) => (n * ps + 1).saturating_sub(w) / ps,
            None => 0,
        };
        let usable = |n: usize| {
            (0..layers).all(|l| chain[first_needed(l, n)..n].iter().all(|c| c.1[l] != RELEASED))
        };
        let Some(n) = (1..=chain.len()).rev().find(|&n| usable(n)) else { return 0 };
        let keys: Vec<u64> = chain[..n].iter().map(|c| c.0).collect();
        let tables: Vec<Vec<u32>> = (0..layers)
            .map(|l| {
                let first = first_needed(l, n);
                (0..n).map(|i| if i < first { RELEASED } else { chain[i].1[l] }).collect()
            })
            .collect();
        for (layer, table) in tables.into_iter().enumerate() {
            for &id in table.iter().filter(|&&id| id != RELEASED) {
                self.refs[id as usize] += 1;
                if self.refs[id as usize] == 1 {
                    cache.unpark(id);
                }
            }
            seq.released[layer] = first_needed(layer, n);
            seq.pages[layer] = table;
        }
        seq.len = n * ps;
        seq.tokens = tokens[..n * ps].to_vec();
        seq.keys = keys;
        cache.hit_tokens += seq.len as u64;
        seq.len
    }

    /// Whether `seq` can be cut back to `new_len` positions: a sliding layer must still hold
    /// the window the next position would read (cutting to 0 always works).
    pub fn can_truncate(&self, seq: &SeqKv, new_len: usize) -> bool {
        let new_len = new_len.min(seq.len);
        new_len == 0
            || (0..self.cfg.num_layers).all(|layer| {
                self.cfg.window(layer).is_none_or(|w| {
                    (new_len + 1).saturating_sub(w) / self.cfg.page_size >= seq.released[layer]
                })
            })
    }

    /// Forgets positions from `new_len` on and returns whole unused pages to the pool.
    /// Callers check [`Self::can_truncate`] first.
    pub fn truncate(&mut self, seq: &mut SeqKv, new_len: usize) {
        debug_assert!(self.can_truncate(seq, new_len));
        seq.len = seq.len.min(new_len);
        seq.tokens.truncate(seq.len);
        seq.keys.truncate(seq.tokens.len() / self.cfg.page_size);
        let keep = seq.len.div_ceil(self.cfg.page_size);
        for layer in 0..seq.pages.len() {
            while seq.pages[layer].len() > keep {
                let id = seq.pages[layer].pop().expect("len > keep");
                if id != RELEASED {
                    self.unref(id);
                }
            }
            seq.released[layer] = seq.released[layer].min(keep);
        }
    }

    pub fn release(&mut self, seq: &mut SeqKv) {
        self.truncate(seq, 0);
    }

    /// Asks for the cache lines that [`Self::write`] will store position `pos`'s rows of
    /// `layer` in (see [`crate::prefetch_new_rows`]).
    pub(crate) fn prefetch_row(&self, seq: &SeqKv, layer: usize, pos: usize) {
        if !self.host_storage {
            return;
        }
        let (ps, rb) = (self.cfg.page_size, self.row_bytes);
        let bytes = words_as_bytes(&self.pages[seq.page(layer, pos / ps) as usize]);
        let slot = (pos % ps) * rb;
        prefetch_all_l2(&bytes[slot..slot + rb]);
        if !self.cfg.values_in_keys {
            prefetch_all_l2(&bytes[ps * rb + slot..][..rb]);
        }
    }

    /// Stores the key and value rows of position `pos` for `layer`, whose heads are
    /// `head_dim` wide (rotated first where the encoding rotates). A layer narrower than the
    /// pool's rows fills a prefix of them. `q` is the position's query row (all query
    /// heads): where pages keep key headers, the first position of a page chooses the
    /// header's channel scales by how strongly its queries read each channel (empty: by
    /// the keys alone).
    pub fn write(
        &mut self,
        seq: &SeqKv,
        (layer, hd): (usize, usize),
        pos: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
    ) {
        let (page, slot) = (seq.page(layer, pos / self.cfg.page_size), pos % self.cfg.page_size);
        let (rb, ps, refs_at) = (self.row_bytes, self.cfg.page_size, self.refs_at());
        let values = !self.cfg.values_in_keys;
        let (enc, hb) = (self.cfg.encoding, self.cfg.encoding.head_bytes(hd));
        assert!(k.len() / hd * hb <= rb, "KV rows of {} values are wider than the pool's", k.len());
        let rotation = enc.rotation(hd);
        let mut key = Cow::Borrowed(k);
        if self.cfg.key_headers() {
            let key = key.to_mut();
            // Keys relative to their page's header, which the page's first position writes
            // (from that key and the previous page) and which stays while any later
            // position of the page is kept.
            let r = rotation.as_ref().expect("a rotating encoding");
            let hdr = self.cfg.header_bytes(hd);
            let index = pos / ps;
            let prev = match index.checked_sub(1).map(|i| seq.pages[layer][i]) {
                Some(id) if slot == 0 && id != RELEASED => {
                    self.page_keys(id, layer_heads(k, hd), hd)
                }
                _ => Vec::new(),
            };
            let bytes = words_as_bytes_mut(&mut self.pages[page as usize]);
            let refs = &mut bytes[refs_at..];
            for (h, (head, at)) in
                key.chunks_exact_mut(hd).zip(refs.chunks_exact_mut(hdr)).enumerate()
            {
                let header = if slot == 0 {
                    let prev: Vec<f32> = prev
                        .chunks_exact(hd)
                        .skip(h)
                        .step_by(k.len() / hd)
                        .flatten()
                        .copied()
                        .collect();
                    let group = q.len() / hd / (k.len() / hd);
                    let q = q.get(h * group * hd..(h + 1) * group * hd).unwrap_or(&[]);
                    KeyHeader::encode(head, &prev, &KeyHeader::importance(q, hd), at)
                } else {
                    KeyHeader::decode(at, hd)
                };
                KeyHeader::encode_key((&header.0, &header.1), r, head);
            }
        } else if let Some(r) = &rotation {
            r.rotate(key.to_mut());
        }
        let bytes = words_as_bytes_mut(&mut self.pages[page as usize]);
        let (rows, _) = bytes.split_at_mut(refs_at);
        let (keys, vals) = rows.split_at_mut(ps * rb);
        let store = |src: &[f32], dst: &mut [u8]| {
            for (head, out) in src.chunks_exact(hd).zip(dst.chunks_exact_mut(hb)) {
                enc.encode(head, out);
            }
        };
        store(&key, &mut keys[slot * rb..(slot + 1) * rb]);
        if values {
            store(&rotated(rotation.as_ref(), v), &mut vals[slot * rb..(slot + 1) * rb]);
        }
    }

    /// The key rows and the value rows of page `index` of `layer` (page_size rows each, raw
    /// encoded bytes, `row_bytes()` per row).
    #[inline]
    pub(crate) fn page_rows(&self, seq: &SeqKv, layer: usize, index: usize) -> (&[u8], &[u8]) {
        let bytes = words_as_bytes(&self.pages[seq.page(layer, index) as usize]);
        let plane = self.cfg.page_size * self.row_bytes;
        if self.cfg.values_in_keys {
            (&bytes[..plane], &bytes[..plane])
        } else {
            bytes[..2 * plane].split_at(plane)
        }
    }

    /// The keys of page `id` (all its positions) as the model gave them, `heads` heads of
    /// `hd` per position, decoded through its key headers.
    fn page_keys(&self, id: u32, heads: usize, hd: usize) -> Vec<f32> {
        let bytes = words_as_bytes(&self.pages[id as usize]);
        let (rb, hb, hdr) =
            (self.row_bytes, self.cfg.encoding.head_bytes(hd), self.cfg.header_bytes(hd));
        let rotation = self.cfg.encoding.rotation(hd).expect("a rotating encoding");
        let decode = self.cfg.encoding.decoder();
        let headers: Vec<_> = (0..heads)
            .map(|h| KeyHeader::decode(&bytes[self.refs_at() + h * hdr..][..hdr], hd))
            .collect();
        let mut out = vec![0.0f32; self.cfg.page_size * heads * hd];
        for (i, o) in out.chunks_exact_mut(hd).enumerate() {
            let (slot, h) = (i / heads, i % heads);
            let row = &bytes[slot * rb + h * hb..][..hb];
            KeyHeader::decode_key((&headers[h].0, &headers[h].1), (&rotation, decode), row, o);
        }
        out
    }

    /// The key headers of page `index` of `layer` (one per kv head, each `header_bytes` of
    /// the layer's head size apart; empty without them).
    #[inline]
    pub(crate) fn page_refs(&self, seq: &SeqKv, layer: usize, index: usize) -> &[u8] {
        let bytes = words_as_bytes(&self.pages[seq.page(layer, index) as usize]);
        &bytes[self.refs_at()..self.page_bytes()]
    }

    #[inline]
    pub(crate) fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// The stored key and value rows of `pos` in `layer`, as raw encoded bytes.
    #[cfg(test)]
    pub(crate) fn rows(&self, seq: &SeqKv, layer: usize, pos: usize) -> (&[u8], &[u8]) {
        let (k, v) = self.page_rows(seq, layer, pos / self.cfg.page_size);
        let (rb, slot) = (self.row_bytes, pos % self.cfg.page_size);
        (&k[slot * rb..(slot + 1) * rb], &v[slot * rb..(slot + 1) * rb])
    }
}

/// Heads of `hd` in a key row `k`.
fn layer_heads(k: &[f32], hd: usize) -> usize {
    k.len() / hd
}

fn words_as_bytes(w: &[u32]) -> &[u8] {
    // SAFETY: any u32 storage is valid as bytes.
    unsafe { std::slice::from_raw_parts(w.as_ptr().cast::<u8>(), w.len() * 4) }
}

fn words_as_bytes_mut(w: &mut [u32]) -> &mut [u8] {
    // SAFETY: any byte pattern is a valid u32; the slice covers the same storage.
    unsafe { std::slice::from_raw_parts_mut(w.as_mut_ptr().cast::<u8>(), w.len() * 4) }
}

/// `src` turned by `rotation`, or as given where the encoding does not rotate (the decode
/// path's f16 and f32 rows go to the page without a copy).
fn rotated<'a>(rotation: Option<&Rotation>, src: &'a [f32]) -> Cow<'a, [f32]> {
    match rotation {
        Some(r) => {
            let mut x = src.to_vec();
            r.rotate(&mut x);
            x.into()
        }
        None => src.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(max_pages: usize) -> PagePool {
        pool_with(max_pages, Some(5))
    }

    /// Two layers of one head of 4, pages of 4; layer 1 slides over `window`.
    fn pool_with(max_pages: usize, window: Option<usize>) -> PagePool {
        PagePool::new(KvConfig {
            num_layers: 2,
            kv_heads: 1,
            head_dim: 4,
            page_size: 4,
            max_pages,
            encoding: KvEncoding::F32,
            windows: vec![None, window],
            values_in_keys: false,
        })
    }

    #[test]
    fn pages_are_shared_reused_and_bounded() {
        let mut p = pool(6);
        let (mut a, mut b) = (p.new_seq(), p.new_seq());
        p.reserve(&mut a, 5).unwrap(); // 2 pages x 2 layers
        assert_eq!(p.pages_in_use(), 4);
        assert!(p.reserve(&mut b, 8).is_err(), "needs 4 more pages, only 2 left");
        assert_eq!(p.pages_in_use(), 4, "a failed reserve changes nothing");
        p.commit(&mut a, 5);
        p.truncate(&mut a, 3);
        assert_eq!((a.len(), p.pages_in_use()), (3, 2));
        p.reserve(&mut b, 8).unwrap();
        assert_eq!(p.pages_allocated(), 6, "freed pages were reused");
        p.release(&mut a);
        p.release(&mut b);
        assert_eq!(p.pages_in_use(), 0);
    }

    /// Layer 1 slides with a window of 5 over pages of 4: once position 8 is next, page 0
    /// (positions 0-3) is unreachable and goes back, and memory stays bounded as it grows.
    #[test]
    fn sliding_layers_give_pages_back() {
        let mut p = pool(64);
        let mut s = p.new_seq();
        p.reserve(&mut s, 7).unwrap();
        p.commit(&mut s, 7);
        assert_eq!(p.pages_in_use(), 4, "position 7 still reads position 3");
        p.reserve(&mut s, 8).unwrap();
        p.commit(&mut s, 8);
        assert_eq!(p.pages_in_use(), 3, "layer 1 released page 0");
        // Cutting back to 7 would make position 7 read position 3 again, which is gone.
        assert!(p.can_truncate(&s, 8) && !p.can_truncate(&s, 7) && p.can_truncate(&s, 0));
        for len in 9..=100 {
            p.reserve(&mut s, len).unwrap();
            p.commit(&mut s, len);
        }
        // Layer 0 holds all 25 pages; layer 1 only page 24 (positions 96-99), all that
        // position 100's window (96-100) reads so far.
        assert_eq!(p.pages_in_use(), 25 + 1);
        p.truncate(&mut s, 0);
        assert_eq!(p.pages_in_use(), 0);
        p.reserve(&mut s, 4).unwrap();
        p.commit(&mut s, 4);
        assert_eq!(p.pages_in_use(), 2, "a reset session starts over");
    }

    fn cached_pool(max_pages: usize, window: Option<usize>) -> PagePool {
        let mut p = pool_with(max_pages, window);
        p.enable_prefix_cache(usize::MAX);
        p
    }

    /// Steps `tokens` into `s` the way a forward does: reserve, write each new position's
    /// rows (a function of the position's id and layer), commit.
    fn feed(p: &mut PagePool, s: &mut SeqKv, tokens: &[u32]) {
        let (start, end) = (s.len(), s.len() + tokens.len());
        p.reserve(s, end).unwrap();
        for (pos, &t) in (start..end).zip(tokens) {
            for layer in 0..2 {
                if p.cfg.window(layer).is_some_and(|w| pos + w < end) {
                    continue; // out of the window before the step ends: never read
                }
                let k = [t as f32, layer as f32, pos as f32, 1.0];
                p.write(s, (layer, 4), pos, &[], &k, &k.map(|x| -x));
            }
        }
        p.commit_tokens(s, end, tokens);
    }

    fn key_of(p: &PagePool, s: &SeqKv, layer: usize, pos: usize) -> [f32; 4] {
        let k = p.rows(s, layer, pos).0;
        std::array::from_fn(|i| f32::from_le_bytes(k[4 * i..4 * i + 4].try_into().unwrap()))
    }

    /// Two sessions share a cached prefix read-only; freeing the first keeps the second's
    /// pages; a write into a shared page copies it first; nothing leaks.
    #[test]
    fn prefix_pages_are_shared_refcounted_and_copied_on_write() {
        let mut p = cached_pool(64, None);
        let ids: Vec<u32> = (100..111).collect(); // 11 ids: pages 0 and 1 full
        let mut a = p.new_seq();
        feed(&mut p, &mut a, &ids);
        assert_eq!(p.cached_pages(), 4, "pages 0-1 of both layers");
        let mut b = p.new_seq();
        assert_eq!(p.reuse_prefix(&mut b, &ids[..8]), 4, "the last id stays to be stepped");
        p.release(&mut b);
        assert_eq!(p.reuse_prefix(&mut b, &ids), 8);
        assert_eq!(p.prefix_hit_tokens(), 12);
        assert_eq!(b.page_table(0), &a.page_table(0)[..2]);
        let in_use = p.pages_in_use();
        feed(&mut p, &mut b, &ids[8..]);
        assert_eq!(p.pages_in_use(), in_use + 2, "b adds its own page 2 in both layers");
        p.release(&mut a);
        for (pos, &id) in ids.iter().enumerate() {
            assert_eq!(key_of(&p, &b, 0, pos), [id as f32, 0.0, pos as f32, 1.0]);
        }
        // Cut back into page 1, which a third session also holds: b writes into a copy.
        let mut c = p.new_seq();
        assert_eq!(p.reuse_prefix(&mut c, &ids), 8);
        p.truncate(&mut b, 6);
        feed(&mut p, &mut b, &[7]);
        assert_ne!(b.page_table(0)[1], c.page_table(0)[1], "copied on write");
        assert_eq!(key_of(&p, &b, 0, 5), key_of(&p, &c, 0, 5), "the copy kept the rows");
        assert_eq!(key_of(&p, &c, 0, 6), [ids[6] as f32, 0.0, 6.0, 1.0], "c's page unchanged");
        assert_eq!(key_of(&p, &b, 0, 6), [7.0, 0.0, 6.0, 1.0]);
        // b's page 1 now holds other ids: a lookup along `ids` still finds c's.
        let mut d = p.new_seq();
        assert_eq!(p.reuse_prefix(&mut d, &ids), 8);
        assert_eq!(d.page_table(0), c.page_table(0));
        for s in [&mut b, &mut c, &mut d] {
            p.release(s);
        }
        assert_eq!(p.pages_in_use(), 0, "no page leaked");
    }

    /// A full pool evicts idle cached pages, least recently used first, and never a page a
    /// session holds; rows given as embeddings are never cached.
    #[test]
    fn idle_cached_pages_are_evicted_lru_first() {
        let mut p = cached_pool(8, Some(5));
        let (x, y): (Vec<u32>, Vec<u32>) = ((0..9).collect(), (50..59).collect());
        for ids in [&x, &y] {
            let mut s = p.new_seq();
            feed(&mut p, &mut s, &ids[..8]);
            p.release(&mut s);
        }
        assert_eq!((p.pages_in_use(), p.pages_allocated(), p.cached_pages()), (0, 8, 8));
        let mut held = p.new_seq();
        assert_eq!(p.reuse_prefix(&mut held, &y), 8, "y's prefix is held from now on");
        let mut s = p.new_seq();
        feed(&mut p, &mut s, &[1, 2, 3, 4, 5, 6]); // 2 pages x 2 layers: x's go first
        let mut probe = p.new_seq();
        assert_eq!(p.reuse_prefix(&mut probe, &x), 0, "x's pages were evicted");
        assert_eq!(p.reuse_prefix(&mut probe, &y), 8, "held pages survive");
        let mut more = p.new_seq();
        assert!(p.reserve(&mut more, 16).is_err(), "nothing idle left to evict");
        for t in [&mut held, &mut s, &mut probe] {
            p.release(t);
        }
        assert_eq!(p.pages_in_use(), 0);
        let mut g = p.new_seq();
        p.reserve(&mut g, 5).unwrap();
        p.commit_tokens(&mut g, 5, &[1, 2]); // positions 2-4 had given embeddings
        p.reserve(&mut g, 9).unwrap();
        p.commit_tokens(&mut g, 9, &[1, 2, 3, 4]);
        let cache = p.prefix.as_ref().unwrap();
        assert!(
            g.page_table(0)[..2].iter().all(|&id| !cache.is_cached(id)),
            "pages with rows from given embeddings (or after them) are not named by ids"
        );
    }

    /// Past `max_idle_pages` idle pages the oldest go back to the free list, where new rows
    /// take them before the pool grows.
    #[test]
    fn idle_pages_are_capped() {
        let mut p = pool_with(64, None);
        p.enable_prefix_cache(4);
        for first in [0, 100, 200] {
            let ids: Vec<u32> = (first..first + 8).collect();
            let mut s = p.new_seq();
            feed(&mut p, &mut s, &ids);
            p.release(&mut s);
        }
        assert_eq!((p.cached_pages(), p.pages_allocated()), (4, 8), "the third took freed pages");
        let mut s = p.new_seq();
        assert_eq!(p.reuse_prefix(&mut s, &(200..209).collect::<Vec<_>>()), 8);
        p.release(&mut s);
        assert_eq!(p.reuse_prefix(&mut s, &(100..109).collect::<Vec<_>>()), 0, "evicted");
    }

    /// Layer 1 slides (window 5, pages of 4): a prefix of 3 pages needs only its page 2
    /// there (position 12 reads 8-12), so evicting its pages 0 and 1 keeps the prefix usable.
    #[test]
    fn sliding_layers_reuse_only_the_window() {
        let mut p = cached_pool(64, Some(5));
        let ids: Vec<u32> = (0..13).collect();
        let mut a = p.new_seq();
        feed(&mut p, &mut a, &ids);
        p.release(&mut a);
        let entries = |p: &PagePool| p.prefix.as_ref().unwrap().entries.len();
        assert_eq!(entries(&p), 3);
        let mut b = p.new_seq();
        assert_eq!(p.reuse_prefix(&mut b, &ids), 12);
        assert_eq!(&b.page_table(1)[..2], &[RELEASED, RELEASED]);
        assert!(p.can_truncate(&b, 12) && !p.can_truncate(&b, 11));
        feed(&mut p, &mut b, &ids[12..]);
        for (pos, &id) in ids.iter().enumerate().skip(8) {
            assert_eq!(key_of(&p, &b, 1, pos), [id as f32, 1.0, pos as f32, 1.0]);
        }
        p.release(&mut b);
        assert_eq!(p.pages_in_use(), 0);
    }

    #[test]
    fn rows_round_trip() {
        let mut p = pool(8);
        let mut s = p.new_seq();
        p.reserve(&mut s, 6).unwrap();
        p.write(&s, (1, 4), 5, &[], &[1.0, 2.0, 3.0, 4.0], &[5.0, 6.0, 7.0, 8.0]);
        let (k, v) = p.rows(&s, 1, 5);
        assert_eq!(&k[4..8], &2.0f32.to_le_bytes());
        assert_eq!(&v[12..16], &8.0f32.to_le_bytes());
    }
}
