//! Granite 4.0 (`granitemoehybrid`): Mamba-2 layers and attention layers (with RoPE or
//! without positions), each followed by a "shared" SwiGLU MLP whose gate and up projections
//! are one matrix; Granite's embedding, residual, attention and logit multipliers. A Mamba-2
//! layer keeps a short-convolution window and a `head_dim x state` matrix per head in the
//! session.

use cellm_format::Result;
use cellm_kernels::gating::Gate;
use cellm_kv::SeqState;
use serde::Deserialize;

use crate::blocks::{Attention, CausalConv, Embedding, Linear, RmsNorm, Rope};
use crate::config::{bad_field, check_dim, check_product, check_state, Section};
use crate::decoder::{hybrid_cache_layout, Decoder, DecoderLayer, Mixer, RecurrentBlock, StepCtx};
use crate::weights::{Storage, Weights};
use crate::{Activation, CausalLm, LayerType, ModelConfig, Step};

/// The description's `mamba` section.
#[derive(Clone, Deserialize)]
struct MambaConfig {
    heads: usize,
    head_dim: usize,
    /// State size per head dimension (HF's `mamba_d_state`).
    state: usize,
    /// Groups of heads sharing B and C.
    groups: usize,
    conv_taps: usize,
    #[serde(default)]
    conv_bias: bool,
    #[serde(default)]
    proj_bias: bool,
    /// Time steps are clamped to `[dt_min, dt_max]` after the softplus.
    #[serde(default)]
    dt_min: f32,
    #[serde(default)]
    dt_max: Option<f32>,
}

impl MambaConfig {
    fn inner(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Channels of the convolution: x, then B and C of every group.
    fn conv_dim(&self) -> usize {
        self.inner() + 2 * self.groups * self.state
    }
}

impl Section for MambaConfig {
    const NAME: &'static str = "mamba";

    fn check(&self, _model: &ModelConfig) -> Result<()> {
        let heads = check_dim("mamba.heads", self.heads)?;
        let groups = check_dim("mamba.groups", self.groups)?;
        if !heads.is_multiple_of(groups) {
            return Err(bad_field(
                "mamba.heads",
                format_args!("{heads} cannot share {groups} groups"),
            ));
        }
        check_dim("mamba.head_dim", self.head_dim)?;
        check_dim("mamba.state", self.state)?;
        check_dim("mamba.conv_taps", self.conv_taps)?;
        let inner = check_product("mamba.heads * head_dim", &[heads, self.head_dim])?;
        let bc = check_product("mamba's B and C", &[2, groups, self.state])?;
        let conv =
            inner.checked_add(bc).ok_or_else(|| bad_field("mamba's conv channels", "overflow"))?;
        check_product("mamba's in_proj rows", &[conv + inner + heads])?;
        check_state("mamba.conv_taps", &[self.conv_taps - 1, conv])?;
        check_state("mamba.heads * head_dim * state", &[inner, self.state])?;
        if !(self.dt_min.is_finite() && self.dt_min >= 0.0)
            || self.dt_max.is_some_and(|m| !(m.is_finite() && m >= self.dt_min))
        {
            return Err(bad_field(
                "mamba.dt_min",
                "and dt_max must be finite, 0 <= dt_min <= dt_max",
            ));
        }
        Ok(())
    }
}

struct Mamba2 {
    cfg: MambaConfig,
    in_proj: Linear,
    conv: CausalConv,
    dt_bias: Vec<f32>,
    /// `-exp(A_log)` per head.
    neg_a: Vec<f32>,
    d: Vec<f32>,
    norm: Vec<f32>,
    eps: f32,
    out_proj: Linear,
    /// Indices of this layer's conv window and SSM state in the session state.
    conv_state: usize,
    ssm_state: usize,
}

/// `output(act(gate) * up)` where `input_linear` yields `[gate | up]`.
struct SharedMlp {
    input: Linear,
    output: Linear,
    width: usize,
    act: Activation,
}

struct Layer {
    input_norm: RmsNorm,
    mixer: Mixer<Mamba2>,
    post_attn_norm: RmsNorm,
    mlp: SharedMlp,
}

pub fn load(w: &Weights, cfg: ModelConfig) -> Result<Box<dyn CausalLm>> {
    let embed = Embedding::load(w, &cfg)?;
    let (h, eps) = (cfg.hidden_size, cfg.norm_eps);
    let rope = Rope::from(&cfg.rope);
    let has_mamba = cfg.layer_types.contains(&LayerType::LinearAttention);
    let mamba: Option<MambaConfig> = has_mamba.then(|| cfg.section()).transpose()?;
    let act = cfg.hidden_act;
    let (mut kv_layers, mut buffers) = (0, 0);
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for i in 0..cfg.num_layers {
        let p = format!("model.layers.{i}");
        let mixer = match (cfg.layer_type(i), &mamba) {
            (LayerType::LinearAttention, Some(mc)) => {
                let block = Mamba2::load(w, &format!("{p}.mamba"), &cfg, mc, buffers)?;
                buffers += 2;
                Mixer::Recurrent(Box::new(block))
            }
            _ => {
                kv_layers += 1;
                let rope = cfg.layer_uses_rope(i).then(|| rope.clone());
                let attn = Attention::load(w, &format!("{p}.self_attn"), &cfg, None, rope)?;
                Mixer::Attention(Box::new(attn), kv_layers - 1)
            }
        };
        let inter = cfg.intermediate_size;
        layers.push(Layer {
            input_norm: w.norm(&format!("{p}.input_layernorm.weight"), h, eps)?,
            mixer,
            post_attn_norm: w.norm(&format!("{p}.post_attention_layernorm.weight"), h, eps)?,
            mlp: SharedMlp {
                input: w.linear(&format!("{p}.shared_mlp.input_linear"), 2 * inter, h, false)?,
                output: w.linear(&format!("{p}.shared_mlp.output_linear"), h, inter, false)?,
                width: inter,
                act,
            },
        });
    }
    let cache = hybrid_cache_layout(&cfg, layers.iter().map(|l: &Layer| &l.mixer));
    Decoder::assemble(w, cfg, embed, layers, "model.norm.weight", cache)
}

impl Mamba2 {
    /// `cfg` was checked ([`Section::check`]), so its products do not overflow.
    fn load(
        w: &Weights,
        p: &str,
        model: &ModelConfig,
        cfg: &MambaConfig,
        first_buffer: usize,
    ) -> Result<Self> {
        let (h, inner, heads) = (model.hidden_size, cfg.inner(), cfg.heads);
        let conv_dim = cfg.conv_dim();
        let vector = |n: &str, len| -> Result<Vec<f32>> {
            Ok(w.get(&format!("{p}.{n}"), &[len], Storage::F32)?.as_f32()?.to_vec())
        };
        Ok(Self {
            in_proj: w.linear(
                &format!("{p}.in_proj"),
                inner + conv_dim + heads,
                h,
                cfg.proj_bias,
            )?,
            conv: CausalConv::load(
                w,
                &format!("{p}.conv1d"),
                conv_dim,
                cfg.conv_taps,
                cfg.conv_bias,
            )?,
            dt_bias: vector("dt_bias", heads)?,
            neg_a: vector("A_log", heads)?.iter().map(|a| -a.exp()).collect(),
            d: vector("D", heads)?,
            norm: vector("norm.weight", inner)?,
            eps: model.norm_eps,
            out_proj: w.linear(&format!("{p}.out_proj"), h, inner, cfg.proj_bias)?,
            conv_state: first_buffer,
            ssm_state: first_buffer + 1,
            cfg: cfg.clone(),
        })
    }

    /// One token of the selective scan for every head: `s = exp(dt A) s + dt x B^T`,
    /// `y = s C + D x`. `xbc` is the token's convolved `[x | B | C]`, `dt` its raw time steps.
    fn scan_token(&self, xbc: &[f32], dt_raw: &[f32], ssm: &mut [f32], y: &mut [f32]) {
        let c = &self.cfg;
        let (p, n, inner) = (c.head_dim, c.state, c.inner());
        let per_group = c.heads / c.groups;
        let (x, bc) = xbc.split_at(inner);
        let (b, cc) = bc.split_at(c.groups * n);
        for h in 0..c.heads {
            let mut dt = softplus(dt_raw[h] + self.dt_bias[h]).max(c.dt_min);
            if let Some(max) = c.dt_max {
                dt = dt.min(max);
            }
            let decay = (dt * self.neg_a[h]).exp();
            let g = h / per_group;
            let (bg, cg) = (&b[g * n..(g + 1) * n], &cc[g * n..(g + 1) * n]);
            for j in 0..p {
                let xv = x[h * p + j];
                let s = &mut ssm[(h * p + j) * n..(h * p + j + 1) * n];
                let mut acc = 0.0f32;
                for ((sv, &bv), &cv) in s.iter_mut().zip(bg).zip(cg) {
                    *sv = *sv * decay + dt * xv * bv;
                    acc += *sv * cv;
                }
                y[h * p + j] = acc + self.d[h] * xv;
            }
        }
    }
}

impl RecurrentBlock for Mamba2 {
    /// The conv window, then the SSM states.
    fn state_sizes(&self) -> Vec<usize> {
        vec![self.conv.state_len(), self.cfg.inner() * self.cfg.state]
    }

    fn forward(&self, x: &[f32], step: &Step, states: &mut [&mut SeqState]) -> Vec<f32> {
        let c = &self.cfg;
        let tokens = step.tokens.len();
        let (inner, conv_dim) = (c.inner(), c.conv_dim());
        let width = inner + conv_dim + c.heads;
        let proj = self.in_proj.forward(x, tokens);
        let mut y = vec![0.0f32; tokens * inner];
        for (span, state) in step.spans.iter().zip(states.iter_mut()) {
            let rows = span.row0..span.row0 + span.len;
            let mut xbc: Vec<f32> = rows
                .clone()
                .flat_map(|r| proj[r * width + inner..][..conv_dim].iter().copied())
                .collect();
            self.conv.forward(&mut xbc, state.buffer(self.conv_state));
            Gate::Silu.apply(&mut xbc, None);
            let ssm = state.buffer(self.ssm_state);
            for (t, r) in rows.enumerate() {
                let dt = &proj[r * width + inner + conv_dim..][..c.heads];
                let xbc = &xbc[t * conv_dim..(t + 1) * conv_dim];
                self.scan_token(xbc, dt, ssm, &mut y[r * inner..(r + 1) * inner]);
            }
        }
        // Gated RMSNorm: y * silu(z), normalised per group of heads, times the weight.
        let group = inner / c.groups;
        for (r, row) in y.chunks_exact_mut(inner).enumerate() {
            let mut z = proj[r * width..r * width + inner].to_vec();
            Gate::Silu.apply_scalar(&mut z, Some(row));
            for (out, gated) in row.chunks_exact_mut(group).zip(z.chunks_exact(group)) {
                let mean_sq = gated.iter().map(|v| v * v).sum::<f32>() / group as f32;
                let inv = 1.0 / (mean_sq + self.eps).sqrt();
                out.iter_mut().zip(gated).for_each(|(o, g)| *o = g * inv);
            }
            row.iter_mut().zip(&self.norm).for_each(|(o, w)| *o *= w);
        }
        self.out_proj.forward(&y, tokens)
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

impl SharedMlp {
    fn forward(&self, x: &[f32], tokens: usize) -> Vec<f32> {
        let both = self.input.forward(x, tokens);
        let i = self.width;
        let (mut gate, mut up) = (Vec::with_capacity(tokens * i), Vec::with_capacity(tokens * i));
        for row in both.chunks_exact(2 * i) {
            gate.extend_from_slice(&row[..i]);
            up.extend_from_slice(&row[i..]);
        }
        self.act.gate(&mut gate, &up);
        self.output.forward(&gate, tokens)
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
