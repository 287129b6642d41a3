//! The prefix cache's bookkeeping: full pages keyed by a hash chain of their token ids, and
//! the least-recently-used order of the cached pages no session holds.
//!
//! Page `i` of a sequence is keyed by `hash(key of page i - 1, token ids of page i)` (page 0
//! by `hash(0, ids)`), so a key names the page's whole prefix, not just its own ids. An entry
//! keeps its parent's key and its ids, and a lookup compares both: a 64-bit collision can
//! only make a lookup miss, never hand out the wrong rows. An entry holds one page per layer
//! (a sliding layer's page can be missing: its owner released it, or it was evicted).

use std::collections::{BTreeMap, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};

/// An entry's page for a layer that it lacks (the page tables' marker too).
pub(crate) const NONE: u32 = u32::MAX;

pub(crate) struct Entry {
    parent: u64,
    tokens: Box<[u32]>,
    /// Per layer, the page holding these positions' rows, or [`NONE`].
    pub(crate) pages: Vec<u32>,
}

#[derive(Default)]
pub(crate) struct PrefixCache {
    pub(crate) entries: HashMap<u64, Entry>,
    /// Per page id: the entry and layer that list it (None: not cached).
    owner: Vec<Option<(u64, u32)>>,
    /// Cached pages no page table holds, by the tick they were let go at (oldest first).
    idle: BTreeMap<u64, u32>,
    /// Per page id: its key in `idle` (0: not idle).
    idle_at: Vec<u64>,
    tick: u64,
    /// The most idle pages kept; past it the least recently used goes back to the free list.
    pub(crate) max_idle: usize,
    /// Positions handed out from the cache instead of being prefilled.
    pub(crate) hit_tokens: u64,
}

/// The key of a page whose ids are `tokens`, after the page keyed `parent` (0 for page 0).
pub(crate) fn chain_key(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    // 0 stands for "no parent"; a key is never 0.
    h.finish().max(1)
}

impl PrefixCache {
    /// Makes room in the per-page tables for page ids below `pages`.
    pub(crate) fn grow(&mut self, pages: usize) {
        if self.owner.len() < pages {
            self.owner.resize(pages, None);
            self.idle_at.resize(pages, 0);
        }
    }

    pub(crate) fn is_cached(&self, page: u32) -> bool {
        self.owner[page as usize].is_some()
    }

    pub(crate) fn cached_pages(&self) -> usize {
        self.owner.iter().filter(|o| o.is_some()).count()
    }

    pub(crate) fn idle_pages(&self) -> usize {
        self.idle.len()
    }

    /// The entry keyed `key` if it really is the page of `tokens` after `parent`.
    pub(crate) fn get(&self, key: u64, parent: u64, tokens: &[u32]) -> Option<&Entry> {
        self.entries.get(&key).filter(|e| e.parent == parent && *e.tokens == *tokens)
    }

    /// Lists `page` as layer `layer`'s rows of the page keyed `key` (ids `tokens` after
    /// `parent`), unless that entry already has a page for the layer (another session
    /// computed the same positions) or the key is taken by other ids.
    pub(crate) fn insert(
        &mut self,
        (key, parent, tokens): (u64, u64, &[u32]),
        layers: usize,
        layer: usize,
        page: u32,
    ) {
        let entry = self.entries.entry(key).or_insert_with(|| Entry {
            parent,
            tokens: tokens.into(),
            pages: vec![NONE; layers],
        });
        if entry.parent != parent || *entry.tokens != *tokens || entry.pages[layer] != NONE {
            return;
        }
        entry.pages[layer] = page;
        self.owner[page as usize] = Some((key, layer as u32));
    }

    /// A cached page's last holder let it go: it becomes the most recently used idle page.
    /// Returns the page evicted to stay within `max_idle`, if one was.
    pub(crate) fn park(&mut self, page: u32) -> Option<u32> {
        self.tick += 1;
        self.idle.insert(self.tick, page);
        self.idle_at[page as usize] = self.tick;
        (self.idle.len() > self.max_idle).then(|| self.evict()).flatten()
    }

    /// A page table takes an idle cached page.
    pub(crate) fn unpark(&mut self, page: u32) {
        let at = std::mem::take(&mut self.idle_at[page as usize]);
        if at != 0 {
            self.idle.remove(&at);
        }
    }

    /// Evicts the least recently used idle page and returns it, free for new rows.
    pub(crate) fn evict(&mut self) -> Option<u32> {
        let (_, page) = self.idle.pop_first()?;
        self.idle_at[page as usize] = 0;
        self.forget(page);
        Some(page)
    }

    /// Takes `page` out of its entry (dropping the entry once it lists no page).
    pub(crate) fn forget(&mut self, page: u32) {
        let Some((key, layer)) = self.owner[page as usize].take() else { return };
        let entry = self.entries.get_mut(&key).expect("an owner names a live entry");
        entry.pages[layer as usize] = NONE;
        if entry.pages.iter().all(|&p| p == NONE) {
            self.entries.remove(&key);
        }
    }
}
