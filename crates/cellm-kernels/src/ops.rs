//! Elementwise and row-wise operations on f32 activations.

/// RMSNorm of each `dim`-wide row of `x` in place: `x / sqrt(mean(x^2) + eps) * weight`.
pub fn rms_norm(x: &mut [f32], weight: &[f32], eps: f32) {
    let dim = weight.len();
    for row in x.chunks_exact_mut(dim) {
        let mean_sq = sum_of_squares(row) / dim as f32;
        let inv = 1.0 / (mean_sq + eps).sqrt();
        for (v, w) in row.iter_mut().zip(weight) {
            *v = *v * inv * w;
        }
    }
}

/// [`rms_norm`] of `x` into a new vector: one pass that reads `x` and writes the result,
/// instead of a copy and a pass over the copy.
pub fn rms_normed(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let dim = weight.len();
    let mut y = Vec::with_capacity(x.len());
    for row in x.chunks_exact(dim) {
        let mean_sq = sum_of_squares(row) / dim as f32;
        let inv = 1.0 / (mean_sq + eps).sqrt();
        y.extend(row.iter().zip(weight).map(|(v, w)| v * inv * w));
    }
    y
}

/// The sum of `x[i]^2` in 16 running sums (lane `i % 16`), then added pairwise: one fixed
/// order on every ISA, which the compiler turns into vector adds. (One running sum was a
/// chain of dependent adds, 4 cycles each: a step's norms took a few percent of a batched
/// decode, on the calling thread alone.)
fn sum_of_squares(x: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut acc = [0.0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a += v * v;
        }
    }
    for (a, v) in acc.iter_mut().zip(tail) {
        *a += v * v;
    }
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            acc[i] += acc[i + width];
        }
    }
    acc[0]
}

/// `acc += scale * x`.
pub fn add_scaled(acc: &mut [f32], x: &[f32], scale: f32) {
    if scale == 1.0 {
        acc.iter_mut().zip(x).for_each(|(a, v)| *a += v);
    } else {
        acc.iter_mut().zip(x).for_each(|(a, v)| *a += scale * v);
    }
}

/// `a . b` in eight interleaved partial sums (which the compiler keeps in one vector
/// register), added up at the end: a fixed order for a given length, on every path.
pub fn dot8(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = a8.remainder().iter().zip(b8.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in a8.zip(b8) {
        for i in 0..8 {
            lanes[i] += x[i] * y[i];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// Adds `bias` to each row of `x`.
pub fn add_bias(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        row.iter_mut().zip(bias).for_each(|(a, b)| *a += b);
    }
}

pub fn scale(x: &mut [f32], s: f32) {
    if s != 1.0 {
        x.iter_mut().for_each(|v| *v *= s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_matches_definition() {
        let mut x = vec![1.0, -2.0, 3.0, 0.5, 0.0, 4.0];
        rms_norm(&mut x, &[1.0, 2.0, 0.5], 1e-6);
        let r = ((1.0f32 + 4.0 + 9.0) / 3.0 + 1e-6).sqrt();
        assert!((x[1] - (-2.0 / r * 2.0)).abs() < 1e-6);
        let r2 = ((0.25f32 + 16.0) / 3.0 + 1e-6).sqrt();
        assert!((x[5] - 4.0 / r2 * 0.5).abs() < 1e-6);
    }

    /// The one-pass norm into a new vector is the in-place one, bit for bit (rows of 37:
    /// tails of the 16 running sums).
    #[test]
    fn rms_normed_equals_rms_norm() {
        let w: Vec<f32> = (0..37).map(|i| 0.5 + i as f32 * 0.03).collect();
        let x: Vec<f32> = (0..37 * 3).map(|i| ((i * 13) % 29) as f32 * 0.7 - 9.0).collect();
        let mut want = x.clone();
        rms_norm(&mut want, &w, 1e-5);
        assert_eq!(rms_normed(&x, &w, 1e-5), want);
    }
}
