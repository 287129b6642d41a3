//! The page pool and the per-session page tables.

use cellm_format::{Error, Result};

use crate::encoding::KvEncoding;

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
}

impl PagePool {
    /// `max_pages` is capped at [`MAX_PAGES`] (page ids are 32-bit).
    pub fn new(mut cfg: KvConfig) -> Self {
        cfg.max_pages = cfg.max_pages.min(MAX_PAGES);
        let row_bytes = cfg.kv_heads * cfg.encoding.head_bytes(cfg.head_dim);
        Self { cfg, row_bytes, pages: Vec::new(), free: Vec::new(), host_storage: true }
    }

    /// A pool that hands out page ids and keeps page tables but stores no rows: a GPU model
    /// keeps them in its own memory ([`PagePool::write`] and attention on it are not for
    /// such a pool).
    pub fn without_storage(cfg: KvConfig) -> Self {
        Self { host_storage: false, ..Self::new(cfg) }
    }

    pub fn config(&self) -> &KvConfig {
        &self.cfg
    }

    pub fn new_seq(&self) -> SeqKv {
        let layers = self.cfg.num_layers;
        SeqKv { len: 0, pages: vec![Vec::new(); layers], released: vec![0; layers] }
    }

    /// Pages handed out to sessions right now.
    pub fn pages_in_use(&self) -> usize {
        self.pages.len() - self.free.len()
    }

    /// Pages that exist (in use or on the free list): the pool's memory high-water mark.
    pub fn pages_allocated(&self) -> usize {
        self.pages.len()
    }

    pub fn page_bytes(&self) -> usize {
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
    pub fn reserve(&mut self, seq: &mut SeqKv, new_len: usize) -> Result<()> {
        let want = new_len.div_ceil(self.cfg.page_size);
        let have = seq.pages.first().map_or(0, Vec::len);
        let needed = want.saturating_sub(have) * self.cfg.num_layers;
        let available = self.free.len() + self.cfg.max_pages.saturating_sub(self.pages.len());
        if needed > available {
            return Err(Error::ContextOverflow(format!(
                "KV cache is full: {needed} more pages needed, {available} free \
                 (raise context_length or free sessions)"
            )));
        }
        for table in &mut seq.pages {
            while table.len() < want {
                let id = match self.free.pop() {
                    Some(id) => id,
                    None => {
                        let words =
                            if self.host_storage { self.page_bytes().div_ceil(4) } else { 0 };
                        self.pages.push(vec![0u32; words].into_boxed_slice());
                        (self.pages.len() - 1) as u32
                    }
                };
                table.push(id);
            }
        }
        Ok(())
    }

    /// Marks positions `..new_len` filled (after their keys and values were written), then
    /// returns the pages of sliding layers that no later query can reach.
    pub fn commit(&mut self, seq: &mut SeqKv, new_len: usize) {
        debug_assert!(seq.pages.iter().all(|t| t.len() * self.cfg.page_size >= new_len));
        seq.len = new_len;
        for layer in 0..self.cfg.num_layers {
            let Some(window) = self.cfg.window(layer) else { continue };
            // The next query sits at `new_len` and reads from `new_len + 1 - window` on.
            let dead = (new_len + 1).saturating_sub(window) / self.cfg.page_size;
            let (table, released) = (&mut seq.pages[layer], &mut seq.released[layer]);
            while *released < dead {
                self.free.push(std::mem::replace(&mut table[*released], RELEASED));
                *released += 1;
            }
        }
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
        let keep = seq.len.div_ceil(self.cfg.page_size);
        for (table, released) in seq.pages.iter_mut().zip(&mut seq.released) {
            while table.len() > keep {
                let id = table.pop().expect("len > keep");
                if id != RELEASED {
                    self.free.push(id);
                }
            }
            *released = (*released).min(keep);
        }
    }

    pub fn release(&mut self, seq: &mut SeqKv) {
        self.truncate(seq, 0);
    }

    /// Stores the key and value rows of position `pos` for `layer`, whose heads are
    /// `head_dim` wide (rotated first where the encoding rotates). A layer narrower than the
    /// pool's rows fills a prefix of them.
    pub fn write(
        &mut self,
        seq: &SeqKv,
        (layer, hd): (usize, usize),
        pos: usize,
        k: &[f32],
        v: &[f32],
    ) {
        let (page, slot) = (seq.page(layer, pos / self.cfg.page_size), pos % self.cfg.page_size);
        let (rb, ps) = (self.row_bytes, self.cfg.page_size);
        let values = !self.cfg.values_in_keys;
        let bytes = words_as_bytes_mut(&mut self.pages[page as usize]);
        let (keys, vals) = bytes.split_at_mut(ps * rb);
        let (enc, hb) = (self.cfg.encoding, self.cfg.encoding.head_bytes(hd));
        assert!(k.len() / hd * hb <= rb, "KV rows of {} values are wider than the pool's", k.len());
        let rotation = enc.rotation(hd);
        let store = |src: &[f32], dst: &mut [u8]| {
            let mut rotated = Vec::new();
            let src = match &rotation {
                Some(r) => {
                    rotated.extend_from_slice(src);
                    r.rotate(&mut rotated);
                    &rotated[..]
                }
                None => src,
            };
            for (head, out) in src.chunks_exact(hd).zip(dst.chunks_exact_mut(hb)) {
                enc.encode(head, out);
            }
        };
        store(k, &mut keys[slot * rb..(slot + 1) * rb]);
        if values {
            store(v, &mut vals[slot * rb..(slot + 1) * rb]);
        }
    }

    /// The key rows and the value rows of page `index` of `layer` (page_size rows each, raw
    /// encoded bytes, `row_bytes()` per row).
    pub(crate) fn page_rows(&self, seq: &SeqKv, layer: usize, index: usize) -> (&[u8], &[u8]) {
        let bytes = words_as_bytes(&self.pages[seq.page(layer, index) as usize]);
        let plane = self.cfg.page_size * self.row_bytes;
        if self.cfg.values_in_keys {
            (&bytes[..plane], &bytes[..plane])
        } else {
            bytes[..2 * plane].split_at(plane)
        }
    }

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

fn words_as_bytes(w: &[u32]) -> &[u8] {
    // SAFETY: any u32 storage is valid as bytes.
    unsafe { std::slice::from_raw_parts(w.as_ptr().cast::<u8>(), w.len() * 4) }
}

fn words_as_bytes_mut(w: &mut [u32]) -> &mut [u8] {
    // SAFETY: any byte pattern is a valid u32; the slice covers the same storage.
    unsafe { std::slice::from_raw_parts_mut(w.as_mut_ptr().cast::<u8>(), w.len() * 4) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(max_pages: usize) -> PagePool {
        PagePool::new(KvConfig {
            num_layers: 2,
            kv_heads: 1,
            head_dim: 4,
            page_size: 4,
            max_pages,
            encoding: KvEncoding::F32,
            windows: vec![None, Some(5)],
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

    #[test]
    fn rows_round_trip() {
        let mut p = pool(8);
        let mut s = p.new_seq();
        p.reserve(&mut s, 6).unwrap();
        p.write(&s, (1, 4), 5, &[1.0, 2.0, 3.0, 4.0], &[5.0, 6.0, 7.0, 8.0]);
        let (k, v) = p.rows(&s, 1, 5);
        assert_eq!(&k[4..8], &2.0f32.to_le_bytes());
        assert_eq!(&v[12..16], &8.0f32.to_le_bytes());
    }
}
