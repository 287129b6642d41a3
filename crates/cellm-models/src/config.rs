//! The normalised model description written by the converter (see docs/format.md).

use cellm_format::{Error, Result};
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
    pub hidden_act: String,
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
}

fn silu() -> String {
    "silu".into()
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
        if self.hidden_act != "silu" {
            return Err(Error::Unsupported(format!(
                "activation '{}' is not supported",
                self.hidden_act
            )));
        }
        Ok(())
    }

    pub fn attention_scale(&self) -> f32 {
        self.attention_scale.unwrap_or(1.0 / (self.head_dim as f32).sqrt())
    }

    pub fn layer_uses_rope(&self, layer: usize) -> bool {
        self.rope_layers.as_ref().is_none_or(|r| r[layer])
    }
}
