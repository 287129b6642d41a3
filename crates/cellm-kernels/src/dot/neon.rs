//! aarch64 NEON float kernels (f32, f16, bf16 rows). Installed only after
//! `Isa::Neon.supported()`. Half floats widen with `fcvtl`, which every ARMv8-A core has; the
//! Rust intrinsic for it needs the unstable `f16` type, so it is written as the instruction.

use std::arch::aarch64::*;
use std::arch::asm;

use cellm_format::TensorFormat;

use super::floats::cast;

float_row_kernels!(assert!(
    crate::Isa::Neon.supported(),
    "NEON kernels requested on a CPU without NEON"
));

head_kernels_by_rows!();

dot_tiles_by_rows!();
gemm_tiles_in_order!(true);

/// Eight f16 bits as two vectors of four f32 (`fcvtl`, `fcvtl2`).
#[inline(always)]
pub(super) unsafe fn widen_f16x8(v: uint16x8_t) -> [float32x4_t; 2] {
    let (lo, hi): (float32x4_t, float32x4_t);
    asm!(
        "fcvtl {lo:v}.4s, {v:v}.4h",
        "fcvtl2 {hi:v}.4s, {v:v}.8h",
        v = in(vreg) v,
        lo = out(vreg) lo,
        hi = out(vreg) hi,
        options(pure, nomem, nostack, preserves_flags)
    );
    [lo, hi]
}

/// The f16 value at `p` (any alignment) as f32.
#[inline(always)]
pub(super) unsafe fn load_f16(p: *const u8) -> f32 {
    let bits = p.cast::<u16>().read_unaligned();
    vgetq_lane_f32::<0>(widen_f16x8(vdupq_n_u16(bits))[0])
}

/// Loads eight stored elements as two vectors of four f32.
trait Lanes {
    type Elem: Copy;
    unsafe fn load8(p: *const Self::Elem) -> [float32x4_t; 2];
    fn widen(e: Self::Elem) -> f32;
}

struct F32;
struct F16;
struct Bf16;

impl Lanes for F32 {
    type Elem = f32;
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> [float32x4_t; 2] {
        [vld1q_f32(p), vld1q_f32(p.add(4))]
    }
    fn widen(e: f32) -> f32 {
        e
    }
}
impl Lanes for F16 {
    type Elem = u16;
    #[inline(always)]
    unsafe fn load8(p: *const u16) -> [float32x4_t; 2] {
        widen_f16x8(vld1q_u16(p))
    }
    fn widen(e: u16) -> f32 {
        half::f16::from_bits(e).to_f32()
    }
}
impl Lanes for Bf16 {
    type Elem = u16;
    #[inline(always)]
    unsafe fn load8(p: *const u16) -> [float32x4_t; 2] {
        // A bf16 is the top half of an f32.
        let v = vld1q_u16(p);
        [
            vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(v))),
            vreinterpretq_f32_u32(vshll_high_n_u16::<16>(v)),
        ]
    }
    fn widen(e: u16) -> f32 {
        half::bf16::from_bits(e).to_f32()
    }
}

/// Four accumulators (16 elements a step) keep more fused multiply-adds in flight than one
/// chain's latency allows.
#[target_feature(enable = "neon")]
unsafe fn dot<L: Lanes>(w: &[L::Elem], x: &[f32]) -> f32 {
    let n = w.len();
    assert!(x.len() >= n, "dot: activations shorter than the row");
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let mut acc = [vdupq_n_f32(0.0); 4];
    let mut i = 0;
    while i + 16 <= n {
        let [a, b] = L::load8(wp.add(i));
        let [c, d] = L::load8(wp.add(i + 8));
        acc[0] = vfmaq_f32(acc[0], a, vld1q_f32(xp.add(i)));
        acc[1] = vfmaq_f32(acc[1], b, vld1q_f32(xp.add(i + 4)));
        acc[2] = vfmaq_f32(acc[2], c, vld1q_f32(xp.add(i + 8)));
        acc[3] = vfmaq_f32(acc[3], d, vld1q_f32(xp.add(i + 12)));
        i += 16;
    }
    while i + 8 <= n {
        let [a, b] = L::load8(wp.add(i));
        acc[0] = vfmaq_f32(acc[0], a, vld1q_f32(xp.add(i)));
        acc[1] = vfmaq_f32(acc[1], b, vld1q_f32(xp.add(i + 4)));
        i += 8;
    }
    let sum = vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3]));
    let mut total = vaddvq_f32(sum);
    for k in i..n {
        total += L::widen(w[k]) * x[k];
    }
    total
}

#[target_feature(enable = "neon")]
unsafe fn decode<L: Lanes>(w: &[L::Elem], out: &mut [f32]) {
    let n = w.len().min(out.len());
    let mut i = 0;
    while i + 8 <= n {
        let [a, b] = L::load8(w.as_ptr().add(i));
        vst1q_f32(out.as_mut_ptr().add(i), a);
        vst1q_f32(out.as_mut_ptr().add(i + 4), b);
        i += 8;
    }
    for k in i..n {
        out[k] = L::widen(w[k]);
    }
}

#[target_feature(enable = "neon")]
unsafe fn axpy<L: Lanes>(a: f32, w: &[L::Elem], acc: &mut [f32]) {
    let n = w.len().min(acc.len());
    let mut i = 0;
    while i + 8 <= n {
        let [lo, hi] = L::load8(w.as_ptr().add(i));
        let p = acc.as_mut_ptr().add(i);
        vst1q_f32(p, vfmaq_n_f32(vld1q_f32(p), lo, a));
        vst1q_f32(p.add(4), vfmaq_n_f32(vld1q_f32(p.add(4)), hi, a));
        i += 8;
    }
    for k in i..n {
        acc[k] += a * L::widen(w[k]);
    }
}

// Safe entry points for the table. SAFETY (all): `kernels` asserts the CPU has NEON before
// handing these out; `dot` checks the activations' length, `decode` and `axpy` stop at the
// shorter slice.

fn dot_f32(row: &[u8], x: &[f32]) -> f32 {
    unsafe { dot::<F32>(cast(row), x) }
}
fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
    unsafe { dot::<F16>(cast(row), x) }
}
fn dot_bf16(row: &[u8], x: &[f32]) -> f32 {
    unsafe { dot::<Bf16>(cast(row), x) }
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
