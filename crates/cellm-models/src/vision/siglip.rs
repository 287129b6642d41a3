//! The SigLIP / SigLIP2 vision transformer: a linear patch embedding plus position
//! embeddings, pre-norm encoder layers (bidirectional attention, gelu-tanh MLP), a final
//! LayerNorm. Tiles are independent sequences: their linears run batched, attention per tile.

use cellm_format::Result;
use cellm_kernels::dense_attention::bidirectional_attention;
use cellm_kernels::gating::Gate;

use crate::blocks::LayerNorm;
use crate::blocks::Linear;
use crate::vision::config::VisionConfig;
use crate::vision::positions::Positions;
use crate::weights::{Storage, Weights};

/// Patches per pass through the layers (whole tiles; a larger tile passes alone).
const CHUNK_TOKENS: usize = 1024;

struct EncoderLayer {
    norm1: LayerNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    out: Linear,
    norm2: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

pub struct Tower {
    patch_embed: Linear,
    positions: Positions,
    layers: Vec<EncoderLayer>,
    post_norm: LayerNorm,
    heads: usize,
    dim: usize,
}

impl Tower {
    /// Tensors under `vision.` with HF's SigLIP names; the patch embedding is a linear over
    /// patches in (y, x, channel) order (the converter reorders Idefics3's conv kernel).
    pub fn load(w: &Weights, c: &VisionConfig) -> Result<Self> {
        let (d, eps) = (c.hidden_size, c.norm_eps);
        let e = "vision.embeddings";
        let patch_embed = w.linear(&format!("{e}.patch_embedding"), d, c.patch_dim(), true)?;
        let table =
            w.get(&format!("{e}.position_embedding.weight"), &[c.num_positions, d], Storage::F32)?;
        let positions = Positions::new(table, c.grid_side(), c.connector);
        let layers = (0..c.num_layers)
            .map(|i| {
                let p = format!("vision.encoder.layers.{i}");
                let a = format!("{p}.self_attn");
                Ok(EncoderLayer {
                    norm1: LayerNorm::load(w, &format!("{p}.layer_norm1"), d, eps)?,
                    q: w.linear(&format!("{a}.q_proj"), d, d, true)?,
                    k: w.linear(&format!("{a}.k_proj"), d, d, true)?,
                    v: w.linear(&format!("{a}.v_proj"), d, d, true)?,
                    out: w.linear(&format!("{a}.out_proj"), d, d, true)?,
                    norm2: LayerNorm::load(w, &format!("{p}.layer_norm2"), d, eps)?,
                    fc1: w.linear(&format!("{p}.mlp.fc1"), c.intermediate_size, d, true)?,
                    fc2: w.linear(&format!("{p}.mlp.fc2"), d, c.intermediate_size, true)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let post_norm = LayerNorm::load(w, "vision.post_layernorm", d, eps)?;
        Ok(Self { patch_embed, positions, layers, post_norm, heads: c.num_heads, dim: d })
    }

    /// Hidden states (`patches x dim`) of tiles given as their patch rows, tile after tile;
    /// `grids` holds each tile's (rows, cols) of patches.
    ///
    /// Tiles are independent sequences, so they pass through the layers in chunks of about
    /// CHUNK_TOKENS patches (whole tiles): a chunk's activations stay in the last-level
    /// cache between products, where 13 of SmolVLM's 1024-patch tiles at once (13312 rows,
    /// 160 MB of MLP activations) would stream through memory and be allocated and freed
    /// per layer. Each row's arithmetic is the same either way.
    pub fn forward(&self, patches: &[f32], grids: &[(usize, usize)]) -> Vec<f32> {
        let patch_dim = patches.len() / grids.iter().map(|(r, c)| r * c).sum::<usize>().max(1);
        let mut out = Vec::new();
        let (mut first, mut at) = (0, 0);
        while first < grids.len() {
            let mut end = first + 1;
            let mut tokens = grids[first].0 * grids[first].1;
            while end < grids.len() && tokens + grids[end].0 * grids[end].1 <= CHUNK_TOKENS {
                tokens += grids[end].0 * grids[end].1;
                end += 1;
            }
            let chunk = &patches[at * patch_dim..(at + tokens) * patch_dim];
            out.extend(self.forward_chunk(chunk, &grids[first..end]));
            (first, at) = (end, at + tokens);
        }
        out
    }

    fn forward_chunk(&self, patches: &[f32], grids: &[(usize, usize)]) -> Vec<f32> {
        let n: usize = grids.iter().map(|(r, c)| r * c).sum();
        let mut x = self.patch_embed.forward(patches, n);
        let mut at = 0;
        for &(rows, cols) in grids {
            let pos = self.positions.embeddings(rows, cols);
            x[at..at + pos.len()].iter_mut().zip(&pos).for_each(|(x, p)| *x += p);
            at += pos.len();
        }
        for layer in &self.layers {
            let [q, k, v] =
                Linear::forward_many([&layer.q, &layer.k, &layer.v], &layer.norm1.applied(&x), n);
            let hd = self.dim / self.heads;
            let scale = 1.0 / (hd as f32).sqrt();
            let mut ctx = Vec::with_capacity(n * self.dim);
            let mut start = 0;
            for &(rows, cols) in grids {
                let tile = start * self.dim..(start + rows * cols) * self.dim;
                let (q, k, v) = (&q[tile.clone()], &k[tile.clone()], &v[tile]);
                ctx.extend(bidirectional_attention(q, k, v, rows * cols, self.heads, hd, scale));
                start += rows * cols;
            }
            let attn = layer.out.forward(&ctx, n);
            x.iter_mut().zip(&attn).for_each(|(x, a)| *x += a);
            let mut h = layer.fc1.forward(&layer.norm2.applied(&x), n);
            Gate::GeluTanh.apply(&mut h, None);
            let mlp = layer.fc2.forward(&h, n);
            x.iter_mut().zip(&mlp).for_each(|(x, m)| *x += m);
        }
        self.post_norm.apply(&mut x);
        x
    }
}
