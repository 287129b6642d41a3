//! AVX2 + FMA + F16C kernels. Installed in a table only after `Isa::Avx2.supported()`.

use std::arch::x86_64::*;

use cellm_format::TensorFormat;

use super::{cast, HeadKernels};

float_row_kernels!(assert!(
    crate::Isa::Avx2.supported(),
    "AVX2 kernels requested on a CPU without AVX2"
));

pub fn head_kernels(format: TensorFormat) -> HeadKernels {
    assert!(crate::Isa::Avx2.supported(), "AVX2 kernels requested on a CPU without AVX2");
    match format {
        TensorFormat::F32 => HeadKernels { dot: dot_heads_f32, axpy: axpy_heads_f32 },
        TensorFormat::F16 => HeadKernels { dot: dot_heads_f16, axpy: axpy_heads_f16 },
        TensorFormat::BF16 => HeadKernels { dot: dot_heads_bf16, axpy: axpy_heads_bf16 },
        other => unreachable!("{other:?} is not a cache format"),
    }
}

pub fn panel_widener(format: TensorFormat) -> super::PanelFn {
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

impl Lanes for F32 {
    type Elem = f32;
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
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
    const PANEL: usize = crate::gemm::PANEL_ROWS;
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

pub fn dot_tiles(format: TensorFormat) -> super::DotTileFn {
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

/// `out[h] = dot(w, q[h])` for `M` query heads at `q` (stride `w.len()`): each 8 stored
/// elements are widened once for all heads. Two accumulators per head keep 2M multiply-adds
/// in flight, more than one chain per head's FMA latency would allow.
#[inline(always)]
unsafe fn dot_heads_m<L: Lanes, const M: usize>(w: &[L::Elem], q: *const f32, out: &mut [f32]) {
    let n = w.len();
    let mut acc = [[_mm256_setzero_ps(); M]; 2];
    let (pairs, full) = (n / 16 * 16, n / 8 * 8);
    for i in (0..pairs).step_by(16) {
        let kv = [L::load8(w.as_ptr().add(i)), L::load8(w.as_ptr().add(i + 8))];
        for (j, acc) in acc.iter_mut().enumerate() {
            for (h, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(h * n + i + 8 * j)), kv[j], *a);
            }
        }
    }
    if full > pairs {
        let kv = L::load8(w.as_ptr().add(pairs));
        for (h, a) in acc[0].iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(h * n + pairs)), kv, *a);
        }
    }
    for h in 0..M {
        let tail: f32 = (full..n).map(|k| widen(w[k]) * *q.add(h * n + k)).sum();
        out[h] = hsum(_mm256_add_ps(acc[0][h], acc[1][h])) + tail;
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_heads<L: Lanes>(w: &[L::Elem], q: &[f32], out: &mut [f32]) {
    let n = w.len();
    assert!(q.len() >= out.len() * n, "dot_heads: queries too short");
    for (h0, o) in (0..out.len()).step_by(4).zip(out.chunks_mut(4)) {
        let qp = q.as_ptr().add(h0 * n);
        match o.len() {
            1 => dot_heads_m::<L, 1>(w, qp, o),
            2 => dot_heads_m::<L, 2>(w, qp, o),
            3 => dot_heads_m::<L, 3>(w, qp, o),
            _ => dot_heads_m::<L, 4>(w, qp, o),
        }
    }
}

/// `acc[h] += a[h] * w` for every head `h` (rows of `acc` are `w.len()` long).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy_heads<L: Lanes>(a: &[f32], w: &[L::Elem], acc: &mut [f32]) {
    let n = w.len();
    assert!(acc.len() >= a.len() * n, "axpy_heads: accumulators too short");
    let full = n / 8 * 8;
    for i in (0..full).step_by(8) {
        let kv = L::load8(w.as_ptr().add(i));
        for (h, &ah) in a.iter().enumerate() {
            let p = acc.as_mut_ptr().add(h * n + i);
            _mm256_storeu_ps(p, _mm256_fmadd_ps(_mm256_set1_ps(ah), kv, _mm256_loadu_ps(p)));
        }
    }
    for (h, &ah) in a.iter().enumerate() {
        for k in full..n {
            acc[h * n + k] += ah * widen(w[k]);
        }
    }
}

fn dot_heads_f32(row: &[u8], q: &[f32], out: &mut [f32]) {
    unsafe { dot_heads::<F32>(cast(row), q, out) }
}
fn dot_heads_f16(row: &[u8], q: &[f32], out: &mut [f32]) {
    unsafe { dot_heads::<F16>(cast(row), q, out) }
}
fn dot_heads_bf16(row: &[u8], q: &[f32], out: &mut [f32]) {
    unsafe { dot_heads::<Bf16>(cast(row), q, out) }
}
fn axpy_heads_f32(a: &[f32], row: &[u8], acc: &mut [f32]) {
    unsafe { axpy_heads::<F32>(a, cast(row), acc) }
}
fn axpy_heads_f16(a: &[f32], row: &[u8], acc: &mut [f32]) {
    unsafe { axpy_heads::<F16>(a, cast(row), acc) }
}
fn axpy_heads_bf16(a: &[f32], row: &[u8], acc: &mut [f32]) {
    unsafe { axpy_heads::<Bf16>(a, cast(row), acc) }
}
