//! A weight matrix as its kernels read it. Both products (`matmul`, `gemm`) take it, so it
//! lives apart from either.

use cellm_format::{Tensor, TensorFormat};

/// A weight matrix as stored: `rows` rows of `cols` elements in `format`.
#[derive(Clone, Copy)]
pub struct WeightRows<'a> {
    pub format: TensorFormat,
    pub bytes: &'a [u8],
    pub rows: usize,
    pub cols: usize,
}

impl<'a> WeightRows<'a> {
    pub fn of(w: &'a Tensor) -> Self {
        let (rows, cols) = w.rows_cols();
        Self { format: w.format, bytes: w.bytes(), rows, cols }
    }
}
