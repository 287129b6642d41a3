//! The tower's own layers: LayerNorm with a bias and exact (erf) gelu (its attention is
//! `cellm_kernels::dense_attention`).

use cellm_format::{Result, Tensor};

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
}
