//! Elementwise and row-wise operations on f32 activations.

/// RMSNorm of each `dim`-wide row of `x` in place: `x / sqrt(mean(x^2) + eps) * weight`.
pub fn rms_norm(x: &mut [f32], weight: &[f32], eps: f32) {
    let dim = weight.len();
    for row in x.chunks_exact_mut(dim) {
        let mean_sq = row.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        let inv = 1.0 / (mean_sq + eps).sqrt();
        for (v, w) in row.iter_mut().zip(weight) {
            *v = *v * inv * w;
        }
    }
}

/// `acc += scale * x`.
pub fn add_scaled(acc: &mut [f32], x: &[f32], scale: f32) {
    if scale == 1.0 {
        acc.iter_mut().zip(x).for_each(|(a, v)| *a += v);
    } else {
        acc.iter_mut().zip(x).for_each(|(a, v)| *a += scale * v);
    }
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
}
