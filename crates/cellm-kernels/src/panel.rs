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

/// The AVX-512 tile: one 16-lane register per panel column, so the 16 x 6 tile is six
/// accumulators; two sets of six take even and odd columns, so each chain gets one
/// multiply-add every other column and twelve are in flight, enough to cover the FMA latency
/// at two 512-bit FMAs a cycle (six chains cannot: 4 cycles of latency, 3 of issue). The
/// activations are broadcast from memory into the FMA. Installed only where the CPU has
/// AVX-512F (the `Avx512Vnni` path).
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use std::arch::x86_64::*;

    use super::{PANEL_ROWS, PANEL_TOKENS};

    pub fn tile(
        panel: &[f32],
        x: &[f32],
        cols: usize,
        tokens: usize,
        tile: &mut [[f32; PANEL_ROWS]; PANEL_TOKENS],
    ) {
        assert!(is_x86_feature_detected!("avx512f"), "AVX-512 kernel on a CPU without AVX-512");
        let (panel, x) = (&panel[..cols * PANEL_ROWS], &x[..cols * PANEL_TOKENS]);
        // SAFETY: AVX-512F was just checked; the slices above hold `cols` columns.
        unsafe {
            match tokens {
                0 => {}
                1 => tile_avx512::<1>(panel, x, cols, tile),
                2 => tile_avx512::<2>(panel, x, cols, tile),
                3 => tile_avx512::<3>(panel, x, cols, tile),
                4 => tile_avx512::<4>(panel, x, cols, tile),
                5 => tile_avx512::<5>(panel, x, cols, tile),
                _ => tile_avx512::<PANEL_TOKENS>(panel, x, cols, tile),
            }
        }
    }

    /// The first `T` tokens of the tile.
    #[target_feature(enable = "avx512f")]
    unsafe fn tile_avx512<const T: usize>(
        panel: &[f32],
        x: &[f32],
        cols: usize,
        tile: &mut [[f32; PANEL_ROWS]; PANEL_TOKENS],
    ) {
        let (p, xp) = (panel.as_ptr(), x.as_ptr());
        let mut even = [_mm512_setzero_ps(); T];
        let mut odd = [_mm512_setzero_ps(); T];
        for (acc, out) in even.iter_mut().zip(tile.iter()) {
            *acc = _mm512_loadu_ps(out.as_ptr());
        }
        let pairs = cols / 2;
        for c in (0..pairs).map(|i| 2 * i) {
            let w0 = _mm512_loadu_ps(p.add(c * PANEL_ROWS));
            let w1 = _mm512_loadu_ps(p.add((c + 1) * PANEL_ROWS));
            for t in 0..T {
                let x0 = _mm512_set1_ps(*xp.add(c * PANEL_TOKENS + t));
                let x1 = _mm512_set1_ps(*xp.add((c + 1) * PANEL_TOKENS + t));
                even[t] = _mm512_fmadd_ps(w0, x0, even[t]);
                odd[t] = _mm512_fmadd_ps(w1, x1, odd[t]);
            }
        }
        if cols % 2 == 1 {
            let c = cols - 1;
            let w = _mm512_loadu_ps(p.add(c * PANEL_ROWS));
            for (t, acc) in even.iter_mut().enumerate() {
                *acc = _mm512_fmadd_ps(w, _mm512_set1_ps(*xp.add(c * PANEL_TOKENS + t)), *acc);
            }
        }
        for ((out, e), o) in tile.iter_mut().zip(&even).zip(&odd) {
            _mm512_storeu_ps(out.as_mut_ptr(), _mm512_add_ps(*e, *o));
        }
    }
}

/// The AVX-512 GEMM tile: WIDE_ROWS = 32 rows (two 16-lane vectors per panel column) times
/// WIDE_TOKENS = 8 tokens, sixteen accumulators. A column costs two panel loads and eight
/// broadcast activations (folded into the FMAs) for sixteen multiply-adds, so the loads stay
/// well under the two a cycle the core sustains while the FMAs issue two a cycle; the 16 x 6
/// tile needs seven loads per six FMAs and stalls on them (about 70% of the FMA peak from L1,
/// against 100% for this one, measured on Zen 5). Sixteen independent chains cover the
/// FMA latency (4 cycles x 2 ports). Used by the float GEMM and dense attention on the
/// `Avx512Vnni` path; the cached attention keeps the 16 x 6 tile.
pub const WIDE_ROWS: usize = 32;
pub const WIDE_TOKENS: usize = 8;

/// `tile[t * WIDE_ROWS + r] += sum_c panel[c][r] * x[c][t]` over `cols` columns for the first
/// `tokens` tokens; a panel column holds WIDE_ROWS rows and a packed column WIDE_TOKENS tokens.
pub type WideTileFn =
    fn(panel: &[f32], x: &[f32], cols: usize, tokens: usize, tile: &mut [f32; WIDE_TILE]);

/// Floats of one wide tile's accumulators.
pub const WIDE_TILE: usize = WIDE_ROWS * WIDE_TOKENS;

/// The wide tile one product at a time: the reference for the AVX-512 wide tile.
pub fn wide_tile_scalar(
    panel: &[f32],
    x: &[f32],
    cols: usize,
    tokens: usize,
    tile: &mut [f32; WIDE_TILE],
) {
    let (panel, x) = (&panel[..cols * WIDE_ROWS], &x[..cols * WIDE_TOKENS]);
    for (p, xs) in panel.chunks_exact(WIDE_ROWS).zip(x.chunks_exact(WIDE_TOKENS)) {
        for (out, &xv) in tile.chunks_exact_mut(WIDE_ROWS).zip(xs).take(tokens) {
            out.iter_mut().zip(p).for_each(|(o, &w)| *o += w * xv);
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub mod avx512_wide {
    use std::arch::x86_64::*;

    use super::{WIDE_ROWS, WIDE_TILE, WIDE_TOKENS};

    /// Whether this CPU runs [`tile`].
    pub fn supported() -> bool {
        is_x86_feature_detected!("avx512f")
    }

    pub fn tile(panel: &[f32], x: &[f32], cols: usize, tokens: usize, tile: &mut [f32; WIDE_TILE]) {
        assert!(supported(), "AVX-512 kernel on a CPU without AVX-512");
        let (panel, x) = (&panel[..cols * WIDE_ROWS], &x[..cols * WIDE_TOKENS]);
        // SAFETY: AVX-512F was just checked; the slices above hold `cols` columns.
        unsafe {
            match tokens {
                0 => {}
                1 => tile_avx512::<1>(panel, x, cols, tile),
                2 => tile_avx512::<2>(panel, x, cols, tile),
                3 => tile_avx512::<3>(panel, x, cols, tile),
                4 => tile_avx512::<4>(panel, x, cols, tile),
                5 => tile_avx512::<5>(panel, x, cols, tile),
                6 => tile_avx512::<6>(panel, x, cols, tile),
                7 => tile_avx512::<7>(panel, x, cols, tile),
                _ => tile_avx512::<WIDE_TOKENS>(panel, x, cols, tile),
            }
        }
    }

    /// The first `T` tokens of the tile.
    #[target_feature(enable = "avx512f")]
    unsafe fn tile_avx512<const T: usize>(
        panel: &[f32],
        x: &[f32],
        cols: usize,
        tile: &mut [f32; WIDE_TILE],
    ) {
        let (p, xp, out) = (panel.as_ptr(), x.as_ptr(), tile.as_mut_ptr());
        let mut lo = [_mm512_setzero_ps(); T];
        let mut hi = [_mm512_setzero_ps(); T];
        for t in 0..T {
            lo[t] = _mm512_loadu_ps(out.add(t * WIDE_ROWS));
            hi[t] = _mm512_loadu_ps(out.add(t * WIDE_ROWS + 16));
        }
        for c in 0..cols {
            let w0 = _mm512_loadu_ps(p.add(c * WIDE_ROWS));
            let w1 = _mm512_loadu_ps(p.add(c * WIDE_ROWS + 16));
            for t in 0..T {
                let xv = _mm512_set1_ps(*xp.add(c * WIDE_TOKENS + t));
                lo[t] = _mm512_fmadd_ps(w0, xv, lo[t]);
                hi[t] = _mm512_fmadd_ps(w1, xv, hi[t]);
            }
        }
        for t in 0..T {
            _mm512_storeu_ps(out.add(t * WIDE_ROWS), lo[t]);
            _mm512_storeu_ps(out.add(t * WIDE_ROWS + 16), hi[t]);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dot::PathKernels;
    use crate::Isa;

    /// Every path's tile equals the scalar tile within f32 rounding, for column counts odd
    /// and even (the AVX-512 tile's two accumulator sets and its odd last column), every
    /// token count 0..=6 (tokens past the count untouched), and a tile that already holds
    /// sums (the tile accumulates).
    #[test]
    fn tiles_match_the_scalar_tile() {
        for cols in [0, 1, 2, 7, 64, 257] {
            let panel: Vec<f32> =
                (0..cols * PANEL_ROWS).map(|i| ((i * 7919) % 211) as f32 / 100.0 - 1.05).collect();
            let x: Vec<f32> = (0..cols * PANEL_TOKENS)
                .map(|i| ((i * 104729) % 251) as f32 / 125.0 - 1.0)
                .collect();
            let start: [[f32; PANEL_ROWS]; PANEL_TOKENS] = std::array::from_fn(|t| {
                std::array::from_fn(|r| (t * PANEL_ROWS + r) as f32 / 10.0)
            });
            for tokens in 0..=PANEL_TOKENS {
                let mut want = start;
                tile_scalar(&panel, &x, cols, tokens, &mut want);
                for isa in Isa::available() {
                    let mut got = start;
                    (PathKernels::of(isa).tile_kernel())(&panel, &x, cols, tokens, &mut got);
                    for t in 0..PANEL_TOKENS {
                        for r in 0..PANEL_ROWS {
                            let (g, w) = (got[t][r], want[t][r]);
                            // Sums of up to 257 products of magnitude <= 1.05 in another
                            // order: rounding near 1e-5 at most; a column or token off by
                            // one is off by O(1). The NEON tile computes all six tokens.
                            if t >= tokens && !isa.has_neon() {
                                assert_eq!(g, start[t][r], "{isa:?} wrote token {t} of {tokens}");
                                continue;
                            }
                            if t >= tokens {
                                continue;
                            }
                            assert!(
                                (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
                                "{isa:?} cols={cols} tokens={tokens} [{t}][{r}]: {g} vs {w}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The AVX-512 wide tile equals the scalar wide tile within f32 rounding, for column
    /// counts odd and even, every token count 0..=8 (tokens past the count untouched), and a
    /// tile that already holds sums.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn wide_tile_matches_the_scalar_wide_tile() {
        if !avx512_wide::supported() {
            return;
        }
        for cols in [0, 1, 2, 7, 64, 257] {
            let panel: Vec<f32> =
                (0..cols * WIDE_ROWS).map(|i| ((i * 7919) % 211) as f32 / 100.0 - 1.05).collect();
            let x: Vec<f32> = (0..cols * WIDE_TOKENS)
                .map(|i| ((i * 104729) % 251) as f32 / 125.0 - 1.0)
                .collect();
            let start: [f32; WIDE_TILE] = std::array::from_fn(|i| i as f32 / 10.0);
            for tokens in 0..=WIDE_TOKENS {
                let (mut want, mut got) = (start, start);
                wide_tile_scalar(&panel, &x, cols, tokens, &mut want);
                avx512_wide::tile(&panel, &x, cols, tokens, &mut got);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    if i / WIDE_ROWS >= tokens {
                        assert_eq!(*g, start[i], "wrote token {} of {tokens}", i / WIDE_ROWS);
                    }
                    // As above: rounding near 1e-5; a column or token off by one is O(1).
                    assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "cols={cols} [{i}]");
                }
            }
        }
    }
}
