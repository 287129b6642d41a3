//! The llama-like family: llama (llama3 rope scaling), qwen2 (qkv bias), qwen3 (q/k norm,
//! free head_dim), granite (embedding/residual/attention multipliers, logits scaling) and
//! smollm3 (layers without RoPE). Their differences are config data, not code paths.

use cellm_format::{CellmFile, Result};
use cellm_kernels::ops;
use cellm_kv::{PagePool, SeqState};

use crate::blocks::{gather_rows, Attention, Embedding, GatedMlp, LmHead, RmsNorm, Rope, Weights};
use crate::{CacheLayout, CausalLm, ModelConfig, Step};

struct Layer {
    input_norm: RmsNorm,
    attn: Attention,
    post_attn_norm: RmsNorm,
    mlp: GatedMlp,
    rope: bool,
}

pub struct Llama {
    cfg: ModelConfig,
    embed: Embedding,
    layers: Vec<Layer>,
    head: LmHead,
    rope: Rope,
}

pub fn load(file: &CellmFile, cfg: ModelConfig) -> Result<Box<dyn CausalLm>> {
    let w = Weights { file };
    let (h, eps) = (cfg.hidden_size, cfg.norm_eps);
    let layers = (0..cfg.num_layers)
        .map(|i| {
            let p = format!("model.layers.{i}");
            Ok(Layer {
                input_norm: w.norm(&format!("{p}.input_layernorm.weight"), h, eps)?,
                attn: Attention::load(&w, &format!("{p}.self_attn"), &cfg, cfg.window(i))?,
                post_attn_norm: w.norm(&format!("{p}.post_attention_layernorm.weight"), h, eps)?,
                mlp: GatedMlp::load(
                    &w,
                    &format!("{p}.mlp"),
                    h,
                    cfg.intermediate_size,
                    cfg.mlp_bias,
                    cfg.hidden_act,
                )?,
                rope: cfg.layer_uses_rope(i),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let embed = Embedding { table: w.tensor("model.embed_tokens.weight", &[cfg.vocab_size, h])? };
    Ok(Box::new(Llama {
        head: LmHead::load(&w, "model.norm.weight", &cfg, &embed)?,
        rope: Rope::from(&cfg.rope),
        embed,
        layers,
        cfg,
    }))
}

impl CausalLm for Llama {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn cache_layout(&self) -> CacheLayout {
        let c = &self.cfg;
        CacheLayout {
            kv_layers: c.num_layers,
            kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            windows: (0..c.num_layers).map(|i| c.window(i)).collect(),
            state: Vec::new(),
            values_in_keys: false,
        }
    }

    fn forward(&self, step: &Step, kv: &mut PagePool, _: &mut [&mut SeqState]) -> Vec<f32> {
        let c = &self.cfg;
        let positions = step.positions();
        let mut x = self
            .embed
            .lookup(step.tokens, c.embedding_multiplier)
            .expect("ids checked by the engine");
        let mut rows = step.tokens.len();
        for (i, layer) in self.layers.iter().enumerate() {
            let normed = layer.input_norm.applied(&x);
            let rope = layer.rope.then_some(&self.rope);
            let attn = layer.attn.forward(i, &normed, step, &positions, rope, kv);
            ops::add_scaled(&mut x, &attn, c.residual_multiplier);
            if i + 1 == self.layers.len() {
                // Only the rows whose logits are wanted go through the last MLP and the head.
                x = gather_rows(&x, c.hidden_size, step.logit_rows);
                rows = step.logit_rows.len();
            }
            let mlp = layer.mlp.forward(&layer.post_attn_norm.applied(&x), rows);
            ops::add_scaled(&mut x, &mlp, c.residual_multiplier);
        }
        self.head.forward(&mut x, rows)
    }
}
