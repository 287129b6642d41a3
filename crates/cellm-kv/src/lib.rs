//! Session caches. Keys and values live in fixed-size pages from one shared pool; each
//! session owns a page table per layer, so sessions can grow, shrink and go away without
//! copying anyone's cache. Model code never sees pages: it hands q, k and v to the pool as
//! an [`AttentionCall`]. Recurrent layers keep their state in a [`SeqState`] per session.

mod attention;
mod call;
mod encoding;
mod pool;
mod prefix;
mod query_rows;
mod query_tiles;
mod rotation;
mod state;

pub use attention::prefetch_new_rows;
pub use call::{AttentionCall, AttentionShape, SeqSpan};
pub use encoding::KvEncoding;
pub use pool::{KvConfig, PagePool, SeqKv};
pub use state::SeqState;
