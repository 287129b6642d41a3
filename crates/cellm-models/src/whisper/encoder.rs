//! Whisper's audio encoder: two 1-D convolutions with GELU (the second halves the frames),
//! the sinusoidal position table, pre-LayerNorm transformer layers (bidirectional attention,
//! GELU MLP) and a final LayerNorm. One 30-second window at a time.

use cellm_format::Result;
use cellm_kernels::gelu::gelu_in_place;

use crate::blocks::LayerNorm;
use crate::blocks::Linear;
use crate::weights::{Storage, Weights};
use crate::whisper::config::WhisperConfig;
use cellm_kernels::dense_attention::bidirectional_attention;

/// Whisper's LayerNorm epsilon (PyTorch's default; the HF config has no key for it).
pub const NORM_EPS: f32 = 1e-5;

/// A 1-D convolution of kernel 3 and padding 1 as one product: each output frame's three
/// input frames side by side (tap-major) times the kernel stored as `out x (3 * in)`, tap
/// by tap (the converter reorders PyTorch's `out x in x 3`).
struct Conv {
    linear: Linear,
    inp: usize,
    stride: usize,
}

const TAPS: usize = 3;

impl Conv {
    fn load(w: &Weights, prefix: &str, out: usize, inp: usize, stride: usize) -> Result<Self> {
        Ok(Self { linear: w.linear(prefix, out, TAPS * inp, true)?, inp, stride })
    }

    /// `frames x inp` in, `(frames / stride) x out` out, GELU applied.
    fn forward(&self, x: &[f32], frames: usize) -> (Vec<f32>, usize) {
        let c = self.inp;
        let out_frames = (frames + 2 - TAPS) / self.stride + 1;
        let mut cols = vec![0.0; out_frames * TAPS * c];
        for (t, row) in cols.chunks_exact_mut(TAPS * c).enumerate() {
            for (k, tap) in row.chunks_exact_mut(c).enumerate() {
                // Input frame t * stride + k - 1; the padding frames stay zero.
                let src = (t * self.stride + k).checked_sub(1).filter(|&s| s < frames);
                if let Some(s) = src {
                    tap.copy_from_slice(&x[s * c..(s + 1) * c]);
                }
            }
        }
        let mut y = self.linear.forward(&cols, out_frames);
        gelu_in_place(&mut y);
        (y, out_frames)
    }
}

struct EncoderLayer {
    attn_norm: LayerNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    out: Linear,
    mlp_norm: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

pub struct Encoder {
    conv1: Conv,
    conv2: Conv,
    /// `source_positions x hidden`, f32.
    positions: cellm_format::Tensor,
    layers: Vec<EncoderLayer>,
    norm: LayerNorm,
    heads: usize,
    dim: usize,
    bins: usize,
    frames: usize,
}

/// Whisper's attention projections: q, v and out have biases, k has none.
pub fn attention_linears(w: &Weights, prefix: &str, d: usize) -> Result<[Linear; 4]> {
    Ok([
        w.linear(&format!("{prefix}.q_proj"), d, d, true)?,
        w.linear(&format!("{prefix}.k_proj"), d, d, false)?,
        w.linear(&format!("{prefix}.v_proj"), d, d, true)?,
        w.linear(&format!("{prefix}.out_proj"), d, d, true)?,
    ])
}

impl Encoder {
    /// HF's tensor names under `model.encoder.`.
    pub fn load(w: &Weights, c: &WhisperConfig, d: usize) -> Result<Self> {
        let e = "model.encoder";
        let conv1 = Conv::load(w, &format!("{e}.conv1"), d, c.num_mel_bins, 1)?;
        let conv2 = Conv::load(w, &format!("{e}.conv2"), d, d, 2)?;
        let positions =
            w.get(&format!("{e}.embed_positions.weight"), &[c.source_positions, d], Storage::F32)?;
        let layers = (0..c.encoder_layers)
            .map(|i| {
                let p = format!("{e}.layers.{i}");
                let [q, k, v, out] = attention_linears(w, &format!("{p}.self_attn"), d)?;
                Ok(EncoderLayer {
                    attn_norm: LayerNorm::load(
                        w,
                        &format!("{p}.self_attn_layer_norm"),
                        d,
                        NORM_EPS,
                    )?,
                    q,
                    k,
                    v,
                    out,
                    mlp_norm: LayerNorm::load(w, &format!("{p}.final_layer_norm"), d, NORM_EPS)?,
                    fc1: w.linear(&format!("{p}.fc1"), c.encoder_ffn_dim, d, true)?,
                    fc2: w.linear(&format!("{p}.fc2"), d, c.encoder_ffn_dim, true)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let norm = LayerNorm::load(w, &format!("{e}.layer_norm"), d, NORM_EPS)?;
        Ok(Self {
            conv1,
            conv2,
            positions,
            layers,
            norm,
            heads: c.encoder_heads,
            dim: d,
            bins: c.num_mel_bins,
            frames: c.frames(),
        })
    }

    /// Encoder states (`source_positions x hidden`) of one window of log-mel features given
    /// as `bins x frames` (HF's `input_features` layout); the caller checked the length.
    pub fn forward(&self, mel: &[f32]) -> Vec<f32> {
        debug_assert_eq!(mel.len(), self.bins * self.frames);
        // Frame-major for the convolutions.
        let mut x = vec![0.0; mel.len()];
        for (b, row) in mel.chunks_exact(self.frames).enumerate() {
            for (t, &v) in row.iter().enumerate() {
                x[t * self.bins + b] = v;
            }
        }
        let (x, frames) = self.conv1.forward(&x, self.frames);
        let (mut x, n) = self.conv2.forward(&x, frames);
        let table = self.positions.as_f32().expect("checked at load");
        x.iter_mut().zip(table).for_each(|(x, p)| *x += p);
        let hd = self.dim / self.heads;
        let scale = 1.0 / (hd as f32).sqrt();
        for layer in &self.layers {
            let h = layer.attn_norm.applied(&x);
            let [q, k, v] = Linear::forward_many([&layer.q, &layer.k, &layer.v], &h, n);
            let ctx = bidirectional_attention(&q, &k, &v, n, self.heads, hd, scale);
            let attn = layer.out.forward(&ctx, n);
            x.iter_mut().zip(&attn).for_each(|(x, a)| *x += a);
            let mut h = layer.fc1.forward(&layer.mlp_norm.applied(&x), n);
            gelu_in_place(&mut h);
            let mlp = layer.fc2.forward(&h, n);
            x.iter_mut().zip(&mlp).for_each(|(x, m)| *x += m);
        }
        self.norm.apply(&mut x);
        x
    }
}
