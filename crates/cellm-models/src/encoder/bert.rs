//! BERT-style sentence encoders (all-MiniLM-L6-v2 and the like): learned absolute position
//! and token-type embeddings, post-LayerNorm layers of full bidirectional attention and an
//! erf-GELU MLP. The output is the last hidden state of every token; pooling is the caller's.

use cellm_format::{Result, Tensor};
use cellm_kernels::decode_row;
use cellm_kernels::gating::exp_in_place;
use cellm_kernels::ops;
use serde::Deserialize;

use super::attention::{banded_attention, Band};
use super::base::{check_batch, description, positions, Encoder};
use crate::blocks::LayerNorm;
use crate::blocks::{Embedding, Linear};
use crate::config::{bad_field, check_dim, check_positive};
use crate::weights::Weights;

#[derive(Debug, Clone, Deserialize)]
struct Config {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_layers: usize,
    num_heads: usize,
    norm_eps: f32,
    max_position_embeddings: usize,
    type_vocab_size: usize,
}

impl Config {
    fn check(&self) -> Result<()> {
        check_dim("vocab_size", self.vocab_size)?;
        let h = check_dim("hidden_size", self.hidden_size)?;
        check_dim("intermediate_size", self.intermediate_size)?;
        check_dim("num_layers", self.num_layers)?;
        check_dim("max_position_embeddings", self.max_position_embeddings)?;
        check_dim("type_vocab_size", self.type_vocab_size)?;
        let heads = check_dim("num_heads", self.num_heads)?;
        if !h.is_multiple_of(heads) {
            return Err(bad_field("num_heads", format_args!("{heads} does not divide {h}")));
        }
        check_positive("norm_eps", self.norm_eps)?;
        Ok(())
    }
}

struct Layer {
    q: Linear,
    k: Linear,
    v: Linear,
    attn_out: Linear,
    attn_norm: LayerNorm,
    up: Linear,
    down: Linear,
    out_norm: LayerNorm,
}

pub struct Bert {
    cfg: Config,
    words: Embedding,
    positions: Tensor,
    /// Token type 0's row: every sentence is one segment.
    type0: Vec<f32>,
    embed_norm: LayerNorm,
    layers: Vec<Layer>,
}

pub fn load(w: &Weights, model: &serde_json::Value) -> Result<Box<dyn Encoder>> {
    let cfg: Config = description(model)?;
    cfg.check()?;
    let (h, inter, eps) = (cfg.hidden_size, cfg.intermediate_size, cfg.norm_eps);
    let words =
        Embedding { table: w.tensor("embeddings.word_embeddings.weight", &[cfg.vocab_size, h])? };
    let positions =
        w.tensor("embeddings.position_embeddings.weight", &[cfg.max_position_embeddings, h])?;
    let types = w.tensor("embeddings.token_type_embeddings.weight", &[cfg.type_vocab_size, h])?;
    let mut type0 = vec![0.0; h];
    decode_row(&types, 0, &mut type0);
    let embed_norm = LayerNorm::load(w, "embeddings.LayerNorm", h, eps)?;
    let layers = (0..cfg.num_layers)
        .map(|i| {
            let p = format!("encoder.layer.{i}");
            let a = format!("{p}.attention");
            Ok(Layer {
                q: w.linear(&format!("{a}.self.query"), h, h, true)?,
                k: w.linear(&format!("{a}.self.key"), h, h, true)?,
                v: w.linear(&format!("{a}.self.value"), h, h, true)?,
                attn_out: w.linear(&format!("{a}.output.dense"), h, h, true)?,
                attn_norm: LayerNorm::load(w, &format!("{a}.output.LayerNorm"), h, eps)?,
                up: w.linear(&format!("{p}.intermediate.dense"), inter, h, true)?,
                down: w.linear(&format!("{p}.output.dense"), h, inter, true)?,
                out_norm: LayerNorm::load(w, &format!("{p}.output.LayerNorm"), h, eps)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Box::new(Bert { cfg, words, positions, type0, embed_norm, layers }))
}

impl Encoder for Bert {
    fn width(&self) -> usize {
        self.cfg.hidden_size
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
        let h = self.cfg.hidden_size;
        let mut x = self.words.lookup(&tokens, 1.0)?;
        let mut pos_row = vec![0.0; h];
        for (row, p) in x.chunks_exact_mut(h).zip(positions(&lens)) {
            decode_row(&self.positions, p, &mut pos_row);
            ops::add_scaled(row, &pos_row, 1.0);
            ops::add_scaled(row, &self.type0, 1.0);
        }
        self.embed_norm.apply(&mut x);
        let hd = h / self.cfg.num_heads;
        let band = Band {
            heads: self.cfg.num_heads,
            kv_heads: self.cfg.num_heads,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            band: None,
            sinks: None,
        };
        for layer in &self.layers {
            let [q, k, v] = Linear::forward_many([&layer.q, &layer.k, &layer.v], &x, rows);
            let ctx = banded_attention(&q, &k, &v, &lens, &band);
            ops::add_scaled(&mut x, &layer.attn_out.forward(&ctx, rows), 1.0);
            layer.attn_norm.apply(&mut x);
            let mut mid = layer.up.forward(&x, rows);
            gelu_erf(&mut mid);
            ops::add_scaled(&mut x, &layer.down.forward(&mid, rows), 1.0);
            layer.out_norm.apply(&mut x);
        }
        Ok(x)
    }
}

/// `x * (1 + erf(x / sqrt 2)) / 2` with Abramowitz-Stegun 7.1.26's erf (absolute error
/// below 1.5e-7, as small as f32 rounding of the result), its exponentials vectorized.
fn gelu_erf(x: &mut [f32]) {
    const P: f32 = 0.327_591_1;
    const A: [f32; 5] = [0.254_829_6, -0.284_496_74, 1.421_413_7, -1.453_152_1, 1.061_405_4];
    for chunk in x.chunks_mut(1024) {
        // e^(-z^2) with z = x / sqrt 2.
        let mut e: Vec<f32> = chunk.iter().map(|v| -0.5 * v * v).collect();
        exp_in_place(&mut e);
        for (v, e) in chunk.iter_mut().zip(&e) {
            let t = 1.0 / (1.0 + P * v.abs() * std::f32::consts::FRAC_1_SQRT_2);
            let poly = t * (A[0] + t * (A[1] + t * (A[2] + t * (A[3] + t * A[4]))));
            let erf = (1.0 - poly * e).copysign(*v);
            *v = 0.5 * *v * (1.0 + erf);
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn gelu_matches_the_erf_definition() {
        // erf values to 16 digits; gelu(x) = x (1 + erf(x / sqrt 2)) / 2.
        for (x, erf) in [
            (0.5f64, 0.382_924_922_548_026_2),
            (-1.0, -0.682_689_492_137_085_9),
            (3.0, 0.997_300_203_936_739_8),
        ] {
            let mut v = [x as f32];
            super::gelu_erf(&mut v);
            let want = 0.5 * x * (1.0 + erf);
            assert!((f64::from(v[0]) - want).abs() < 3e-7, "gelu({x}) = {}", v[0]);
        }
    }
}
