//! Qwen3.5 (`qwen3_5_text`): a hybrid of gated DeltaNet linear-attention layers and, every few
//! layers, full attention with an output gate and partial RoPE. Each DeltaNet layer keeps a
//! short-convolution window and a `k_dim x v_dim` state per value head in the session. The
//! `(1 + w)` of its RMSNorms is folded into the weights at conversion (not the gated norm's,
//! which is a plain `w`).

use cellm_format::{Result, Tensor};
use cellm_kernels::gating::Gate;
use cellm_kernels::ops;
use cellm_kv::SeqState;
use serde::Deserialize;

use crate::blocks::{Attention, CausalConv, Embedding, GatedMlp, Linear, RmsNorm, Rope};
use crate::config::{bad_field, check_dim, check_product, check_state, Section};
use crate::decoder::{hybrid_cache_layout, Decoder, DecoderLayer, Mixer, RecurrentBlock, StepCtx};
use crate::delta_rule::{self, HeadInputs};
use crate::weights::Weights;
use crate::{CausalLm, LayerType, ModelConfig, Step};

/// The description's `linear_attention` section.
#[derive(Clone, Deserialize)]
struct DeltaNetConfig {
    conv_taps: usize,
    k_heads: usize,
    v_heads: usize,
    k_dim: usize,
    v_dim: usize,
}

impl Section for DeltaNetConfig {
    const NAME: &'static str = "linear_attention";

    fn check(&self, _model: &ModelConfig) -> Result<()> {
        check_dim("linear_attention.conv_taps", self.conv_taps)?;
        let k_heads = check_dim("linear_attention.k_heads", self.k_heads)?;
        let v_heads = check_dim("linear_attention.v_heads", self.v_heads)?;
        if !v_heads.is_multiple_of(k_heads) {
            return Err(bad_field(
                "linear_attention.v_heads",
                format_args!("{v_heads} cannot share {k_heads} key heads"),
            ));
        }
        check_dim("linear_attention.k_dim", self.k_dim)?;
        check_dim("linear_attention.v_dim", self.v_dim)?;
        let key_dim = check_product("linear_attention.k_heads * k_dim", &[k_heads, self.k_dim])?;
        let value_dim = check_product("linear_attention.v_heads * v_dim", &[v_heads, self.v_dim])?;
        let conv_dim = check_product("linear_attention's conv channels", &[2, key_dim])?
            .checked_add(value_dim)
            .ok_or_else(|| bad_field("linear_attention's conv channels", "overflow"))?;
        check_product("linear_attention's conv channels", &[conv_dim])?;
        check_state("linear_attention.conv_taps", &[self.conv_taps - 1, conv_dim])?;
        check_state(
            "linear_attention.v_heads * k_dim * v_dim",
            &[v_heads, self.k_dim, self.v_dim],
        )?;
        Ok(())
    }
}

struct DeltaNet {
    cfg: DeltaNetConfig,
    in_qkv: Linear,
    in_z: Linear,
    in_b: Linear,
    in_a: Linear,
    conv: CausalConv,
    /// `-exp(A_log)` per value head: the decay rate.
    neg_a: Vec<f32>,
    dt_bias: Vec<f32>,
    norm: Tensor,
    eps: f32,
    out: Linear,
    /// Indices of this layer's conv window and recurrent state in the session state.
    conv_state: usize,
    rec_state: usize,
}

struct Layer {
    input_norm: RmsNorm,
    mixer: Mixer<DeltaNet>,
    post_attn_norm: RmsNorm,
    mlp: GatedMlp,
}

pub fn load(w: &Weights, cfg: ModelConfig) -> Result<Box<dyn CausalLm>> {
    let embed = Embedding::load(w, &cfg)?;
    let (h, eps) = (cfg.hidden_size, cfg.norm_eps);
    let rope = Rope::from(&cfg.rope);
    let mut kv_layers = 0;
    let mut buffers = 0;
    let has_delta_net = cfg.layer_types.contains(&LayerType::LinearAttention);
    let delta_cfg: Option<DeltaNetConfig> = has_delta_net.then(|| cfg.section()).transpose()?;
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for i in 0..cfg.num_layers {
        let p = format!("model.layers.{i}");
        let mixer = match (cfg.layer_type(i), &delta_cfg) {
            (LayerType::LinearAttention, Some(dc)) => {
                let net = DeltaNet::load(w, &format!("{p}.linear_attn"), &cfg, dc, buffers)?;
                buffers += 2;
                Mixer::Recurrent(Box::new(net))
            }
            _ => {
                kv_layers += 1;
                let rope = Some(rope.clone());
                let attn = Attention::load(w, &format!("{p}.self_attn"), &cfg, None, rope)?;
                Mixer::Attention(Box::new(attn), kv_layers - 1)
            }
        };
        layers.push(Layer {
            input_norm: w.norm(&format!("{p}.input_layernorm.weight"), h, eps)?,
            mixer,
            post_attn_norm: w.norm(&format!("{p}.post_attention_layernorm.weight"), h, eps)?,
            mlp: GatedMlp::from_config(w, &format!("{p}.mlp"), &cfg)?,
        });
    }
    let cache = hybrid_cache_layout(&cfg, layers.iter().map(|l: &Layer| &l.mixer));
    Decoder::assemble(w, cfg, embed, layers, "model.norm.weight", cache)
}

impl DeltaNet {
    /// `cfg` was checked ([`Section::check`]), so its products do not overflow.
    fn load(
        w: &Weights,
        p: &str,
        model: &ModelConfig,
        cfg: &DeltaNetConfig,
        first_buffer: usize,
    ) -> Result<Self> {
        let h = model.hidden_size;
        let (key_dim, value_dim) = (cfg.k_heads * cfg.k_dim, cfg.v_heads * cfg.v_dim);
        let conv_dim = 2 * key_dim + value_dim;
        let vector = |n: &str, len| -> Result<Vec<f32>> {
            Ok(w.vector(&format!("{p}.{n}"), len)?.as_f32()?.to_vec())
        };
        Ok(Self {
            in_qkv: w.linear(&format!("{p}.in_proj_qkv"), conv_dim, h, false)?,
            in_z: w.linear(&format!("{p}.in_proj_z"), value_dim, h, false)?,
            in_b: w.linear(&format!("{p}.in_proj_b"), cfg.v_heads, h, false)?,
            in_a: w.linear(&format!("{p}.in_proj_a"), cfg.v_heads, h, false)?,
            conv: CausalConv::load(w, &format!("{p}.conv1d"), conv_dim, cfg.conv_taps, false)?,
            neg_a: vector("A_log", cfg.v_heads)?.iter().map(|a| -a.exp()).collect(),
            dt_bias: vector("dt_bias", cfg.v_heads)?,
            norm: w.vector(&format!("{p}.norm.weight"), cfg.v_dim)?,
            eps: model.norm_eps,
            out: w.linear(&format!("{p}.out_proj"), h, value_dim, false)?,
            conv_state: first_buffer,
            rec_state: first_buffer + 1,
            cfg: cfg.clone(),
        })
    }
}

impl RecurrentBlock for DeltaNet {
    /// The conv window, then the per-head recurrent states.
    fn state_sizes(&self) -> Vec<usize> {
        let c = &self.cfg;
        vec![self.conv.state_len(), c.v_heads * c.k_dim * c.v_dim]
    }

    fn forward(&self, x: &[f32], step: &Step, states: &mut [&mut SeqState]) -> Vec<f32> {
        let c = &self.cfg;
        let tokens = step.tokens.len();
        let (key_dim, value_dim) = (c.k_heads * c.k_dim, c.v_heads * c.v_dim);
        let conv_dim = self.conv.channels;
        let mut qkv = self.in_qkv.forward(x, tokens);
        let (z, b, a) = (
            self.in_z.forward(x, tokens),
            self.in_b.forward(x, tokens),
            self.in_a.forward(x, tokens),
        );
        let mut core = vec![0.0f32; tokens * value_dim];
        for (span, state) in step.spans.iter().zip(states.iter_mut()) {
            let rows = span.row0..span.row0 + span.len;
            let qkv = &mut qkv[rows.start * conv_dim..rows.end * conv_dim];
            self.conv.forward(qkv, state.buffer(self.conv_state));
            Gate::Silu.apply(qkv, None);
            let recurrent = state.buffer(self.rec_state);
            for hv in 0..c.v_heads {
                let hk = hv / (c.v_heads / c.k_heads);
                let head = |base: usize, d: usize| -> Vec<f32> {
                    qkv.chunks_exact(conv_dim)
                        .flat_map(|r| r[base..base + d].iter().copied())
                        .collect()
                };
                let mut q = head(hk * c.k_dim, c.k_dim);
                let mut k = head(key_dim + hk * c.k_dim, c.k_dim);
                let v = head(2 * key_dim + hv * c.v_dim, c.v_dim);
                l2_normalise(&mut q, c.k_dim, 1.0 / (c.k_dim as f32).sqrt());
                l2_normalise(&mut k, c.k_dim, 1.0);
                let g: Vec<f32> = rows
                    .clone()
                    .map(|r| self.neg_a[hv] * softplus(a[r * c.v_heads + hv] + self.dt_bias[hv]))
                    .collect();
                let beta: Vec<f32> =
                    rows.clone().map(|r| 1.0 / (1.0 + (-b[r * c.v_heads + hv]).exp())).collect();
                let mut out = vec![0.0f32; span.len * c.v_dim];
                let inputs = HeadInputs { q: &q, k: &k, v: &v, g: &g, beta: &beta };
                let s = &mut recurrent[hv * c.k_dim * c.v_dim..(hv + 1) * c.k_dim * c.v_dim];
                delta_rule::run(&inputs, c.k_dim, c.v_dim, s, &mut out);
                for (r, o) in rows.clone().zip(out.chunks_exact(c.v_dim)) {
                    core[r * value_dim + hv * c.v_dim..][..c.v_dim].copy_from_slice(o);
                }
            }
        }
        // Gated RMSNorm per value head: rms_norm(o) * w * silu(z).
        let norm = self.norm.as_f32().expect("checked at load");
        ops::rms_norm(&mut core, norm, self.eps);
        let mut gate = z;
        Gate::Silu.apply(&mut gate, None);
        core.iter_mut().zip(&gate).for_each(|(o, g)| *o *= g);
        self.out.forward(&core, tokens)
    }
}

/// Scales each `d`-wide row of `x` to unit L2 norm (eps 1e-6 inside the root, as fla does),
/// times `scale`.
fn l2_normalise(x: &mut [f32], d: usize, scale: f32) {
    for row in x.chunks_exact_mut(d) {
        let inv = scale / (row.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
        row.iter_mut().for_each(|v| *v *= inv);
    }
}

/// torch's softplus (beta 1, linear above 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

impl DecoderLayer for Layer {
    fn mix(&self, x: &[f32], ctx: &mut StepCtx) -> Vec<f32> {
        self.mixer.forward(&self.input_norm.applied(x), ctx)
    }

    fn feed_forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        self.mlp.forward(&self.post_attn_norm.applied(x), rows)
    }
}
