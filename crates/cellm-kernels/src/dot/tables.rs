//! Kernel tables that several paths build the same way, as macros expanded inside each path's
//! module (so the tables name that module's own kernels).

/// `pub fn kernels(format) -> RowKernels` for a module with `dot_f32`, `decode_f32`,
/// `axpy_f32` and their `_f16`, `_bf16` twins, after the path's check `$ready` if any.
macro_rules! float_row_kernels {
    () => {
        float_row_kernels!(());
    };
    ($ready:expr) => {
        pub fn kernels(format: TensorFormat) -> super::kinds::RowKernels {
            $ready;
            use super::kinds::RowKernels as K;
            match format {
                TensorFormat::F32 => {
                    K { dot: dot_f32, decode: decode_f32, axpy: axpy_f32, qdot: None }
                }
                TensorFormat::F16 => {
                    K { dot: dot_f16, decode: decode_f16, axpy: axpy_f16, qdot: None }
                }
                TensorFormat::BF16 => {
                    K { dot: dot_bf16, decode: decode_bf16, axpy: axpy_bf16, qdot: None }
                }
                other => unreachable!("{other:?} is a block format"),
            }
        }
    };
}

/// `pub fn dot_tiles` as one row dot per (row, token), for a module with `kernels(format)`:
/// the scalar reference, and NEON (where decode tiles are one token anyway).
macro_rules! dot_tiles_by_rows {
    () => {
        pub fn dot_tiles(format: TensorFormat) -> super::kinds::DotTileFn {
            use super::floats::{float_index, FLOAT_BYTES, FLOAT_FORMATS};
            fn tile<const F: usize>(rows: &[&[u8]], x: &[f32], out: &mut [f32]) {
                let dot = kernels(FLOAT_FORMATS[F]).dot;
                let n = rows.first().map_or(0, |r| r.len() / FLOAT_BYTES[F]);
                let tokens = x.len() / n.max(1);
                assert!(out.len() == rows.len() * tokens, "dot_tile: output size");
                for (r, row) in rows.iter().enumerate() {
                    for t in 0..tokens {
                        out[r * tokens + t] = dot(row, &x[t * n..(t + 1) * n]);
                    }
                }
            }
            let tiles: [super::kinds::DotTileFn; 3] = [tile::<0>, tile::<1>, tile::<2>];
            tiles[float_index(format)]
        }
    };
}

/// `pub fn gemm_tiles` (the float GEMM's order for 1..=3 tokens, [`super::kinds::GEMM_TILE_ROWS`]
/// rows), for a module with `kernels(format)`: rows decoded to f32 a chunk of columns at a
/// time, then one multiply-add chain per (row, token) over the columns in order; `$fused`
/// says whether the path's GEMM tile fuses them (NEON's `fmla`) or rounds the product first
/// (the scalar tile).
macro_rules! gemm_tiles_in_order {
    ($fused:expr) => {
        pub fn gemm_tiles(format: TensorFormat) -> super::kinds::DotTileFn {
            use super::floats::{float_index, FLOAT_BYTES, FLOAT_FORMATS};
            use super::kinds::{GEMM_TILE_ROWS, TILE_TOKENS};
            fn tile<const F: usize>(rows: &[&[u8]], x: &[f32], out: &mut [f32]) {
                const CHUNK: usize = 64;
                let decode = kernels(FLOAT_FORMATS[F]).decode;
                let elem = FLOAT_BYTES[F];
                let n = rows.first().map_or(0, |r| r.len() / elem);
                let tokens = x.len() / n.max(1);
                assert!(rows.len() <= GEMM_TILE_ROWS && tokens <= TILE_TOKENS, "gemm_tile");
                assert!(out.len() == rows.len() * tokens, "gemm_tile: output size");
                let mut wide = [[0.0f32; CHUNK]; GEMM_TILE_ROWS];
                let mut acc = [[0.0f32; GEMM_TILE_ROWS]; TILE_TOKENS];
                for c0 in (0..n).step_by(CHUNK) {
                    let kc = (n - c0).min(CHUNK);
                    for (w, row) in wide.iter_mut().zip(rows) {
                        decode(&row[c0 * elem..(c0 + kc) * elem], &mut w[..kc]);
                    }
                    for c in 0..kc {
                        for (t, acc) in acc.iter_mut().enumerate().take(tokens) {
                            let xv = x[t * n + c0 + c];
                            for (a, w) in acc.iter_mut().zip(&wide).take(rows.len()) {
                                *a = if $fused { w[c].mul_add(xv, *a) } else { *a + w[c] * xv };
                            }
                        }
                    }
                }
                for (r, o) in out.chunks_exact_mut(tokens.max(1)).enumerate() {
                    o.iter_mut().enumerate().for_each(|(t, o)| *o = acc[t][r]);
                }
            }
            let tiles: [super::kinds::DotTileFn; 3] = [tile::<0>, tile::<1>, tile::<2>];
            tiles[float_index(format)]
        }
    };
}

/// `pub fn head_kernels` as one row kernel call per (head, row), for a module with
/// `kernels(format)`: the scalar reference, and NEON.
macro_rules! head_kernels_by_rows {
    () => {
        pub fn head_kernels(format: TensorFormat) -> super::kinds::HeadKernels {
            use super::floats::{float_index, FLOAT_BYTES, FLOAT_FORMATS};
            use super::kinds::{CachedRows, HeadKernels as K};
            fn dot_heads<const F: usize>(
                rows: CachedRows,
                q: &[f32],
                scores: &mut [f32],
                stride: usize,
            ) {
                let (dot, n, count) = (kernels(FLOAT_FORMATS[F]).dot, rows.dim, rows.count);
                let heads = rows.heads(FLOAT_BYTES[F], (q.len(), n), (scores.len(), stride));
                for s in 0..count {
                    let row = rows.row(s, FLOAT_BYTES[F]);
                    for h in 0..heads {
                        scores[h * stride + s] = dot(row, &q[h * n..(h + 1) * n]);
                    }
                }
            }
            fn axpy_heads<const F: usize>(
                weights: &[f32],
                stride: usize,
                rows: CachedRows,
                acc: &mut [f32],
            ) {
                let (axpy, n, count) = (kernels(FLOAT_FORMATS[F]).axpy, rows.dim, rows.count);
                let heads = rows.heads(FLOAT_BYTES[F], (acc.len(), n), (weights.len(), stride));
                for s in 0..count {
                    let row = rows.row(s, FLOAT_BYTES[F]);
                    for h in 0..heads {
                        axpy(weights[h * stride + s], row, &mut acc[h * n..(h + 1) * n]);
                    }
                }
            }
            let heads = [
                K { dot: dot_heads::<0>, axpy: axpy_heads::<0> },
                K { dot: dot_heads::<1>, axpy: axpy_heads::<1> },
                K { dot: dot_heads::<2>, axpy: axpy_heads::<2> },
            ];
            heads[float_index(format)]
        }
    };
}

/// `one` and `four`, the safe entries of an integer row kernel for one and four activation
/// rows, around the enclosing module's `run::<P, N>` (the kernel compiled for path `P`).
macro_rules! integer_entry_points {
    ($format:path) => {
        pub fn one<const P: u8>(row: &[u8], x: Q8Row) -> f32 {
            crate::dot::kinds::check_integer_acts(row, &[x], $format);
            // SAFETY: only the path tables hand these out, and `PathKernels::of` checks the
            // path's CPU features; every activation load stays inside the rows checked above.
            unsafe { run::<P, 1>(row, &[x])[0] }
        }

        pub fn four<const P: u8>(row: &[u8], x: &[Q8Row; 4]) -> [f32; 4] {
            crate::dot::kinds::check_integer_acts(row, x, $format);
            // SAFETY: as above.
            unsafe { run::<P, 4>(row, x) }
        }
    };
}

/// Calls `$then!` with every integer row kernel, as `entry module => kernel, format;`: the
/// list each path's integer entries are generated from.
macro_rules! with_integer_kernels {
    ($then:ident) => {
        $then! {
            e_q8_0 => q8_0, TensorFormat::Q8_0;
            e_q4_0 => q4_0, TensorFormat::Q4_0;
            e_q4_1 => q4_1, TensorFormat::Q4_1;
            e_q5_0 => q5_0, TensorFormat::Q5_0;
            e_q4_k => q4_k, TensorFormat::Q4K;
            e_q5_k => q5_k, TensorFormat::Q5K;
            e_q6_k => q6_k, TensorFormat::Q6K;
            e_q1_0 => q1_0, TensorFormat::Q1_0;
            e_i8_row => i8_row, TensorFormat::I8Row;
            e_i4_g64 => i4_g64, TensorFormat::I4G64;
            e_i4_g128 => i4_g128, TensorFormat::I4G128;
            e_i4a_g64 => i4a_g64, TensorFormat::I4AG64;
            e_i4a_g128 => i4a_g128, TensorFormat::I4AG128;
            e_i2a_g64 => i2a_g64, TensorFormat::I2AG64;
            e_i2a_g128 => i2a_g128, TensorFormat::I2AG128;
            e_i3a_g64 => i3a_g64, TensorFormat::I3AG64;
            e_i3a_g128 => i3a_g128, TensorFormat::I3AG128;
        }
    };
}

/// `fn entries<const P: u8>(format)`: the (one row, four rows) entries of `format` on path
/// `P`, from the entry modules `integer_entry_points!` filled.
macro_rules! integer_entries_table {
    ($($name:ident => $format:path),*) => {
        pub(super) fn entries<const P: u8>(format: TensorFormat) -> Option<(QDotFn, QDot4Fn)> {
            match format {
                $($format => Some(($name::one::<P>, $name::four::<P>)),)*
                _ => None,
            }
        }
    };
}
