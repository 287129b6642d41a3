//! openai/privacy-filter: a bidirectional token classifier. Pre-norm layers of banded
//! attention (each token sees `sliding_window` positions on either side) with per-head sinks,
//! and a top-k mixture of experts with biased, clamped SwiGLU experts; RMSNorm, then one
//! linear layer to the BIOES label logits.
//!
//! The checkpoint's interleaved RoPE pairs are made half-split by permuting q and k rows at
//! conversion (attention scores do not change), and each layer's experts are stored as two
//! matrices of consecutive per-expert row blocks, `[experts * 2 * inter, hidden]` (gate rows
//! then up rows) and `[experts * hidden, inter]`.

use cellm_format::{Result, Tensor};
use cellm_kernels::{matmul, matmul_raw, ops};
use serde::Deserialize;

use super::attention::{banded_attention, Band};
use super::base::{check_batch, description, positions, Encoder};
use crate::blocks::{gather_rows, row_block, Embedding, Linear, RmsNorm, Rope};
use crate::config::{bad_field, check_at_most, check_dim, check_positive, check_product};
use crate::weights::{Storage, Weights};
use crate::RopeConfig;

#[derive(Debug, Clone, Deserialize)]
struct Config {
    vocab_size: usize,
    hidden_size: usize,
    num_layers: usize,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    norm_eps: f32,
    max_position_embeddings: usize,
    /// Keys a token sees on each side.
    sliding_window: usize,
    attention_bias: bool,
    rope: RopeConfig,
    experts: usize,
    experts_per_token: usize,
    expert_intermediate_size: usize,
    swiglu_limit: f32,
    swiglu_alpha: f32,
    labels: Vec<String>,
}

impl Config {
    fn check(&self) -> Result<()> {
        check_dim("vocab_size", self.vocab_size)?;
        check_dim("hidden_size", self.hidden_size)?;
        check_dim("num_layers", self.num_layers)?;
        check_dim("num_kv_heads", self.num_kv_heads)?;
        check_dim("max_position_embeddings", self.max_position_embeddings)?;
        check_dim("sliding_window", self.sliding_window)?;
        let heads = check_dim("num_heads", self.num_heads)?;
        if !heads.is_multiple_of(self.num_kv_heads) {
            return Err(bad_field(
                "num_kv_heads",
                format_args!("{} cannot share {heads} heads", self.num_kv_heads),
            ));
        }
        check_product("num_heads * head_dim", &[heads, self.head_dim])?;
        check_positive("norm_eps", self.norm_eps)?;
        check_positive("swiglu_alpha", self.swiglu_alpha)?;
        check_positive("swiglu_limit", self.swiglu_limit)?;
        self.rope.check("rope", self.head_dim, "head_dim")?;
        let experts = check_dim("experts", self.experts)?;
        check_dim("experts_per_token", self.experts_per_token)?;
        check_at_most("experts_per_token", self.experts_per_token, "experts", experts)?;
        check_product(
            "experts * 2 * expert_intermediate_size",
            &[experts, 2, self.expert_intermediate_size],
        )?;
        check_product("experts * hidden_size", &[experts, self.hidden_size])?;
        check_dim("labels", self.labels.len())?;
        Ok(())
    }
}

struct Experts {
    router: Tensor,
    router_bias: Tensor,
    /// Expert e's rows `e * 2I ..`: I gate rows, then I up rows.
    gate_up: Tensor,
    gate_up_bias: Tensor,
    down: Tensor,
    down_bias: Tensor,
}

struct Layer {
    input_norm: RmsNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    sinks: Vec<f32>,
    post_norm: RmsNorm,
    experts: Experts,
}

pub struct PrivacyFilter {
    cfg: Config,
    embed: Embedding,
    rope: Rope,
    layers: Vec<Layer>,
    norm: RmsNorm,
    score: Linear,
}

pub fn load(w: &Weights, model: &serde_json::Value) -> Result<Box<dyn Encoder>> {
    let cfg: Config = description(model)?;
    cfg.check()?;
    let (h, hd, eps) = (cfg.hidden_size, cfg.head_dim, cfg.norm_eps);
    let embed = Embedding { table: w.tensor("model.embed_tokens.weight", &[cfg.vocab_size, h])? };
    let (e, inter) = (cfg.experts, cfg.expert_intermediate_size);
    let layers = (0..cfg.num_layers)
        .map(|i| {
            let p = format!("model.layers.{i}");
            let a = format!("{p}.self_attn");
            let m = format!("{p}.mlp");
            let bias = cfg.attention_bias;
            let (q_out, kv_out) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
            Ok(Layer {
                input_norm: w.norm(&format!("{p}.input_layernorm.weight"), h, eps)?,
                q: w.linear(&format!("{a}.q_proj"), q_out, h, bias)?,
                k: w.linear(&format!("{a}.k_proj"), kv_out, h, bias)?,
                v: w.linear(&format!("{a}.v_proj"), kv_out, h, bias)?,
                o: w.linear(&format!("{a}.o_proj"), h, q_out, bias)?,
                sinks: w.vector(&format!("{a}.sinks"), cfg.num_heads)?.as_f32()?.to_vec(),
                post_norm: w.norm(&format!("{p}.post_attention_layernorm.weight"), h, eps)?,
                experts: Experts {
                    router: w.get(&format!("{m}.router.weight"), &[e, h], Storage::F32)?,
                    router_bias: w.vector(&format!("{m}.router.bias"), e)?,
                    gate_up: w.get(
                        &format!("{m}.experts.gate_up_proj"),
                        &[e * 2 * inter, h],
                        Storage::RowSlices,
                    )?,
                    gate_up_bias: w.get(
                        &format!("{m}.experts.gate_up_proj_bias"),
                        &[e, 2 * inter],
                        Storage::F32,
                    )?,
                    down: w.get(
                        &format!("{m}.experts.down_proj"),
                        &[e * h, inter],
                        Storage::RowSlices,
                    )?,
                    down_bias: w.get(
                        &format!("{m}.experts.down_proj_bias"),
                        &[e, h],
                        Storage::F32,
                    )?,
                },
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let norm = w.norm("model.norm.weight", h, eps)?;
    let score = w.linear("score", cfg.labels.len(), h, true)?;
    let rope = Rope::from(&cfg.rope);
    Ok(Box::new(PrivacyFilter { cfg, embed, rope, layers, norm, score }))
}

impl Encoder for PrivacyFilter {
    fn width(&self) -> usize {
        self.cfg.labels.len()
    }

    fn vocab_size(&self) -> usize {
        self.cfg.vocab_size
    }

    fn max_tokens(&self) -> usize {
        self.cfg.max_position_embeddings
    }

    fn forward(&self, seqs: &[&[u32]]) -> Result<Vec<f32>> {
        let lens = check_batch(seqs, self.max_tokens())?;
        let tokens: Vec<u32> = seqs.concat();
        let rows = tokens.len();
        let mut x = self.embed.lookup(&tokens, 1.0)?;
        let pos = positions(&lens);
        let c = &self.cfg;
        // HF scales q and k by head_dim^-1/4 each.
        let s = (c.head_dim as f32).powf(-0.25);
        for layer in &self.layers {
            let hn = layer.input_norm.applied(&x);
            let [mut q, mut k, v] = Linear::forward_many([&layer.q, &layer.k, &layer.v], &hn, rows);
            self.rope.apply(&mut q, &pos, c.head_dim);
            self.rope.apply(&mut k, &pos, c.head_dim);
            let band = Band {
                heads: c.num_heads,
                kv_heads: c.num_kv_heads,
                head_dim: c.head_dim,
                scale: s * s,
                band: Some(c.sliding_window),
                sinks: Some(&layer.sinks),
            };
            let ctx = banded_attention(&q, &k, &v, &lens, &band);
            ops::add_scaled(&mut x, &layer.o.forward(&ctx, rows), 1.0);
            let hn = layer.post_norm.applied(&x);
            ops::add_scaled(&mut x, &self.moe(&layer.experts, &hn, rows)?, 1.0);
        }
        self.norm.apply(&mut x);
        Ok(self.score.forward(&x, rows))
    }
}

impl PrivacyFilter {
    /// `rows x hidden` in and out: each row through its top-k experts, weighted by the
    /// softmax of their router logits.
    fn moe(&self, m: &Experts, x: &[f32], rows: usize) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let (e, h, inter) = (c.experts, c.hidden_size, c.expert_intermediate_size);
        let mut logits = vec![0.0; rows * e];
        matmul(x, rows, &m.router, &mut logits);
        ops::add_bias(&mut logits, m.router_bias.as_f32()?);
        let mut routed: Vec<(Vec<usize>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); e];
        for (r, row) in logits.chunks_exact(e).enumerate() {
            for (expert, weight) in top_k_softmax(row, c.experts_per_token) {
                routed[expert].0.push(r);
                routed[expert].1.push(weight);
            }
        }
        let (gu_bias, down_bias) = (m.gate_up_bias.as_f32()?, m.down_bias.as_f32()?);
        let mut out = vec![0.0; rows * h];
        for (expert, (ids, weights)) in routed.iter().enumerate() {
            if ids.is_empty() {
                continue;
            }
            let n = ids.len();
            let mut gu = vec![0.0; n * 2 * inter];
            matmul_raw(
                &gather_rows(x, h, ids),
                n,
                row_block(&m.gate_up, expert, 2 * inter),
                &mut gu,
            );
            ops::add_bias(&mut gu, &gu_bias[expert * 2 * inter..(expert + 1) * 2 * inter]);
            let act: Vec<f32> = gu.chunks_exact(2 * inter).flat_map(|r| self.swiglu(r)).collect();
            let mut y = vec![0.0; n * h];
            matmul_raw(&act, n, row_block(&m.down, expert, h), &mut y);
            ops::add_bias(&mut y, &down_bias[expert * h..(expert + 1) * h]);
            for ((&r, &wgt), yr) in ids.iter().zip(weights).zip(y.chunks_exact(h)) {
                ops::add_scaled(&mut out[r * h..(r + 1) * h], yr, wgt);
            }
        }
        Ok(out)
    }

    /// `(clamp(up, -L, L) + 1) * g * sigmoid(alpha * g)` with `g = min(gate, L)`, of one row
    /// of `[gate | up]`.
    fn swiglu<'a>(&self, row: &'a [f32]) -> impl Iterator<Item = f32> + 'a {
        let (limit, alpha) = (self.cfg.swiglu_limit, self.cfg.swiglu_alpha);
        let (gate, up) = row.split_at(row.len() / 2);
        gate.iter().zip(up).map(move |(&g, &u)| {
            let g = g.min(limit);
            let u = u.clamp(-limit, limit);
            (u + 1.0) * g / (1.0 + (-alpha * g).exp())
        })
    }
}

/// The `k` largest logits' indices (ties: the lower index first) and the softmax of their
/// values.
fn top_k_softmax(logits: &[f32], k: usize) -> Vec<(usize, f32)> {
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    idx.truncate(k);
    let max = logits[idx[0]];
    let exps: Vec<f32> = idx.iter().map(|&i| (logits[i] - max).exp()).collect();
    let total: f32 = exps.iter().sum();
    idx.into_iter().zip(exps.into_iter().map(|x| x / total)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_weights_are_a_softmax_over_the_chosen() {
        let got = top_k_softmax(&[0.0, 2.0, 1.0, 2.0], 2);
        assert_eq!(got.iter().map(|p| p.0).collect::<Vec<_>>(), [1, 3]);
        assert!((got[0].1 - 0.5).abs() < 1e-7 && (got[1].1 - 0.5).abs() < 1e-7);
    }
}
