//! The llama-like family: llama (llama3 rope scaling), qwen2 (qkv bias), qwen3 (q/k norm,
//! free head_dim), granite (embedding/residual/attention multipliers, logits scaling) and
//! smollm3 (layers without RoPE). Their differences are config data, not code paths.

use cellm_format::{CellmFile, Result};
use cellm_kernels::{matmul, ops};
use cellm_kv::{AttentionShape, PagePool};

use crate::blocks::{gather_rows, Attention, Embedding, GatedMlp, Linear, RmsNorm, Rope, Weights};
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
    norm: RmsNorm,
    lm_head: Option<Linear>,
    rope: Rope,
}

pub fn load(file: &CellmFile, cfg: ModelConfig) -> Result<Box<dyn CausalLm>> {
    let w = Weights { file };
    let (h, hd, eps) = (cfg.hidden_size, cfg.head_dim, cfg.norm_eps);
    let shape = AttentionShape {
        n_heads: cfg.num_heads,
        n_kv_heads: cfg.num_kv_heads,
        head_dim: hd,
        scale: cfg.attention_scale(),
        window: None,
        softcap: None,
    };
    let layers = (0..cfg.num_layers)
        .map(|i| {
            let p = format!("model.layers.{i}");
            let a = format!("{p}.self_attn");
            let qk_norm = |n: &str| {
                cfg.qk_norm.then(|| w.norm(&format!("{a}.{n}.weight"), hd, eps)).transpose()
            };
            Ok(Layer {
                input_norm: w.norm(&format!("{p}.input_layernorm.weight"), h, eps)?,
                attn: Attention {
                    q: w.linear(&format!("{a}.q_proj"), cfg.num_heads * hd, h, cfg.attention_bias)?,
                    k: w.linear(
                        &format!("{a}.k_proj"),
                        cfg.num_kv_heads * hd,
                        h,
                        cfg.attention_bias,
                    )?,
                    v: w.linear(
                        &format!("{a}.v_proj"),
                        cfg.num_kv_heads * hd,
                        h,
                        cfg.attention_bias,
                    )?,
                    o: w.linear(
                        &format!("{a}.o_proj"),
                        h,
                        cfg.num_heads * hd,
                        cfg.attention_out_bias,
                    )?,
                    q_norm: qk_norm("q_norm")?,
                    k_norm: qk_norm("k_norm")?,
                    shape: shape.clone(),
                },
                post_attn_norm: w.norm(&format!("{p}.post_attention_layernorm.weight"), h, eps)?,
                mlp: GatedMlp::load(
                    &w,
                    &format!("{p}.mlp"),
                    h,
                    cfg.intermediate_size,
                    cfg.mlp_bias,
                )?,
                rope: cfg.layer_uses_rope(i),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let embed = Embedding { table: w.tensor("model.embed_tokens.weight", &[cfg.vocab_size, h])? };
    let lm_head = if cfg.tie_word_embeddings {
        None
    } else {
        Some(w.linear("lm_head", cfg.vocab_size, h, false)?)
    };
    Ok(Box::new(Llama {
        norm: w.norm("model.norm.weight", h, eps)?,
        rope: Rope {
            inv_freq: cfg.rope.inv_freq.clone(),
            attention_factor: cfg.rope.attention_factor,
        },
        embed,
        layers,
        lm_head,
        cfg,
    }))
}

impl CausalLm for Llama {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn cache_layout(&self) -> CacheLayout {
        CacheLayout {
            num_layers: self.cfg.num_layers,
            kv_heads: self.cfg.num_kv_heads,
            head_dim: self.cfg.head_dim,
        }
    }

    fn forward(&self, step: &Step, kv: &mut PagePool) -> Vec<f32> {
        let c = &self.cfg;
        let h = c.hidden_size;
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
                x = gather_rows(&x, h, step.logit_rows);
                rows = step.logit_rows.len();
            }
            let mlp = layer.mlp.forward(&layer.post_attn_norm.applied(&x), rows);
            ops::add_scaled(&mut x, &mlp, c.residual_multiplier);
        }
        self.norm.apply(&mut x);
        let mut logits = vec![0.0; rows * c.vocab_size];
        match &self.lm_head {
            Some(head) => matmul(&x, rows, &head.weight, &mut logits),
            None => matmul(&x, rows, &self.embed.table, &mut logits),
        }
        ops::scale(&mut logits, c.logits_scale);
        logits
    }
}
