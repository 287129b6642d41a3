//! BERT-style sentence encoders (all-MiniLM-L6-v2 and the like): learned absolute position
//! and token-type embeddings, post-LayerNorm layers of full bidirectional attention and an
//! erf-GELU MLP. The output is the last hidden state of every token; pooling is the caller's.

use cellm_format::{Error, Result, Tensor};
use cellm_kernels::decode_row;
use cellm_kernels::ops;
use cellm_kernels::pool::{self, parallel_for, SharedOut};
use serde::Deserialize;

use super::attention::{banded_attention_into, lane_sum, Band, Rows};
use super::base::{check_batch, description, positions, Encoder};
use super::dense::{dense, Epilogue, Target};
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
    attn_norm: Norm,
    up: Linear,
    down: Linear,
    out_norm: Norm,
}

pub struct Bert {
    cfg: Config,
    words: Embedding,
    positions: Tensor,
    /// Token type 0's row: every sentence is one segment.
    type0: Vec<f32>,
    embed_norm: Norm,
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
    let embed_norm = Norm::load(w, "embeddings.LayerNorm", h, eps)?;
    let layers = (0..cfg.num_layers)
        .map(|i| {
            let p = format!("encoder.layer.{i}");
            let a = format!("{p}.attention");
            Ok(Layer {
                q: w.linear(&format!("{a}.self.query"), h, h, true)?,
                k: w.linear(&format!("{a}.self.key"), h, h, true)?,
                v: w.linear(&format!("{a}.self.value"), h, h, true)?,
                attn_out: w.linear(&format!("{a}.output.dense"), h, h, true)?,
                attn_norm: Norm::load(w, &format!("{a}.output.LayerNorm"), h, eps)?,
                up: w.linear(&format!("{p}.intermediate.dense"), inter, h, true)?,
                down: w.linear(&format!("{p}.output.dense"), h, inter, true)?,
                out_norm: Norm::load(w, &format!("{p}.output.LayerNorm"), h, eps)?,
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
        let vocab = self.cfg.vocab_size;
        if let Some(t) = seqs.iter().flat_map(|s| s.iter()).find(|&&t| t as usize >= vocab) {
            return Err(Error::InvalidArgument(format!(
                "token id {t} is outside the vocabulary ({vocab})"
            )));
        }
        let h = self.cfg.hidden_size;
        let mut out = vec![0.0; lens.iter().sum::<usize>() * h];
        let threads = pool::current_threads();
        let Some(blocks) = plan_blocks(&lens, threads) else {
            // Too few sequences to keep every thread busy: each step splits over the pool.
            self.encode(seqs, &lens, &mut out, threads * 2);
            return Ok(out);
        };
        // Blocks of whole sequences, each through every layer on one thread: no step waits
        // for the others, and a block's activations stay in cache from layer to layer.
        let starts: Vec<usize> =
            lens.iter().scan(0, |at, &n| Some(std::mem::replace(at, *at + n))).collect();
        let dst = SharedOut(out.as_mut_ptr());
        parallel_for(blocks.len(), |b| {
            let r = blocks[b].clone();
            let rows: usize = lens[r.clone()].iter().sum();
            // SAFETY: blocks hold disjoint runs of sequences, so their rows do not overlap.
            let x =
                unsafe { std::slice::from_raw_parts_mut(dst.at(starts[r.start] * h), rows * h) };
            self.encode(&seqs[r.clone()], &lens[r], x, 1);
        });
        Ok(out)
    }
}

/// The most tokens of a block of sequences that one thread runs through the layers.
const BLOCK_TOKENS: usize = 512;

/// Consecutive runs of sequences, a few per thread, or None where they cannot keep the
/// threads evenly busy (fewer sequences than threads, or one block longer than a thread's
/// share).
fn plan_blocks(lens: &[usize], threads: usize) -> Option<Vec<std::ops::Range<usize>>> {
    let total: usize = lens.iter().sum();
    if threads < 2 || lens.len() < threads {
        return None;
    }
    let target = total.div_ceil(threads * 4).clamp(1, BLOCK_TOKENS);
    let mut blocks = Vec::new();
    let (mut start, mut tokens) = (0, 0);
    for (i, &n) in lens.iter().enumerate() {
        if tokens > 0 && tokens + n > target.max(n) {
            blocks.push(start..i);
            (start, tokens) = (i, 0);
        }
        tokens += n;
    }
    blocks.push(start..lens.len());
    let longest = blocks.iter().map(|r| lens[r.clone()].iter().sum::<usize>()).max()?;
    (blocks.len() >= threads && longest * threads <= total).then_some(blocks)
}

impl Bert {
    /// The last hidden states of `seqs` (`lens` tokens each) into `x` (`sum(lens) x hidden`);
    /// `split`: tasks per step for the installed pool (1: this thread only).
    fn encode(&self, seqs: &[&[u32]], lens: &[usize], x: &mut [f32], split: usize) {
        let (h, inter) = (self.cfg.hidden_size, self.cfg.intermediate_size);
        let rows = x.len() / h;
        let mut pos_row = vec![0.0; h];
        let tokens = seqs.iter().flat_map(|s| s.iter());
        for ((row, p), &t) in x.chunks_exact_mut(h).zip(positions(lens)).zip(tokens) {
            decode_row(&self.words.table, t as usize, row);
            decode_row(&self.positions, p, &mut pos_row);
            ops::add_scaled(row, &pos_row, 1.0);
            ops::add_scaled(row, &self.type0, 1.0);
        }
        normalize(&self.embed_norm, x, h, split);
        let hd = h / self.cfg.num_heads;
        let band = Band {
            heads: self.cfg.num_heads,
            kv_heads: self.cfg.num_heads,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            band: None,
            sinks: None,
        };
        // q, k and v side by side in each row; the buffers serve every layer.
        let mut qkv = vec![0.0; rows * 3 * h];
        let mut ctx = vec![0.0; rows * h];
        let mut mid = vec![0.0; rows * inter];
        for layer in &self.layers {
            let qkv_targets = [
                Target { linear: &layer.q, offset: 0 },
                Target { linear: &layer.k, offset: h },
                Target { linear: &layer.v, offset: 2 * h },
            ];
            dense(x, rows, &qkv_targets, &mut qkv, 3 * h, Epilogue::Store, split);
            let at = |offset| Rows { data: &qkv, stride: 3 * h, offset };
            banded_attention_into(at(0), at(h), at(2 * h), lens, &band, &mut ctx);
            let attn_out = [Target { linear: &layer.attn_out, offset: 0 }];
            dense(&ctx, rows, &attn_out, x, h, Epilogue::Add, split);
            normalize(&layer.attn_norm, x, h, split);
            let up = [Target { linear: &layer.up, offset: 0 }];
            dense(x, rows, &up, &mut mid, inter, Epilogue::Gelu, split);
            let down = [Target { linear: &layer.down, offset: 0 }];
            dense(&mid, rows, &down, x, h, Epilogue::Add, split);
            normalize(&layer.out_norm, x, h, split);
        }
    }
}

/// LayerNorm's weight and bias: `(x - mean) / sqrt(var + eps) * w + b` per row.
struct Norm {
    weight: Vec<f32>,
    bias: Vec<f32>,
    eps: f32,
}

impl Norm {
    fn load(w: &Weights, prefix: &str, dim: usize, eps: f32) -> Result<Self> {
        let weight = w.vector(&format!("{prefix}.weight"), dim)?.as_f32()?.to_vec();
        let bias = w.vector(&format!("{prefix}.bias"), dim)?.as_f32()?.to_vec();
        Ok(Self { weight, bias, eps })
    }

    fn row(&self, row: &mut [f32]) {
        let n = row.len() as f32;
        let mean = lane_sum(row, |v| v) / n;
        let var = lane_sum(row, |v| (v - mean) * (v - mean)) / n;
        let inv = 1.0 / (var + self.eps).sqrt();
        for ((v, w), b) in row.iter_mut().zip(&self.weight).zip(&self.bias) {
            *v = (*v - mean) * inv * w + b;
        }
    }
}

/// LayerNorm of each `h`-wide row of `x`, in `split` tasks on the pool.
fn normalize(norm: &Norm, x: &mut [f32], h: usize, split: usize) {
    let rows = x.len() / h;
    let per = rows.div_ceil(split.max(1)).max(1);
    let len = x.len();
    let dst = SharedOut(x.as_mut_ptr());
    parallel_for(rows.div_ceil(per), |i| {
        let (a, b) = (i * per * h, ((i + 1) * per * h).min(len));
        // SAFETY: the tasks' row ranges are disjoint and inside `x`.
        let part = unsafe { std::slice::from_raw_parts_mut(dst.at(a), b - a) };
        part.chunks_exact_mut(h).for_each(|row| norm.row(row));
    });
}

#[cfg(test)]
mod tests {
    use super::plan_blocks;

    #[test]
    fn blocks_cover_the_batch_in_order_and_share_it_evenly() {
        let lens = [128; 64];
        let blocks = plan_blocks(&lens, 2).unwrap();
        assert_eq!(blocks.len(), 16);
        assert!(blocks.iter().all(|r| r.len() == 4));
        assert_eq!(blocks.first().unwrap().start, 0);
        assert_eq!(blocks.last().unwrap().end, 64);
        assert!(blocks.windows(2).all(|w| w[0].end == w[1].start));
        // Uneven lengths: still whole, consecutive runs.
        let lens = [3, 500, 7, 9, 200, 1, 1, 300, 40, 40];
        let blocks = plan_blocks(&lens, 2).unwrap();
        assert_eq!(blocks.iter().map(|r| r.len()).sum::<usize>(), lens.len());
        assert!(blocks.windows(2).all(|w| w[0].end == w[1].start));
    }

    #[test]
    fn too_few_or_too_uneven_sequences_split_each_step_instead() {
        assert!(plan_blocks(&[128], 2).is_none());
        assert!(plan_blocks(&[128; 8], 1).is_none());
        // One sequence is more than a thread's share.
        assert!(plan_blocks(&[500, 10, 10], 2).is_none());
        assert!(plan_blocks(&[100, 100], 2).is_some());
    }
}
