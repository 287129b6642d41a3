//! What a path's kernels look like: their signatures, the per-format tables they come in
//! (`RowKernels`, `HeadKernels`) and the run of cached rows attention hands them. The path
//! modules import these from here, not from `mod.rs`, so none of them depends on the modules
//! that pick between them (`paths.rs`) or re-export them.

use cellm_format::TensorFormat;

use crate::acts::Q8Row;

/// Dot product of a stored row (raw bytes) with `x` (same length in elements).
pub type DotFn = fn(&[u8], &[f32]) -> f32;
/// Decode a stored row into `out`.
pub type DecodeFn = fn(&[u8], &mut [f32]);
/// `acc += w * row`, for attention's weighted sum of values.
pub type AxpyFn = fn(f32, &[u8], &mut [f32]);
/// Dot product of a stored row with int8-quantized activations.
pub type QDotFn = fn(&[u8], Q8Row) -> f32;
/// The same for four activation rows at once (each weight block unpacked once).
pub type QDot4Fn = fn(&[u8], &[Q8Row; 4]) -> [f32; 4];

/// `out[r * T + t] = dot(rows[r], x[t])` for 1..=4 float rows of one length and the `T` =
/// 1..=3 token rows in `x`: a register tile of the float matmul.
pub type DotTileFn = fn(&[&[u8]], &[f32], &mut [f32]);
/// `out[t] = dot(row, x[t])` for every token row of `x` (`out.len()` of them), each the same
/// bits as the path's row dot alone, the row loaded once for several tokens.
pub type DotTokensFn = fn(&[u8], &[f32], &mut [f32]);
/// Rows of the largest GEMM-order tile (`PathKernels::gemm_tiles`): a [`DotTileFn`] whose
/// sums are the float GEMM's, bit for bit, for a prompt of 1..=3 tokens.
pub const GEMM_TILE_ROWS: usize = 16;
/// Rows and tokens of the largest [`DotTileFn`] tile.
pub const TILE_ROWS: usize = 4;
pub const TILE_TOKENS: usize = 3;

/// A run of cached rows of one kv head: `count` rows of `dim` stored elements, `stride` bytes
/// apart, the first at the start of `bytes` (a page plane holds every kv head of a position
/// side by side, so one head's rows are strided).
#[derive(Clone, Copy)]
pub struct CachedRows<'a> {
    pub bytes: &'a [u8],
    pub stride: usize,
    pub count: usize,
    pub dim: usize,
}

impl<'a> CachedRows<'a> {
    /// The same rows in a plane that starts `offset` bytes later.
    #[inline]
    pub fn offset_by(self, offset: usize) -> Self {
        Self { bytes: &self.bytes[offset..], ..self }
    }

    /// Row `s`, for elements of `elem` bytes.
    pub fn row(&self, s: usize, elem: usize) -> &'a [u8] {
        &self.bytes[s * self.stride..][..self.dim * elem]
    }

    /// The number of heads in `per_head = (len, per)`: `len` values, `per` for each head
    /// (`dim` for queries and accumulators). Checks that every row lies inside `bytes` and
    /// that `runs = (len, stride)` holds a run of `count` values (scores or weights) for
    /// each of those heads, `stride` (at least `count`) apart. The SIMD kernels read through
    /// raw pointers after this check.
    #[inline]
    pub(super) fn heads(
        &self,
        elem: usize,
        per_head: (usize, usize),
        runs: (usize, usize),
    ) -> usize {
        let end = self.count.checked_sub(1).map_or(0, |last| last * self.stride + self.dim * elem);
        assert!(self.bytes.len() >= end, "cached rows end at {end}, past the plane");
        assert!(self.dim > 0 && self.count > 0, "cached rows: empty run");
        let heads = per_head.0 / per_head.1;
        let (len, stride) = runs;
        let runs_fit = heads.checked_sub(1).is_none_or(|last| len >= last * stride + self.count);
        assert!(
            per_head.0 == heads * per_head.1 && stride >= self.count && runs_fit,
            "head shapes"
        );
        heads
    }
}

/// `scores[h * stride + s] = dot(q[h], row s)` for the query heads that share the rows' kv
/// head (`q` holds those heads, `rows.dim` apart; each head's `rows.count` scores start
/// `stride` apart, so that a page's scores land in place in a longer run of positions).
pub type DotHeadsFn = fn(CachedRows, &[f32], &mut [f32], usize);
/// `acc[h] += sum over s of weights[h * stride + s] * row s`, for the heads that share the
/// rows' kv head (`acc` holds those heads, `rows.dim` apart).
pub type AxpyHeadsFn = fn(&[f32], usize, CachedRows, &mut [f32]);

/// How many heads of a group a page kernel takes in one pass, and the passes' sizes: the
/// group split as evenly as it goes into passes of at most `most` (7 in threes: 3, 2, 2).
pub fn head_passes(heads: usize, most: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let passes = heads.div_ceil(most);
    (0..passes).map(move |p| p * heads / passes..(p + 1) * heads / passes)
}

/// Widens columns `0..cols` (a multiple of 8) of up to 16 stored float rows into `panel`,
/// column-major with 16 rows per column; rows past `rows.len()` are zeros (`gemm`'s panels).
pub type PanelFn = fn(rows: &[&[u8]], cols: usize, panel: &mut [f32]);

/// Attention's kernels over a float cache row, for a group of query heads at once.
#[derive(Clone, Copy)]
pub struct HeadKernels {
    pub dot: DotHeadsFn,
    pub axpy: AxpyHeadsFn,
}

#[derive(Clone, Copy)]
pub struct RowKernels {
    pub dot: DotFn,
    pub decode: DecodeFn,
    pub axpy: AxpyFn,
    /// Integer kernels (one and four activation rows), for formats that take int8
    /// activations.
    pub qdot: Option<(QDotFn, QDot4Fn)>,
}

/// Panics unless every activation row covers the integer kernel's weight row.
pub(super) fn check_integer_acts(row: &[u8], x: &[Q8Row], f: TensorFormat) {
    let elems = (row.len() - f.row_header()) / f.block_bytes() * f.block_len();
    for r in x {
        assert!(r.qs.len() >= elems && r.ds.len() * 32 >= elems, "activations too short");
    }
}
