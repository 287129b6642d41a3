//! Gemma 3 (`gemma3_text`): llama-style attention with q/k norm, interleaved sliding and full
//! layers with their own RoPE, "sandwich" norms around both the attention and the MLP, a
//! gelu-tanh MLP, a sqrt(hidden) embedding scale and optional soft-capping. The `(1 + w)` of
//! its RMSNorm is folded into the weights at conversion.

use cellm_format::Result;

use crate::blocks::{Attention, Embedding, GatedMlp, RmsNorm, Rope};
use crate::decoder::{attention_cache_layout, Decoder, DecoderLayer, StepCtx};
use crate::weights::Weights;
use crate::{CausalLm, LayerType, ModelConfig};

struct Layer {
    index: usize,
    input_norm: RmsNorm,
    attn: Attention,
    post_attn_norm: RmsNorm,
    pre_mlp_norm: RmsNorm,
    mlp: GatedMlp,
    post_mlp_norm: RmsNorm,
}

pub fn load(w: &Weights, cfg: ModelConfig) -> Result<Box<dyn CausalLm>> {
    let embed = Embedding::load(w, &cfg)?;
    let (h, eps) = (cfg.hidden_size, cfg.norm_eps);
    let rope_full = Rope::from(&cfg.rope);
    let rope_local = Rope::from(cfg.rope_local.as_ref().unwrap_or(&cfg.rope));
    let layers = (0..cfg.num_layers)
        .map(|i| {
            let p = format!("model.layers.{i}");
            let norm = |n: &str| w.norm(&format!("{p}.{n}.weight"), h, eps);
            // Sliding layers use the local RoPE, full layers the global one.
            let sliding = cfg.layer_type(i) == LayerType::SlidingAttention;
            let rope = if sliding { rope_local.clone() } else { rope_full.clone() };
            Ok(Layer {
                index: i,
                input_norm: norm("input_layernorm")?,
                attn: Attention::load(
                    w,
                    &format!("{p}.self_attn"),
                    &cfg,
                    cfg.window(i),
                    Some(rope),
                )?,
                post_attn_norm: norm("post_attention_layernorm")?,
                pre_mlp_norm: norm("pre_feedforward_layernorm")?,
                mlp: GatedMlp::from_config(w, &format!("{p}.mlp"), &cfg)?,
                post_mlp_norm: norm("post_feedforward_layernorm")?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let cache = attention_cache_layout(&cfg);
    Decoder::assemble(w, cfg, embed, layers, "model.norm.weight", cache)
}

impl DecoderLayer for Layer {
    fn mix(&self, x: &[f32], ctx: &mut StepCtx) -> Vec<f32> {
        let normed = self.input_norm.applied(x);
        let mut out = self.attn.forward(self.index, &normed, ctx.step, ctx.positions, ctx.kv);
        self.post_attn_norm.apply(&mut out);
        out
    }

    fn feed_forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let mut out = self.mlp.forward(&self.pre_mlp_norm.applied(x), rows);
        self.post_mlp_norm.apply(&mut out);
        out
    }
}
