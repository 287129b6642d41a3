//! DeepSeek-V3-style models: multi-head latent attention (MLA) and mixture-of-experts MLPs
//! after the first dense layers.
//!
//! MLA runs "absorbed": the cache holds, per token, the normalised KV latent `c` and the
//! shared rotated key part `k_rot`, one row of `rank + rope` values. Each head's query is
//! mapped into latent space (`q_lat = W_UK^T q_nope`), so its score against a token is
//! `[q_lat | q_rot] . [c | k_rot]`; the weighted sum of latents is mapped back per head by
//! `W_UV`. The converter splits HF's `kv_b_proj` into `k_absorb` (per head `W_UK^T`) and
//! `v_up` (per head `W_UV`), and stores interleaved rope dims in the half-split layout.

use cellm_format::{Result, Tensor};
use cellm_kernels::matmul_raw;
use cellm_kv::AttentionShape;
use serde::Deserialize;

use crate::blocks::{row_block, Embedding, GatedMlp, Linear, RmsNorm, Rope};
use crate::config::{check_dim, check_product, Section};
use crate::decoder::{Decoder, DecoderLayer, StepCtx};
use crate::moe::{Moe, MoeConfig};
use crate::weights::{Storage, Weights};
use crate::{CacheLayout, CausalLm, ModelConfig};

/// The description's `mla` section.
#[derive(Debug, Clone, Deserialize)]
struct MlaConfig {
    q_lora_rank: Option<usize>,
    kv_lora_rank: usize,
    nope_dim: usize,
    rope_dim: usize,
    v_dim: usize,
}

impl Section for MlaConfig {
    const NAME: &'static str = "mla";

    fn check(&self, model: &ModelConfig) -> Result<()> {
        if let Some(rank) = self.q_lora_rank {
            check_dim("mla.q_lora_rank", rank)?;
        }
        let rank = check_dim("mla.kv_lora_rank", self.kv_lora_rank)?;
        let nope = check_dim("mla.nope_dim", self.nope_dim)?;
        let rope = check_dim("mla.rope_dim", self.rope_dim)?;
        let v_dim = check_dim("mla.v_dim", self.v_dim)?;
        let heads = model.num_heads;
        let qk = check_product("mla.nope_dim + rope_dim", &[nope + rope])?;
        check_product("num_heads * (mla.nope_dim + rope_dim)", &[heads, qk])?;
        check_product("num_heads * mla.kv_lora_rank", &[heads, rank])?;
        check_product("num_heads * mla.v_dim", &[heads, v_dim])?;
        let row = check_product("mla.kv_lora_rank + rope_dim", &[rank + rope])?;
        check_product("num_heads * (mla.kv_lora_rank + rope_dim)", &[heads, row])?;
        // RoPE turns the rope_dim-wide part of each query head and the shared key.
        model.rope.check("rope", rope, "mla.rope_dim")
    }
}

/// `q_b(norm(q_a(x)))`.
struct LowRankQuery {
    down: Linear,
    norm: RmsNorm,
    up: Linear,
}

enum QueryProj {
    Direct(Linear),
    LowRank(Box<LowRankQuery>),
}

struct Mla {
    q: QueryProj,
    kv_down: Linear,
    kv_norm: RmsNorm,
    k_absorb: Tensor,
    v_up: Tensor,
    o: Linear,
    shape: AttentionShape,
    dims: MlaConfig,
    rope: Rope,
    kv_layer: usize,
}

enum Mlp {
    Dense(Box<GatedMlp>),
    Experts(Box<Moe>),
}

struct Layer {
    input_norm: RmsNorm,
    attn: Mla,
    post_attn_norm: RmsNorm,
    mlp: Mlp,
}

pub fn load(w: &Weights, cfg: ModelConfig) -> Result<Box<dyn CausalLm>> {
    let embed = Embedding::load(w, &cfg)?;
    let mla: MlaConfig = cfg.section()?;
    let moe: MoeConfig = cfg.section()?;
    let (h, eps) = (cfg.hidden_size, cfg.norm_eps);
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for i in 0..cfg.num_layers {
        let p = format!("model.layers.{i}");
        let mlp = if i < moe.first_moe_layer {
            let inter = cfg.intermediate_size;
            Mlp::Dense(Box::new(GatedMlp::load(
                w,
                &format!("{p}.mlp"),
                h,
                inter,
                false,
                cfg.hidden_act,
            )?))
        } else {
            Mlp::Experts(Box::new(Moe::load(w, &format!("{p}.mlp"), &moe, h, cfg.hidden_act)?))
        };
        layers.push(Layer {
            input_norm: w.norm(&format!("{p}.input_layernorm.weight"), h, eps)?,
            attn: Mla::load(w, &format!("{p}.self_attn"), &cfg, &mla, i)?,
            post_attn_norm: w.norm(&format!("{p}.post_attention_layernorm.weight"), h, eps)?,
            mlp,
        });
    }
    let cache = CacheLayout {
        kv_layers: cfg.num_layers,
        kv_heads: 1,
        head_dim: mla.kv_lora_rank + mla.rope_dim,
        windows: Vec::new(),
        state: Vec::new(),
        values_in_keys: true,
        state_fixed: false,
    };
    Decoder::assemble(w, cfg, embed, layers, "model.norm.weight", cache)
}

impl Mla {
    fn load(
        w: &Weights,
        p: &str,
        cfg: &ModelConfig,
        m: &MlaConfig,
        kv_layer: usize,
    ) -> Result<Self> {
        let (h, eps, heads) = (cfg.hidden_size, cfg.norm_eps, cfg.num_heads);
        let qk = m.nope_dim + m.rope_dim;
        let q = match m.q_lora_rank {
            None => QueryProj::Direct(w.linear(&format!("{p}.q_proj"), heads * qk, h, false)?),
            Some(rank) => QueryProj::LowRank(Box::new(LowRankQuery {
                down: w.linear(&format!("{p}.q_a_proj"), rank, h, cfg.attention_bias)?,
                norm: w.norm(&format!("{p}.q_a_layernorm.weight"), rank, eps)?,
                up: w.linear(&format!("{p}.q_b_proj"), heads * qk, rank, false)?,
            })),
        };
        let rank = m.kv_lora_rank;
        Ok(Self {
            q,
            kv_down: w.linear(
                &format!("{p}.kv_a_proj_with_mqa"),
                rank + m.rope_dim,
                h,
                cfg.attention_bias,
            )?,
            kv_norm: w.norm(&format!("{p}.kv_a_layernorm.weight"), rank, eps)?,
            k_absorb: w.get(
                &format!("{p}.kv_b_proj.k_absorb.weight"),
                &[heads * rank, m.nope_dim],
                Storage::RowSlices,
            )?,
            v_up: w.get(
                &format!("{p}.kv_b_proj.v_up.weight"),
                &[heads * m.v_dim, rank],
                Storage::RowSlices,
            )?,
            o: w.linear(&format!("{p}.o_proj"), h, heads * m.v_dim, cfg.attention_bias)?,
            shape: AttentionShape {
                n_heads: heads,
                n_kv_heads: 1,
                head_dim: rank + m.rope_dim,
                scale: cfg.attention_scale(),
                window: None,
                softcap: None,
            },
            dims: m.clone(),
            rope: Rope::from(&cfg.rope),
            kv_layer,
        })
    }

    fn forward(&self, x: &[f32], ctx: &mut StepCtx) -> Vec<f32> {
        let (step, positions, m, rope) = (ctx.step, ctx.positions, &self.dims, &self.rope);
        let tokens = step.tokens.len();
        let heads = self.shape.n_heads;
        let (rank, nope, rd) = (m.kv_lora_rank, m.nope_dim, m.rope_dim);
        let q = match &self.q {
            QueryProj::Direct(proj) => proj.forward(x, tokens),
            QueryProj::LowRank(q) => {
                let mut lat = q.down.forward(x, tokens);
                q.norm.apply(&mut lat);
                q.up.forward(&lat, tokens)
            }
        };
        // Keys: [c | k_rot] per token, the row the cache stores.
        let latent = self.kv_down.forward(x, tokens);
        let mut keys = vec![0.0f32; tokens * (rank + rd)];
        let mut k_rot = vec![0.0f32; tokens * rd];
        for (t, row) in latent.chunks_exact(rank + rd).enumerate() {
            keys[t * (rank + rd)..][..rank].copy_from_slice(&row[..rank]);
            k_rot[t * rd..(t + 1) * rd].copy_from_slice(&row[rank..]);
        }
        rope.apply(&mut k_rot, positions, rd);
        // Queries: per head [W_UK^T q_nope | rope(q_rot)].
        let mut q_nope = vec![0.0f32; tokens * nope];
        let mut q_rot = vec![0.0f32; tokens * heads * rd];
        let mut queries = vec![0.0f32; tokens * heads * (rank + rd)];
        for (t, row) in q.chunks_exact(heads * (nope + rd)).enumerate() {
            for (hh, head) in row.chunks_exact(nope + rd).enumerate() {
                q_rot[(t * heads + hh) * rd..][..rd].copy_from_slice(&head[nope..]);
            }
        }
        rope.apply(&mut q_rot, positions, rd);
        let mut q_lat = vec![0.0f32; tokens * rank];
        for hh in 0..heads {
            for (t, row) in q.chunks_exact(heads * (nope + rd)).enumerate() {
                q_nope[t * nope..(t + 1) * nope].copy_from_slice(&row[hh * (nope + rd)..][..nope]);
            }
            matmul_raw(&q_nope, tokens, row_block(&self.k_absorb, hh, rank), &mut q_lat);
            for t in 0..tokens {
                let dst = &mut queries[(t * heads + hh) * (rank + rd)..][..rank + rd];
                dst[..rank].copy_from_slice(&q_lat[t * rank..(t + 1) * rank]);
                dst[rank..].copy_from_slice(&q_rot[(t * heads + hh) * rd..][..rd]);
            }
        }
        for (t, row) in keys.chunks_exact_mut(rank + rd).enumerate() {
            self.kv_norm.apply(&mut row[..rank]);
            row[rank..].copy_from_slice(&k_rot[t * rd..(t + 1) * rd]);
        }
        // Per head, the attention-weighted sum of [c | k_rot] rows.
        let mut attended = vec![0.0f32; queries.len()];
        let shape = &self.shape;
        cellm_kv::AttentionCall {
            layer: self.kv_layer,
            spans: step.spans,
            q: &queries,
            k: &keys,
            v: &[],
            shape,
        }
        .run(ctx.kv, &mut attended);
        // Back from latent space, per head: o_h = W_UV_h ctx_h[..rank].
        let v_dim = m.v_dim;
        let mut heads_out = vec![0.0f32; tokens * heads * v_dim];
        let mut ctx_h = vec![0.0f32; tokens * rank];
        let mut o_h = vec![0.0f32; tokens * v_dim];
        for hh in 0..heads {
            for t in 0..tokens {
                ctx_h[t * rank..(t + 1) * rank]
                    .copy_from_slice(&attended[(t * heads + hh) * (rank + rd)..][..rank]);
            }
            matmul_raw(&ctx_h, tokens, row_block(&self.v_up, hh, v_dim), &mut o_h);
            for t in 0..tokens {
                heads_out[(t * heads + hh) * v_dim..][..v_dim]
                    .copy_from_slice(&o_h[t * v_dim..(t + 1) * v_dim]);
            }
        }
        self.o.forward(&heads_out, tokens)
    }
}

/// Rows `head * n .. (head + 1) * n` of a stored matrix.
impl DecoderLayer for Layer {
    fn mix(&self, x: &[f32], ctx: &mut StepCtx) -> Vec<f32> {
        self.attn.forward(&self.input_norm.applied(x), ctx)
    }

    fn feed_forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let normed = self.post_attn_norm.applied(x);
        match &self.mlp {
            Mlp::Dense(mlp) => mlp.forward(&normed, rows),
            Mlp::Experts(moe) => moe.forward(&normed, rows),
        }
    }
}
