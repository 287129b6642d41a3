//! The float GEMM's register tile: a widened panel of PANEL_ROWS stored rows times a packed
//! group of PANEL_TOKENS tokens, accumulated in registers. `gemm` runs it over weight panels
//! and attention's query tiles (`cellm-kv`) over blocks of cached keys and values; it lives
//! apart from both so the row kernels (`dot`) can name the panel's shape, and the path tables
//! (`dot::paths`) its kernels, without a cycle.

/// Rows and tokens of one register tile.
pub const PANEL_ROWS: usize = 16;
pub const PANEL_TOKENS: usize = 6;

/// `tile[t][r] += sum_c panel[c][r] * x[c][t]` over `cols` columns for the first `tokens`
/// tokens (a path may compute the padded rest too): a panel column holds PANEL_ROWS rows and a
/// packed activation column PANEL_TOKENS tokens.
pub type TileFn = fn(
    panel: &[f32],
    x: &[f32],
    cols: usize,
    tokens: usize,
    tile: &mut [[f32; PANEL_ROWS]; PANEL_TOKENS],
);

/// The register tile, one product at a time: the reference for the SIMD tile.
pub(crate) fn tile_scalar(
    panel: &[f32],
    x: &[f32],
    cols: usize,
    tokens: usize,
    tile: &mut [[f32; PANEL_ROWS]; PANEL_TOKENS],
) {
    let (panel, x) = (&panel[..cols * PANEL_ROWS], &x[..cols * PANEL_TOKENS]);
    for (p, xs) in panel.chunks_exact(PANEL_ROWS).zip(x.chunks_exact(PANEL_TOKENS)) {
        for (out, &xv) in tile.iter_mut().zip(xs).take(tokens) {
            out.iter_mut().zip(p).for_each(|(o, &w)| *o += w * xv);
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    use super::{PANEL_ROWS, PANEL_TOKENS};

    pub fn tile(
        panel: &[f32],
        x: &[f32],
        cols: usize,
        tokens: usize,
        tile: &mut [[f32; PANEL_ROWS]; PANEL_TOKENS],
    ) {
        assert!(crate::Isa::Avx2.supported(), "AVX2 kernel on a CPU without AVX2");
        let (panel, x) = (&panel[..cols * PANEL_ROWS], &x[..cols * PANEL_TOKENS]);
        // SAFETY: AVX2 and FMA were just checked; the slices above hold `cols` columns.
        unsafe {
            match tokens {
                0 => {}
                1 => tile_avx2::<1>(panel, x, cols, tile),
                2 => tile_avx2::<2>(panel, x, cols, tile),
                3 => tile_avx2::<3>(panel, x, cols, tile),
                4 => tile_avx2::<4>(panel, x, cols, tile),
                5 => tile_avx2::<5>(panel, x, cols, tile),
                _ => tile_avx2::<PANEL_TOKENS>(panel, x, cols, tile),
            }
        }
    }

    /// The first `T` tokens of the tile.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile_avx2<const T: usize>(
        panel: &[f32],
        x: &[f32],
        cols: usize,
        tile: &mut [[f32; PANEL_ROWS]; PANEL_TOKENS],
    ) {
        let (p, xp) = (panel.as_ptr(), x.as_ptr());
        let mut acc = [[_mm256_setzero_ps(); 2]; T];
        for (acc, out) in acc.iter_mut().zip(tile.iter()) {
            acc[0] = _mm256_loadu_ps(out.as_ptr());
            acc[1] = _mm256_loadu_ps(out.as_ptr().add(8));
        }
        for c in 0..cols {
            let lo = _mm256_loadu_ps(p.add(c * PANEL_ROWS));
            let hi = _mm256_loadu_ps(p.add(c * PANEL_ROWS + 8));
            for (t, acc) in acc.iter_mut().enumerate() {
                let xv = _mm256_broadcast_ss(&*xp.add(c * PANEL_TOKENS + t));
                acc[0] = _mm256_fmadd_ps(lo, xv, acc[0]);
                acc[1] = _mm256_fmadd_ps(hi, xv, acc[1]);
            }
        }
        for (out, acc) in tile.iter_mut().zip(&acc) {
            _mm256_storeu_ps(out.as_mut_ptr(), acc[0]);
            _mm256_storeu_ps(out.as_mut_ptr().add(8), acc[1]);
        }
    }
}

/// The NEON tile: 16 rows x 6 tokens in 24 of the 32 vector registers, each panel column's
/// four row vectors times the six activations by lane (`fmla` by element).
#[cfg(target_arch = "aarch64")]
pub(crate) mod neon {
    use std::arch::aarch64::*;

    use super::{PANEL_ROWS, PANEL_TOKENS};

    /// All six tokens whatever `tokens` asks: lanes are picked by constant, so a shorter
    /// tile would be another copy of the loop.
    pub fn tile(
        panel: &[f32],
        x: &[f32],
        cols: usize,
        _tokens: usize,
        tile: &mut [[f32; PANEL_ROWS]; PANEL_TOKENS],
    ) {
        assert!(crate::Isa::Neon.supported(), "NEON kernel on a CPU without NEON");
        let (panel, x) = (&panel[..cols * PANEL_ROWS], &x[..cols * PANEL_TOKENS]);
        // SAFETY: NEON was just checked; the slices above hold `cols` columns.
        unsafe { tile_neon(panel, x, cols, tile) }
    }

    #[target_feature(enable = "neon")]
    unsafe fn tile_neon(
        panel: &[f32],
        x: &[f32],
        cols: usize,
        tile: &mut [[f32; PANEL_ROWS]; PANEL_TOKENS],
    ) {
        const VECS: usize = PANEL_ROWS / 4;
        let (p, xp) = (panel.as_ptr(), x.as_ptr());
        let mut acc = [[vdupq_n_f32(0.0); VECS]; PANEL_TOKENS];
        for (acc, out) in acc.iter_mut().zip(tile.iter()) {
            for (v, a) in acc.iter_mut().enumerate() {
                *a = vld1q_f32(out.as_ptr().add(4 * v));
            }
        }
        for c in 0..cols {
            let w: [float32x4_t; VECS] =
                std::array::from_fn(|v| vld1q_f32(p.add(c * PANEL_ROWS + 4 * v)));
            // Tokens 0..4 and 4..6 of the column: no load past the packed activations.
            let (xa, xb) =
                (vld1q_f32(xp.add(c * PANEL_TOKENS)), vld1_f32(xp.add(c * PANEL_TOKENS + 4)));
            for v in 0..VECS {
                acc[0][v] = vfmaq_laneq_f32::<0>(acc[0][v], w[v], xa);
                acc[1][v] = vfmaq_laneq_f32::<1>(acc[1][v], w[v], xa);
                acc[2][v] = vfmaq_laneq_f32::<2>(acc[2][v], w[v], xa);
                acc[3][v] = vfmaq_laneq_f32::<3>(acc[3][v], w[v], xa);
                acc[4][v] = vfmaq_lane_f32::<0>(acc[4][v], w[v], xb);
                acc[5][v] = vfmaq_lane_f32::<1>(acc[5][v], w[v], xb);
            }
        }
        for (out, acc) in tile.iter_mut().zip(&acc) {
            for (v, a) in acc.iter().enumerate() {
                vst1q_f32(out.as_mut_ptr().add(4 * v), *a);
            }
        }
    }
}
