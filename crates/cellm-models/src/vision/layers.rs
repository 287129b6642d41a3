//! The tower's own layers: LayerNorm with a bias, exact (erf) gelu, and bidirectional
//! multi-head attention over one image's patches.

use cellm_format::{Result, Tensor, TensorFormat};
use cellm_kernels::gating::exp_in_place;
use cellm_kernels::pool::{parallel_for, SharedOut};
use cellm_kernels::{matmul_raw, WeightRows};

use crate::weights::Weights;

/// `(x - mean) / sqrt(var + eps) * w + b` per row.
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f32,
}

impl LayerNorm {
    pub fn load(w: &Weights, prefix: &str, dim: usize, eps: f32) -> Result<Self> {
        Ok(Self {
            weight: w.vector(&format!("{prefix}.weight"), dim)?,
            bias: w.vector(&format!("{prefix}.bias"), dim)?,
            eps,
        })
    }

    pub fn apply(&self, x: &mut [f32]) {
        let w = self.weight.as_f32().expect("checked at load");
        let b = self.bias.as_f32().expect("checked at load");
        for row in x.chunks_exact_mut(w.len()) {
            let n = row.len() as f32;
            let mean = row.iter().sum::<f32>() / n;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
            let inv = 1.0 / (var + self.eps).sqrt();
            for ((v, w), b) in row.iter_mut().zip(w).zip(b) {
                *v = (*v - mean) * inv * w + b;
            }
        }
    }

    pub fn applied(&self, x: &[f32]) -> Vec<f32> {
        let mut y = x.to_vec();
        self.apply(&mut y);
        y
    }
}

/// `x * (1 + erf(x / sqrt 2)) / 2`, HF's `gelu` (LFM2-VL's projector), in f64 for the erf.
pub fn gelu_erf(x: &mut [f32]) {
    for v in x {
        let z = f64::from(*v);
        *v = (0.5 * z * (1.0 + erf(z / std::f64::consts::SQRT_2))) as f32;
    }
}

/// erf to about 1e-13 (std has none; Abramowitz-Stegun's 1.5e-7 would show in the
/// features): its Taylor series below 3, erfc's continued fraction above.
fn erf(x: f64) -> f64 {
    let a = x.abs();
    let r = if a < 3.0 {
        let (mut term, mut sum, x2) = (a, a, a * a);
        let mut n = 0.0;
        while term.abs() > 1e-17 * sum.abs() {
            n += 1.0;
            term *= -x2 / n;
            sum += term / (2.0 * n + 1.0);
        }
        sum * std::f64::consts::FRAC_2_SQRT_PI
    } else {
        // erfc(a) = exp(-a^2)/sqrt(pi) * 1/(a + 1/2/(a + 1/(a + 3/2/(a + ...)))).
        let mut f = a;
        for k in (1..60).rev() {
            f = a + (k as f64 / 2.0) / f;
        }
        1.0 - (-a * a).exp() / (std::f64::consts::PI.sqrt() * f)
    };
    r.copysign(x)
}

/// Softmax attention of every patch to every patch of one image: `q`, `k`, `v` are
/// `n x (heads * hd)`; returns the context rows in the same layout. Heads run in parallel,
/// each on the f32 GEMM serially.
pub fn bidirectional_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n: usize,
    heads: usize,
    hd: usize,
    scale: f32,
) -> Vec<f32> {
    let width = heads * hd;
    let mut ctx = vec![0.0; n * width];
    let out = SharedOut(ctx.as_mut_ptr());
    parallel_for(heads, |h| {
        let head = one_head([q, k, v], n, width, h * hd..(h + 1) * hd, scale);
        for (i, row) in head.chunks_exact(hd).enumerate() {
            // SAFETY: head h writes only its own columns of each row of `ctx`.
            let dst = unsafe { std::slice::from_raw_parts_mut(out.at(i * width + h * hd), hd) };
            dst.copy_from_slice(row);
        }
    });
    ctx
}

/// `softmax(Q K^T * scale) V` (`n x hd`) of the head whose columns are `cols`.
fn one_head(
    [q, k, v]: [&[f32]; 3],
    n: usize,
    width: usize,
    cols: std::ops::Range<usize>,
    scale: f32,
) -> Vec<f32> {
    let hd = cols.len();
    let part = |x: &[f32]| -> Vec<f32> {
        x.chunks_exact(width).flat_map(|row| row[cols.clone()].iter().copied()).collect()
    };
    let (qh, kh) = (part(q), part(k));
    // Scores = Q K^T: K's rows are the "weight" rows of an f32 product.
    let mut scores = vec![0.0; n * n];
    matmul_raw(&qh, n, f32_rows(&kh, n, hd), &mut scores);
    for row in scores.chunks_exact_mut(n) {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s * scale));
        row.iter_mut().for_each(|s| *s = *s * scale - max);
        // n^2 exponentials per head: the vectorized exp, not libm's.
        exp_in_place(row);
        let inv = 1.0 / row.iter().sum::<f32>();
        row.iter_mut().for_each(|s| *s *= inv);
    }
    // Context = P V: V transposed gives one weight row per output dim.
    let mut vt = vec![0.0; hd * n];
    for (i, row) in v.chunks_exact(width).enumerate() {
        for (d, &x) in row[cols.clone()].iter().enumerate() {
            vt[d * n + i] = x;
        }
    }
    let mut out = vec![0.0; n * hd];
    matmul_raw(&scores, n, f32_rows(&vt, hd, n), &mut out);
    out
}

/// An f32 matrix as weight rows for the kernels' products.
fn f32_rows(x: &[f32], rows: usize, cols: usize) -> WeightRows<'_> {
    debug_assert_eq!(x.len(), rows * cols);
    // SAFETY: any f32 slice is a valid byte slice of 4 times its length.
    let bytes = unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<u8>(), x.len() * 4) };
    WeightRows { format: TensorFormat::F32, bytes, rows, cols }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_matches_known_values() {
        for (x, want) in [
            (0.0, 0.0),
            (0.5, 0.520_499_877_813_046_5),
            (1.0, 0.842_700_792_949_714_9),
            (2.0, 0.995_322_265_018_952_7),
            (3.5, 0.999_999_256_901_627_7),
            (-1.0, -0.842_700_792_949_714_9),
        ] {
            assert!((erf(x) - want).abs() < 1e-13, "erf({x}) = {}", erf(x));
        }
    }

    #[test]
    fn attention_of_one_patch_is_its_value() {
        let v = [1.0, 2.0, 3.0, 4.0];
        let ctx = bidirectional_attention(&[0.5; 4], &[0.3; 4], &v, 1, 2, 2, 0.7);
        assert_eq!(ctx, v);
    }
}
