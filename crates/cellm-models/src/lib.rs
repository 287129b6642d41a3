//! Model architectures. Each family is one file built from the shared blocks in [`blocks`];
//! the registry maps the file's `architecture` to a loader. Models never see paging or weight
//! formats: linear layers hold tensors whose format picks the kernel, and attention goes
//! through the KV pool.

pub mod blocks;
mod config;
mod llama;
mod registry;

use cellm_kv::{PagePool, SeqSpan};

pub use config::{ModelConfig, RopeConfig};
pub use registry::{load, SUPPORTED_ARCHITECTURES};

/// One batched forward step: the new tokens of several sessions, concatenated.
pub struct Step<'a> {
    pub tokens: &'a [u32],
    pub spans: &'a [SeqSpan<'a>],
    /// Rows (indices into `tokens`) whose next-token logits are wanted, in output order.
    pub logit_rows: &'a [usize],
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

/// The KV layout a model asks of the engine.
#[derive(Debug, Clone, Copy)]
pub struct CacheLayout {
    pub num_layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

pub trait CausalLm: Send + Sync {
    fn config(&self) -> &ModelConfig;
    fn cache_layout(&self) -> CacheLayout;
    /// Logits for `step.logit_rows`, row-major `rows x vocab`.
    fn forward(&self, step: &Step, kv: &mut PagePool) -> Vec<f32>;
}
