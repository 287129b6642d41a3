//! The llama-like family: llama (llama3 rope scaling), qwen2 (qkv bias), qwen3 (q/k norm,
//! free head_dim), granite (embedding/residual/attention multipliers, logits scaling) and
//! smollm3 (layers without RoPE). Their differences are config data, not code paths.

use cellm_format::Result;

use crate::blocks::{Attention, Embedding, GatedMlp, RmsNorm, Rope};
use crate::decoder::{attention_cache_layout, Decoder, DecoderLayer, StepCtx};
use crate::weights::Weights;
use crate::{CausalLm, ModelConfig};

struct Layer {
    index: usize,
    input_norm: RmsNorm,
    attn: Attention,
    post_attn_norm: RmsNorm,
    mlp: GatedMlp,
}

pub fn load(w: &Weights, cfg: ModelConfig) -> Result<Box<dyn CausalLm>> {
    let embed = Embedding::load(w, &cfg)?;
    let (h, eps) = (cfg.hidden_size, cfg.norm_eps);
    let rope = Rope::from(&cfg.rope);
    let layers = (0..cfg.num_layers)
        .map(|i| {
            let p = format!("model.layers.{i}");
            Ok(Layer {
                index: i,
                input_norm: w.norm(&format!("{p}.input_layernorm.weight"), h, eps)?,
                attn: Attention::load(
                    w,
                    &format!("{p}.self_attn"),
                    &cfg,
                    cfg.window(i),
                    // smollm3's NoPE layers have none.
                    cfg.layer_uses_rope(i).then(|| rope.clone()),
                )?,
                post_attn_norm: w.norm(&format!("{p}.post_attention_layernorm.weight"), h, eps)?,
                mlp: GatedMlp::from_config(w, &format!("{p}.mlp"), &cfg)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let cache = attention_cache_layout(&cfg);
    Decoder::assemble(w, cfg, embed, layers, "model.norm.weight", cache)
}

impl DecoderLayer for Layer {
    fn mix(&self, x: &[f32], ctx: &mut StepCtx) -> Vec<f32> {
        let normed = self.input_norm.applied(x);
        self.attn.forward(self.index, &normed, ctx.step, ctx.positions, ctx.kv)
    }

    fn feed_forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        self.mlp.forward(&self.post_attn_norm.applied(x), rows)
    }
}
