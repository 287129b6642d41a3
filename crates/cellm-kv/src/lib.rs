//! Paged KV cache. Fixed-size pages come from one shared pool; each session owns a page table
//! per layer, so sessions can grow, shrink and go away without copying anyone's cache. Model
//! code never sees pages: it hands q, k and v to [`PagePool::attention`].

mod attention;
mod pool;

pub use attention::{AttentionShape, SeqSpan};
pub use pool::{KvConfig, KvEncoding, PagePool, SeqKv};
