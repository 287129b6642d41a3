//! Session caches. Keys and values live in fixed-size pages from one shared pool; each
//! session owns a page table per layer, so sessions can grow, shrink and go away without
//! copying anyone's cache. Model code never sees pages: it hands q, k and v to
//! [`PagePool::attention`]. Recurrent layers keep their state in a [`SeqState`] per session.

mod attention;
mod pool;
mod query_tiles;
mod state;

pub use attention::{AttentionShape, SeqSpan};
pub use pool::{KvConfig, KvEncoding, PagePool, SeqKv};
pub use state::SeqState;
