//! What a model hands attention: one layer's query, key and value rows for a batch of
//! sessions, and the layer's shape. Both attention paths (`query_rows`, `query_tiles`) read
//! these, so they live apart from the code that picks between the paths (`attention`).

use crate::pool::SeqKv;

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

impl AttentionShape {
    /// The first position a query at `pos` sees.
    pub(crate) fn first_visible(&self, pos: usize) -> usize {
        self.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }
}

/// One layer's attention over a batch: `q` is `rows x n_heads*head_dim`, `k` and `v` are
/// `rows x n_kv_heads*head_dim` (`v` is ignored when the pool keeps values in the keys).
/// [`AttentionCall::run`] stores the keys and values and writes the attention.
#[derive(Clone, Copy)]
pub struct AttentionCall<'a> {
    pub layer: usize,
    pub spans: &'a [SeqSpan<'a>],
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub shape: &'a AttentionShape,
}
