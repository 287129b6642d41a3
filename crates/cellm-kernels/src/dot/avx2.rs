//! AVX2 + FMA + F16C kernels. Installed in a table only after `Isa::Avx2.supported()`.

use std::arch::x86_64::*;

use cellm_format::TensorFormat;

use super::floats::cast;
use super::kinds::{head_passes, CachedRows, DotTileFn, DotTokensFn, HeadKernels, PanelFn};
use crate::kv_rows::{scale_f16c, I8_SCALE_BYTES};

float_row_kernels!(assert!(
    crate::Isa::Avx2.supported(),
    "AVX2 kernels requested on a CPU without AVX2"
));

/// `pub fn $name(format) -> HeadKernels`: the page kernels `$dot` and `$axpy` (generic over
/// `$lanes`) as safe entries for each cache format, handed out only on a CPU that `$isa`
/// runs on. SAFETY (all): that check covers the kernels' target features, and they check
/// their shapes (`CachedRows::heads`) before reading through pointers.
macro_rules! float_head_kernels {
    ($name:ident, $isa:expr, $lanes:ident, $dot:ident, $axpy:ident) => {
        pub fn $name(format: TensorFormat) -> HeadKernels {
            assert!($isa.supported(), "{:?} page kernels requested on a CPU without them", $isa);
            fn dot<L: $lanes>(rows: CachedRows, q: &[f32], scores: &mut [f32], stride: usize) {
                unsafe { $dot::<L>(rows, q, scores, stride) }
            }
            fn axpy<L: $lanes>(w: &[f32], stride: usize, rows: CachedRows, acc: &mut [f32]) {
                unsafe { $axpy::<L>(w, stride, rows, acc) }
            }
            match format {
                TensorFormat::F32 => HeadKernels { dot: dot::<F32>, axpy: axpy::<F32> },
                TensorFormat::F16 => HeadKernels { dot: dot::<F16>, axpy: axpy::<F16> },
                TensorFormat::BF16 => HeadKernels { dot: dot::<Bf16>, axpy: axpy::<Bf16> },
                other => unreachable!("{other:?} is not a cache format"),
            }
        }
    };
}

float_head_kernels!(head_kernels, crate::Isa::Avx2, Lanes, dot_heads, axpy_heads);

pub fn panel_widener(format: TensorFormat) -> PanelFn {
    assert!(crate::Isa::Avx2.supported(), "AVX2 kernels requested on a CPU without AVX2");
    match format {
        TensorFormat::F32 => |rows, cols, panel| unsafe { widen_panel::<F32>(rows, cols, panel) },
        TensorFormat::F16 => |rows, cols, panel| unsafe { widen_panel::<F16>(rows, cols, panel) },
        TensorFormat::BF16 => |rows, cols, panel| unsafe { widen_panel::<Bf16>(rows, cols, panel) },
        other => unreachable!("{other:?} is a block format"),
    }
}

/// Loads eight stored elements as f32 lanes.
trait Lanes {
    type Elem: Copy + Into<Widen>;
    unsafe fn load8(p: *const Self::Elem) -> __m256;
}

/// Scalar widening for the tails.
#[derive(Clone, Copy)]
struct Widen(f32);
impl From<f32> for Widen {
    fn from(v: f32) -> Self {
        Widen(v)
    }
}

struct F32;
struct F16;
struct Bf16;
#[derive(Clone, Copy)]
struct HalfBits(u16);
#[derive(Clone, Copy)]
struct BrainBits(u16);
impl From<HalfBits> for Widen {
    fn from(v: HalfBits) -> Self {
        Widen(half::f16::from_bits(v.0).to_f32())
    }
}
impl From<BrainBits> for Widen {
    fn from(v: BrainBits) -> Self {
        Widen(half::bf16::from_bits(v.0).to_f32())
    }
}
impl From<i8> for Widen {
    fn from(v: i8) -> Self {
        Widen(f32::from(v))
    }
}

impl Lanes for F32 {
    type Elem = f32;
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
}
/// The values of an int8 KV row (`kv_rows::encode_i8`), after its f16 scale; the head
/// kernels of int8 pages (`dot_heads16_i8`, `axpy_heads16_i8`) apply the scales.
struct I8;
impl Lanes for I8 {
    type Elem = i8;
    #[inline(always)]
    unsafe fn load8(p: *const i8) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast())))
    }
}
impl Lanes for F16 {
    type Elem = HalfBits;
    #[inline(always)]
    unsafe fn load8(p: *const HalfBits) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
    }
}
impl Lanes for Bf16 {
    type Elem = BrainBits;
    #[inline(always)]
    unsafe fn load8(p: *const BrainBits) -> __m256 {
        let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide))
    }
}

/// Eight columns of eight rows at a time: eight row loads, an 8 x 8 transpose in registers,
/// eight column stores (each half of a 16-row panel column).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen_panel<L: Lanes>(rows: &[&[u8]], cols: usize, panel: &mut [f32]) {
    const PANEL: usize = crate::panel::PANEL_ROWS;
    assert!(rows.len() <= PANEL && cols.is_multiple_of(8) && panel.len() >= cols * PANEL);
    let count = rows.len();
    let mut elems: [&[L::Elem]; PANEL] = [&[]; PANEL];
    for (e, r) in elems.iter_mut().zip(rows) {
        *e = cast::<L::Elem>(r);
        assert!(e.len() >= cols, "panel rows shorter than the columns");
    }
    let p = panel.as_mut_ptr();
    for c in (0..cols).step_by(8) {
        for half in 0..PANEL / 8 {
            let mut v = [_mm256_setzero_ps(); 8];
            for (i, v) in v.iter_mut().enumerate().take(count.saturating_sub(half * 8)) {
                *v = L::load8(elems[half * 8 + i].as_ptr().add(c));
            }
            for (j, col) in transpose8(v).iter().enumerate() {
                _mm256_storeu_ps(p.add((c + j) * PANEL + half * 8), *col);
            }
        }
    }
}

/// Rows of an 8 x 8 block in, its columns out.
#[inline(always)]
unsafe fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    let t = [
        _mm256_unpacklo_ps(r[0], r[1]),
        _mm256_unpackhi_ps(r[0], r[1]),
        _mm256_unpacklo_ps(r[2], r[3]),
        _mm256_unpackhi_ps(r[2], r[3]),
        _mm256_unpacklo_ps(r[4], r[5]),
        _mm256_unpackhi_ps(r[4], r[5]),
        _mm256_unpacklo_ps(r[6], r[7]),
        _mm256_unpackhi_ps(r[6], r[7]),
    ];
    let s = [
        _mm256_shuffle_ps::<0x44>(t[0], t[2]),
        _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
        _mm256_shuffle_ps::<0x44>(t[1], t[3]),
        _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
        _mm256_shuffle_ps::<0x44>(t[4], t[6]),
        _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
        _mm256_shuffle_ps::<0x44>(t[5], t[7]),
        _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
    ];
    [
        _mm256_permute2f128_ps::<0x20>(s[0], s[4]),
        _mm256_permute2f128_ps::<0x20>(s[1], s[5]),
        _mm256_permute2f128_ps::<0x20>(s[2], s[6]),
        _mm256_permute2f128_ps::<0x20>(s[3], s[7]),
        _mm256_permute2f128_ps::<0x31>(s[0], s[4]),
        _mm256_permute2f128_ps::<0x31>(s[1], s[5]),
        _mm256_permute2f128_ps::<0x31>(s[2], s[6]),
        _mm256_permute2f128_ps::<0x31>(s[3], s[7]),
    ]
}

#[inline(always)]
fn widen(e: impl Into<Widen>) -> f32 {
    e.into().0
}

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
    _mm_cvtss_f32(s)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot<L: Lanes>(w: &[L::Elem], x: &[f32]) -> f32 {
    let n = w.len();
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    // No software prefetch: in the model, requests 4 KiB ahead (T0 or NTA) made F16 decode
    // 7-11% slower, though `gemv` on one large matrix could not tell them apart.
    while i + 32 <= n {
        for (j, a) in acc.iter_mut().enumerate() {
            let o = i + 8 * j;
            *a = _mm256_fmadd_ps(L::load8(wp.add(o)), _mm256_loadu_ps(xp.add(o)), *a);
        }
        i += 32;
    }
    while i + 8 <= n {
        acc[0] = _mm256_fmadd_ps(L::load8(wp.add(i)), _mm256_loadu_ps(xp.add(i)), acc[0]);
        i += 8;
    }
    let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut total = hsum(sum);
    for k in i..n {
        total += widen(w[k]) * x[k];
    }
    total
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode<L: Lanes>(w: &[L::Elem], out: &mut [f32]) {
    let n = w.len().min(out.len());
    let mut i = 0;
    while i + 8 <= n {
        _mm256_storeu_ps(out.as_mut_ptr().add(i), L::load8(w.as_ptr().add(i)));
        i += 8;
    }
    for k in i..n {
        out[k] = widen(w[k]);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy<L: Lanes>(a: f32, w: &[L::Elem], acc: &mut [f32]) {
    let n = w.len().min(acc.len());
    let av = _mm256_set1_ps(a);
    let mut i = 0;
    while i + 8 <= n {
        let p = acc.as_mut_ptr().add(i);
        _mm256_storeu_ps(p, _mm256_fmadd_ps(av, L::load8(w.as_ptr().add(i)), _mm256_loadu_ps(p)));
        i += 8;
    }
    for k in i..n {
        acc[k] += a * widen(w[k]);
    }
}

/// Row tiles: `out[r * T + t] = dot(row r, x[t])` for `R` stored rows and `T` tokens. Each
/// 8 stored elements are widened once for `T` tokens and each 8 activations loaded once for
/// `R` rows, with `R * T` independent accumulators: 4 x 3 fills 16 registers, and the loop
/// runs on multiply-adds rather than on loads and conversions, as one row at a time does.
#[inline(always)]
unsafe fn tile<L: Lanes, const R: usize, const T: usize>(
    rows: &[&[L::Elem]],
    x: &[f32],
    out: &mut [f32],
) {
    let n = x.len() / T;
    let full = n / 8 * 8;
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    for i in (0..full).step_by(8) {
        let xv: [__m256; T] = std::array::from_fn(|t| _mm256_loadu_ps(x.as_ptr().add(t * n + i)));
        for (r, acc) in acc.iter_mut().enumerate() {
            let w = L::load8(rows[r].as_ptr().add(i));
            for (a, xt) in acc.iter_mut().zip(&xv) {
                *a = _mm256_fmadd_ps(w, *xt, *a);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        for (t, a) in acc.iter().enumerate() {
            let tail: f32 = (full..n).map(|k| widen(rows[r][k]) * x[t * n + k]).sum();
            out[r * T + t] = hsum(*a) + tail;
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_tile<L: Lanes>(rows: &[&[u8]], x: &[f32], out: &mut [f32]) {
    assert!((1..=4).contains(&rows.len()), "dot_tile takes 1..=4 rows");
    // Slots past the tile's rows repeat row 0; the kernel never reads them.
    let w: [&[L::Elem]; 4] =
        std::array::from_fn(|r| cast(rows[if r < rows.len() { r } else { 0 }]));
    let n = w[0].len();
    let tokens = x.len() / n.max(1);
    assert!(
        w[..rows.len()].iter().all(|r| r.len() == n) && x.len() == tokens * n,
        "dot_tile: rows and activations differ in length"
    );
    assert!(out.len() == rows.len() * tokens, "dot_tile: output size");
    if tokens == 1 {
        // Decode: nothing to share between rows, and one row at a time with four accumulators
        // streams 16-bit rows about 1.5x faster than a 4 x 1 tile (`gemv`).
        for (o, row) in out.iter_mut().zip(&w[..rows.len()]) {
            *o = dot::<L>(row, x);
        }
        return;
    }
    macro_rules! go {
        ($r:literal, $t:literal) => {
            tile::<L, $r, $t>(&w[..$r], x, out)
        };
    }
    match (rows.len(), tokens) {
        (4, 3) => go!(4, 3),
        (4, 2) => go!(4, 2),
        (3, 3) => go!(3, 3),
        (3, 2) => go!(3, 2),
        (2, 3) => go!(2, 3),
        (2, 2) => go!(2, 2),
        (1, 3) => go!(1, 3),
        (1, 2) => go!(1, 2),
        (r, t) => panic!("dot_tile takes 1..=4 rows and 1..=3 tokens, got {r} x {t}"),
    }
}

/// `out[t] = dot(w, x[t])` for every token row of `x`, each the same bits as [`dot`] gives it
/// alone (the same four accumulators, sums and tail), three tokens at a time so that each 8
/// stored elements are loaded and widened once for three tokens.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_tokens<L: Lanes>(w: &[L::Elem], x: &[f32], out: &mut [f32]) {
    let n = w.len();
    assert_eq!(x.len(), out.len() * n, "dot_tokens: activations do not match the row");
    let mut t = 0;
    while t + 3 <= out.len() {
        dot_many::<L, 3>(w, x, t, n, out);
        t += 3;
    }
    match out.len() - t {
        2 => dot_many::<L, 2>(w, x, t, n, out),
        1 => dot_many::<L, 1>(w, x, t, n, out),
        _ => {}
    }
}

/// Tokens `t0..t0 + T` of [`dot_tokens`]: [`dot`]'s loop with the stored vector shared.
#[inline(always)]
unsafe fn dot_many<L: Lanes, const T: usize>(
    w: &[L::Elem],
    x: &[f32],
    t0: usize,
    n: usize,
    out: &mut [f32],
) {
    let wp = w.as_ptr();
    let xp: [*const f32; T] = std::array::from_fn(|t| x.as_ptr().add((t0 + t) * n));
    let mut acc = [[_mm256_setzero_ps(); 4]; T];
    let mut i = 0;
    while i + 32 <= n {
        for j in 0..4 {
            let o = i + 8 * j;
            let wv = L::load8(wp.add(o));
            for (a, x) in acc.iter_mut().zip(&xp) {
                a[j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x.add(o)), a[j]);
            }
        }
        i += 32;
    }
    while i + 8 <= n {
        let wv = L::load8(wp.add(i));
        for (a, x) in acc.iter_mut().zip(&xp) {
            a[0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x.add(i)), a[0]);
        }
        i += 8;
    }
    for (t, (a, x)) in acc.iter().zip(&xp).enumerate() {
        let sum = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
        let mut total = hsum(sum);
        for (k, &e) in w.iter().enumerate().skip(i) {
            total += widen(e) * *x.add(k);
        }
        out[t0 + t] = total;
    }
}

pub fn dot_tokens_kernel(format: TensorFormat) -> DotTokensFn {
    assert!(crate::Isa::Avx2.supported(), "AVX2 kernels requested on a CPU without AVX2");
    // SAFETY (all three): AVX2, FMA and F16C were just checked; `dot_tokens` checks lengths.
    match format {
        TensorFormat::F32 => |row, x, out| unsafe { dot_tokens::<F32>(cast(row), x, out) },
        TensorFormat::F16 => |row, x, out| unsafe { dot_tokens::<F16>(cast(row), x, out) },
        TensorFormat::BF16 => |row, x, out| unsafe { dot_tokens::<Bf16>(cast(row), x, out) },
        other => unreachable!("{other:?} is a block format"),
    }
}

/// GEMM-order tiles ([`super::kinds::GEMM_TILE_ROWS`]): `out[r * tokens + t]` for up to 16
/// stored rows and 1..=3 tokens, each one fused multiply-add chain over the columns in order
/// from zero, as the float GEMM's register tiles sum (`gemm`), bit for bit. Rows go in lanes:
/// eight columns of eight rows are loaded, widened and transposed in registers, and each
/// column meets every token's broadcast activation.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemm_tile<L: Lanes>(rows: &[&[u8]], x: &[f32], out: &mut [f32]) {
    assert!((1..=16).contains(&rows.len()), "gemm_tile takes 1..=16 rows");
    // Slots past the tile's rows repeat row 0; their lanes are never stored.
    let w: [&[L::Elem]; 16] =
        std::array::from_fn(|r| cast(rows[if r < rows.len() { r } else { 0 }]));
    let n = w[0].len();
    let tokens = x.len() / n.max(1);
    assert!(
        w[..rows.len()].iter().all(|r| r.len() == n) && x.len() == tokens * n,
        "gemm_tile: rows and activations differ in length"
    );
    assert!(out.len() == rows.len() * tokens, "gemm_tile: output size");
    match tokens {
        1 => seq_tile::<L, 1>(&w, rows.len(), x, n, out),
        2 => seq_tile::<L, 2>(&w, rows.len(), x, n, out),
        3 => seq_tile::<L, 3>(&w, rows.len(), x, n, out),
        t => panic!("gemm_tile takes 1..=3 tokens, got {t}"),
    }
}

// The tail loop indexes sixteen rows and the activations by one column.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn seq_tile<L: Lanes, const T: usize>(
    w: &[&[L::Elem]; 16],
    count: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) {
    let blocks = count.div_ceil(8);
    let full = n / 8 * 8;
    let xp = x.as_ptr();
    let mut acc = [[_mm256_setzero_ps(); T]; 2];
    for c in (0..full).step_by(8) {
        for (b, acc) in acc.iter_mut().enumerate().take(blocks) {
            let v: [__m256; 8] = std::array::from_fn(|i| L::load8(w[8 * b + i].as_ptr().add(c)));
            for (j, col) in transpose8(v).iter().enumerate() {
                for (t, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(*col, _mm256_set1_ps(*xp.add(t * n + c + j)), *a);
                }
            }
        }
    }
    for c in full..n {
        for (b, acc) in acc.iter_mut().enumerate().take(blocks) {
            let e: [f32; 8] = std::array::from_fn(|i| widen(w[8 * b + i][c]));
            let col = _mm256_loadu_ps(e.as_ptr());
            for (t, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(col, _mm256_set1_ps(*xp.add(t * n + c)), *a);
            }
        }
    }
    for (b, acc) in acc.iter().enumerate().take(blocks) {
        for (t, a) in acc.iter().enumerate() {
            let mut lanes = [0.0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), *a);
            for (i, v) in lanes.iter().enumerate().take(count - 8 * b) {
                out[(8 * b + i) * T + t] = *v;
            }
        }
    }
}

pub fn gemm_tiles(format: TensorFormat) -> DotTileFn {
    assert!(crate::Isa::Avx2.supported(), "AVX2 kernels requested on a CPU without AVX2");
    // SAFETY (all three): AVX2, FMA and F16C were just checked; `gemm_tile` checks lengths.
    match format {
        TensorFormat::F32 => |rows, x, out| unsafe { gemm_tile::<F32>(rows, x, out) },
        TensorFormat::F16 => |rows, x, out| unsafe { gemm_tile::<F16>(rows, x, out) },
        TensorFormat::BF16 => |rows, x, out| unsafe { gemm_tile::<Bf16>(rows, x, out) },
        other => unreachable!("{other:?} is a block format"),
    }
}

pub fn dot_tiles(format: TensorFormat) -> DotTileFn {
    assert!(crate::Isa::Avx2.supported(), "AVX2 kernels requested on a CPU without AVX2");
    // SAFETY (all three): AVX2, FMA and F16C were just checked; `dot_tile` checks lengths.
    match format {
        TensorFormat::F32 => |rows, x, out| unsafe { dot_tile::<F32>(rows, x, out) },
        TensorFormat::F16 => |rows, x, out| unsafe { dot_tile::<F16>(rows, x, out) },
        TensorFormat::BF16 => |rows, x, out| unsafe { dot_tile::<Bf16>(rows, x, out) },
        other => unreachable!("{other:?} is a block format"),
    }
}

// Safe entry points for the table. SAFETY (all): `kernels` asserts the CPU has AVX2, FMA
// and F16C before handing these out; slices carry their own bounds, and `x`/`acc` are at
// least as long as the row (checked by the slicing below).

fn dot_f32(row: &[u8], x: &[f32]) -> f32 {
    let w = cast::<f32>(row);
    unsafe { dot::<F32>(w, &x[..w.len()]) }
}
fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
    let w = cast::<HalfBits>(row);
    unsafe { dot::<F16>(w, &x[..w.len()]) }
}
fn dot_bf16(row: &[u8], x: &[f32]) -> f32 {
    let w = cast::<BrainBits>(row);
    unsafe { dot::<Bf16>(w, &x[..w.len()]) }
}
fn decode_f32(row: &[u8], out: &mut [f32]) {
    unsafe { decode::<F32>(cast(row), out) }
}
fn decode_f16(row: &[u8], out: &mut [f32]) {
    unsafe { decode::<F16>(cast(row), out) }
}
fn decode_bf16(row: &[u8], out: &mut [f32]) {
    unsafe { decode::<Bf16>(cast(row), out) }
}
fn axpy_f32(a: f32, row: &[u8], acc: &mut [f32]) {
    unsafe { axpy::<F32>(a, cast(row), acc) }
}
fn axpy_f16(a: f32, row: &[u8], acc: &mut [f32]) {
    unsafe { axpy::<F16>(a, cast(row), acc) }
}
fn axpy_bf16(a: f32, row: &[u8], acc: &mut [f32]) {
    unsafe { axpy::<Bf16>(a, cast(row), acc) }
}

// Attention's page kernels. A pass takes up to three query heads of a kv head group: with
// four rows at a time the dot products keep 12 accumulators, three queries and a widened row
// in the 16 registers, and the weighted sums 12 output vectors, three weights and a row.

/// Four rows' dot products with `H` queries, as `[__m128; H]` (lane s: row s). Each 8 stored
/// elements are widened once for every head; the sums are reduced four rows at a time.
#[inline(always)]
unsafe fn dot_four<L: Lanes, const H: usize>(
    rows: [*const L::Elem; 4],
    n: usize,
    q: *const f32,
) -> [__m128; H] {
    // No closures here: they would not inherit this path's target features, and every
    // intrinsic in them would become a call.
    let mut acc = [[_mm256_setzero_ps(); 4]; H];
    let mut qv = [_mm256_setzero_ps(); H];
    let full = n / 8 * 8;
    for i in (0..full).step_by(8) {
        for (h, qv) in qv.iter_mut().enumerate() {
            *qv = _mm256_loadu_ps(q.add(h * n + i));
        }
        for (s, row) in rows.iter().enumerate() {
            let k = L::load8(row.add(i));
            for h in 0..H {
                acc[h][s] = _mm256_fmadd_ps(qv[h], k, acc[h][s]);
            }
        }
    }
    let mut sums = [_mm_setzero_ps(); H];
    for (sum, acc) in sums.iter_mut().zip(acc) {
        *sum = hsum4(acc);
    }
    if full < n {
        for (h, sum) in sums.iter_mut().enumerate() {
            let mut tails = [0.0f32; 4];
            for (s, tail) in tails.iter_mut().enumerate() {
                for k in full..n {
                    *tail += widen(*rows[s].add(k)) * *q.add(h * n + k);
                }
            }
            *sum = _mm_add_ps(*sum, _mm_loadu_ps(tails.as_ptr()));
        }
    }
    sums
}

/// The horizontal sums of four vectors, in order.
#[inline(always)]
unsafe fn hsum4(v: [__m256; 4]) -> __m128 {
    let pairs = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps::<1>(pairs))
}

/// Scores of one pass of `H` heads against every row, four rows at a time (a last partial
/// four repeats its last row and keeps only the real sums).
#[inline(always)]
unsafe fn dot_pass<L: Lanes, const H: usize>(
    rows: CachedRows,
    q: *const f32,
    scores: *mut f32,
    stride: usize,
) {
    let (base, count) = (rows.bytes.as_ptr(), rows.count);
    for s0 in (0..count).step_by(4) {
        let mut four = [base.cast::<L::Elem>(); 4];
        for (s, row) in four.iter_mut().enumerate() {
            *row = base.add((s0 + s).min(count - 1) * rows.stride).cast();
        }
        let sums = dot_four::<L, H>(four, rows.dim, q);
        let real = (count - s0).min(4);
        for (h, sum) in sums.iter().enumerate() {
            let to = scores.add(h * stride + s0);
            if real == 4 {
                _mm_storeu_ps(to, *sum);
            } else {
                let mut lanes = [0.0f32; 4];
                _mm_storeu_ps(lanes.as_mut_ptr(), *sum);
                for (i, &lane) in lanes[..real].iter().enumerate() {
                    *to.add(i) = lane;
                }
            }
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_heads<L: Lanes>(rows: CachedRows, q: &[f32], scores: &mut [f32], stride: usize) {
    let elem = size_of::<L::Elem>();
    let heads = rows.heads(elem, (q.len(), rows.dim), (scores.len(), stride));
    for pass in head_passes(heads, 3) {
        let (qp, sp) = (q.as_ptr().add(pass.start * rows.dim), scores.as_mut_ptr());
        let sp = sp.add(pass.start * stride);
        match pass.len() {
            1 => dot_pass::<L, 1>(rows, qp, sp, stride),
            2 => dot_pass::<L, 2>(rows, qp, sp, stride),
            _ => dot_pass::<L, 3>(rows, qp, sp, stride),
        }
    }
}

/// `acc[h][cols] += sum over s of w[h][s] * row s[cols]` for `H` heads and the `C` vectors of
/// columns from `col`: the outputs stay in registers while every row streams past.
#[inline(always)]
unsafe fn axpy_cols<L: Lanes, const H: usize, const C: usize>(
    w: *const f32,
    stride: usize,
    rows: CachedRows,
    col: usize,
    acc: *mut f32,
) {
    let (n, count) = (rows.dim, rows.count);
    let mut o = [[_mm256_setzero_ps(); C]; H];
    for (h, o) in o.iter_mut().enumerate() {
        for (c, o) in o.iter_mut().enumerate() {
            *o = _mm256_loadu_ps(acc.add(h * n + col + 8 * c));
        }
    }
    for s in 0..count {
        let row = rows.bytes.as_ptr().add(s * rows.stride).cast::<L::Elem>().add(col);
        let mut ws = [_mm256_setzero_ps(); H];
        for (h, ws) in ws.iter_mut().enumerate() {
            *ws = _mm256_broadcast_ss(&*w.add(h * stride + s));
        }
        for c in 0..C {
            let v = L::load8(row.add(8 * c));
            for (o, w) in o.iter_mut().zip(ws) {
                o[c] = _mm256_fmadd_ps(w, v, o[c]);
            }
        }
    }
    for (h, o) in o.iter().enumerate() {
        for (c, o) in o.iter().enumerate() {
            _mm256_storeu_ps(acc.add(h * n + col + 8 * c), *o);
        }
    }
}

/// One pass of `H` heads over every column: 32 at a time, then 8, then one by one.
#[inline(always)]
unsafe fn axpy_pass<L: Lanes, const H: usize>(
    w: *const f32,
    stride: usize,
    rows: CachedRows,
    acc: *mut f32,
) {
    let (n, count) = (rows.dim, rows.count);
    let mut col = 0;
    while col + 32 <= n {
        axpy_cols::<L, H, 4>(w, stride, rows, col, acc);
        col += 32;
    }
    while col + 8 <= n {
        axpy_cols::<L, H, 1>(w, stride, rows, col, acc);
        col += 8;
    }
    for s in 0..count {
        let row = rows.bytes.as_ptr().add(s * rows.stride).cast::<L::Elem>();
        for h in 0..H {
            for k in col..n {
                *acc.add(h * n + k) += *w.add(h * stride + s) * widen(*row.add(k));
            }
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy_heads<L: Lanes>(weights: &[f32], stride: usize, rows: CachedRows, acc: &mut [f32]) {
    let elem = size_of::<L::Elem>();
    let heads = rows.heads(elem, (acc.len(), rows.dim), (weights.len(), stride));
    for pass in head_passes(heads, 3) {
        let wp = weights.as_ptr().add(pass.start * stride);
        let ap = acc.as_mut_ptr().add(pass.start * rows.dim);
        match pass.len() {
            1 => axpy_pass::<L, 1>(wp, stride, rows, ap),
            2 => axpy_pass::<L, 2>(wp, stride, rows, ap),
            _ => axpy_pass::<L, 3>(wp, stride, rows, ap),
        }
    }
}

// The page kernels again in 512-bit vectors, for the AVX-512 path (`head_kernels_512`):
// half the instructions per position of the 256-bit ones, and 32 registers, so the three
// heads' four running sums of `dot_four` no longer spill. Rows whose width is not a multiple
// of 16 take the 256-bit kernels. A path's kernels are the same for every batch, so a
// session's attention stays bitwise independent of what it is decoded beside.

trait Lanes16: Lanes {
    unsafe fn load16(p: *const Self::Elem) -> __m512;
}
impl Lanes16 for F32 {
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
}
impl Lanes16 for F16 {
    #[inline(always)]
    unsafe fn load16(p: *const HalfBits) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
    }
}
impl Lanes16 for I8 {
    #[inline(always)]
    unsafe fn load16(p: *const i8) -> __m512 {
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast())))
    }
}
impl Lanes16 for Bf16 {
    #[inline(always)]
    unsafe fn load16(p: *const BrainBits) -> __m512 {
        let wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()));
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(wide))
    }
}

/// The high and low 256-bit halves of `v`, added.
#[inline(always)]
unsafe fn fold512(v: __m512) -> __m256 {
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    _mm256_add_ps(_mm512_castps512_ps256(v), hi)
}

/// The `H` heads' running sums against `R` rows, 16 columns a vector (`n` a multiple of 16):
/// the lanes still to be added up.
#[inline(always)]
unsafe fn running_sums16<L: Lanes16, const H: usize, const R: usize>(
    rows: [*const L::Elem; R],
    n: usize,
    q: *const f32,
) -> [[__m512; R]; H] {
    let mut acc = [[_mm512_setzero_ps(); R]; H];
    let mut qv = [_mm512_setzero_ps(); H];
    for i in (0..n).step_by(16) {
        for (h, qv) in qv.iter_mut().enumerate() {
            *qv = _mm512_loadu_ps(q.add(h * n + i));
        }
        for (s, row) in rows.iter().enumerate() {
            let k = L::load16(row.add(i));
            for h in 0..H {
                acc[h][s] = _mm512_fmadd_ps(qv[h], k, acc[h][s]);
            }
        }
    }
    acc
}

/// [`dot_four`] 16 columns at a time (`n` a multiple of 16).
#[inline(always)]
unsafe fn dot_four16<L: Lanes16, const H: usize>(
    rows: [*const L::Elem; 4],
    n: usize,
    q: *const f32,
) -> [__m128; H] {
    let acc = running_sums16::<L, H, 4>(rows, n, q);
    let mut sums = [_mm_setzero_ps(); H];
    for (sum, acc) in sums.iter_mut().zip(acc) {
        // (No closure: it would not inherit the target features.)
        let halves = [fold512(acc[0]), fold512(acc[1]), fold512(acc[2]), fold512(acc[3])];
        *sum = hsum4(halves);
    }
    sums
}

/// The lane sums of eight vectors, in order: pairs interleaved and added level by level
/// (24 shuffles and adds for the eight, where folding each vector alone took 38 micro-ops).
#[inline(always)]
unsafe fn lane_sums8(v: &[__m512; 8]) -> __m256 {
    // (Functions, not closures: those would not inherit the caller's target features.)
    let low = quad_sums(pair_sums(v[0], v[1]), pair_sums(v[2], v[3]));
    let high = quad_sums(pair_sums(v[4], v[5]), pair_sums(v[6], v[7]));
    // Lanes [low 0 + 1, low 2 + 3, high 0 + 1, high 2 + 3], reordered so that the two
    // 256-bit halves add up to [low, high].
    let halves = _mm512_add_ps(
        _mm512_shuffle_f32x4::<0b01_00_01_00>(low, high),
        _mm512_shuffle_f32x4::<0b11_10_11_10>(low, high),
    );
    fold512(_mm512_shuffle_f32x4::<0b11_01_10_00>(halves, halves))
}

/// Per 128-bit lane of `a` and `b`: [a0 + a2, b0 + b2, a1 + a3, b1 + b3].
#[inline(always)]
unsafe fn pair_sums(a: __m512, b: __m512) -> __m512 {
    _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b))
}

/// Per 128-bit lane, the sums of the four vectors that `pair_sums` gave `ab` and `cd`.
#[inline(always)]
unsafe fn quad_sums(ab: __m512, cd: __m512) -> __m512 {
    _mm512_add_ps(_mm512_shuffle_ps::<0x44>(ab, cd), _mm512_shuffle_ps::<0xEE>(ab, cd))
}

/// [`dot_four16`] for eight rows: 8 x `H` running sums (24 of the 32 registers at three
/// heads), reduced together by [`lane_sums8`].
#[inline(always)]
unsafe fn dot_eight16<L: Lanes16, const H: usize>(
    rows: [*const L::Elem; 8],
    n: usize,
    q: *const f32,
) -> [__m256; H] {
    let acc = running_sums16::<L, H, 8>(rows, n, q);
    let mut sums = [_mm256_setzero_ps(); H];
    for (sum, acc) in sums.iter_mut().zip(&acc) {
        *sum = lane_sums8(acc);
    }
    sums
}

/// [`dot_pass`] on [`dot_eight16`], then [`dot_four16`] for the last rows.
#[inline(always)]
unsafe fn dot_pass16<L: Lanes16, const H: usize>(
    rows: CachedRows,
    q: *const f32,
    scores: *mut f32,
    stride: usize,
) {
    let (base, count) = (rows.bytes.as_ptr(), rows.count);
    let eights = count / 8 * 8;
    for s0 in (0..eights).step_by(8) {
        let mut eight = [base.cast::<L::Elem>(); 8];
        for (s, row) in eight.iter_mut().enumerate() {
            *row = base.add((s0 + s) * rows.stride).cast();
        }
        let sums = dot_eight16::<L, H>(eight, rows.dim, q);
        for (h, sum) in sums.iter().enumerate() {
            _mm256_storeu_ps(scores.add(h * stride + s0), *sum);
        }
    }
    for s0 in (eights..count).step_by(4) {
        let mut four = [base.cast::<L::Elem>(); 4];
        for (s, row) in four.iter_mut().enumerate() {
            *row = base.add((s0 + s).min(count - 1) * rows.stride).cast();
        }
        let sums = dot_four16::<L, H>(four, rows.dim, q);
        let real = (count - s0).min(4);
        for (h, sum) in sums.iter().enumerate() {
            let to = scores.add(h * stride + s0);
            if real == 4 {
                _mm_storeu_ps(to, *sum);
            } else {
                let mut lanes = [0.0f32; 4];
                _mm_storeu_ps(lanes.as_mut_ptr(), *sum);
                for (i, &lane) in lanes[..real].iter().enumerate() {
                    *to.add(i) = lane;
                }
            }
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw")]
unsafe fn dot_heads16<L: Lanes16>(rows: CachedRows, q: &[f32], scores: &mut [f32], stride: usize) {
    if !rows.dim.is_multiple_of(16) {
        return dot_heads::<L>(rows, q, scores, stride);
    }
    let elem = size_of::<L::Elem>();
    let heads = rows.heads(elem, (q.len(), rows.dim), (scores.len(), stride));
    for pass in head_passes(heads, 3) {
        let (qp, sp) = (q.as_ptr().add(pass.start * rows.dim), scores.as_mut_ptr());
        let sp = sp.add(pass.start * stride);
        match pass.len() {
            1 => dot_pass16::<L, 1>(rows, qp, sp, stride),
            2 => dot_pass16::<L, 2>(rows, qp, sp, stride),
            _ => dot_pass16::<L, 3>(rows, qp, sp, stride),
        }
    }
}

/// [`axpy_cols`] 16 columns a vector.
#[inline(always)]
unsafe fn axpy_cols16<L: Lanes16, const H: usize, const C: usize>(
    w: *const f32,
    stride: usize,
    rows: CachedRows,
    col: usize,
    acc: *mut f32,
) {
    let (n, count) = (rows.dim, rows.count);
    let mut o = [[_mm512_setzero_ps(); C]; H];
    for (h, o) in o.iter_mut().enumerate() {
        for (c, o) in o.iter_mut().enumerate() {
            *o = _mm512_loadu_ps(acc.add(h * n + col + 16 * c));
        }
    }
    for s in 0..count {
        let row = rows.bytes.as_ptr().add(s * rows.stride).cast::<L::Elem>().add(col);
        let mut ws = [_mm512_setzero_ps(); H];
        for (h, ws) in ws.iter_mut().enumerate() {
            *ws = _mm512_set1_ps(*w.add(h * stride + s));
        }
        for c in 0..C {
            let v = L::load16(row.add(16 * c));
            for (o, w) in o.iter_mut().zip(ws) {
                o[c] = _mm512_fmadd_ps(w, v, o[c]);
            }
        }
    }
    for (h, o) in o.iter().enumerate() {
        for (c, o) in o.iter().enumerate() {
            _mm512_storeu_ps(acc.add(h * n + col + 16 * c), *o);
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw")]
unsafe fn axpy_heads16<L: Lanes16>(
    weights: &[f32],
    stride: usize,
    rows: CachedRows,
    acc: &mut [f32],
) {
    if !rows.dim.is_multiple_of(16) {
        return axpy_heads::<L>(weights, stride, rows, acc);
    }
    let elem = size_of::<L::Elem>();
    let heads = rows.heads(elem, (acc.len(), rows.dim), (weights.len(), stride));
    let n = rows.dim;
    for pass in head_passes(heads, 3) {
        let wp = weights.as_ptr().add(pass.start * stride);
        let ap = acc.as_mut_ptr().add(pass.start * n);
        let mut col = 0;
        while col + 64 <= n {
            match pass.len() {
                1 => axpy_cols16::<L, 1, 4>(wp, stride, rows, col, ap),
                2 => axpy_cols16::<L, 2, 4>(wp, stride, rows, col, ap),
                _ => axpy_cols16::<L, 3, 4>(wp, stride, rows, col, ap),
            }
            col += 64;
        }
        while col < n {
            match pass.len() {
                1 => axpy_cols16::<L, 1, 1>(wp, stride, rows, col, ap),
                2 => axpy_cols16::<L, 2, 1>(wp, stride, rows, col, ap),
                _ => axpy_cols16::<L, 3, 1>(wp, stride, rows, col, ap),
            }
            col += 16;
        }
    }
}

/// Rows of a page whose int8 scales (and scaled weights) the head kernels keep on the stack.
const I8_STACK_ROWS: usize = 64;

/// The f16 scales of `rows`, widened into `out` (`rows.count` of them).
#[target_feature(enable = "f16c")]
unsafe fn i8_scales(rows: CachedRows, out: &mut [f32]) {
    for (s, d) in out.iter_mut().enumerate().take(rows.count) {
        *d = scale_f16c(&rows.bytes[s * rows.stride..]);
    }
}

/// Runs `f` with `rows`' scales (on the stack for pages of up to `I8_STACK_ROWS` rows).
fn with_i8_scales<R>(rows: CachedRows, f: impl FnOnce(&[f32]) -> R) -> R {
    let mut stack = [0.0f32; I8_STACK_ROWS];
    let mut heap = Vec::new();
    let scales = if rows.count <= I8_STACK_ROWS {
        &mut stack[..rows.count]
    } else {
        heap.resize(rows.count, 0.0);
        &mut heap[..]
    };
    // SAFETY: the AVX-512 path's table hands these kernels out after checking the CPU (F16C
    // with it).
    unsafe { i8_scales(rows, scales) };
    f(scales)
}

/// `dot_heads16` over int8 rows: each row's sums over its int8 values, times its scale (the
/// pages are read as stored, half of f16's bytes, instead of widened to f32 first).
fn dot_heads16_i8(rows: CachedRows, q: &[f32], scores: &mut [f32], stride: usize) {
    // SAFETY: the values start past the scale, and `heads` checks every row's end there.
    unsafe { dot_heads16::<I8>(rows.offset_by(I8_SCALE_BYTES), q, scores, stride) }
    with_i8_scales(rows, |d| {
        for h in 0..q.len() / rows.dim {
            let head = &mut scores[h * stride..][..rows.count];
            head.iter_mut().zip(d).for_each(|(s, d)| *s *= d);
        }
    });
}

/// `axpy_heads16` over int8 rows: each row's weights times its scale, then its int8 values.
fn axpy_heads16_i8(weights: &[f32], stride: usize, rows: CachedRows, acc: &mut [f32]) {
    let (heads, count) = (acc.len() / rows.dim, rows.count);
    let mut stack = [0.0f32; 4 * I8_STACK_ROWS];
    let mut heap = Vec::new();
    let scaled = if heads * count <= stack.len() {
        &mut stack[..heads * count]
    } else {
        heap.resize(heads * count, 0.0);
        &mut heap[..]
    };
    assert!(stride >= count, "int8 page weights: heads {stride} apart, {count} rows");
    with_i8_scales(rows, |d| {
        for (h, out) in scaled.chunks_exact_mut(count).enumerate() {
            let w = &weights[h * stride..][..count];
            out.iter_mut().zip(w).zip(d).for_each(|((o, w), d)| *o = w * d);
        }
    });
    // SAFETY: as in `dot_heads16_i8`.
    unsafe { axpy_heads16::<I8>(scaled, count, rows.offset_by(I8_SCALE_BYTES), acc) }
}

/// The head-group kernels of int8 KV pages on the AVX-512 path (its table hands them out).
pub const INT8_HEADS_512: HeadKernels = HeadKernels { dot: dot_heads16_i8, axpy: axpy_heads16_i8 };

// The head-group kernels of the AVX-512 path.
float_head_kernels!(head_kernels_512, crate::Isa::Avx512Vnni, Lanes16, dot_heads16, axpy_heads16);
