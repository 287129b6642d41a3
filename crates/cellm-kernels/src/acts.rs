//! Activations quantized to int8 once per matmul, in blocks of 32 with one f32 scale each (and
//! the block's integer sum, for formats with an offset term). Weight formats with integer
//! kernels then run on integer dot products.

/// Elements per activation block; every integer-kernel format's blocks are multiples of it.
pub const QBLOCK: usize = 32;

/// `rows x cols` activations as int8 blocks.
#[derive(Debug, Default, Clone)]
pub struct Q8Acts {
    pub cols: usize,
    pub qs: Vec<i8>,
    pub d: Vec<f32>,
    pub sums: Vec<i32>,
}

/// One row of quantized activations.
#[derive(Clone, Copy)]
pub struct Q8Row<'a> {
    pub qs: &'a [i8],
    pub d: &'a [f32],
    pub sums: &'a [i32],
}

impl Q8Acts {
    /// Quantizes each `cols`-wide row of `x` (cols a multiple of 32): per block, the scale is
    /// max|x| / 127 and values round to nearest.
    pub fn quantize(x: &[f32], cols: usize) -> Self {
        assert!(cols.is_multiple_of(QBLOCK) && x.len().is_multiple_of(cols.max(1)));
        let blocks = x.len() / QBLOCK;
        let mut acts = Self {
            cols,
            qs: vec![0; x.len()],
            d: Vec::with_capacity(blocks),
            sums: Vec::with_capacity(blocks),
        };
        for (src, dst) in x.chunks_exact(QBLOCK).zip(acts.qs.chunks_exact_mut(QBLOCK)) {
            let amax = src.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            let mut sum = 0i32;
            for (q, v) in dst.iter_mut().zip(src) {
                *q = (v * inv).round() as i8;
                sum += i32::from(*q);
            }
            acts.d.push(d);
            acts.sums.push(sum);
        }
        acts
    }

    pub fn row(&self, r: usize) -> Q8Row<'_> {
        let b = self.cols / QBLOCK;
        Q8Row {
            qs: &self.qs[r * self.cols..(r + 1) * self.cols],
            d: &self.d[r * b..(r + 1) * b],
            sums: &self.sums[r * b..(r + 1) * b],
        }
    }
}
