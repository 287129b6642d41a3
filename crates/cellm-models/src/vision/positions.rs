//! Where each patch of a tile takes its position embedding from the learned square grid:
//! Idefics3 buckets the tile's fractional coordinates into grid cells; SigLIP2 NaFlex resizes
//! the whole grid to the tile's patch grid (bilinear, antialiased when shrinking, as
//! `F.interpolate(mode="bilinear", align_corners=False, antialias=True)`).

use cellm_format::Tensor;

use crate::vision::config::ConnectorKind;

pub struct Positions {
    /// `side * side x dim`, f32.
    table: Tensor,
    side: usize,
    kind: ConnectorKind,
}

impl Positions {
    pub fn new(table: Tensor, side: usize, kind: ConnectorKind) -> Self {
        Self { table, side, kind }
    }

    /// The embeddings (`rows * cols x dim`) of a tile of `rows x cols` patches, row-major.
    pub fn embeddings(&self, rows: usize, cols: usize) -> Vec<f32> {
        let table = self.table.as_f32().expect("checked at load");
        let dim = table.len() / (self.side * self.side);
        let mut out = vec![0.0; rows * cols * dim];
        match self.kind {
            ConnectorKind::Idefics3 => {
                let (by, bx) = (self.buckets(rows), self.buckets(cols));
                for (i, o) in out.chunks_exact_mut(dim).enumerate() {
                    let cell = by[i / cols] * self.side + bx[i % cols];
                    o.copy_from_slice(&table[cell * dim..(cell + 1) * dim]);
                }
            }
            ConnectorKind::Lfm2Vl => {
                let (wy, wx) = (self.resize_weights(rows), self.resize_weights(cols));
                for (i, o) in out.chunks_exact_mut(dim).enumerate() {
                    let (ry, rx) = (&wy[i / cols], &wx[i % cols]);
                    for (y, &a) in ry.iter().enumerate().filter(|(_, a)| **a != 0.0) {
                        for (x, &b) in rx.iter().enumerate().filter(|(_, b)| **b != 0.0) {
                            let cell = &table[(y * self.side + x) * dim..][..dim];
                            o.iter_mut().zip(cell).for_each(|(o, c)| *o += a * b * c);
                        }
                    }
                }
            }
        }
        out
    }

    /// Idefics3: patch `i` of `n` sits at `i / n`, bucketed by the boundaries `k / side`,
    /// in f32 as torch computes them.
    fn buckets(&self, n: usize) -> Vec<usize> {
        let side = self.side as f64;
        let bounds: Vec<f32> =
            (0..self.side - 1).map(|k| (1.0 / side + k as f64 / side) as f32).collect();
        let step = 1.0 / n as f32;
        (0..n)
            .map(|i| {
                let frac = (i as f32 * step).min(1.0 - 1e-6);
                bounds.iter().filter(|&&b| b <= frac).count()
            })
            .collect()
    }

    /// NaFlex: per output index along an axis of `n`, the normalised triangle weights over
    /// the grid's `side` cells.
    fn resize_weights(&self, n: usize) -> Vec<Vec<f32>> {
        let scale = self.side as f32 / n as f32;
        let support = scale.max(1.0);
        (0..n)
            .map(|i| {
                let center = (i as f32 + 0.5) * scale - 0.5;
                let w: Vec<f32> = (0..self.side)
                    .map(|s| (1.0 - (s as f32 - center).abs() / support).max(0.0))
                    .collect();
                let total: f32 = w.iter().sum();
                w.into_iter().map(|v| v / total).collect()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use cellm_format::TensorFormat;

    use super::*;

    fn positions(kind: ConnectorKind) -> Positions {
        Positions::new(Tensor::zeros("table", TensorFormat::F32, &[16, 1]).unwrap(), 4, kind)
    }

    #[test]
    fn a_full_idefics3_tile_takes_the_grid_in_order() {
        assert_eq!(positions(ConnectorKind::Idefics3).buckets(4), [0, 1, 2, 3]);
        // A 2-patch side spreads over the 4-cell grid.
        assert_eq!(positions(ConnectorKind::Idefics3).buckets(2), [0, 2]);
    }

    #[test]
    fn resize_weights_are_normalised_and_identity_at_the_grid_size() {
        let p = positions(ConnectorKind::Lfm2Vl);
        for n in [1, 3, 4, 7, 26] {
            for w in p.resize_weights(n) {
                assert!((w.iter().sum::<f32>() - 1.0).abs() < 1e-6);
            }
        }
        let same = p.resize_weights(4);
        for (i, w) in same.iter().enumerate() {
            assert_eq!(w[i], 1.0);
        }
    }
}
