//! Whisper (speech to text): an audio encoder over 30-second windows of log-mel features
//! and a text decoder with learned positions, causal self-attention on the paged KV cache
//! and cross-attention to the window, whose keys and values each session keeps as its state
//! (written once per window by [`SpeechModel::attend_to`], read by every step). Features
//! are computed in Python (`python/cellm/audio`).

mod config;
mod cross;
mod encoder;

use cellm_format::{Error, Result, Tensor, TensorFormat};
use cellm_kernels::gelu::gelu_in_place;
use cellm_kernels::{matmul, ops};
use cellm_kv::{AttentionShape, PagePool, SeqState};

pub use config::WhisperConfig;

use crate::blocks::LayerNorm;
use crate::blocks::{Attention, Embedding, Linear};
use crate::decoder::{run_layers, DecoderLayer, StepCtx};
use crate::weights::{Storage, Weights};
use crate::{Activation, CacheLayout, CausalLm, ForwardError, ModelConfig, SpeechModel, Step};
use cross::CrossAttention;
use encoder::{attention_linears, Encoder, NORM_EPS};

struct Layer {
    self_norm: LayerNorm,
    self_attn: Attention,
    cross_norm: LayerNorm,
    cross: CrossAttention,
    mlp_norm: LayerNorm,
    fc1: Linear,
    fc2: Linear,
    index: usize,
}

impl DecoderLayer for Layer {
    /// Self-attention then cross-attention, each a pre-norm residual branch: returns both
    /// branches' sum, which the residual loop adds to `x`.
    fn mix(&self, x: &[f32], ctx: &mut StepCtx) -> Vec<f32> {
        let h = self.self_norm.applied(x);
        let mut delta = self.self_attn.forward(self.index, &h, ctx.step, ctx.positions, ctx.kv);
        let mut y = x.to_vec();
        ops::add_scaled(&mut y, &delta, 1.0);
        self.cross_norm.apply(&mut y);
        let cross = self.cross.forward(&y, ctx.step, ctx.states);
        ops::add_scaled(&mut delta, &cross, 1.0);
        delta
    }

    fn feed_forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let mut h = self.fc1.forward(&self.mlp_norm.applied(x), rows);
        gelu_in_place(&mut h);
        self.fc2.forward(&h, rows)
    }
}

pub struct Whisper {
    cfg: ModelConfig,
    audio: WhisperConfig,
    encoder: Encoder,
    embed: Embedding,
    /// Learned decoder positions, `max_position_embeddings x hidden`, f32.
    positions: Tensor,
    layers: Vec<Layer>,
    norm: LayerNorm,
}

/// HF's tensor names; the output projection is the token embedding (tied).
pub fn load(w: &Weights, cfg: ModelConfig) -> Result<Box<dyn CausalLm>> {
    let audio: WhisperConfig = cfg.section()?;
    if !cfg.tie_word_embeddings || cfg.hidden_act != Activation::Gelu {
        return Err(Error::format(
            "bad model description: whisper ties its output to the embedding and uses gelu",
        ));
    }
    let d = cfg.hidden_size;
    let encoder = Encoder::load(w, &audio, d)?;
    let p = "model.decoder";
    let embed =
        Embedding { table: w.tensor(&format!("{p}.embed_tokens.weight"), &[cfg.vocab_size, d])? };
    let positions = w.get(
        &format!("{p}.embed_positions.weight"),
        &[cfg.max_position_embeddings, d],
        Storage::F32,
    )?;
    let shape = AttentionShape {
        n_heads: cfg.num_heads,
        n_kv_heads: cfg.num_heads,
        head_dim: cfg.head_dim,
        scale: 1.0 / (cfg.head_dim as f32).sqrt(),
        window: None,
        softcap: None,
    };
    let layers = (0..cfg.num_layers)
        .map(|i| {
            let l = format!("{p}.layers.{i}");
            let [q, k, v, o] = attention_linears(w, &format!("{l}.self_attn"), d)?;
            let self_attn = Attention {
                q,
                k,
                v,
                o,
                q_norm: None,
                k_norm: None,
                shape: shape.clone(),
                rope: None,
                gated: false,
            };
            let [q, k, v, out] = attention_linears(w, &format!("{l}.encoder_attn"), d)?;
            let half = k.weight.format != TensorFormat::F32;
            let cross = CrossAttention {
                half,
                q,
                k,
                v,
                out,
                heads: cfg.num_heads,
                positions: audio.source_positions,
                buffer: i,
            };
            Ok(Layer {
                self_norm: LayerNorm::load(w, &format!("{l}.self_attn_layer_norm"), d, NORM_EPS)?,
                self_attn,
                cross_norm: LayerNorm::load(
                    w,
                    &format!("{l}.encoder_attn_layer_norm"),
                    d,
                    NORM_EPS,
                )?,
                cross,
                mlp_norm: LayerNorm::load(w, &format!("{l}.final_layer_norm"), d, NORM_EPS)?,
                fc1: w.linear(&format!("{l}.fc1"), cfg.intermediate_size, d, true)?,
                fc2: w.linear(&format!("{l}.fc2"), d, cfg.intermediate_size, true)?,
                index: i,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let norm = LayerNorm::load(w, &format!("{p}.layer_norm"), d, NORM_EPS)?;
    Ok(Box::new(Whisper { cfg, audio, encoder, embed, positions, layers, norm }))
}

impl CausalLm for Whisper {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn cache_layout(&self) -> CacheLayout {
        CacheLayout {
            kv_layers: self.cfg.num_layers,
            kv_heads: self.cfg.num_heads,
            head_dim: self.cfg.head_dim,
            windows: Vec::new(),
            state: self.layers.iter().map(|l| l.cross.state_len()).collect(),
            values_in_keys: false,
            state_fixed: true,
        }
    }

    fn position_limit(&self) -> Option<usize> {
        Some(self.cfg.max_position_embeddings)
    }

    fn forward(
        &self,
        step: &Step,
        kv: &mut PagePool,
        states: &mut [&mut SeqState],
    ) -> std::result::Result<Vec<f32>, ForwardError> {
        let d = self.cfg.hidden_size;
        let positions = step.positions();
        let mut x = self.embed.lookup(step.tokens, 1.0).expect("ids checked by the engine");
        let table = self.positions.as_f32().expect("checked at load");
        for (row, &pos) in x.chunks_exact_mut(d).zip(&positions) {
            // The engine keeps positions below `position_limit`.
            row.iter_mut().zip(&table[pos * d..(pos + 1) * d]).for_each(|(x, p)| *x += p);
        }
        let mut ctx = StepCtx { step, positions: &positions, kv, states };
        let (mut x, rows) = run_layers(&self.layers, x, d, 1.0, &mut ctx)?;
        self.norm.apply(&mut x);
        let mut logits = vec![0.0; rows * self.cfg.vocab_size];
        matmul(&x, rows, &self.embed.table, &mut logits);
        Ok(logits)
    }

    fn speech(&self) -> Option<&dyn SpeechModel> {
        Some(self)
    }
}

impl SpeechModel for Whisper {
    fn input_shape(&self) -> (usize, usize) {
        (self.audio.num_mel_bins, self.audio.frames())
    }

    fn encode(&self, mel: &[f32]) -> Result<Vec<f32>> {
        let (bins, frames) = self.input_shape();
        if mel.len() != bins * frames {
            return Err(Error::InvalidArgument(format!(
                "{} feature values for one window of {bins} mel bins x {frames} frames",
                mel.len()
            )));
        }
        Ok(self.encoder.forward(mel))
    }

    fn attend_to(&self, encoded: &[f32], state: &mut SeqState) -> Result<()> {
        let want = self.audio.source_positions * self.cfg.hidden_size;
        if encoded.len() != want {
            return Err(Error::InvalidArgument(format!(
                "{} encoder values, expected {} positions x {}",
                encoded.len(),
                self.audio.source_positions,
                self.cfg.hidden_size
            )));
        }
        self.layers.iter().for_each(|l| l.cross.remember(encoded, state));
        Ok(())
    }
}
