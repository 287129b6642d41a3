//! The decoder's cross-attention over one window's encoder states. Its keys and values are
//! computed once per window ([`CrossAttention::remember`]) into the session's state buffer,
//! laid out for the f32 products: per head, the keys as rows (`positions x hd`), then per
//! head the values transposed (`hd x positions`). Decode steps only read them.
//!
//! With float32 weights the memory is f32; otherwise (f16 or quantized weights) it is kept
//! in f16, as the engine's default KV encoding keeps the self-attention's keys and values:
//! a decode step reads all of it (2 x 1500 x hidden per layer, more than the layer's
//! quantized weights), so half the bytes is a fifth of an int8 step.

use cellm_format::TensorFormat;
use cellm_kernels::gating::exp_in_place;
use cellm_kernels::pool::{parallel_for, SharedOut};
use cellm_kernels::{matmul_raw, WeightRows};
use cellm_kv::SeqState;

use crate::blocks::Linear;
use crate::Step;

pub struct CrossAttention {
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub out: Linear,
    pub heads: usize,
    pub positions: usize,
    /// Which state buffer of a session holds this layer's memory.
    pub buffer: usize,
    /// Whether the memory is stored as f16 (else f32).
    pub half: bool,
}

impl CrossAttention {
    fn dim(&self) -> usize {
        self.q.out_features()
    }

    /// Floats of one session's memory for this layer.
    pub fn state_len(&self) -> usize {
        let values = 2 * self.positions * self.dim();
        if self.half {
            values.div_ceil(2)
        } else {
            values
        }
    }

    /// Keys and values of `encoded` (`positions x hidden`) into `state`'s buffer.
    pub fn remember(&self, encoded: &[f32], state: &mut SeqState) {
        let (n, d) = (self.positions, self.dim());
        let [k, v] = Linear::forward_many([&self.k, &self.v], encoded, n);
        if self.half {
            let buf = state.buffer(self.buffer);
            // SAFETY: the f32 buffer's bytes as 2-byte values (u16 has the lesser alignment).
            let buf: &mut [u16] =
                unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr().cast(), buf.len() * 2) };
            let (keys, values) = buf.split_at_mut(n * d);
            let f16 = |x: f32| half::f16::from_f32(x).to_bits();
            return self.lay_out(&k, &v, keys, values, f16);
        }
        let buf = state.buffer(self.buffer);
        let (keys, values) = buf.split_at_mut(n * d);
        self.lay_out(&k, &v, keys, values, |x| x);
    }

    /// Per head: keys as rows, values transposed, each value converted by `cast`.
    fn lay_out<T: Copy>(
        &self,
        k: &[f32],
        v: &[f32],
        keys: &mut [T],
        values: &mut [T],
        cast: impl Fn(f32) -> T,
    ) {
        let (n, d) = (self.positions, self.dim());
        let hd = d / self.heads;
        for h in 0..self.heads {
            let (kh, vh) = (&mut keys[h * n * hd..][..n * hd], &mut values[h * hd * n..][..hd * n]);
            for p in 0..n {
                let row = p * d + h * hd;
                for j in 0..hd {
                    kh[p * hd + j] = cast(k[row + j]);
                    vh[j * n + p] = cast(v[row + j]);
                }
            }
        }
    }

    /// Cross-attention of the step's rows (`x` already normalised), each span over its own
    /// session's memory, through the output projection.
    pub fn forward(&self, x: &[f32], step: &Step, states: &mut [&mut SeqState]) -> Vec<f32> {
        let tokens = step.tokens.len();
        let (n, d) = (self.positions, self.dim());
        let hd = d / self.heads;
        let scale = 1.0 / (hd as f32).sqrt();
        let q = self.q.forward(x, tokens);
        let mut ctx = vec![0.0; tokens * d];
        let out = SharedOut(ctx.as_mut_ptr());
        for (span, state) in step.spans.iter().zip(states.iter_mut()) {
            let memory: &[f32] = state.buffer(self.buffer);
            // SAFETY: any f32 slice is a valid byte slice of 4 times its length.
            let memory: &[u8] =
                unsafe { std::slice::from_raw_parts(memory.as_ptr().cast(), memory.len() * 4) };
            let (format, size) =
                if self.half { (TensorFormat::F16, 2) } else { (TensorFormat::F32, 4) };
            let (keys, values) = memory.split_at(n * d * size);
            let rows = span.row0..span.row0 + span.len;
            parallel_for(self.heads, |h| {
                let qh: Vec<f32> =
                    rows.clone().flat_map(|r| q[r * d + h * hd..][..hd].iter().copied()).collect();
                let mut scores = vec![0.0; span.len * n];
                matmul_raw(
                    &qh,
                    span.len,
                    WeightRows {
                        format,
                        bytes: &keys[h * n * hd * size..][..n * hd * size],
                        rows: n,
                        cols: hd,
                    },
                    &mut scores,
                );
                softmax_rows(&mut scores, n, scale);
                let mut head = vec![0.0; span.len * hd];
                let vt = WeightRows {
                    format,
                    bytes: &values[h * hd * n * size..][..hd * n * size],
                    rows: hd,
                    cols: n,
                };
                matmul_raw(&scores, span.len, vt, &mut head);
                for (i, row) in head.chunks_exact(hd).enumerate() {
                    let at = (span.row0 + i) * d + h * hd;
                    // SAFETY: head h writes only its own columns of its span's rows.
                    let dst = unsafe { std::slice::from_raw_parts_mut(out.at(at), hd) };
                    dst.copy_from_slice(row);
                }
            });
        }
        self.out.forward(&ctx, tokens)
    }
}

/// `softmax(row * scale)` of each `width`-wide row of attention scores, in place.
fn softmax_rows(scores: &mut [f32], width: usize, scale: f32) {
    for row in scores.chunks_exact_mut(width) {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s * scale));
        row.iter_mut().for_each(|s| *s = *s * scale - max);
        // Many exponentials per head: the vectorized exp, not libm's.
        exp_in_place(row);
        let inv = 1.0 / row.iter().sum::<f32>();
        row.iter_mut().for_each(|s| *s *= inv);
    }
}
