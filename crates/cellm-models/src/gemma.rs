//! Gemma 3 (`gemma3_text`): llama-style attention with q/k norm, interleaved sliding and full
//! layers with their own RoPE, "sandwich" norms around both the attention and the MLP, a
//! gelu-tanh MLP, a sqrt(hidden) embedding scale and optional soft-capping. The `(1 + w)` of
//! its RMSNorm is folded into the weights at conversion.

use cellm_format::{CellmFile, Result};
use cellm_kernels::ops;
use cellm_kv::{PagePool, SeqState};

use crate::blocks::{gather_rows, Attention, Embedding, GatedMlp, LmHead, RmsNorm, Rope, Weights};
use crate::{CacheLayout, CausalLm, LayerType, ModelConfig, Step};

struct Layer {
    input_norm: RmsNorm,
    attn: Attention,
    post_attn_norm: RmsNorm,
    pre_mlp_norm: RmsNorm,
    mlp: GatedMlp,
    post_mlp_norm: RmsNorm,
    sliding: bool,
}

pub struct Gemma {
    cfg: ModelConfig,
    embed: Embedding,
    layers: Vec<Layer>,
    head: LmHead,
    rope_full: Rope,
    rope_local: Rope,
}

pub fn load(file: &CellmFile, cfg: ModelConfig) -> Result<Box<dyn CausalLm>> {
    let w = Weights { file };
    let (h, eps) = (cfg.hidden_size, cfg.norm_eps);
    let layers = (0..cfg.num_layers)
        .map(|i| {
            let p = format!("model.layers.{i}");
            let norm = |n: &str| w.norm(&format!("{p}.{n}.weight"), h, eps);
            Ok(Layer {
                input_norm: norm("input_layernorm")?,
                attn: Attention::load(&w, &format!("{p}.self_attn"), &cfg, cfg.window(i))?,
                post_attn_norm: norm("post_attention_layernorm")?,
                pre_mlp_norm: norm("pre_feedforward_layernorm")?,
                mlp: GatedMlp::load(
                    &w,
                    &format!("{p}.mlp"),
                    h,
                    cfg.intermediate_size,
                    cfg.mlp_bias,
                    cfg.hidden_act,
                )?,
                post_mlp_norm: norm("post_feedforward_layernorm")?,
                sliding: cfg.layer_type(i) == LayerType::SlidingAttention,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let embed = Embedding { table: w.tensor("model.embed_tokens.weight", &[cfg.vocab_size, h])? };
    Ok(Box::new(Gemma {
        head: LmHead::load(&w, "model.norm.weight", &cfg, &embed)?,
        rope_full: Rope::from(&cfg.rope),
        rope_local: Rope::from(cfg.rope_local.as_ref().unwrap_or(&cfg.rope)),
        embed,
        layers,
        cfg,
    }))
}

impl CausalLm for Gemma {
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
            let rope = if layer.sliding { &self.rope_local } else { &self.rope_full };
            let normed = layer.input_norm.applied(&x);
            let mut attn = layer.attn.forward(i, &normed, step, &positions, Some(rope), kv);
            layer.post_attn_norm.apply(&mut attn);
            ops::add_scaled(&mut x, &attn, 1.0);
            if i + 1 == self.layers.len() {
                x = gather_rows(&x, c.hidden_size, step.logit_rows);
                rows = step.logit_rows.len();
            }
            let mut mlp = layer.mlp.forward(&layer.pre_mlp_norm.applied(&x), rows);
            layer.post_mlp_norm.apply(&mut mlp);
            ops::add_scaled(&mut x, &mlp, 1.0);
        }
        self.head.forward(&mut x, rows)
    }
}
