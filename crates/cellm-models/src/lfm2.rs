//! LFM2: most layers mix tokens with a gated short convolution (in_proj -> B, C, x; a causal
//! depthwise conv over B*x; C gates the result; out_proj), the rest with GQA attention with
//! q/k norms. Every layer then runs a SwiGLU feed-forward. The final norm is called
//! `embedding_norm`. Conv layers keep their last inputs in the session's state.

use cellm_format::Result;
use cellm_kv::SeqState;
use serde::Deserialize;

use crate::blocks::{Attention, CausalConv, Embedding, GatedMlp, Linear, RmsNorm, Rope};
use crate::config::{check_dim, check_state, Section};
use crate::decoder::{hybrid_cache_layout, Decoder, DecoderLayer, Mixer, RecurrentBlock, StepCtx};
use crate::weights::Weights;
use crate::{CausalLm, LayerType, ModelConfig, Step};

/// The description's `conv` section.
#[derive(Deserialize)]
struct ConvConfig {
    /// Kernel length (HF's `conv_L_cache`).
    taps: usize,
    #[serde(default)]
    bias: bool,
}

impl Section for ConvConfig {
    const NAME: &'static str = "conv";

    fn check(&self, model: &ModelConfig) -> Result<()> {
        check_dim("conv.taps", self.taps)?;
        check_state("conv.taps", &[self.taps - 1, model.hidden_size])?;
        Ok(())
    }
}

struct ShortConv {
    in_proj: Linear,
    conv: CausalConv,
    out_proj: Linear,
    /// Index of this layer's buffer in the session state.
    state: usize,
}

struct Layer {
    operator_norm: RmsNorm,
    mixer: Mixer<ShortConv>,
    ffn_norm: RmsNorm,
    mlp: GatedMlp,
}

const ATTENTION_NAMES: [&str; 6] =
    ["q_proj", "k_proj", "v_proj", "out_proj", "q_layernorm", "k_layernorm"];

pub fn load(w: &Weights, cfg: ModelConfig) -> Result<Box<dyn CausalLm>> {
    let embed = Embedding::load(w, &cfg)?;
    let conv_cfg: ConvConfig = cfg.section()?;
    let (h, eps) = (cfg.hidden_size, cfg.norm_eps);
    let rope = Rope::from(&cfg.rope);
    let (mut kv_layers, mut conv_layers) = (0, 0);
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for i in 0..cfg.num_layers {
        let p = format!("model.layers.{i}");
        let mixer = match cfg.layer_type(i) {
            LayerType::Conv => {
                let c = format!("{p}.conv");
                conv_layers += 1;
                Mixer::Recurrent(Box::new(ShortConv {
                    in_proj: w.linear(&format!("{c}.in_proj"), 3 * h, h, conv_cfg.bias)?,
                    conv: CausalConv::load(
                        w,
                        &format!("{c}.conv"),
                        h,
                        conv_cfg.taps,
                        conv_cfg.bias,
                    )?,
                    out_proj: w.linear(&format!("{c}.out_proj"), h, h, conv_cfg.bias)?,
                    state: conv_layers - 1,
                }))
            }
            _ => {
                kv_layers += 1;
                let prefix = format!("{p}.self_attn");
                let rope = Some(rope.clone());
                let attn = Attention::load_named(w, &prefix, ATTENTION_NAMES, &cfg, None, rope)?;
                Mixer::Attention(Box::new(attn), kv_layers - 1)
            }
        };
        layers.push(Layer {
            operator_norm: w.norm(&format!("{p}.operator_norm.weight"), h, eps)?,
            mixer,
            ffn_norm: w.norm(&format!("{p}.ffn_norm.weight"), h, eps)?,
            mlp: GatedMlp::load_named(
                w,
                &format!("{p}.feed_forward"),
                ["w1", "w3", "w2"],
                h,
                cfg.intermediate_size,
                false,
                cfg.hidden_act,
            )?,
        });
    }
    let cache = hybrid_cache_layout(&cfg, layers.iter().map(|l: &Layer| &l.mixer));
    Decoder::assemble(w, cfg, embed, layers, "model.embedding_norm.weight", cache)
}

impl RecurrentBlock for ShortConv {
    fn state_sizes(&self) -> Vec<usize> {
        vec![self.conv.state_len()]
    }

    fn forward(&self, x: &[f32], step: &Step, states: &mut [&mut SeqState]) -> Vec<f32> {
        let tokens = step.tokens.len();
        let h = self.conv.channels;
        let bcx = self.in_proj.forward(x, tokens);
        let mut gated = vec![0.0; tokens * h];
        for (span, state) in step.spans.iter().zip(states.iter_mut()) {
            let rows = span.row0..span.row0 + span.len;
            let mut bx: Vec<f32> = rows
                .clone()
                .flat_map(|r| {
                    let (b, x) = (&bcx[r * 3 * h..][..h], &bcx[r * 3 * h + 2 * h..][..h]);
                    b.iter().zip(x).map(|(b, x)| b * x)
                })
                .collect();
            self.conv.forward(&mut bx, state.buffer(self.state));
            for (r, conv) in rows.zip(bx.chunks_exact(h)) {
                let c = &bcx[r * 3 * h + h..][..h];
                let out = &mut gated[r * h..(r + 1) * h];
                out.iter_mut().zip(c.iter().zip(conv)).for_each(|(o, (c, v))| *o = c * v);
            }
        }
        self.out_proj.forward(&gated, tokens)
    }
}

impl DecoderLayer for Layer {
    fn mix(&self, x: &[f32], ctx: &mut StepCtx) -> Vec<f32> {
        self.mixer.forward(&self.operator_norm.applied(x), ctx)
    }

    fn feed_forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        self.mlp.forward(&self.ffn_norm.applied(x), rows)
    }
}
