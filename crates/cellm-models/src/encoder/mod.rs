//! Encoders: models that read a whole text at once and give one row per token (a token
//! classifier's label logits, a sentence embedder's hidden states) instead of generating.
//! Each sequence of a batch attends only to itself; all of a batch's tokens share the
//! matmuls, so a batch needs no padding.

mod attention;
mod base;
mod bert;
mod dense;
mod privacy_filter;

pub use attention::{banded_attention, Band};
pub use base::{Encoder, EncoderLoader};
pub use bert::load as load_bert;
pub use privacy_filter::load as load_privacy_filter;
