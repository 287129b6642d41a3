//! Shared blocks every family is built from: linear layers, RMSNorm and LayerNorm, RoPE, the gated MLP,
//! grouped-query attention and the language-model head. Tensors come through [`Weights`].

use std::sync::{Arc, Mutex};

use cellm_format::{Error, Result, Tensor};
use cellm_kernels::gating::Gate;
use cellm_kernels::gelu::gelu_in_place;
use cellm_kernels::{decode_row, matmul_combined, matmul_many_new, matmul_new, ops, WeightRows};
use cellm_kv::{AttentionShape, PagePool};

use crate::weights::{Storage, Weights};
use crate::{Activation, ModelConfig, RopeConfig, Step};

/// Shorthands for the blocks every family loads.
impl Weights<'_> {
    pub fn linear(&self, prefix: &str, out: usize, inp: usize, bias: bool) -> Result<Linear> {
        let weight = self.tensor(&format!("{prefix}.weight"), &[out, inp])?;
        let bias = if bias { Some(self.vector(&format!("{prefix}.bias"), out)?) } else { None };
        Ok(Linear { weight, bias })
    }

    pub fn norm(&self, name: &str, dim: usize, eps: f32) -> Result<RmsNorm> {
        Ok(RmsNorm::new(self.vector(name, dim)?, eps))
    }
}

/// `y = x W^T + b`, with `W` in any stored format.
pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
}

impl Linear {
    pub fn out_features(&self) -> usize {
        self.weight.shape[0]
    }

    pub fn bias_f32(&self) -> Option<&[f32]> {
        self.bias.as_ref().map(|b| b.as_f32().expect("checked at load"))
    }

    pub fn forward(&self, x: &[f32], tokens: usize) -> Vec<f32> {
        let [y] = Self::forward_many([self], x, tokens);
        y
    }

    /// Several linears of the same input (q/k/v, gate/up) as one job for the thread pool,
    /// with the input quantized once.
    pub fn forward_many<const N: usize>(
        linears: [&Linear; N],
        x: &[f32],
        tokens: usize,
    ) -> [Vec<f32>; N] {
        let ys = matmul_many_new(x, tokens, &linears.map(|l| &l.weight));
        let mut ys: [Vec<f32>; N] = ys.try_into().expect("one output per linear");
        for (l, y) in linears.iter().zip(&mut ys) {
            if let Some(b) = l.bias_f32() {
                ops::add_bias(y, b);
            }
        }
        ys
    }
}

/// `(x - mean) / sqrt(var + eps) * w + b` per row.
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f32,
}

impl LayerNorm {
    pub fn load(w: &Weights, prefix: &str, dim: usize, eps: f32) -> Result<Self> {
        Ok(Self {
            weight: w.vector(&format!("{prefix}.weight"), dim)?,
            bias: w.vector(&format!("{prefix}.bias"), dim)?,
            eps,
        })
    }

    pub fn apply(&self, x: &mut [f32]) {
        let w = self.weight.as_f32().expect("checked at load");
        let b = self.bias.as_f32().expect("checked at load");
        for row in x.chunks_exact_mut(w.len()) {
            let n = row.len() as f32;
            let mean = row.iter().sum::<f32>() / n;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
            let inv = 1.0 / (var + self.eps).sqrt();
            for ((v, w), b) in row.iter_mut().zip(w).zip(b) {
                *v = (*v - mean) * inv * w + b;
            }
        }
    }

    pub fn applied(&self, x: &[f32]) -> Vec<f32> {
        let mut y = x.to_vec();
        self.apply(&mut y);
        y
    }
}

/// `x / rms(x) * w`. Gemma's `(1 + w)` is folded into `w` at conversion.
pub struct RmsNorm {
    weight: Tensor,
    eps: f32,
}

impl RmsNorm {
    /// `weight` must be an f32 vector ([`Weights::norm`] asks for one).
    pub fn new(weight: Tensor, eps: f32) -> Self {
        Self { weight, eps }
    }

    /// Normalises each row of `x` (rows as wide as the weight) in place.
    pub fn apply(&self, x: &mut [f32]) {
        ops::rms_norm(x, self.weight.as_f32().expect("checked at load"), self.eps);
    }

    pub fn applied(&self, x: &[f32]) -> Vec<f32> {
        ops::rms_normed(x, self.weight.as_f32().expect("checked at load"), self.eps)
    }
}

/// Token embedding table; also the lm_head when the model ties them.
pub struct Embedding {
    pub table: Tensor,
}

impl Embedding {
    /// `model.embed_tokens.weight`. Families load it first, so that the converter, which
    /// writes tensors in the order loaders ask for them, lays a file out in forward order.
    pub fn load(w: &Weights, cfg: &ModelConfig) -> Result<Self> {
        Ok(Self {
            table: w.tensor("model.embed_tokens.weight", &[cfg.vocab_size, cfg.hidden_size])?,
        })
    }

    pub fn lookup(&self, tokens: &[u32], scale: f32) -> Result<Vec<f32>> {
        let (vocab, dim) = self.table.rows_cols();
        let mut x = vec![0.0; tokens.len() * dim];
        for (row, &t) in x.chunks_exact_mut(dim).zip(tokens) {
            if t as usize >= vocab {
                return Err(Error::InvalidArgument(format!(
                    "token id {t} is outside the vocabulary ({vocab})"
                )));
            }
            decode_row(&self.table, t as usize, row);
        }
        ops::scale(&mut x, scale);
        Ok(x)
    }
}

/// Rotary position embedding in the half-split layout HF uses (`rotate_half`): dimension `i`
/// pairs with `i + rot/2`. GGUF's interleaved layout is undone at conversion.
#[derive(Clone)]
pub struct Rope {
    pub inv_freq: Vec<f32>,
    pub attention_factor: f32,
    /// The angles of the positions last asked for, shared by the clones (every layer holds
    /// one, and every layer of a step asks for the same positions): the f64 `cos` and `sin`
    /// per layer were 1% of a decode step.
    angles: Arc<Mutex<Angles>>,
}

/// `cos_sin[t * half + i]`: frequency `i`'s (cos, sin) at `positions[t]`, times the
/// attention factor.
#[derive(Default)]
struct Angles {
    positions: Vec<usize>,
    cos_sin: Vec<(f32, f32)>,
}

impl From<&RopeConfig> for Rope {
    fn from(c: &RopeConfig) -> Self {
        Self {
            inv_freq: c.inv_freq.clone(),
            attention_factor: c.attention_factor,
            angles: Arc::default(),
        }
    }
}

impl Rope {
    /// Rotates the first `2 * inv_freq.len()` dims of every `head_dim`-wide head in `x`.
    pub fn apply(&self, x: &mut [f32], positions: &[usize], head_dim: usize) {
        self.apply_all(&mut [x], positions, head_dim);
    }

    /// [`Self::apply`] to each of `xs` (queries and keys), each position's angles computed
    /// once for all of them (and for every layer while the positions stay the same).
    pub fn apply_all(&self, xs: &mut [&mut [f32]], positions: &[usize], head_dim: usize) {
        let half = self.inv_freq.len();
        let mut angles = self.angles.lock().unwrap_or_else(|e| e.into_inner());
        if angles.positions != positions {
            angles.cos_sin.clear();
            for &pos in positions {
                angles.cos_sin.extend(self.inv_freq.iter().map(|&f| {
                    // The angle is rounded to f32 first, as the reference computes it.
                    let angle = f64::from(pos as f32 * f);
                    (
                        (angle.cos() as f32) * self.attention_factor,
                        (angle.sin() as f32) * self.attention_factor,
                    )
                }));
            }
            angles.positions = positions.to_vec();
        }
        for (t, cos_sin) in angles.cos_sin.chunks_exact(half.max(1)).enumerate() {
            for x in xs.iter_mut() {
                let per_token = x.len() / positions.len();
                for head in x[t * per_token..(t + 1) * per_token].chunks_exact_mut(head_dim) {
                    let (a, b) = head[..2 * half].split_at_mut(half);
                    for ((x1, x2), &(c, s)) in a.iter_mut().zip(b.iter_mut()).zip(cos_sin) {
                        let (u, v) = (*x1, *x2);
                        *x1 = u * c - v * s;
                        *x2 = v * c + u * s;
                    }
                }
            }
        }
    }
}

impl Activation {
    /// `gate = act(gate) * up`.
    pub fn gate(self, gate: &mut [f32], up: &[f32]) {
        match self {
            Activation::Silu => Gate::Silu.apply(gate, Some(up)),
            Activation::GeluTanh => Gate::GeluTanh.apply(gate, Some(up)),
            Activation::Gelu => {
                gelu_in_place(gate);
                gate.iter_mut().zip(up).for_each(|(g, u)| *g *= u);
            }
        }
    }
}

/// `down(act(gate(x)) * up(x))`.
pub struct GatedMlp {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
    pub act: Activation,
}

/// Tensor names of a gated MLP: gate, up, down.
pub const MLP_NAMES: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

impl GatedMlp {
    /// The HF layout: `{prefix}.gate_proj`, `.up_proj`, `.down_proj`.
    pub fn load(
        w: &Weights,
        prefix: &str,
        hidden: usize,
        inter: usize,
        bias: bool,
        act: Activation,
    ) -> Result<Self> {
        Self::load_named(w, prefix, MLP_NAMES, hidden, inter, bias, act)
    }

    /// The HF layout at the config's width, bias and activation.
    pub fn from_config(w: &Weights, prefix: &str, cfg: &ModelConfig) -> Result<Self> {
        let (h, inter) = (cfg.hidden_size, cfg.intermediate_size);
        Self::load(w, prefix, h, inter, cfg.mlp_bias, cfg.hidden_act)
    }

    /// A gated MLP whose gate, up and down projections have other names.
    pub fn load_named(
        w: &Weights,
        prefix: &str,
        [gate, up, down]: [&str; 3],
        hidden: usize,
        inter: usize,
        bias: bool,
        act: Activation,
    ) -> Result<Self> {
        Ok(Self {
            gate: w.linear(&format!("{prefix}.{gate}"), inter, hidden, bias)?,
            up: w.linear(&format!("{prefix}.{up}"), inter, hidden, bias)?,
            down: w.linear(&format!("{prefix}.{down}"), hidden, inter, bias)?,
            act,
        })
    }

    pub fn forward(&self, x: &[f32], tokens: usize) -> Vec<f32> {
        let (gate_bias, up_bias) = (self.gate.bias_f32(), self.up.bias_f32());
        // Each task gates its own rows of every token as soon as it has them.
        let gate_rows = |rows: std::ops::Range<usize>, g: &mut [f32], up: &mut [f32]| {
            for (y, bias) in [(&mut *g, gate_bias), (&mut *up, up_bias)] {
                if let Some(b) = bias {
                    y.iter_mut().zip(&b[rows.clone()]).for_each(|(y, b)| *y += b);
                }
            }
            self.act.gate(g, up);
        };
        let weights = [&self.gate.weight, &self.up.weight];
        let [g, _] = matmul_combined(x, tokens, weights, &gate_rows);
        self.down.forward(&g, tokens)
    }
}

/// Grouped-query attention with optional per-head q/k RMSNorm and RoPE; `shape` carries the
/// layer's scale, sliding window and soft-cap.
pub struct Attention {
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub q_norm: Option<RmsNorm>,
    pub k_norm: Option<RmsNorm>,
    pub shape: AttentionShape,
    /// The layer's rotary embedding (None: no positions, as in smollm3's NoPE layers).
    pub rope: Option<Rope>,
    /// Qwen3.5's output gate: `q` also yields, per head, a gate whose sigmoid scales that
    /// head's attention output.
    pub gated: bool,
}

impl Attention {
    pub fn forward(
        &self,
        layer: usize,
        x: &[f32],
        step: &Step,
        positions: &[usize],
        kv: &mut PagePool,
    ) -> Vec<f32> {
        let tokens = step.tokens.len();
        let hd = self.shape.head_dim;
        cellm_kv::prefetch_new_rows(kv, step.spans, layer);
        let [mut q, mut k, v] = Linear::forward_many([&self.q, &self.k, &self.v], x, tokens);
        let gate = self.gated.then(|| split_query_gate(&mut q, hd));
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            qn.apply(&mut q);
            kn.apply(&mut k);
        }
        if let Some(rope) = &self.rope {
            rope.apply_all(&mut [&mut q, &mut k], positions, hd);
        }
        let mut ctx = vec![0.0; q.len()];
        cellm_kv::AttentionCall {
            layer,
            spans: step.spans,
            q: &q,
            k: &k,
            v: &v,
            shape: &self.shape,
        }
        .run(kv, &mut ctx);
        if let Some(gate) = gate {
            ctx.iter_mut().zip(gate).for_each(|(c, g)| *c *= 1.0 / (1.0 + (-g).exp()));
        }
        self.o.forward(&ctx, tokens)
    }
}

/// Splits rows of per-head `[query | gate]` pairs (`2 * hd` each) into queries, left in `q`,
/// and the returned gates, both `hd` per head.
fn split_query_gate(q: &mut Vec<f32>, hd: usize) -> Vec<f32> {
    let (mut queries, mut gates) =
        (Vec::with_capacity(q.len() / 2), Vec::with_capacity(q.len() / 2));
    for pair in q.chunks_exact(2 * hd) {
        queries.extend_from_slice(&pair[..hd]);
        gates.extend_from_slice(&pair[hd..]);
    }
    *q = queries;
    gates
}

/// Tensor names of an attention block: q, k, v, output, q norm, k norm.
pub const ATTENTION_NAMES: [&str; 6] = ["q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"];

impl Attention {
    /// The HF layout `{prefix}.{q,k,v,o}_proj` (+ `q_norm`/`k_norm` when `qk_norm`), shaped by
    /// the config; `window` is the layer's sliding window.
    pub fn load(
        w: &Weights,
        prefix: &str,
        cfg: &ModelConfig,
        window: Option<usize>,
        rope: Option<Rope>,
    ) -> Result<Self> {
        Self::load_named(w, prefix, ATTENTION_NAMES, cfg, window, rope)
    }

    /// An attention block whose tensors have other names (in [`ATTENTION_NAMES`] order).
    pub fn load_named(
        w: &Weights,
        prefix: &str,
        [q, k, v, o, q_norm, k_norm]: [&str; 6],
        cfg: &ModelConfig,
        window: Option<usize>,
        rope: Option<Rope>,
    ) -> Result<Self> {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let (q_out, kv_out) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
        let q_rows = if cfg.attn_output_gate { 2 * q_out } else { q_out };
        let bias = cfg.attention_bias;
        let qk_norm = |n: &str| {
            cfg.qk_norm.then(|| w.norm(&format!("{prefix}.{n}.weight"), hd, cfg.norm_eps))
        };
        Ok(Attention {
            q: w.linear(&format!("{prefix}.{q}"), q_rows, h, bias)?,
            k: w.linear(&format!("{prefix}.{k}"), kv_out, h, bias)?,
            v: w.linear(&format!("{prefix}.{v}"), kv_out, h, bias)?,
            o: w.linear(&format!("{prefix}.{o}"), h, q_out, cfg.attention_out_bias)?,
            q_norm: qk_norm(q_norm).transpose()?,
            k_norm: qk_norm(k_norm).transpose()?,
            shape: AttentionShape {
                n_heads: cfg.num_heads,
                n_kv_heads: cfg.num_kv_heads,
                head_dim: hd,
                scale: cfg.attention_scale(),
                window,
                softcap: cfg.attn_logit_softcap,
            },
            rope,
            gated: cfg.attn_output_gate,
        })
    }
}

/// Final norm, then the output projection (the embedding table when tied), the logit scale
/// and the optional final soft-cap.
pub struct LmHead {
    norm: RmsNorm,
    weight: Tensor,
    scale: f32,
    softcap: Option<f32>,
}

impl LmHead {
    pub fn load(w: &Weights, norm: &str, cfg: &ModelConfig, embed: &Embedding) -> Result<Self> {
        let norm = w.norm(norm, cfg.hidden_size, cfg.norm_eps)?;
        let weight = if cfg.tie_word_embeddings {
            embed.table.clone()
        } else {
            w.tensor("lm_head.weight", &[cfg.vocab_size, cfg.hidden_size])?
        };
        Ok(Self { norm, weight, scale: cfg.logits_scale, softcap: cfg.final_logit_softcap })
    }

    /// Logits (`rows x vocab`) of the hidden rows `x`, which it normalises in place.
    pub fn forward(&self, x: &mut [f32], rows: usize) -> Vec<f32> {
        self.norm.apply(x);
        let mut logits = matmul_new(x, rows, &self.weight);
        ops::scale(&mut logits, self.scale);
        if let Some(cap) = self.softcap {
            logits.iter_mut().for_each(|l| *l = cap * (*l / cap).tanh());
        }
        logits
    }
}

/// A causal depthwise 1-D convolution over time (kernel `taps` per channel), the short
/// convolution of LFM2 and of gated DeltaNet. Each session keeps its last `taps - 1` inputs.
pub struct CausalConv {
    /// `channels x taps`, f32; tap `taps - 1` multiplies the current input.
    weight: Tensor,
    bias: Option<Tensor>,
    pub channels: usize,
    pub taps: usize,
}

impl CausalConv {
    /// HF stores Conv1d weights as `[channels, 1, taps]`; the converter drops the middle axis.
    pub fn load(
        w: &Weights,
        prefix: &str,
        channels: usize,
        taps: usize,
        bias: bool,
    ) -> Result<Self> {
        let weight = w.get(&format!("{prefix}.weight"), &[channels, taps], Storage::F32)?;
        let bias = if bias { Some(w.vector(&format!("{prefix}.bias"), channels)?) } else { None };
        Ok(Self { weight, bias, channels, taps })
    }

    /// Floats of per-session state.
    pub fn state_len(&self) -> usize {
        (self.taps - 1) * self.channels
    }

    /// Convolves the `rows x channels` inputs `x` of one session's new tokens in place,
    /// continuing from (and then advancing) its `state`, the previous `taps - 1` inputs.
    pub fn forward(&self, x: &mut [f32], state: &mut [f32]) {
        let (c, taps) = (self.channels, self.taps);
        let w = self.weight.as_f32().expect("checked at load");
        let bias = self.bias.as_ref().map(|b| b.as_f32().expect("checked at load"));
        // History then new inputs, so every output reads one contiguous window.
        let mut seq = Vec::with_capacity(state.len() + x.len());
        seq.extend_from_slice(state);
        seq.extend_from_slice(x);
        for (t, out) in x.chunks_exact_mut(c).enumerate() {
            let window = &seq[t * c..(t + taps) * c];
            for (ch, o) in out.iter_mut().enumerate() {
                let taps_w = &w[ch * taps..(ch + 1) * taps];
                let mut acc = bias.map_or(0.0, |b| b[ch]);
                for (k, wk) in taps_w.iter().enumerate() {
                    acc += wk * window[k * c + ch];
                }
                *o = acc;
            }
        }
        state.copy_from_slice(&seq[seq.len() - state.len()..]);
    }
}

/// Rows `index * n .. (index + 1) * n` of a stored matrix (a head's or an expert's block),
/// as the kernels read them; the tensor must be in a format rows can be sliced from
/// ([`Storage::RowSlices`]).
pub fn row_block(t: &Tensor, index: usize, n: usize) -> WeightRows<'_> {
    let cols = t.shape[1];
    let row_bytes = t.format.nbytes(&[1, cols]).expect("checked at load");
    WeightRows {
        format: t.format,
        bytes: &t.bytes()[index * n * row_bytes..(index + 1) * n * row_bytes],
        rows: n,
        cols,
    }
}

/// Copies the given rows of a `rows x width` matrix.
pub fn gather_rows(x: &[f32], width: usize, rows: &[usize]) -> Vec<f32> {
    rows.iter().flat_map(|&r| x[r * width..(r + 1) * width].iter().copied()).collect()
}
