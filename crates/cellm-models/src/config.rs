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
    /// Exact `gelu` (erf), HF's `gelu` (Whisper).
    Gelu,
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
    /// Run only the first this many layers, then the final norm and head (a debugging aid;
    /// never in a file: set by [`crate::load_limited`]).
    #[serde(skip)]
    pub max_layers: Option<usize>,
    /// Family-specific sections (`conv`, `linear_attention`, `mla`, `moe`), read with
    /// [`ModelConfig::section`].
    #[serde(flatten)]
    pub extra: HashMap<String, serde_json::Value>,
}

fn silu() -> Activation {
    Activation::Silu
}

/// The largest width or count a description may give (any tensor dimension included):
/// products of two stay far from overflowing, and no real model comes near.
pub const MAX_DIM: usize = 1 << 31;
/// The most positions a description may declare, or an engine be asked for.
pub const MAX_CONTEXT: usize = 1 << 32;
/// The most floats one recurrent-state buffer of a session may hold (4 GiB).
pub const MAX_STATE_FLOATS: usize = 1 << 30;

/// `bad model description: {field} {problem}`, the one form every check reports.
pub fn bad_field(field: &str, problem: impl std::fmt::Display) -> Error {
    Error::format(format!("bad model description: {field} {problem}"))
}

/// `value` is a width or count: at least 1, at most [`MAX_DIM`].
pub fn check_dim(field: &str, value: usize) -> Result<usize> {
    if value == 0 || value > MAX_DIM {
        return Err(bad_field(field, format_args!("is {value} (must be 1 to {MAX_DIM})")));
    }
    Ok(value)
}

/// The product of `factors`, itself a width or count ([`check_dim`]), without overflowing.
pub fn check_product(field: &str, factors: &[usize]) -> Result<usize> {
    let shown = || factors.iter().map(|f| f.to_string()).collect::<Vec<_>>().join(" * ");
    let product = factors.iter().try_fold(1usize, |a, &f| a.checked_mul(f));
    match product {
        Some(p) if (1..=MAX_DIM).contains(&p) => Ok(p),
        _ => Err(bad_field(field, format_args!("= {} is outside 1 to {MAX_DIM}", shown()))),
    }
}

/// A session's state buffer of `factors` floats (0 allowed) stays within
/// [`MAX_STATE_FLOATS`].
pub fn check_state(field: &str, factors: &[usize]) -> Result<usize> {
    let shown = || factors.iter().map(|f| f.to_string()).collect::<Vec<_>>().join(" * ");
    let product = factors.iter().try_fold(1usize, |a, &f| a.checked_mul(f));
    match product {
        Some(p) if p <= MAX_STATE_FLOATS => Ok(p),
        _ => Err(bad_field(
            field,
            format_args!(
                "makes a session state of {} floats, more than {MAX_STATE_FLOATS}",
                shown()
            ),
        )),
    }
}

/// `value` is at most `limit` (named `limit_field` in the message).
pub fn check_at_most(field: &str, value: usize, limit_field: &str, limit: usize) -> Result<()> {
    if value > limit {
        return Err(bad_field(
            field,
            format_args!("is {value}, more than {limit_field} ({limit})"),
        ));
    }
    Ok(())
}

/// `value` is finite and greater than 0 (epsilons, scales, soft-caps).
pub fn check_positive(field: &str, value: f32) -> Result<f32> {
    if !(value.is_finite() && value > 0.0) {
        return Err(bad_field(field, format_args!("is {value} (must be finite and > 0)")));
    }
    Ok(value)
}

/// A family-specific section of the description (`conv`, `linear_attention`, `mla`, `moe`),
/// checked against itself and the rest of the model whenever it is read.
pub trait Section: DeserializeOwned {
    const NAME: &'static str;
    /// An error naming the field at fault ([`bad_field`] with `NAME.field`), if any.
    fn check(&self, model: &ModelConfig) -> Result<()>;
}

impl RopeConfig {
    /// Frequencies finite, the factor finite and positive, and at most `dims` rotated
    /// dimensions.
    pub(crate) fn check(&self, field: &str, dims: usize, dims_field: &str) -> Result<()> {
        if let Some(f) = self.inv_freq.iter().find(|f| !f.is_finite()) {
            return Err(bad_field(&format!("{field}.inv_freq"), format_args!("holds {f}")));
        }
        check_positive(&format!("{field}.attention_factor"), self.attention_factor)?;
        let rotated = self.inv_freq.len().saturating_mul(2);
        if rotated > dims {
            return Err(bad_field(
                &format!("{field}.inv_freq"),
                format_args!(
                    "has {} frequencies: {rotated} rotary dims > {dims_field} {dims}",
                    self.inv_freq.len()
                ),
            ));
        }
        Ok(())
    }
}

impl ModelConfig {
    pub fn from_json(v: &serde_json::Value) -> Result<Self> {
        let c: Self = serde_json::from_value(v.clone())
            .map_err(|e| Error::format(format!("bad model description: {e}")))?;
        c.validate()?;
        Ok(c)
    }

    /// Every size, count and float the shared blocks read, checked once here (products with
    /// checked arithmetic), so that no kernel meets a number it cannot handle. Family
    /// sections are checked when read ([`Section`]).
    fn validate(&self) -> Result<()> {
        check_dim("vocab_size", self.vocab_size)?;
        check_dim("hidden_size", self.hidden_size)?;
        check_dim("intermediate_size", self.intermediate_size)?;
        check_dim("num_layers", self.num_layers)?;
        check_dim("num_heads", self.num_heads)?;
        check_dim("num_kv_heads", self.num_kv_heads)?;
        check_dim("head_dim", self.head_dim)?;
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(bad_field(
                "num_heads",
                format_args!("{} cannot share {} kv heads", self.num_heads, self.num_kv_heads),
            ));
        }
        if self.attn_output_gate {
            check_product("2 * num_heads * head_dim", &[2, self.num_heads, self.head_dim])?;
        } else {
            check_product("num_heads * head_dim", &[self.num_heads, self.head_dim])?;
        }
        check_product("num_kv_heads * head_dim", &[self.num_kv_heads, self.head_dim])?;
        check_product("3 * hidden_size", &[3, self.hidden_size])?;
        if self.max_position_embeddings == 0 || self.max_position_embeddings > MAX_CONTEXT {
            return Err(bad_field(
                "max_position_embeddings",
                format_args!("is {} (must be 1 to {MAX_CONTEXT})", self.max_position_embeddings),
            ));
        }
        check_positive("norm_eps", self.norm_eps)?;
        check_positive("embedding_multiplier", self.embedding_multiplier)?;
        check_positive("residual_multiplier", self.residual_multiplier)?;
        check_positive("logits_scale", self.logits_scale)?;
        if let Some(s) = self.attention_scale {
            check_positive("attention_scale", s)?;
        }
        if let Some(cap) = self.attn_logit_softcap {
            check_positive("attn_logit_softcap", cap)?;
        }
        if let Some(cap) = self.final_logit_softcap {
            check_positive("final_logit_softcap", cap)?;
        }
        self.rope.check("rope", self.head_dim, "head_dim")?;
        if let Some(local) = &self.rope_local {
            local.check("rope_local", self.head_dim, "head_dim")?;
        }
        let per_layer = |field: &str, len: usize| match len == self.num_layers {
            true => Ok(()),
            false => Err(bad_field(
                field,
                format_args!("has {len} entries for {} layers", self.num_layers),
            )),
        };
        if let Some(r) = &self.rope_layers {
            per_layer("rope_layers", r.len())?;
        }
        if !self.layer_types.is_empty() {
            per_layer("layer_types", self.layer_types.len())?;
        }
        if self.layer_types.contains(&LayerType::SlidingAttention)
            && self.sliding_window.is_none_or(|w| w == 0)
        {
            return Err(bad_field(
                "sliding_window",
                "must be at least 1 where layer_types has sliding layers",
            ));
        }
        Ok(())
    }

    /// A family-specific section of the description, checked ([`Section::check`]).
    pub fn section<T: Section>(&self) -> Result<T> {
        let name = T::NAME;
        let v = self
            .extra
            .get(name)
            .ok_or_else(|| Error::format(format!("bad model description: no '{name}' section")))?;
        let section: T = serde_json::from_value(v.clone())
            .map_err(|e| Error::format(format!("bad model description: '{name}': {e}")))?;
        section.check(self)?;
        Ok(section)
    }

    /// How many layers a forward runs: all, or the first `max_layers`.
    pub fn layers_run(&self) -> usize {
        self.max_layers.map_or(self.num_layers, |n| n.clamp(1, self.num_layers))
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

#[cfg(test)]
pub(crate) mod tests {
    use serde_json::{json, Value};

    use super::*;

    /// The tiny llama fixture's description, as the converter writes it.
    pub(crate) fn llama() -> Value {
        json!({
            "architecture": "llama", "model_type": "llama", "vocab_size": 1000,
            "hidden_size": 64, "intermediate_size": 160, "num_layers": 4, "num_heads": 4,
            "num_kv_heads": 2, "head_dim": 16, "norm_eps": 1e-5,
            "max_position_embeddings": 2048, "tie_word_embeddings": true,
            "rope": {"inv_freq": [1.0, 0.5, 0.25, 0.125, 0.0625, 0.03, 0.01, 0.001]},
            "attention_scale": 0.25,
        })
    }

    /// `model` with `edits` (a JSON object) merged in at the top level.
    pub(crate) fn with(mut model: Value, edits: Value) -> Value {
        for (k, v) in edits.as_object().expect("an object") {
            model[k] = v.clone();
        }
        model
    }

    /// The error `ModelConfig::from_json` gives `model`, which must be a format error.
    pub(crate) fn refusal(model: &Value) -> String {
        match ModelConfig::from_json(model) {
            Err(Error::Format(m)) => m,
            other => panic!("expected a format error, got {other:?}"),
        }
    }

    #[test]
    fn the_fixture_description_is_valid() {
        ModelConfig::from_json(&llama()).unwrap();
    }

    /// Each field out of range gives one message naming it, not a panic in a kernel.
    #[test]
    fn sizes_and_counts_are_refused_by_name() {
        let wrap = 1usize << 62; // * head_dim 16 wraps to 0 in unchecked arithmetic
        for (edit, needle) in [
            (json!({"head_dim": 0}), "head_dim is 0 (must be 1 to"),
            (json!({"num_layers": 0}), "num_layers is 0"),
            (json!({"vocab_size": 0}), "vocab_size is 0"),
            (json!({"hidden_size": 0}), "hidden_size is 0"),
            (json!({"intermediate_size": 0}), "intermediate_size is 0"),
            (json!({"num_kv_heads": 0}), "num_kv_heads is 0"),
            (json!({"num_kv_heads": 3}), "num_heads 4 cannot share 3 kv heads"),
            (json!({"num_heads": wrap, "num_kv_heads": 1}), "num_heads is 4611686018427387904"),
            (
                json!({"num_heads": 1 << 30, "num_kv_heads": 1}),
                "num_heads * head_dim = 1073741824 * 16 is outside 1 to 2147483648",
            ),
            (json!({"hidden_size": MAX_DIM}), "3 * hidden_size = 3 * 2147483648"),
            (json!({"max_position_embeddings": 1usize << 61}), "max_position_embeddings is"),
            (json!({"max_position_embeddings": 0}), "max_position_embeddings is 0"),
            (json!({"rope_layers": [true]}), "rope_layers has 1 entries for 4 layers"),
            (json!({"layer_types": ["full_attention"]}), "layer_types has 1 entries"),
            (
                json!({"layer_types": vec!["sliding_attention"; 4]}),
                "sliding_window must be at least 1",
            ),
        ] {
            let message = refusal(&with(llama(), edit.clone()));
            assert!(message.starts_with("bad model description: "), "{message}");
            assert!(message.contains(needle), "{edit}: {message}");
        }
    }

    /// Epsilons, scales and soft-caps must be finite and positive; frequencies finite.
    #[test]
    fn float_ranges_are_checked() {
        let mut rope_nan = llama();
        rope_nan["rope"]["inv_freq"][3] = json!(f64::MAX); // inf as f32
        let mut factor = llama();
        factor["rope"]["attention_factor"] = json!(-1.0);
        let mut long_rope = llama();
        long_rope["rope"]["inv_freq"] = json!(vec![0.5; 9]);
        let local = with(llama(), json!({"rope_local": {"inv_freq": vec![0.5; 9]}}));
        for (model, needle) in [
            (with(llama(), json!({"norm_eps": -1e-5})), "norm_eps is -0.00001 (must be finite"),
            (with(llama(), json!({"norm_eps": 0.0})), "norm_eps is 0"),
            (with(llama(), json!({"attn_logit_softcap": -30.0})), "attn_logit_softcap is -30"),
            (with(llama(), json!({"final_logit_softcap": 0.0})), "final_logit_softcap is 0"),
            (with(llama(), json!({"attention_scale": -0.25})), "attention_scale is -0.25"),
            (with(llama(), json!({"embedding_multiplier": -2.0})), "embedding_multiplier"),
            (with(llama(), json!({"residual_multiplier": 0.0})), "residual_multiplier is 0"),
            (with(llama(), json!({"logits_scale": f64::MAX})), "logits_scale is inf"),
            (rope_nan, "rope.inv_freq holds inf"),
            (factor, "rope.attention_factor is -1"),
            (long_rope, "rope.inv_freq has 9 frequencies: 18 rotary dims > head_dim 16"),
            (local, "rope_local.inv_freq has 9 frequencies"),
        ] {
            let message = refusal(&model);
            assert!(message.contains(needle), "{needle}: {message}");
        }
    }
}
