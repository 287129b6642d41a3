//! Gemma 4 (`gemma4_text`): Gemma 3's sandwich-normed layers with four additions. Per-layer
//! input embeddings (PLE): a second, narrow embedding per layer, mixed with a projection of
//! the token embedding, gates a residual branch after each feed-forward. Head widths differ
//! per layer (full-attention layers are wider), with a `proportional` RoPE on full layers
//! (part of each head turns, the rest keeps frequency 0) and the default one on sliding
//! layers. The last layers share the KV cache of the last earlier layer of their type and
//! write none of their own. Each layer ends by scaling the residual stream (`layer_scalar`).
//! Attention is unscaled (q and k are RMS-normed), values are RMS-normed without a weight,
//! and its RMSNorms multiply by a plain `w`.

use cellm_format::Result;
use cellm_kernels::ops;
use cellm_kv::{AttentionCall, AttentionShape, PagePool, SeqState};
use serde::Deserialize;

use crate::blocks::{gather_rows, Embedding, GatedMlp, Linear, LmHead, RmsNorm, Rope};
use crate::config::{bad_field, check_at_most, check_dim, check_positive, check_product, Section};
use crate::weights::{Storage, Weights};
use crate::{Activation, CacheLayout, CausalLm, ForwardError, LayerType, ModelConfig, Step};

/// The description's `gemma4` section: what varies per layer, and the per-layer inputs.
#[derive(Deserialize)]
struct Gemma4Config {
    /// Each layer's head width (at most the model's `head_dim`, the widest).
    head_dims: Vec<usize>,
    /// Each layer's feed-forward width (KV-shared layers may be twice as wide).
    mlp_widths: Vec<usize>,
    /// Per layer, the earlier layer whose KV cache it reads instead of writing its own.
    kv_from: Vec<Option<usize>>,
    /// Full-attention layers take their values from the key projection (no `v_proj`).
    #[serde(default)]
    values_from_keys: bool,
    #[serde(default)]
    per_layer_input: Option<PerLayerInputConfig>,
}

#[derive(Deserialize)]
struct PerLayerInputConfig {
    /// Width of each layer's input (HF's `hidden_size_per_layer_input`).
    width: usize,
    /// sqrt(width), rounded to the embedding's dtype as HF does.
    embed_scale: f32,
}

impl Section for Gemma4Config {
    const NAME: &'static str = "gemma4";

    fn check(&self, m: &ModelConfig) -> Result<()> {
        let n = m.num_layers;
        for (field, len) in [
            ("gemma4.head_dims", self.head_dims.len()),
            ("gemma4.mlp_widths", self.mlp_widths.len()),
            ("gemma4.kv_from", self.kv_from.len()),
        ] {
            if len != n {
                return Err(bad_field(field, format_args!("has {len} entries for {n} layers")));
            }
        }
        for (i, (&hd, &width)) in self.head_dims.iter().zip(&self.mlp_widths).enumerate() {
            check_dim(&format!("gemma4.head_dims[{i}]"), hd)?;
            check_at_most(&format!("gemma4.head_dims[{i}]"), hd, "head_dim", m.head_dim)?;
            check_dim(&format!("gemma4.mlp_widths[{i}]"), width)?;
            // HF turns every head whole: frequency 0 pads the dims a partial RoPE keeps.
            let rotated = 2 * rope_of(m, i).inv_freq.len();
            if rotated != hd {
                return Err(bad_field(
                    &format!("gemma4.head_dims[{i}]"),
                    format_args!("is {hd}, but the layer's RoPE turns {rotated} dims"),
                ));
            }
            if let Some(j) = self.kv_from[i] {
                let fits = j < i
                    && self.kv_from[j].is_none()
                    && self.head_dims[j] == hd
                    && m.layer_type(j) == m.layer_type(i);
                if !fits {
                    return Err(bad_field(
                        &format!("gemma4.kv_from[{i}]"),
                        format_args!(
                            "is {j}: not an earlier layer of the same type and width with \
                             a cache of its own"
                        ),
                    ));
                }
            }
        }
        if let Some(p) = &self.per_layer_input {
            check_dim("gemma4.per_layer_input.width", p.width)?;
            check_product("num_layers * gemma4.per_layer_input.width", &[n, p.width])?;
            check_positive("gemma4.per_layer_input.embed_scale", p.embed_scale)?;
        }
        Ok(())
    }
}

/// The RoPE of layer `i`: the local one on sliding layers, the global one elsewhere.
fn rope_of(m: &ModelConfig, i: usize) -> &crate::RopeConfig {
    match m.layer_type(i) {
        LayerType::SlidingAttention => m.rope_local.as_ref().unwrap_or(&m.rope),
        _ => &m.rope,
    }
}

/// The key and value projections of a layer that writes its own cache.
struct OwnKv {
    k: Linear,
    /// None: values are the key projection's output (before the key norm).
    v: Option<Linear>,
    k_norm: RmsNorm,
}

struct Attention {
    q: Linear,
    q_norm: RmsNorm,
    own: Option<OwnKv>,
    o: Linear,
    /// Ones: values are RMS-normed without a weight.
    v_norm: Vec<f32>,
    eps: f32,
    rope: Rope,
    shape: AttentionShape,
    /// The KV layer this layer writes, or reads when it shares another's.
    kv_layer: usize,
}

struct Layer {
    input_norm: RmsNorm,
    attn: Attention,
    post_attn_norm: RmsNorm,
    pre_mlp_norm: RmsNorm,
    mlp: GatedMlp,
    post_mlp_norm: RmsNorm,
    per_layer: Option<PerLayerBranch>,
    /// Multiplies the residual stream at the end of the layer.
    scalar: f32,
}

/// `x += norm(proj(act(gate(x)) * per_layer_input))`.
struct PerLayerBranch {
    gate: Linear,
    proj: Linear,
    norm: RmsNorm,
}

/// Builds each layer's per-layer input from the token ids and their embeddings.
struct PerLayerInputs {
    table: Embedding,
    embed_scale: f32,
    projection: Linear,
    norm: RmsNorm,
    width: usize,
    layers: usize,
}

struct Gemma4 {
    cfg: ModelConfig,
    embed: Embedding,
    per_layer_inputs: Option<PerLayerInputs>,
    layers: Vec<Layer>,
    head: LmHead,
    cache: CacheLayout,
    act: Activation,
}

pub fn load(w: &Weights, cfg: ModelConfig) -> Result<Box<dyn CausalLm>> {
    let embed = Embedding::load(w, &cfg)?;
    let g: Gemma4Config = cfg.section()?;
    let (h, eps, n) = (cfg.hidden_size, cfg.norm_eps, cfg.num_layers);
    let per_layer_inputs = match &g.per_layer_input {
        Some(p) => Some(PerLayerInputs {
            table: Embedding {
                table: w.tensor(
                    "model.embed_tokens_per_layer.weight",
                    &[cfg.vocab_size, n * p.width],
                )?,
            },
            embed_scale: p.embed_scale,
            projection: w.linear("model.per_layer_model_projection", n * p.width, h, false)?,
            norm: w.norm("model.per_layer_projection_norm.weight", p.width, eps)?,
            width: p.width,
            layers: n,
        }),
        None => None,
    };
    // Layers with a cache of their own number the KV layers; sharing layers read theirs.
    let mut kv_index = vec![0; n];
    let mut windows = Vec::new();
    for i in 0..n {
        kv_index[i] = match g.kv_from[i] {
            Some(j) => kv_index[j],
            None => {
                windows.push(cfg.window(i));
                windows.len() - 1
            }
        };
    }
    let layers = (0..n)
        .map(|i| {
            let p = format!("model.layers.{i}");
            let norm = |name: &str| w.norm(&format!("{p}.{name}.weight"), h, eps);
            let attn = Attention::load(w, &format!("{p}.self_attn"), &cfg, &g, i, kv_index[i])?;
            let per_layer = match &g.per_layer_input {
                Some(pl) => Some(PerLayerBranch {
                    gate: w.linear(&format!("{p}.per_layer_input_gate"), pl.width, h, false)?,
                    proj: w.linear(&format!("{p}.per_layer_projection"), h, pl.width, false)?,
                    norm: norm("post_per_layer_input_norm")?,
                }),
                None => None,
            };
            let scalar = w.get(&format!("{p}.layer_scalar"), &[1], Storage::F32)?;
            Ok(Layer {
                input_norm: norm("input_layernorm")?,
                attn,
                post_attn_norm: norm("post_attention_layernorm")?,
                pre_mlp_norm: norm("pre_feedforward_layernorm")?,
                mlp: GatedMlp::load(
                    w,
                    &format!("{p}.mlp"),
                    h,
                    g.mlp_widths[i],
                    false,
                    cfg.hidden_act,
                )?,
                post_mlp_norm: norm("post_feedforward_layernorm")?,
                per_layer,
                scalar: scalar.as_f32()?[0],
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let head = LmHead::load(w, "model.norm.weight", &cfg, &embed)?;
    let cache = CacheLayout {
        kv_layers: windows.len(),
        kv_heads: cfg.num_kv_heads,
        head_dim: g.head_dims.iter().copied().max().unwrap_or(cfg.head_dim),
        windows,
        state: Vec::new(),
        values_in_keys: false,
        state_fixed: false,
    };
    let act = cfg.hidden_act;
    Ok(Box::new(Gemma4 { cfg, embed, per_layer_inputs, layers, head, cache, act }))
}

impl Attention {
    fn load(
        w: &Weights,
        p: &str,
        cfg: &ModelConfig,
        g: &Gemma4Config,
        i: usize,
        kv_layer: usize,
    ) -> Result<Self> {
        let (h, hd, eps) = (cfg.hidden_size, g.head_dims[i], cfg.norm_eps);
        let (q_out, kv_out) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
        let full = cfg.layer_type(i) != LayerType::SlidingAttention;
        let q = w.linear(&format!("{p}.q_proj"), q_out, h, cfg.attention_bias)?;
        let q_norm = w.norm(&format!("{p}.q_norm.weight"), hd, eps)?;
        let own = match g.kv_from[i] {
            Some(_) => None,
            None => Some(OwnKv {
                k: w.linear(&format!("{p}.k_proj"), kv_out, h, cfg.attention_bias)?,
                v: match g.values_from_keys && full {
                    true => None,
                    false => {
                        Some(w.linear(&format!("{p}.v_proj"), kv_out, h, cfg.attention_bias)?)
                    }
                },
                k_norm: w.norm(&format!("{p}.k_norm.weight"), hd, eps)?,
            }),
        };
        Ok(Self {
            q,
            q_norm,
            own,
            o: w.linear(&format!("{p}.o_proj"), h, q_out, cfg.attention_bias)?,
            v_norm: vec![1.0; hd],
            eps,
            rope: Rope::from(rope_of(cfg, i)),
            shape: AttentionShape {
                n_heads: cfg.num_heads,
                n_kv_heads: cfg.num_kv_heads,
                head_dim: hd,
                scale: cfg.attention_scale(),
                window: cfg.window(i),
                softcap: cfg.attn_logit_softcap,
            },
            kv_layer,
        })
    }

    fn forward(&self, x: &[f32], step: &Step, positions: &[usize], kv: &mut PagePool) -> Vec<f32> {
        let tokens = step.tokens.len();
        let hd = self.shape.head_dim;
        let (mut q, keys) = match &self.own {
            Some(own) => {
                let (q, mut k, mut v) = match &own.v {
                    Some(v_proj) => {
                        let [q, k, v] = Linear::forward_many([&self.q, &own.k, v_proj], x, tokens);
                        (q, k, v)
                    }
                    None => {
                        let [q, k] = Linear::forward_many([&self.q, &own.k], x, tokens);
                        let v = k.clone();
                        (q, k, v)
                    }
                };
                own.k_norm.apply(&mut k);
                self.rope.apply(&mut k, positions, hd);
                ops::rms_norm(&mut v, &self.v_norm, self.eps);
                (q, Some((k, v)))
            }
            None => (self.q.forward(x, tokens), None),
        };
        self.q_norm.apply(&mut q);
        self.rope.apply(&mut q, positions, hd);
        let (k, v) = keys.as_ref().map_or((&[][..], &[][..]), |(k, v)| (&k[..], &v[..]));
        let call = AttentionCall {
            layer: self.kv_layer,
            spans: step.spans,
            q: &q,
            k,
            v,
            shape: &self.shape,
        };
        let mut out = vec![0.0; q.len()];
        match keys {
            Some(_) => call.run(kv, &mut out),
            // A sharing layer reads what its source layer wrote earlier in this step.
            None => call.attend(kv, &mut out),
        }
        self.o.forward(&out, tokens)
    }
}

impl PerLayerInputs {
    /// Per layer, `rows x width` inputs: `(norm(proj(x) / sqrt(hidden)) + table[id] * scale)
    /// / sqrt(2)`, where `x` are the (scaled) token embeddings.
    fn compute(&self, tokens: &[u32], x: &[f32], hidden: usize) -> Vec<Vec<f32>> {
        let rows = tokens.len();
        let ids = self.table.lookup(tokens, self.embed_scale).expect("ids checked by the engine");
        let mut proj = self.projection.forward(x, rows);
        // HF multiplies by Python floats, which become f32 in the product.
        ops::scale(&mut proj, (hidden as f64).powf(-0.5) as f32);
        self.norm.apply(&mut proj);
        let mix = std::f64::consts::FRAC_1_SQRT_2 as f32;
        let packed = self.layers * self.width;
        (0..self.layers)
            .map(|l| {
                (0..rows)
                    .flat_map(|r| {
                        let at = r * packed + l * self.width;
                        let (p, t) = (&proj[at..at + self.width], &ids[at..at + self.width]);
                        p.iter().zip(t).map(move |(p, t)| (p + t) * mix)
                    })
                    .collect()
            })
            .collect()
    }
}

impl Layer {
    /// Feed-forward, per-layer branch and layer scalar over `rows` rows of `x`.
    fn finish(&self, x: &mut [f32], rows: usize, per_layer_input: Option<&[f32]>, act: Activation) {
        let mut ff = self.mlp.forward(&self.pre_mlp_norm.applied(x), rows);
        self.post_mlp_norm.apply(&mut ff);
        ops::add_scaled(x, &ff, 1.0);
        if let (Some(branch), Some(input)) = (&self.per_layer, per_layer_input) {
            let mut g = branch.gate.forward(x, rows);
            act.gate(&mut g, input);
            let mut out = branch.proj.forward(&g, rows);
            branch.norm.apply(&mut out);
            ops::add_scaled(x, &out, 1.0);
        }
        ops::scale(x, self.scalar);
    }
}

impl CausalLm for Gemma4 {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn cache_layout(&self) -> CacheLayout {
        self.cache.clone()
    }

    fn forward(
        &self,
        step: &Step,
        kv: &mut PagePool,
        _states: &mut [&mut SeqState],
    ) -> std::result::Result<Vec<f32>, ForwardError> {
        let (c, h) = (&self.cfg, self.cfg.hidden_size);
        let positions = step.positions();
        let mut x = self
            .embed
            .lookup(step.tokens, c.embedding_multiplier)
            .expect("ids checked by the engine");
        let given = step.embeds;
        for (&row, values) in given.rows.iter().zip(given.values.chunks_exact(h)) {
            x[row * h..(row + 1) * h].copy_from_slice(values);
        }
        let mut per_layer = self.per_layer_inputs.as_ref().map(|p| p.compute(step.tokens, &x, h));
        let mut rows = step.tokens.len();
        let layers = &self.layers[..c.layers_run()];
        let last = layers.len() - 1;
        for (i, layer) in layers.iter().enumerate() {
            if (step.cancel)() {
                return Err(ForwardError::Cancelled);
            }
            let mut mixed = layer.attn.forward(&layer.input_norm.applied(&x), step, &positions, kv);
            layer.post_attn_norm.apply(&mut mixed);
            ops::add_scaled(&mut x, &mixed, 1.0);
            let mut input = per_layer.as_mut().map(|p| std::mem::take(&mut p[i]));
            if i == last {
                // Only the rows whose logits are wanted go on.
                x = gather_rows(&x, h, step.logit_rows);
                let width = self.per_layer_inputs.as_ref().map_or(0, |p| p.width);
                input = input.map(|v| gather_rows(&v, width, step.logit_rows));
                rows = step.logit_rows.len();
            }
            if (step.cancel)() {
                return Err(ForwardError::Cancelled);
            }
            layer.finish(&mut x, rows, input.as_deref(), self.act);
        }
        Ok(cellm_kernels::for_logit_rows(|| self.head.forward(&mut x, rows)))
    }
}
