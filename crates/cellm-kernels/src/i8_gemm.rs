//! cellm's int8 rows (`i8_row`: an f32 scale per row, then the row's int8 values) times a
//! batch of tokens (prefill, Whisper's 1500-frame encoder) as a blocked integer GEMM.
//!
//! The per-row kernels (`dot::int_avx2::i8_row`) read each weight row once per 4 tokens and
//! pay a sign fix-up, a conversion and a multiply-add per 32 products. Here a task packs 32
//! stored rows into a panel, 4 consecutive columns of each row side by side (so one 64-byte
//! vector holds 16 rows x 4 columns), offset by +128 to unsigned bytes, and multiplies it with
//! 6 tokens at once: per 4 columns, two panel vectors times six broadcast 4-byte groups of
//! int8 activations, 12 `vpdpbusd` per 8 loads, no horizontal sums. The output lanes are rows,
//! so a tile's results are stored as they are.
//!
//! The activations are the per-row kernels' own (`ActScheme::Q8_0`: int8 in blocks of 32, each
//! with an f16-rounded scale `d`), so both compute the same sum:
//! `scale_r * sum_b d_b * sum_{k in b} w_k q_k`. Per block the integer products
//! `P_b = sum (w_k + 128) q_k` lose the offset's share `128 * sum_{k in b} q_k` (one integer
//! per token and block, subtracted in the integer lanes, so each block's dot product is exact,
//! as the row kernel's is), are converted once and multiplied by `d_b`.
//! `|P_b| <= 32 * 255 * 128`: no int32 overflow.

use std::ops::Range;

use cellm_format::TensorFormat;

use crate::acts::{Q8Acts, QBLOCK};
use crate::isa::{self, Isa};
use crate::rows::WeightRows;

/// Rows of a packed panel (two 16-lane vectors).
pub const PANEL_ROWS: usize = 32;
/// Tokens of a register tile: 12 integer and 12 float accumulators, 2 panel vectors and a
/// broadcast fit the 32 vector registers.
pub const TILE_TOKENS: usize = 6;
/// Below this many tokens the per-row kernels win (no panel to pack).
pub const MIN_TOKENS: usize = 16;

/// Whether `tokens` tokens times `w` run here on this CPU's selected kernel path.
pub fn applies(w: WeightRows, tokens: usize) -> bool {
    w.format == TensorFormat::I8Row
        && tokens >= MIN_TOKENS
        && w.cols.is_multiple_of(QBLOCK)
        && isa::selected() == Isa::Avx512Vnni
}

/// One product, ready to run over any range of its rows.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // runs on x86-64 AVX-512 VNNI only
pub struct I8RowGemm<'a> {
    w: WeightRows<'a>,
    acts: &'a Q8Acts,
    tokens: usize,
    /// Per token and block: `128 * sum(q)`, the +128 offset's share of every row's block
    /// product.
    offset: Vec<i32>,
}

impl<'a> I8RowGemm<'a> {
    /// `acts` must be `w`'s activations quantized with `ActScheme::Q8_0` (`tokens` rows).
    pub fn new(w: WeightRows<'a>, acts: &'a Q8Acts) -> Self {
        assert_eq!(w.format, TensorFormat::I8Row);
        assert_eq!(acts.cols, w.cols, "i8 gemm: activations do not match the weight");
        let blocks = w.cols / QBLOCK;
        let tokens = acts.ds.len() / blocks.max(1);
        let offset = acts
            .qs
            .chunks_exact(QBLOCK)
            .map(|q| 128 * q.iter().map(|&v| i32::from(v)).sum::<i32>())
            .collect();
        Self { w, acts, tokens, offset }
    }

    /// Every token's outputs for the rows in `rows`: `store(t, r0, vals)` gets token `t`'s
    /// outputs for rows `r0..r0 + vals.len()`.
    pub fn run(&self, rows: Range<usize>, mut store: impl FnMut(usize, usize, &[f32])) {
        #[cfg(target_arch = "x86_64")]
        {
            assert!(
                is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vnni"),
                "AVX-512 VNNI kernel on a CPU without it"
            );
            let cols = self.w.cols;
            let stride = self.w.bytes.len() / self.w.rows.max(1);
            let mut panel = vec![0u8; cols * PANEL_ROWS];
            let mut scales = [0.0f32; PANEL_ROWS];
            let mut vals = [[0.0f32; PANEL_ROWS]; TILE_TOKENS];
            for r0 in rows.clone().step_by(PANEL_ROWS) {
                let live = (rows.end - r0).min(PANEL_ROWS);
                pack_panel(self.w.bytes, stride, r0, live, cols, &mut panel, &mut scales);
                for t0 in (0..self.tokens).step_by(TILE_TOKENS) {
                    let count = (self.tokens - t0).min(TILE_TOKENS);
                    // SAFETY: AVX-512 F + VNNI checked above; the panel holds cols x 32 bytes
                    // and the activations `tokens` rows of `cols`.
                    unsafe {
                        avx512::tile(&panel, self.acts, &self.offset, &scales, t0, count, &mut vals)
                    };
                    for (i, v) in vals[..count].iter().enumerate() {
                        store(t0 + i, r0, &v[..live]);
                    }
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (rows, &mut store);
            unreachable!("i8 gemm runs only where `applies` said so (x86-64 AVX-512 VNNI)");
        }
    }
}

/// Rows `r0..r0 + live` of the stored weight into `panel`: for each 4 columns, 32 rows of 4
/// bytes (`w + 128`); missing rows are zero weights (bytes 128) with scale 0.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // runs on x86-64 AVX-512 VNNI only
fn pack_panel(
    bytes: &[u8],
    stride: usize,
    r0: usize,
    live: usize,
    cols: usize,
    panel: &mut [u8],
    scales: &mut [f32; PANEL_ROWS],
) {
    for r in 0..PANEL_ROWS {
        if r >= live {
            scales[r] = 0.0;
            for k4 in 0..cols / 4 {
                panel[(k4 * PANEL_ROWS + r) * 4..][..4].fill(128);
            }
            continue;
        }
        let row = &bytes[(r0 + r) * stride..(r0 + r + 1) * stride];
        scales[r] = f32::from_le_bytes([row[0], row[1], row[2], row[3]]);
        for (k4, q) in row[4..].chunks_exact(4).enumerate() {
            let dst = &mut panel[(k4 * PANEL_ROWS + r) * 4..][..4];
            for (d, &q) in dst.iter_mut().zip(q) {
                *d = q ^ 0x80; // (q as i8) + 128 as u8
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{PANEL_ROWS, TILE_TOKENS};
    use crate::acts::{Q8Acts, QBLOCK};

    /// `vals[i][r]` for tokens `t0..t0 + count` and the panel's 32 rows.
    #[target_feature(enable = "avx512f,avx512vnni")]
    pub(super) unsafe fn tile(
        panel: &[u8],
        acts: &Q8Acts,
        offset: &[i32],
        scales: &[f32; PANEL_ROWS],
        t0: usize,
        count: usize,
        vals: &mut [[f32; PANEL_ROWS]; TILE_TOKENS],
    ) {
        match count {
            1 => tile_n::<1>(panel, acts, offset, scales, t0, vals),
            2 => tile_n::<2>(panel, acts, offset, scales, t0, vals),
            3 => tile_n::<3>(panel, acts, offset, scales, t0, vals),
            4 => tile_n::<4>(panel, acts, offset, scales, t0, vals),
            5 => tile_n::<5>(panel, acts, offset, scales, t0, vals),
            _ => tile_n::<TILE_TOKENS>(panel, acts, offset, scales, t0, vals),
        }
    }

    #[target_feature(enable = "avx512f,avx512vnni")]
    unsafe fn tile_n<const M: usize>(
        panel: &[u8],
        acts: &Q8Acts,
        offset: &[i32],
        scales: &[f32; PANEL_ROWS],
        t0: usize,
        vals: &mut [[f32; PANEL_ROWS]; TILE_TOKENS],
    ) {
        let cols = acts.cols;
        let blocks = cols / QBLOCK;
        debug_assert!(panel.len() >= cols * PANEL_ROWS && (t0 + M) * cols <= acts.qs.len());
        let p = panel.as_ptr();
        let x: [*const u8; M] =
            std::array::from_fn(|i| acts.qs.as_ptr().add((t0 + i) * cols).cast());
        let ds: [*const [f32; 2]; M] =
            std::array::from_fn(|i| acts.ds.as_ptr().add((t0 + i) * blocks));
        let mut accf = [[_mm512_setzero_ps(); 2]; M];
        for b in 0..blocks {
            let mut acci = [[_mm512_setzero_si512(); 2]; M];
            for j in 0..QBLOCK / 4 {
                let k4 = b * (QBLOCK / 4) + j;
                let w0 = _mm512_loadu_si512(p.add(k4 * 4 * PANEL_ROWS).cast());
                let w1 = _mm512_loadu_si512(p.add(k4 * 4 * PANEL_ROWS + 64).cast());
                for i in 0..M {
                    let xb = _mm512_set1_epi32(x[i].add(k4 * 4).cast::<i32>().read_unaligned());
                    acci[i][0] = _mm512_dpbusd_epi32(acci[i][0], w0, xb);
                    acci[i][1] = _mm512_dpbusd_epi32(acci[i][1], w1, xb);
                }
            }
            for i in 0..M {
                let off = _mm512_set1_epi32(offset[(t0 + i) * blocks + b]);
                acci[i][0] = _mm512_sub_epi32(acci[i][0], off);
                acci[i][1] = _mm512_sub_epi32(acci[i][1], off);
                let d = _mm512_set1_ps((*ds[i].add(b))[0]);
                accf[i][0] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(acci[i][0]), accf[i][0]);
                accf[i][1] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(acci[i][1]), accf[i][1]);
            }
        }
        let s0 = _mm512_loadu_ps(scales.as_ptr());
        let s1 = _mm512_loadu_ps(scales.as_ptr().add(16));
        for i in 0..M {
            let out = vals[i].as_mut_ptr();
            _mm512_storeu_ps(out, _mm512_mul_ps(accf[i][0], s0));
            _mm512_storeu_ps(out.add(16), _mm512_mul_ps(accf[i][1], s1));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::acts::ActScheme;
    use crate::dot::PathKernels;

    /// Stored int8 rows: per row an f32 scale, then `cols` int8 values.
    fn rows_bytes(
        rows: usize,
        cols: usize,
        scale: impl Fn(usize) -> f32,
        q: impl Fn(usize, usize) -> i8,
    ) -> Vec<u8> {
        let mut b = Vec::new();
        for r in 0..rows {
            b.extend(scale(r).to_le_bytes());
            b.extend((0..cols).map(|k| q(r, k) as u8));
        }
        b
    }

    fn gemm(w: WeightRows, acts: &Q8Acts, rows: Range<usize>) -> Vec<f32> {
        let tokens = acts.qs.len() / acts.cols;
        let mut out = vec![f32::NAN; tokens * w.rows];
        I8RowGemm::new(w, acts)
            .run(rows, |t, r0, v| out[t * w.rows + r0..][..v.len()].copy_from_slice(v));
        out
    }

    fn vnni() -> bool {
        Isa::Avx512Vnni.supported()
    }

    /// Integer activations whose every block reaches +-127 quantize exactly (d = 1), and with
    /// row scales of 1 the product is an integer sum below 2^24: the GEMM must give it exactly,
    /// for every row and token count (partial panels and tiles included).
    #[test]
    fn integer_products_are_exact() {
        if !vnni() {
            eprintln!("no AVX-512 VNNI: skipped");
            return;
        }
        let (rows, cols, tokens) = (45, 256, 23);
        let q =
            |r: usize, k: usize| ((((r * 131 + k * 71) * 2654435761usize) >> 9) % 255) as i32 as i8;
        let q = move |r, k| q(r, k).wrapping_sub(127).max(-127);
        let bytes = rows_bytes(rows, cols, |_| 1.0, q);
        let w = WeightRows { format: TensorFormat::I8Row, bytes: &bytes, rows, cols };
        let xi = |t: usize, k: usize| -> i32 {
            if k % QBLOCK == (t % 7) {
                if t.is_multiple_of(2) {
                    127
                } else {
                    -127
                }
            } else {
                (((t * 37 + k * 11) % 253) as i32) - 126
            }
        };
        let x: Vec<f32> = (0..tokens * cols).map(|i| xi(i / cols, i % cols) as f32).collect();
        let acts = Q8Acts::quantize(&x, cols, ActScheme::Q8_0);
        assert!(acts.ds.iter().all(|d| d[0] == 1.0));
        let got = gemm(w, &acts, 0..rows);
        for t in 0..tokens {
            for r in 0..rows {
                let want: i64 = (0..cols).map(|k| i64::from(q(r, k)) * i64::from(xi(t, k))).sum();
                assert_eq!(got[t * rows + r], want as f32, "token {t} row {r}");
            }
        }
    }

    /// Real-valued weights and activations: the GEMM gives the per-row kernel's sums (the same
    /// integer block products and scales, summed in another order) to f32 rounding, over a
    /// row range that starts mid-matrix.
    #[test]
    fn matches_the_row_kernel() {
        if !vnni() {
            eprintln!("no AVX-512 VNNI: skipped");
            return;
        }
        let (rows, cols, tokens) = (70, 512, 20);
        let q = |r: usize, k: usize| ((r * 7919 + k * 104729) % 255) as i32 as u8 as i8;
        let bytes = rows_bytes(rows, cols, |r| 0.001 + r as f32 * 1e-4, q);
        let w = WeightRows { format: TensorFormat::I8Row, bytes: &bytes, rows, cols };
        let x: Vec<f32> = (0..tokens * cols)
            .map(|i| (((i * 2654435761usize) >> 5) % 1000) as f32 / 250.0 - 2.0)
            .collect();
        let acts = Q8Acts::quantize(&x, cols, ActScheme::Q8_0);
        let range = 8..rows;
        let got = gemm(w, &acts, range.clone());
        let (one, _) = PathKernels::selected().row_kernels(TensorFormat::I8Row).qdot.unwrap();
        let stride = bytes.len() / rows;
        for t in 0..tokens {
            for r in 0..rows {
                let g = got[t * rows + r];
                if !range.contains(&r) {
                    assert!(g.is_nan(), "row {r} outside the range was written");
                    continue;
                }
                let want = one(&bytes[r * stride..(r + 1) * stride], acts.row(t));
                let tol = 1e-5 * want.abs().max(1.0);
                assert!((g - want).abs() <= tol, "token {t} row {r}: {g} vs {want}");
            }
        }
    }

    /// Through `matmul`: a batch takes the GEMM, serial and on a pool of 2 (tasks of whole
    /// panels) alike, and is as close to the exact (f64) sum of the integer block products as
    /// the per-row kernel is.
    #[test]
    fn matmul_batches_take_the_gemm() {
        if !vnni() {
            eprintln!("no AVX-512 VNNI: skipped");
            return;
        }
        let _serial = crate::isa::test_lock();
        let (rows, cols, tokens) = (200, 256, 37);
        let q = |r: usize, k: usize| ((r * 131 + k * 977) % 251) as i32 as u8 as i8;
        let bytes = rows_bytes(rows, cols, |r| 0.01 + r as f32 * 1e-3, q);
        let w = WeightRows { format: TensorFormat::I8Row, bytes: &bytes, rows, cols };
        assert!(applies(w, tokens));
        let x: Vec<f32> =
            (0..tokens * cols).map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0).collect();
        let mut serial = vec![0.0; tokens * rows];
        crate::matmul_raw(&x, tokens, w, &mut serial);
        let mut pooled = vec![0.0; tokens * rows];
        let pool = crate::pool::ThreadPool::new(2).unwrap();
        pool.install(|| crate::matmul_raw(&x, tokens, w, &mut pooled));
        assert_eq!(serial, pooled);
        // Against the f64 sum of the exact block products: the GEMM and the row kernel both
        // within f32 rounding of the terms' magnitudes (the sum may cancel).
        let acts = Q8Acts::quantize(&x, cols, ActScheme::Q8_0);
        let (one, _) = PathKernels::selected().row_kernels(TensorFormat::I8Row).qdot.unwrap();
        let stride = bytes.len() / rows;
        let blocks = cols / QBLOCK;
        for t in 0..tokens {
            for r in 0..rows {
                let scale = f64::from(0.01 + r as f32 * 1e-3);
                let terms: Vec<f64> = (0..blocks)
                    .map(|b| {
                        let dot: i32 = (b * QBLOCK..(b + 1) * QBLOCK)
                            .map(|k| i32::from(q(r, k)) * i32::from(acts.qs[t * cols + k]))
                            .sum();
                        f64::from(acts.ds[t * blocks + b][0]) * f64::from(dot) * scale
                    })
                    .collect();
                let exact: f64 = terms.iter().sum();
                let tol = 2e-6 * terms.iter().map(|v| v.abs()).sum::<f64>();
                let row = one(&bytes[r * stride..(r + 1) * stride], acts.row(t));
                for (what, v) in [("gemm", serial[t * rows + r]), ("row kernel", row)] {
                    let err = (f64::from(v) - exact).abs();
                    assert!(err <= tol, "{what}, token {t} row {r}: {v} vs {exact}");
                }
            }
        }
    }
}
