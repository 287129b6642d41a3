//! How the NEON integer kernels multiply bytes: every i32 lane gets the sum of four adjacent
//! i8 x i8 products, `sdot`'s arithmetic. Cores with the dot product extension (ARMv8.2+) do
//! it in one `sdot`; plain ARMv8 NEON widens with `smull`/`smull2` and adds pairs. The
//! kernels are written once, generic over [`NeonDot`], and compiled once per path.
//!
//! Both i8 operands are signed, so unlike AVX2 no operand needs to be unsigned: weights are
//! unpacked to their signed values (q4_0's `q - 8`) wherever that is exact.

use std::arch::aarch64::*;
use std::arch::asm;

pub(super) trait NeonDot {
    /// `acc` plus, in lane `i`, the products of bytes `4i..4i + 4` of `a` and `b`.
    unsafe fn step(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t;

    /// The 32-byte product `a . b` per lane, from nothing.
    #[inline(always)]
    unsafe fn dot32(a: [int8x16_t; 2], b: [int8x16_t; 2]) -> int32x4_t {
        Self::step(Self::step(vdupq_n_s32(0), a[0], b[0]), a[1], b[1])
    }
}

/// `sdot` (FEAT_DotProd). `vdotq_s32` is not stable Rust yet, so this is the instruction.
pub(super) struct Dotprod;

impl NeonDot for Dotprod {
    #[inline(always)]
    unsafe fn step(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
        let mut r = acc;
        asm!(
            "sdot {r:v}.4s, {a:v}.16b, {b:v}.16b",
            r = inout(vreg) r,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags)
        );
        r
    }
}

/// Plain NEON: 16 i16 products, pairs added into i16 (`addp`), then pairs of those into the
/// i32 lanes (`sadalp`). A pair of products stays within i16 because activations are within
/// +-127 (`acts`): |w * x| <= 128 * 127, twice that is 32512.
pub(super) struct Widening;

impl NeonDot for Widening {
    #[inline(always)]
    unsafe fn step(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
        let lo = vmull_s8(vget_low_s8(a), vget_low_s8(b));
        let hi = vmull_high_s8(a, b);
        vpadalq_s16(acc, vpaddq_s16(lo, hi))
    }
}

/// The paths as const-generic parameters (an enum cannot be one).
pub(super) const NEON: u8 = 0;
pub(super) const NEON_DOTPROD: u8 = 1;

/// Four activation bytes (one i32) in every lane.
#[inline(always)]
pub(super) unsafe fn broadcast4(p: *const i8) -> int8x16_t {
    vreinterpretq_s8_s32(vdupq_n_s32(p.cast::<i32>().read_unaligned()))
}

/// 32 activation bytes as two vectors.
#[inline(always)]
pub(super) unsafe fn load32(p: *const i8) -> [int8x16_t; 2] {
    [vld1q_s8(p), vld1q_s8(p.add(16))]
}

/// 16 bytes of nibbles -> 32 values: low nibbles (elements 0..16), then high nibbles (16..32),
/// ggml's element order.
#[inline(always)]
pub(super) unsafe fn nibbles32(p: *const u8) -> [uint8x16_t; 2] {
    let q = vld1q_u8(p);
    [vandq_u8(q, vdupq_n_u8(0x0F)), vshrq_n_u8::<4>(q)]
}
