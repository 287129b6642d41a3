//! Model architectures. Each family is one file built from the shared blocks in [`blocks`];
//! the registry maps the file's `architecture` to a loader. Models never see paging or weight
//! formats: linear layers hold tensors whose format picks the kernel, and attention goes
//! through the KV pool.

pub mod blocks;
mod config;
mod decoder;
mod deepseek;
mod delta_rule;
pub mod encoder;
mod gemma;
mod gemma4;
mod granite_hybrid;
mod lfm2;
mod llama;
mod moe;
mod qwen35;
mod registry;
mod vision;
mod weights;
mod whisper;

use cellm_kv::{PagePool, SeqSpan, SeqState};

pub use config::{Activation, LayerType, ModelConfig, RopeConfig, MAX_CONTEXT};
pub use encoder::Encoder;
pub use registry::{architectures, expected_tensors, load, load_encoder, load_limited};
pub use vision::{ConnectorKind, VisionConfig, VisionEncoder};
pub use weights::{Storage, TensorSpec, Weights};
pub use whisper::WhisperConfig;

/// One batched forward step: the new tokens of several sessions, concatenated.
pub struct Step<'a> {
    pub tokens: &'a [u32],
    pub spans: &'a [SeqSpan<'a>],
    /// Rows (indices into `tokens`) whose next-token logits are wanted, in output order.
    pub logit_rows: &'a [usize],
    /// Rows whose input embedding is given instead of looked up (image features).
    pub embeds: GivenEmbeds<'a>,
    /// Asked before each layer's token mixer and feed-forward, on the calling thread: true
    /// stops the forward there ([`Cancelled`]), with the caches partly written (the engine
    /// rolls them back).
    pub cancel: &'a (dyn Fn() -> bool + Sync),
}

/// Embedding rows that replace the looked-up ones at some rows of a step.
#[derive(Debug, Clone, Copy, Default)]
pub struct GivenEmbeds<'a> {
    /// Indices into [`Step::tokens`].
    pub rows: &'a [usize],
    /// `rows.len() x hidden_size`, in `rows` order.
    pub values: &'a [f32],
}

/// A forward stopped by [`Step::cancel`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cancelled;

/// Why a forward returned no logits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ForwardError {
    /// [`Step::cancel`] said stop.
    Cancelled,
    /// The device running the model failed (a GPU backend: out of memory, a lost device).
    Failed(cellm_format::Error),
}

impl From<Cancelled> for ForwardError {
    fn from(_: Cancelled) -> Self {
        ForwardError::Cancelled
    }
}

impl Step<'_> {
    /// The position of every token row.
    pub fn positions(&self) -> Vec<usize> {
        let mut pos = vec![0; self.tokens.len()];
        for s in self.spans {
            for i in 0..s.len {
                pos[s.row0 + i] = s.start + i;
            }
        }
        pos
    }
}

/// The per-session caches a model asks of the engine.
#[derive(Debug, Clone)]
pub struct CacheLayout {
    /// KV layers (a model numbers its attention layers 0..kv_layers).
    pub kv_layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Per KV layer, its sliding window (empty: none slides).
    pub windows: Vec<Option<usize>>,
    /// Floats of each recurrent-state buffer (empty: the model keeps none).
    pub state: Vec<usize>,
    /// Values are the key rows (MLA's latent cache).
    pub values_in_keys: bool,
    /// Steps only read the state (Whisper's cross-attention memory, written per audio
    /// window): it survives rewinding and needs no copy to roll a step back.
    pub state_fixed: bool,
}

pub trait CausalLm: Send + Sync {
    fn config(&self) -> &ModelConfig;
    fn cache_layout(&self) -> CacheLayout;
    /// Logits for `step.logit_rows`, row-major `rows x vocab`. `states[i]` is the recurrent
    /// state of `step.spans[i]`'s session. Cancelled between layers when `step.cancel` says
    /// so, having written part of the new positions' KV rows and states.
    fn forward(
        &self,
        step: &Step,
        kv: &mut PagePool,
        states: &mut [&mut SeqState],
    ) -> Result<Vec<f32>, ForwardError>;
    /// The vision encoder of a vision-language model.
    fn vision(&self) -> Option<&VisionEncoder> {
        None
    }
    /// The encoder side of a speech model.
    fn speech(&self) -> Option<&dyn SpeechModel> {
        None
    }
    /// The most positions the model can address (a learned position table), if limited.
    fn position_limit(&self) -> Option<usize> {
        None
    }
}

/// An encoder-decoder speech model's encoder: one window of features in, encoder states
/// out, and those states made into a session's cross-attention memory.
pub trait SpeechModel: Send + Sync {
    /// (mel bins, frames) of one window of features.
    fn input_shape(&self) -> (usize, usize);
    /// Encoder states (`positions x hidden`) of `mel`, `bins x frames` row-major.
    fn encode(&self, mel: &[f32]) -> cellm_format::Result<Vec<f32>>;
    /// Writes the decoder's memory of `encoded` into a session's state.
    fn attend_to(&self, encoded: &[f32], state: &mut SeqState) -> cellm_format::Result<()>;
}
