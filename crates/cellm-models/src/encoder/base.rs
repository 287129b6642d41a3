//! The encoder interface, and what every encoder's forward needs.

use cellm_format::{Error, Result};
use serde::de::DeserializeOwned;

use crate::weights::Weights;

pub trait Encoder: Send + Sync {
    /// Values per output row (labels, or the hidden width).
    fn width(&self) -> usize;
    fn vocab_size(&self) -> usize;
    /// The longest sequence one forward accepts.
    fn max_tokens(&self) -> usize;
    /// One output row per token of each sequence, the sequences' rows concatenated.
    fn forward(&self, seqs: &[&[u32]]) -> Result<Vec<f32>>;
}

/// An encoder's description (a file's `model` section), parsed and checked.
pub(crate) fn description<T: DeserializeOwned>(model: &serde_json::Value) -> Result<T> {
    serde_json::from_value(model.clone())
        .map_err(|e| Error::format(format!("bad model description: {e}")))
}

/// Each sequence's length, checked against the model's limits and vocabulary (token ids are
/// checked by the embedding lookup).
pub(crate) fn check_batch(seqs: &[&[u32]], max_tokens: usize) -> Result<Vec<usize>> {
    seqs.iter()
        .map(|s| {
            if s.len() > max_tokens {
                return Err(Error::ContextOverflow(format!(
                    "a sequence of {} tokens is longer than the model's {max_tokens}",
                    s.len()
                )));
            }
            Ok(s.len())
        })
        .collect()
}

/// The position of each token within its own sequence.
pub(crate) fn positions(lens: &[usize]) -> Vec<usize> {
    lens.iter().flat_map(|&n| 0..n).collect()
}

pub type EncoderLoader = fn(&Weights, &serde_json::Value) -> Result<Box<dyn Encoder>>;
