//! The normalised model description written by the converter (see docs/format.md).

use std::collections::HashMap;

use cellm_format::{Error, Result};
use serde::de::DeserializeOwned;
use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
pub struct RopeConfig {
    /// Inverse frequencies, already scaled by the source's rule; rotary dim = 2 * len.
    pub inv_freq: Vec<f32>,
    /// Multiplies cos and sin (yarn's attention factor; 1 otherwise).
    #[serde(default = "one")]
    pub attention_factor: f32,
}

fn one() -> f32 {
    1.0
}

/// What a layer's token mixer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerType {
    FullAttention,
    SlidingAttention,
    /// A gated short convolution (LFM2).
    Conv,
    /// A gated DeltaNet recurrence (Qwen3.5).
    LinearAttention,
}

/// The MLP's gate activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    Silu,
    /// `gelu` with the tanh approximation (HF's `gelu_pytorch_tanh`).
    GeluTanh,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ModelConfig {
    pub architecture: String,
    #[serde(default)]
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub norm_eps: f32,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    #[serde(default = "silu")]
    pub hidden_act: Activation,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub attention_out_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default)]
    pub qk_norm: bool,
    pub rope: RopeConfig,
    #[serde(default)]
    pub rope_layers: Option<Vec<bool>>,
    #[serde(default = "one")]
    pub embedding_multiplier: f32,
    #[serde(default = "one")]
    pub residual_multiplier: f32,
    #[serde(default)]
    pub attention_scale: Option<f32>,
    #[serde(default = "one")]
    pub logits_scale: f32,
    /// One entry per layer; empty means every layer is full attention.
    #[serde(default)]
    pub layer_types: Vec<LayerType>,
    /// Positions a sliding layer attends to, itself included.
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// RoPE of sliding layers when it differs from `rope` (Gemma's local base).
    #[serde(default)]
    pub rope_local: Option<RopeConfig>,
    /// `cap * tanh(x / cap)` on attention scores / on the final logits.
    #[serde(default)]
    pub attn_logit_softcap: Option<f32>,
    #[serde(default)]
    pub final_logit_softcap: Option<f32>,
    /// Attention outputs are gated by a sigmoid of a second half of `q_proj` (Qwen3.5).
    #[serde(default)]
    pub attn_output_gate: bool,
    /// Family-specific sections (`conv`, `linear_attention`, `mla`, `moe`), read with
    /// [`ModelConfig::section`].
    #[serde(flatten)]
    pub extra: HashMap<String, serde_json::Value>,
}

fn silu() -> Activation {
    Activation::Silu
}

impl ModelConfig {
    pub fn from_json(v: &serde_json::Value) -> Result<Self> {
        let c: Self = serde_json::from_value(v.clone())
            .map_err(|e| Error::format(format!("bad model description: {e}")))?;
        c.validate()?;
        Ok(c)
    }

    fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::format(format!("bad model description: {m}")));
        if self.num_heads == 0
            || self.num_kv_heads == 0
            || !self.num_heads.is_multiple_of(self.num_kv_heads)
        {
            return bad(format!(
                "{} heads cannot share {} kv heads",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.rope.inv_freq.len() * 2 > self.head_dim {
            return bad(format!(
                "rotary dim {} > head_dim {}",
                self.rope.inv_freq.len() * 2,
                self.head_dim
            ));
        }
        if self.rope_layers.as_ref().is_some_and(|r| r.len() != self.num_layers) {
            return bad("rope_layers must have one entry per layer".into());
        }
        if !self.layer_types.is_empty() && self.layer_types.len() != self.num_layers {
            return bad("layer_types must have one entry per layer".into());
        }
        if self.layer_types.contains(&LayerType::SlidingAttention)
            && self.sliding_window.is_none_or(|w| w == 0)
        {
            return bad("sliding layers need a sliding_window of at least 1".into());
        }
        Ok(())
    }

    /// A family-specific section of the description.
    pub fn section<T: DeserializeOwned>(&self, name: &str) -> Result<T> {
        let v = self
            .extra
            .get(name)
            .ok_or_else(|| Error::format(format!("bad model description: no '{name}' section")))?;
        serde_json::from_value(v.clone())
            .map_err(|e| Error::format(format!("bad model description: '{name}': {e}")))
    }

    pub fn layer_type(&self, layer: usize) -> LayerType {
        self.layer_types.get(layer).copied().unwrap_or(LayerType::FullAttention)
    }

    /// The sliding window of `layer`, if it slides.
    pub fn window(&self, layer: usize) -> Option<usize> {
        (self.layer_type(layer) == LayerType::SlidingAttention)
            .then(|| self.sliding_window.expect("validated"))
    }

    pub fn attention_scale(&self) -> f32 {
        self.attention_scale.unwrap_or(1.0 / (self.head_dim as f32).sqrt())
    }

    pub fn layer_uses_rope(&self, layer: usize) -> bool {
        self.rope_layers.as_ref().is_none_or(|r| r[layer])
    }
}
