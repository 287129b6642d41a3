//! Encoders: models that read a whole text at once and give one row per token (a token
//! classifier's label logits, a sentence embedder's hidden states) instead of generating.
//! Each sequence of a batch attends only to itself and sequences are concatenated, never
//! padded, so no work is spent on padding. privacy-filter runs the whole batch through each
//! step (its experts want many tokens at once); BERT runs blocks of whole sequences through
//! every layer, one block per thread (`bert::plan_blocks`), or splits each step over the
//! threads when there are too few sequences.

mod attention;
mod base;
mod bert;
mod dense;
mod privacy_filter;

pub use attention::{banded_attention, Band};
pub use base::{Encoder, EncoderLoader};
pub use bert::load as load_bert;
pub use privacy_filter::load as load_privacy_filter;
