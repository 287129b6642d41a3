//! Row kernels: dot product of one stored weight row with f32 activations, and decoding a
//! stored row to f32. One table per (format, ISA); every SIMD entry has a scalar twin.
//! [`PathKernels::of`] picks an ISA path's tables (`paths.rs`); the path modules take what
//! their kernels look like from `kinds.rs`. This module only declares and re-exports (and
//! holds the tests that compare every path with the scalar one).

#[macro_use]
mod tables;

#[cfg(target_arch = "x86_64")]
mod avx2;
mod blocks;
#[cfg(target_arch = "x86_64")]
mod bytes;
#[cfg(target_arch = "aarch64")]
mod bytes_neon;
mod floats;
#[cfg(target_arch = "x86_64")]
mod int_avx2;
#[cfg(target_arch = "aarch64")]
mod int_neon;
mod int_scalar;
pub(crate) mod kinds;
#[cfg(target_arch = "aarch64")]
mod neon;
mod paths;
#[cfg(target_arch = "x86_64")]
mod prefetch;
mod scalar;
pub mod x8;
#[cfg(target_arch = "x86_64")]
mod x8_avx2;
#[cfg(target_arch = "aarch64")]
mod x8_neon;

#[cfg(test)]
pub(crate) use floats::encode;
pub use kinds::{
    head_passes, AxpyFn, AxpyHeadsFn, CachedRows, DecodeFn, DotFn, DotHeadsFn, DotTileFn,
    DotTokensFn, HeadKernels, PanelFn, QDot4Fn, QDotFn, RowKernels, GEMM_TILE_ROWS, TILE_ROWS,
    TILE_TOKENS,
};
pub use paths::PathKernels;

/// Deterministic pseudo-random bytes for the kernel tests.
#[cfg(test)]
fn noise(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 24) as u8
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use cellm_format::TensorFormat;

    use super::*;
    use crate::isa::Isa;

    fn aligned(bytes: &[u8]) -> Vec<u32> {
        let mut words = vec![0u32; bytes.len().div_ceil(4)];
        // SAFETY: the u32 buffer is at least as long as `bytes`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                words.as_mut_ptr().cast::<u8>(),
                bytes.len(),
            )
        };
        words
    }

    fn as_bytes(words: &[u32], len: usize) -> &[u8] {
        // SAFETY: reading initialised u32 storage as bytes.
        unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), len) }
    }

    fn scalar_rows(format: TensorFormat) -> RowKernels {
        PathKernels::of(Isa::Scalar).row_kernels(format)
    }

    fn pseudo_random(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).max(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s as f32 / u32::MAX as f32) * 4.0 - 2.0
            })
            .collect()
    }

    /// Checks page kernels `heads` over `run` against one call of `rows` per (head, row),
    /// row `s` given by `row(s)` in the format `rows` reads: the dot within 1e-5 per
    /// element, the weighted sums within 1e-5 of their size per row. The heads' scores and
    /// weights lie `count + 5` apart, as a page's do in a block of pages: the gaps between
    /// the runs must stay as they were, and the gaps' weights must not count.
    fn check_by_rows(
        heads: HeadKernels,
        rows: RowKernels,
        run: CachedRows,
        row: &dyn Fn(usize) -> Vec<u8>,
        group: usize,
        what: &str,
    ) {
        let (n, count) = (run.dim, run.count);
        let stride = count + 5;
        let q = pseudo_random(n * group, 9);
        let mut got = vec![f32::NAN; group * stride];
        (heads.dot)(run, &q, &mut got, stride);
        for (i, g) in got.iter().enumerate() {
            let (h, s) = (i / stride, i % stride);
            if s >= count {
                assert!(g.is_nan(), "{what} dot wrote {g} past head {h}'s run");
                continue;
            }
            let want = (rows.dot)(&row(s), &q[h * n..(h + 1) * n]);
            assert!((g - want).abs() <= 1e-5 * n as f32, "{what} dot: {g} vs {want}");
        }
        let w: Vec<f32> = (0..group * stride)
            .map(|i| if i % stride < count { 0.3 - 0.07 * i as f32 } else { 1e9 })
            .collect();
        let (mut got, mut want) = (q.clone(), q.clone());
        (heads.axpy)(&w, stride, run, &mut got);
        for h in 0..group {
            for s in 0..count {
                (rows.axpy)(w[h * stride + s], &row(s), &mut want[h * n..(h + 1) * n]);
            }
        }
        for (g, w) in got.iter().zip(&want) {
            let tol = 1e-5 * w.abs().max(1.0) * count as f32;
            assert!((g - w).abs() <= tol, "{what} axpy: {g} vs {w}");
        }
    }

    /// The page kernels equal one scalar row kernel call per (head, row) on every path, for
    /// head dims with and without a tail, groups of 1 to 7 heads (one to three passes) and
    /// runs of rows that do and do not fill the last eight or four, strided as in a page plane.
    #[test]
    fn head_kernels_match_per_row_calls() {
        for isa in Isa::available() {
            for format in [TensorFormat::F32, TensorFormat::F16, TensorFormat::BF16] {
                let (rows, heads) =
                    (scalar_rows(format), PathKernels::of(isa).head_kernels(format));
                let elem = format.nbytes(&[1]).unwrap();
                for (n, group, count) in [
                    (64, 1, 16),
                    (64, 3, 7),
                    (64, 3, 13),
                    (128, 2, 24),
                    (60, 7, 5),
                    (256, 4, 1),
                    (12, 5, 9),
                    (80, 2, 6),
                ] {
                    // Each row sits in a stride of three rows (kv heads side by side), the
                    // run starting at the second.
                    let stride = 3 * n * elem;
                    let plane = encode(format, &pseudo_random(3 * n * count, n as u32));
                    let words = aligned(&plane);
                    let plane = as_bytes(&words, plane.len());
                    let run = CachedRows { bytes: &plane[n * elem..], stride, count, dim: n };
                    let row = |s: usize| plane[s * stride + n * elem..][..n * elem].to_vec();
                    check_by_rows(heads, rows, run, &row, group, &format!("{isa:?} {format:?}"));
                }
            }
        }
    }

    /// The int8 page kernels, on the paths that have them, equal the f32 kernels over the
    /// same rows decoded to f32 (`KvCodes::of(Isa::Scalar)`), for head dims with and without
    /// a tail, groups of 1 to 7 heads, and pages of up to 70 rows (past the kernels' stack
    /// buffers). Tolerance: the kernels scale each row's sum once where the decoded rows
    /// scaled each value, relative float rounding of a sum of n products.
    #[test]
    fn int8_head_kernels_match_decoded_rows() {
        use crate::kv_rows::{encode_i8, i8_row_bytes, KvCodes};
        let decode = KvCodes::of(Isa::Scalar).i8;
        for isa in Isa::available() {
            let Some(heads) = PathKernels::of(isa).int8_head_kernels() else { continue };
            let f32_rows = scalar_rows(TensorFormat::F32);
            for (n, group, count) in [(64, 3, 16), (64, 1, 70), (128, 4, 9), (60, 7, 5), (12, 2, 3)]
            {
                // Rows strided as in a page plane of three kv heads, the run at the second.
                let bytes = i8_row_bytes(n);
                let stride = 3 * bytes;
                let values = pseudo_random(3 * n * count, n as u32 + 1);
                let mut plane = vec![0u8; stride * count];
                for (row, x) in plane.chunks_exact_mut(bytes).zip(values.chunks_exact(n)) {
                    encode_i8(x, row);
                }
                let run = CachedRows { bytes: &plane[bytes..], stride, count, dim: n };
                let wide: Vec<Vec<f32>> = (0..count)
                    .map(|s| {
                        let mut out = vec![0.0; n];
                        decode(&plane[s * stride + bytes..][..bytes], &mut out);
                        out
                    })
                    .collect();
                let f32_row = |s: usize| -> Vec<u8> {
                    wide[s].iter().flat_map(|v| v.to_le_bytes()).collect()
                };
                check_by_rows(heads, f32_rows, run, &f32_row, group, &format!("{isa:?} int8"));
            }
        }
    }

    /// The float tiles equal one row kernel call per (row, token) on every path, for every
    /// tile shape and for row lengths with and without a tail.
    #[test]
    fn tiles_match_row_kernels() {
        for isa in Isa::available() {
            for format in [TensorFormat::F32, TensorFormat::F16, TensorFormat::BF16] {
                let (rows_k, tile) = (scalar_rows(format), PathKernels::of(isa).dot_tiles(format));
                for n in [8, 29, 64, 200] {
                    let stored: Vec<Vec<u32>> = (0..TILE_ROWS)
                        .map(|r| aligned(&encode(format, &pseudo_random(n, 40 + r as u32))))
                        .collect();
                    let len = encode(format, &pseudo_random(n, 1)).len();
                    let x = pseudo_random(n * TILE_TOKENS, 77);
                    for r_count in 1..=TILE_ROWS {
                        for t_count in 1..=TILE_TOKENS {
                            let rows: Vec<&[u8]> =
                                stored[..r_count].iter().map(|w| as_bytes(w, len)).collect();
                            let mut got = vec![0.0; r_count * t_count];
                            tile(&rows, &x[..t_count * n], &mut got);
                            for (r, row) in rows.iter().enumerate() {
                                for t in 0..t_count {
                                    let want = (rows_k.dot)(row, &x[t * n..(t + 1) * n]);
                                    let g = got[r * t_count + t];
                                    assert!(
                                        (g - want).abs() <= 1e-5 * n as f32,
                                        "{isa:?} {format:?} n={n} {r_count}x{t_count}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// The GEMM-order tiles give the float GEMM's sums bit for bit on every path: a token's
    /// products are the same bits with 1..=3 tokens as in a batch of 7, for row counts that
    /// fill and do not fill a tile's two blocks of 8, and lengths with and without a tail of
    /// columns (and two of the GEMM's column blocks).
    #[test]
    fn gemm_tiles_equal_the_gemm_bitwise() {
        use crate::gemm::FloatGemm;
        use crate::rows::WeightRows;
        for isa in Isa::available() {
            for format in [TensorFormat::F32, TensorFormat::F16, TensorFormat::BF16] {
                let tile = PathKernels::of(isa).gemm_tiles(format);
                for (rows, n) in [(GEMM_TILE_ROWS, 64), (11, 29), (5, 300), (3, 8)] {
                    let bytes = encode(format, &pseudo_random(rows * n, n as u32));
                    let words = aligned(&bytes);
                    let stored = as_bytes(&words, bytes.len());
                    let stride = stored.len() / rows;
                    let w = WeightRows { format, bytes: stored, rows, cols: n };
                    let batch = 7;
                    let x = pseudo_random(batch * n, 5);
                    let gemm = FloatGemm::new(w, isa);
                    let mut want = vec![0.0f32; batch * rows];
                    gemm.run(&gemm.pack(&x, batch), batch, 0..rows, |t, r0, vals| {
                        want[t * rows + r0..][..vals.len()].copy_from_slice(vals)
                    });
                    let row_bytes: Vec<&[u8]> = stored.chunks_exact(stride).collect();
                    for tokens in 1..=TILE_TOKENS {
                        let mut got = vec![0.0f32; rows * tokens];
                        tile(&row_bytes, &x[..tokens * n], &mut got);
                        for r in 0..rows {
                            for t in 0..tokens {
                                assert_eq!(
                                    got[r * tokens + t].to_bits(),
                                    want[t * rows + r].to_bits(),
                                    "{isa:?} {format:?} rows={rows} n={n} tokens={tokens} r={r}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// The several-token row dot gives each token what the path's row dot gives it alone,
    /// bit for bit, for 1 to 7 tokens (three at a time, then two or one) and row lengths with
    /// and without the 8-element and scalar tails.
    #[test]
    fn dot_tokens_equal_row_dots_bitwise() {
        for isa in Isa::available() {
            let path = PathKernels::of(isa);
            for format in [TensorFormat::F32, TensorFormat::F16, TensorFormat::BF16] {
                let Some(many) = path.dot_tokens(format) else { continue };
                let dot = path.row_kernels(format).dot;
                for n in [8, 29, 64, 77, 200] {
                    let bytes = encode(format, &pseudo_random(n, n as u32));
                    let words = aligned(&bytes);
                    let row = as_bytes(&words, bytes.len());
                    for tokens in 1..=7 {
                        let x = pseudo_random(tokens * n, 3 + tokens as u32);
                        let mut got = vec![0.0; tokens];
                        many(row, &x, &mut got);
                        for (t, g) in got.iter().enumerate() {
                            let want = dot(row, &x[t * n..(t + 1) * n]);
                            assert_eq!(g.to_bits(), want.to_bits(), "{isa:?} {format:?} n={n}");
                        }
                    }
                }
            }
        }
    }

    /// Every ISA path agrees with the scalar reference on every format, for lengths that are
    /// and are not multiples of the vector width, and on zeros and extreme magnitudes.
    #[test]
    fn simd_paths_match_scalar() {
        let formats = [TensorFormat::F32, TensorFormat::F16, TensorFormat::BF16];
        for isa in Isa::available() {
            for format in formats {
                let reference = scalar_rows(format);
                let k = PathKernels::of(isa).row_kernels(format);
                for (n, seed) in [(1, 1), (7, 2), (8, 3), (31, 4), (64, 5), (333, 6), (1024, 7)] {
                    for scale in [0.0f32, 1.0e-6, 1.0, 3.0e4] {
                        let w: Vec<f32> =
                            pseudo_random(n, seed).iter().map(|v| v * scale).collect();
                        let x = pseudo_random(n, seed + 100);
                        let bytes = encode(format, &w);
                        let words = aligned(&bytes);
                        let row = as_bytes(&words, bytes.len());
                        let (a, b) = ((reference.dot)(row, &x), (k.dot)(row, &x));
                        let mag: f32 = w.iter().zip(&x).map(|(p, q)| (p * q).abs()).sum();
                        assert!(
                            (a - b).abs() <= 1e-5 * mag.max(1.0),
                            "{isa:?} {format:?} n={n}: {a} vs {b}"
                        );
                        let (mut da, mut db) = (vec![0.0; n], vec![0.0; n]);
                        (reference.decode)(row, &mut da);
                        (k.decode)(row, &mut db);
                        assert_eq!(da, db, "{isa:?} {format:?} decode n={n}");
                        let (mut aa, mut ab) = (x.clone(), x.clone());
                        (reference.axpy)(0.37, row, &mut aa);
                        (k.axpy)(0.37, row, &mut ab);
                        for (p, q) in aa.iter().zip(&ab) {
                            assert!(
                                (p - q).abs() <= 1e-6 * p.abs().max(1.0),
                                "{isa:?} {format:?} axpy"
                            );
                        }
                    }
                }
            }
        }
    }
}
