//! From the tower's patches to the language model's embedding rows. Both connectors first
//! merge each `s x s` block of patches into one token (Idefics3's pixel shuffle and LFM2-VL's
//! pixel unshuffle are the same gather: row offset outer, column offset inner, channels
//! last), then project.

use cellm_format::Result;

use crate::blocks::LayerNorm;
use crate::blocks::Linear;
use crate::vision::config::{ConnectorKind, VisionConfig};
use crate::weights::Weights;
use cellm_kernels::gelu::gelu_in_place;

pub enum Connector {
    /// `proj(merged)`, no bias.
    Idefics3 {
        proj: Linear,
    },
    Lfm2Vl(Box<Projector>),
}

/// LFM2-VL's `linear_2(gelu(linear_1(layer_norm(merged))))`.
pub struct Projector {
    norm: Option<LayerNorm>,
    linear_1: Linear,
    linear_2: Linear,
}

impl Connector {
    pub fn load(w: &Weights, c: &VisionConfig, text_hidden: usize) -> Result<Self> {
        let merged = c.merged_dim();
        Ok(match c.connector {
            ConnectorKind::Idefics3 => Connector::Idefics3 {
                proj: w.linear("connector.proj", text_hidden, merged, false)?,
            },
            ConnectorKind::Lfm2Vl => {
                let (hidden, bias) = (c.projector_hidden_size, c.projector_bias);
                Connector::Lfm2Vl(Box::new(Projector {
                    // nn.LayerNorm's default eps, not the tower's.
                    norm: c
                        .projector_layernorm
                        .then(|| LayerNorm::load(w, "connector.layer_norm", merged, 1e-5))
                        .transpose()?,
                    linear_1: w.linear("connector.linear_1", hidden, merged, bias)?,
                    linear_2: w.linear("connector.linear_2", text_hidden, hidden, bias)?,
                }))
            }
        })
    }

    /// Embedding rows of tokens merged from `x` (`tokens x merged width`).
    pub fn project(&self, mut x: Vec<f32>, tokens: usize) -> Vec<f32> {
        match self {
            Connector::Idefics3 { proj } => proj.forward(&x, tokens),
            Connector::Lfm2Vl(p) => {
                if let Some(norm) = &p.norm {
                    norm.apply(&mut x);
                }
                let mut h = p.linear_1.forward(&x, tokens);
                gelu_in_place(&mut h);
                p.linear_2.forward(&h, tokens)
            }
        }
    }
}

/// Merges each `s x s` block of a `rows x cols` grid of `dim`-wide patches into one token of
/// `s * s * dim`: token (i, j) is patches (i s + a, j s + b) for a, then b, in order.
pub fn merge_blocks(x: &[f32], rows: usize, cols: usize, dim: usize, s: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for i in 0..rows / s {
        for j in 0..cols / s {
            for a in 0..s {
                let row = (i * s + a) * cols + j * s;
                out.extend_from_slice(&x[row * dim..(row + s) * dim]);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merging_takes_row_offsets_outer() {
        // A 2 x 4 grid of 1-wide patches numbered row-major, merged 2 x 2.
        let x: Vec<f32> = (0..8).map(|v| v as f32).collect();
        assert_eq!(merge_blocks(&x, 2, 4, 1, 2), [0.0, 1.0, 4.0, 5.0, 2.0, 3.0, 6.0, 7.0]);
    }
}
