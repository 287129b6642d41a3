//! The fixed rotation of the compressed (int8, int4) caches: per head, `R = H * S / sqrt(b)` on blocks of `b`
//! dimensions, with `H` the Walsh-Hadamard matrix and `S` a fixed diagonal of signs. `R` is
//! orthogonal, so `(R q) . (R k) = q . k` and `sum w (R v) = R (sum w v)`: attention runs on
//! rotated queries against rotated keys and values, and only its output turns back. The
//! rotation spreads a head's few large dimensions over the whole block, so the scales of
//! int8 rows and int4 groups see flatter values and waste fewer levels.

use cellm_kernels::hadamard::hadamard;

/// The most dimensions one Hadamard block spans.
const MAX_BLOCK: usize = 256;

#[derive(Debug, Clone)]
pub(crate) struct Rotation {
    block: usize,
    /// `S` for one head, with the `1 / sqrt(block)` normalisation folded in.
    signs: Vec<f32>,
}

impl Rotation {
    /// Rotates heads of `head_dim` in blocks of its largest power-of-two divisor (at most 256).
    pub(crate) fn new(head_dim: usize) -> Self {
        let block = (1usize << head_dim.trailing_zeros()).min(MAX_BLOCK);
        let norm = 1.0 / (block as f32).sqrt();
        // Fixed signs from a 64-bit mix of the index: the same for every run and machine.
        let signs = (0..head_dim as u64)
            .map(|i| {
                let h = (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                if (h ^ (h >> 29)) & (1 << 40) == 0 {
                    norm
                } else {
                    -norm
                }
            })
            .collect();
        Self { block, signs }
    }

    /// `x <- R x` for every head in `x` (a multiple of head_dim long).
    pub(crate) fn rotate(&self, x: &mut [f32]) {
        for head in x.chunks_exact_mut(self.signs.len()) {
            head.iter_mut().zip(&self.signs).for_each(|(v, s)| *v *= s);
            head.chunks_exact_mut(self.block).for_each(hadamard);
        }
    }

    /// `x <- R^T x` for every head in `x`.
    pub(crate) fn unrotate(&self, x: &mut [f32]) {
        for head in x.chunks_exact_mut(self.signs.len()) {
            head.chunks_exact_mut(self.block).for_each(hadamard);
            head.iter_mut().zip(&self.signs).for_each(|(v, s)| *v *= s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against the rotation written as a dense matrix: `H[i][j] = (-1)^popcount(i & j)` (the
    /// Sylvester construction) times the signs, per block; and R^T R = I.
    #[test]
    fn matches_the_dense_matrix_and_inverts() {
        for head_dim in [64, 96, 576] {
            let r = Rotation::new(head_dim);
            let b = r.block;
            assert_eq!(b, [64, 32, 64][[64, 96, 576].iter().position(|&d| d == head_dim).unwrap()]);
            let x: Vec<f32> = (0..2 * head_dim).map(|i| ((i * 37) % 11) as f32 - 5.0).collect();
            let mut got = x.clone();
            r.rotate(&mut got);
            for head in 0..2 {
                for i in 0..head_dim {
                    let (blk, row) = (i / b, i % b);
                    let want: f64 = (0..b)
                        .map(|j| {
                            let sign = if (row & j).count_ones() % 2 == 0 { 1.0 } else { -1.0 };
                            let col = blk * b + j;
                            sign * r.signs[col] as f64 * x[head * head_dim + col] as f64
                        })
                        .sum();
                    let g = got[head * head_dim + i] as f64;
                    assert!((g - want).abs() < 1e-4, "dim {head_dim} i {i}: {g} vs {want}");
                }
            }
            let norm = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
            assert!((norm(&got) - norm(&x)).abs() < 1e-3 * norm(&x), "orthogonal");
            r.unrotate(&mut got);
            for (a, b) in got.iter().zip(&x) {
                assert!((a - b).abs() < 1e-5, "R^T R x = x: {a} vs {b}");
            }
        }
    }
}
