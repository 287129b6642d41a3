//! The SigLIP / SigLIP2 vision transformer: a linear patch embedding plus position
//! embeddings, pre-norm encoder layers (bidirectional attention, gelu-tanh MLP), a final
//! LayerNorm. Tiles are independent sequences: their linears run batched, attention per tile.

use cellm_format::{Result, TensorFormat};
use cellm_kernels::dense_attention::bidirectional_attention;
use cellm_kernels::gating::Gate;
use cellm_kernels::gemm::{bias_gelu_tanh, FloatGemm, PackedLayout};
use cellm_kernels::pool::{current_threads, parallel_for, SharedOut};
use cellm_kernels::{isa, WeightRows};

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
    /// Every encoder linear is stored as floats: the layers run as fused GEMMs
    /// ([`Tower::layers_fused`]); a quantized tower runs them through `matmul`.
    float: bool,
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
        let float = layers.iter().all(|l: &EncoderLayer| {
            [&l.q, &l.k, &l.v, &l.out, &l.fc1, &l.fc2].iter().all(|lin| {
                matches!(
                    lin.weight.format,
                    TensorFormat::F32 | TensorFormat::F16 | TensorFormat::BF16
                )
            })
        });
        Ok(Self { patch_embed, positions, layers, post_norm, heads: c.num_heads, dim: d, float })
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
        if self.float {
            self.layers_fused(&mut x, grids);
        } else {
            self.layers_unfused(&mut x, grids);
        }
        in_token_chunks(&mut x, self.dim, |rows| self.post_norm.apply(rows));
        x
    }

    /// Each tile's attention over its own patches: `ctx` from `q`, `k`, `v` (n x dim each).
    fn attention(&self, [q, k, v]: [&[f32]; 3], grids: &[(usize, usize)], ctx: &mut Vec<f32>) {
        let hd = self.dim / self.heads;
        let scale = 1.0 / (hd as f32).sqrt();
        ctx.clear();
        let mut start = 0;
        for &(rows, cols) in grids {
            let tile = start * self.dim..(start + rows * cols) * self.dim;
            let (q, k, v) = (&q[tile.clone()], &k[tile.clone()], &v[tile]);
            ctx.extend(bidirectional_attention(q, k, v, rows * cols, self.heads, hd, scale));
            start += rows * cols;
        }
    }

    /// The layers through `matmul` (any weight format), one product and one pass at a time.
    fn layers_unfused(&self, x: &mut [f32], grids: &[(usize, usize)]) {
        let n = x.len() / self.dim;
        let mut ctx = Vec::with_capacity(n * self.dim);
        for layer in &self.layers {
            let [q, k, v] =
                Linear::forward_many([&layer.q, &layer.k, &layer.v], &layer.norm1.applied(x), n);
            self.attention([&q, &k, &v], grids, &mut ctx);
            let attn = layer.out.forward(&ctx, n);
            x.iter_mut().zip(&attn).for_each(|(x, a)| *x += a);
            let mut h = layer.fc1.forward(&layer.norm2.applied(x), n);
            Gate::GeluTanh.apply(&mut h, None);
            let mlp = layer.fc2.forward(&h, n);
            x.iter_mut().zip(&mlp).for_each(|(x, m)| *x += m);
        }
    }

    /// The layers as float GEMMs whose inputs are written packed by their producers and whose
    /// outputs are finished where they are stored: the LayerNorms write the packed input of
    /// the next product; q/k/v get their bias as stored; the output projection and fc2 add
    /// bias and residual into `x`; fc1 adds its bias and applies gelu-tanh and writes fc2's
    /// packed input. No n x 3072 activation is ever stored row-major, zeroed or packed in a
    /// separate pass, and every pass runs on the pool. Buffers live for the whole chunk.
    fn layers_fused(&self, x: &mut [f32], grids: &[(usize, usize)]) {
        let (d, n) = (self.dim, x.len() / self.dim);
        let Some(first) = self.layers.first() else { return };
        let isa = isa::selected();
        let gemm = |l| float_gemm(l, isa);
        let (narrow, wide) = (gemm(&first.q).layout(n), gemm(&first.fc2).layout(n));
        let mut packed = vec![0.0f32; narrow.len()];
        let mut hidden = vec![0.0f32; wide.len()];
        let [mut q, mut k, mut v] = [0; 3].map(|_| vec![0.0f32; n * d]);
        let mut ctx = Vec::with_capacity(n * d);
        for layer in &self.layers {
            norm_packed(&layer.norm1, x, narrow, &mut packed);
            let qkv =
                [(&layer.q, &mut q), (&layer.k, &mut k), (&layer.v, &mut v)].map(|(l, out)| {
                    Product { gemm: gemm(l), bias: bias(l), out: Out::Rows(out.as_mut_ptr()) }
                });
            run_products(&qkv, &packed, n);
            self.attention([&q, &k, &v], grids, &mut ctx);
            pack_rows(&ctx, narrow, &mut packed);
            let residual = Out::Residual(x.as_mut_ptr());
            run_products(
                &[Product { gemm: gemm(&layer.out), bias: bias(&layer.out), out: residual }],
                &packed,
                n,
            );
            norm_packed(&layer.norm2, x, narrow, &mut packed);
            let gelu = Out::GeluPacked(hidden.as_mut_ptr(), wide);
            run_products(
                &[Product { gemm: gemm(&layer.fc1), bias: bias(&layer.fc1), out: gelu }],
                &packed,
                n,
            );
            let residual = Out::Residual(x.as_mut_ptr());
            run_products(
                &[Product { gemm: gemm(&layer.fc2), bias: bias(&layer.fc2), out: residual }],
                &hidden,
                n,
            );
        }
    }
}

fn float_gemm(l: &Linear, isa: cellm_kernels::Isa) -> FloatGemm<'_> {
    FloatGemm::new(WeightRows::of(&l.weight), isa)
}

fn bias(l: &Linear) -> &[f32] {
    l.bias.as_ref().and_then(|b| b.as_f32().ok()).expect("SigLIP linears have f32 biases")
}

/// Where a fused product's outputs go (with its bias added first).
#[derive(Clone, Copy)]
enum Out {
    /// Row-major `tokens x rows`.
    Rows(*mut f32),
    /// Added into row-major `tokens x rows` (the residual stream).
    Residual(*mut f32),
    /// gelu-tanh, written packed for the next product.
    GeluPacked(*mut f32, PackedLayout),
}

struct Product<'a> {
    gemm: FloatGemm<'a>,
    bias: &'a [f32],
    out: Out,
}

// SAFETY: tasks of `run_products` write disjoint outputs (distinct rows of a product).
unsafe impl Sync for Product<'_> {}

impl Product<'_> {
    /// Stores `vals` (rows r0.. of token t) finished.
    #[inline]
    fn store(&self, t: usize, r0: usize, vals: &[f32]) {
        let rows = self.bias.len();
        let bias = &self.bias[r0..r0 + vals.len()];
        // SAFETY (all three): (t, r0 + i) lies inside the output (tokens x rows) and belongs
        // to this task alone.
        match self.out {
            Out::Rows(p) => {
                let at = unsafe { p.add(t * rows + r0) };
                let dst = unsafe { std::slice::from_raw_parts_mut(at, vals.len()) };
                dst.iter_mut().zip(vals).zip(bias).for_each(|((o, v), b)| *o = v + b);
            }
            Out::Residual(p) => {
                let at = unsafe { p.add(t * rows + r0) };
                let dst = unsafe { std::slice::from_raw_parts_mut(at, vals.len()) };
                dst.iter_mut().zip(vals).zip(bias).for_each(|((o, v), b)| *o += v + b);
            }
            Out::GeluPacked(p, layout) => {
                let mut buf = [0.0f32; 64];
                let buf = &mut buf[..vals.len()];
                bias_gelu_tanh(vals, bias, buf);
                unsafe { layout.write(p, t, r0, buf) };
            }
        }
    }
}

/// The products over the same packed input, split into tasks of whole tiles of rows times
/// blocks of tokens on the pool: sixteen or so per thread, so that a thread that falls behind
/// (or is descheduled on a shared machine) leaves the others little to wait for.
fn run_products(products: &[Product], packed: &[f32], tokens: usize) {
    let threads = current_threads();
    let mut tasks = Vec::new();
    for (i, p) in products.iter().enumerate() {
        let rows = p.bias.len();
        let per = rows.div_ceil(threads * 4).next_multiple_of(p.gemm.tile_rows());
        let part = TASK_TOKENS.next_multiple_of(p.gemm.group());
        for r in (0..rows).step_by(per) {
            for t in (0..tokens).step_by(part) {
                tasks.push((i, r..(r + per).min(rows), t..(t + part).min(tokens)));
            }
        }
    }
    parallel_for(tasks.len(), |task| {
        let (i, rows, part) = tasks[task].clone();
        let p = &products[i];
        p.gemm.run_tokens(packed, tokens, part, rows, |t, r0, vals| p.store(t, r0, vals));
    });
}

/// Tokens per task of a fused product (rounded up to whole groups): at most one token block
/// of the GEMM, whose packed slice stays in L2.
const TASK_TOKENS: usize = 256;

/// Tokens per task of the row-wise passes (whole packed groups of any tile).
const ROW_TASK_TOKENS: usize = 48;

/// `f` over `x` (rows of `width`) in chunks of ROW_TASK_TOKENS rows on the pool.
fn in_token_chunks(x: &mut [f32], width: usize, f: impl Fn(&mut [f32]) + Sync) {
    let n = x.len() / width.max(1);
    let out = SharedOut(x.as_mut_ptr());
    parallel_for(n.div_ceil(ROW_TASK_TOKENS), |task| {
        let rows = task * ROW_TASK_TOKENS..((task + 1) * ROW_TASK_TOKENS).min(n);
        // SAFETY: the tasks' row ranges are disjoint and inside `x`.
        let chunk = unsafe {
            std::slice::from_raw_parts_mut(out.at(rows.start * width), rows.len() * width)
        };
        f(chunk);
    });
}

/// `norm(x)` written packed (`layout`), rows split over the pool.
fn norm_packed(norm: &LayerNorm, x: &[f32], layout: PackedLayout, packed: &mut [f32]) {
    let out = SharedOut(packed.as_mut_ptr());
    rows_packed(x, layout, |t, row, y| {
        y.copy_from_slice(row);
        norm.apply(y);
        // SAFETY: token t belongs to this task alone; the layout is `packed`'s.
        unsafe { layout.write(out.at(0), t, 0, y) };
    });
}

/// Rows of `x` copied into the packed layout, rows split over the pool.
fn pack_rows(x: &[f32], layout: PackedLayout, packed: &mut [f32]) {
    let out = SharedOut(packed.as_mut_ptr());
    // SAFETY: as above.
    rows_packed(x, layout, |t, row, _| unsafe { layout.write(out.at(0), t, 0, row) });
}

/// `f(t, row t of x, scratch row)` for every row of `x`, in tasks of ROW_TASK_TOKENS rows
/// (whole packed groups) on the pool.
fn rows_packed(x: &[f32], layout: PackedLayout, f: impl Fn(usize, &[f32], &mut [f32]) + Sync) {
    let width = layout.cols;
    let n = x.len() / width;
    parallel_for(n.div_ceil(ROW_TASK_TOKENS), |task| {
        let mut scratch = vec![0.0f32; width];
        for t in task * ROW_TASK_TOKENS..((task + 1) * ROW_TASK_TOKENS).min(n) {
            f(t, &x[t * width..(t + 1) * width], &mut scratch);
        }
    });
}
