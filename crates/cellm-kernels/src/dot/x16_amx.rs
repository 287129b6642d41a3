//! Pair kernels on AMX, the tile matrix unit of Intel's server cores from Sapphire Rapids on.
//! Several sessions decoding at once make the interleaved products compute-bound, and there
//! the AVX-512 pair kernels are held to one `vpdpbusd` a cycle (the one port that has it);
//! one `tdpbssd` does the 16 rows x 8 tokens x 32 columns that take them 64.
//!
//! Per block column (32 columns) of a pair of groups: the 16 rows' quants go, as bytes, into
//! a 512-byte tile B (8 rows of 16 dwords: dword `k` of a row holds columns 4k..4k + 4 of each
//! of the 16 weight rows, which is what a pair's 4-byte chunks already are once their nibbles
//! are split), the tokens' int8 activations of that block are tile A (a row per token, read
//! in place: the tokens' rows must lie at one stride), and `tdpbssd` leaves each (token, row)
//! block sum in tile C. C goes back to memory and the block's scales apply with the AVX-512
//! pair kernels' float operations in their order, so every output is bitwise theirs (and the
//! group kernels'). Two block columns go through the tiles per pass (tiles 0-2 and 3-5), so
//! one's multiply overlaps the other's scales.

use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

use cellm_format::{TensorFormat, INTERLEAVE};

use super::x8::{check_group_args, QDotX16Fn, MAX_TOKENS};
use crate::acts::Q8Row;

/// Whether this process can run AMX int8 tiles: the CPU has AMX-TILE and AMX-INT8, the OS
/// saves tile state (XCR0 bits 17 and 18), and Linux granted this process the tile data
/// (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, Linux 5.16 on). `CELLM_NO_AMX=1` says no (A/B runs).
pub fn usable() -> bool {
    static USABLE: OnceLock<bool> = OnceLock::new();
    *USABLE.get_or_init(|| std::env::var_os("CELLM_NO_AMX").is_none() && detect())
}

fn detect() -> bool {
    // SAFETY: CPUID exists on every x86-64 CPU; XGETBV runs only where CPUID says the OS
    // enabled it (OSXSAVE).
    unsafe {
        let leaf7 = __cpuid_count(7, 0);
        let (tile, int8) = ((leaf7.edx >> 24) & 1 == 1, (leaf7.edx >> 25) & 1 == 1);
        if !(tile && int8 && (__cpuid(1).ecx >> 27) & 1 == 1) {
            return false;
        }
        let xcr0 = xgetbv0();
        xcr0 & (3 << 17) == 3 << 17 && request_tile_data()
    }
}

/// XCR0, the state components the OS saves.
unsafe fn xgetbv0() -> u64 {
    let (lo, hi): (u32, u32);
    // SAFETY: the caller checked OSXSAVE.
    unsafe { asm!("xgetbv", in("ecx") 0, out("eax") lo, out("edx") hi, options(nomem, nostack)) };
    u64::from(hi) << 32 | u64::from(lo)
}

/// Asks Linux for the tile data state (process-wide; without it the first tile instruction
/// faults).
#[cfg(target_os = "linux")]
fn request_tile_data() -> bool {
    const SYS_ARCH_PRCTL: usize = 158;
    const ARCH_REQ_XCOMP_PERM: usize = 0x1023;
    const XFEATURE_XTILEDATA: usize = 18;
    let ret: isize;
    // SAFETY: a plain system call; it reads and writes no memory of ours.
    unsafe {
        asm!("syscall", inlateout("rax") SYS_ARCH_PRCTL as isize => ret,
             in("rdi") ARCH_REQ_XCOMP_PERM, in("rsi") XFEATURE_XTILEDATA,
             lateout("rcx") _, lateout("r11") _, options(nostack));
    }
    ret == 0
}

#[cfg(not(target_os = "linux"))]
fn request_tile_data() -> bool {
    false
}

/// `ldtilecfg`'s 64 bytes: palette 1, then each tile's bytes a row and rows.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

impl TileConfig {
    /// Tiles 0-2 and 3-5: A (`tokens` rows of 32 activation bytes), B (8 rows of 16 weight
    /// rows' dwords), C (`tokens` rows of 16 int32 sums).
    fn for_tokens(tokens: usize) -> Self {
        let mut c = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        for base in [0, 3] {
            c.colsb[base..base + 3].copy_from_slice(&[32, 64, 64]);
            c.rows[base..base + 3].copy_from_slice(&[tokens as u8, 8, tokens as u8]);
        }
        c
    }
}

/// Block columns one pass stages, multiplies, then scales.
const CHUNK: usize = 8;

/// A pass's tiles in memory (64-byte aligned): B of each block column, then C of each.
#[repr(C, align(64))]
struct Scratch {
    b: [[__m512i; 8]; CHUNK],
    c: [[[[i32; 16]; MAX_TOKENS]; CHUNK]; 2],
}

/// The 32-byte chunk at `at` of the first group and the one `stride` later, of the second.
#[inline(always)]
unsafe fn load_pair(at: *const u8, stride: usize) -> __m512i {
    let a = _mm256_loadu_si256(at.cast());
    let b = _mm256_loadu_si256(at.add(stride).cast());
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b)
}

/// The 8 f16 fields at `at` (first group's rows) and `stride` later (second's), as f32.
#[inline(always)]
unsafe fn halves_ph(at: *const u8, stride: usize) -> __m512 {
    let a = _mm_loadu_si128(at.cast());
    let b = _mm_loadu_si128(at.add(stride).cast());
    _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(a), b))
}

/// Format `F`'s block column `b` of the pair: its B tile into `tile`, and its scale fields
/// (`d`, and q4's offset factor: q4_1's `m`, q4_0's `-8 d`).
#[inline(always)]
unsafe fn stage_column<const F: usize>(
    base: *const u8,
    b: usize,
    stride: usize,
    tile: &mut [__m512i; 8],
) -> (__m512, __m512) {
    // q8_0: 8 chunks of signed quants after d; q4_0 / q4_1: 4 chunks of nibble pairs after
    // d (and m).
    let head = [16, 16, 32][F];
    let bytes = head + if F == 0 { 256 } else { 128 };
    let blk = base.add(bytes * b);
    super::prefetch::pair_ahead(blk, bytes * b, bytes, stride);
    let d = halves_ph(blk, stride);
    let qs = blk.add(head);
    if F == 0 {
        for (c, row) in tile.iter_mut().enumerate() {
            *row = load_pair(qs.add(32 * c), stride);
        }
        return (d, _mm512_setzero_ps());
    }
    let low = _mm512_set1_epi8(0x0F);
    for c in 0..4 {
        let q = load_pair(qs.add(32 * c), stride);
        tile[c] = _mm512_and_si512(q, low);
        tile[c + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(q), low);
    }
    let offset = if F == 1 {
        _mm512_mul_ps(d, _mm512_set1_ps(-8.0))
    } else {
        halves_ph(blk.add(16), stride)
    };
    (d, offset)
}

/// Block column `b`'s C tile from its staged B tile at `bt` into `ct`, through tiles 0-2
/// or (`SET` 1) 3-5: neighbouring columns take the other set, so that one's multiply need
/// not wait for the other's store.
#[inline(always)]
unsafe fn multiply<const SET: usize>(a: *const i8, a_stride: usize, bt: *const u8, ct: *mut u8) {
    if SET == 0 {
        asm!(
            "tileloadd tmm0, [{a} + {as_}*1]",
            "tileloadd tmm1, [{b} + {s64}*1]",
            "tilezero tmm2",
            "tdpbssd tmm2, tmm0, tmm1",
            "tilestored [{c} + {s64}*1], tmm2",
            a = in(reg) a, as_ = in(reg) a_stride, b = in(reg) bt, c = in(reg) ct,
            s64 = in(reg) 64usize, options(nostack),
        );
    } else {
        asm!(
            "tileloadd tmm3, [{a} + {as_}*1]",
            "tileloadd tmm4, [{b} + {s64}*1]",
            "tilezero tmm5",
            "tdpbssd tmm5, tmm3, tmm4",
            "tilestored [{c} + {s64}*1], tmm5",
            a = in(reg) a, as_ = in(reg) a_stride, b = in(reg) bt, c = in(reg) ct,
            s64 = in(reg) 64usize, options(nostack),
        );
    }
}

/// Adds block column `b`'s sums (C tile `c`) times its scales into `acc`, as the AVX-512
/// pair kernels do.
#[inline(always)]
unsafe fn scale_into<const N: usize, const F: usize>(
    acc: &mut [__m512; N],
    c: &[[i32; 16]; MAX_TOKENS],
    (d, offset): (__m512, __m512),
    x: &[Q8Row; N],
    b: usize,
) {
    for t in 0..N {
        let p = _mm512_cvtepi32_ps(_mm512_load_si512(c[t].as_ptr().cast()));
        let [dx, sx] = *x[t].ds.get_unchecked(b);
        acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx)), p, acc[t]);
        if F != 0 {
            acc[t] = _mm512_fmadd_ps(offset, _mm512_set1_ps(sx), acc[t]);
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn run<const N: usize, const F: usize>(
    pair: &[u8],
    x: &[Q8Row],
    a_stride: usize,
    out: &mut [[f32; 2 * INTERLEAVE]],
) {
    let x: &[Q8Row; N] = x.try_into().expect("N activation rows");
    let stride = pair.len() / 2;
    let bytes = [16 + 256, 16 + 128, 32 + 128][F];
    let blocks = stride / bytes;
    let base = pair.as_ptr();
    let a = x[0].qs.as_ptr();
    let config = TileConfig::for_tokens(N);
    asm!("ldtilecfg [{}]", in(reg) &config, options(nostack, readonly));
    // Every B tile is written before its tile load reads it, every C tile stored by the
    // tile unit before it is read.
    let mut scratch = std::mem::MaybeUninit::<Scratch>::uninit();
    let sp = scratch.as_mut_ptr();
    let mut scales = [[(_mm512_setzero_ps(), _mm512_setzero_ps()); CHUNK]; 2];
    let mut acc = [_mm512_setzero_ps(); N];
    // Per pass: stage every B tile and multiply, then scale the previous pass's columns
    // (their C tiles stored long before), so the tile unit and the vector units overlap.
    let passes = blocks.div_ceil(CHUNK);
    for pass in 0..=passes {
        let half = pass % 2;
        if pass < passes {
            let start = pass * CHUNK;
            let n = CHUNK.min(blocks - start);
            for j in 0..n {
                scales[half][j] = stage_column::<F>(base, start + j, stride, &mut (*sp).b[j]);
            }
            for j in 0..n {
                let at = a.add(32 * (start + j));
                let (bt, ct) = ((*sp).b[j].as_ptr().cast(), (*sp).c[half][j].as_mut_ptr().cast());
                match j % 2 {
                    0 => multiply::<0>(at, a_stride, bt, ct),
                    _ => multiply::<1>(at, a_stride, bt, ct),
                }
            }
        }
        if pass > 0 {
            let start = (pass - 1) * CHUNK;
            for j in 0..CHUNK.min(blocks - start) {
                scale_into::<N, F>(
                    &mut acc,
                    &(*sp).c[1 - half][j],
                    scales[1 - half][j],
                    x,
                    start + j,
                );
            }
        }
    }
    asm!("tilerelease", options(nostack, nomem));
    for (o, v) in out.iter_mut().zip(acc) {
        _mm512_storeu_ps(o.as_mut_ptr(), v);
    }
}

/// The tokens' activation rows' common stride, where each lies that far after the one before
/// (rows of one `Q8Acts`), as one tile load needs.
fn common_stride(x: &[Q8Row]) -> Option<usize> {
    let at = |t: usize| x[t].qs.as_ptr() as usize;
    let stride = if x.len() > 1 { at(1).checked_sub(at(0))? } else { x[0].qs.len() };
    (1..x.len()).all(|t| at(t) == at(0) + t * stride).then_some(stride)
}

/// The pair kernel of format `F` (q8_0x8, q4_0x8, q4_1x8) on AMX, for 1..=8 tokens; rows
/// not at one stride go to the AVX-512 pair kernel (`fallback`), which gives the same bits.
fn entry<const F: usize>(pair: &[u8], x: &[Q8Row], out: &mut [[f32; 2 * INTERLEAVE]]) {
    let format = TensorFormat::INTERLEAVED[F];
    let (first, second) = pair.split_at(pair.len() / 2);
    check_group_args(format, first, x, out.len(), false);
    assert!(first.len() == second.len(), "{format:?} pair kernel: groups of unequal size");
    let Some(a_stride) = common_stride(x) else {
        return FALLBACK[F](pair, x, out);
    };
    // SAFETY: only `pair_qdot` hands this out, after `usable()` (AMX granted, AVX-512 VNNI
    // checked by its path's table); the tile loads read, for each token, its own block
    // columns (inside its row, checked above, at the stride just checked), and the pair's
    // loads stay inside its two groups.
    unsafe {
        match x.len() {
            1 => run::<1, F>(pair, x, a_stride, out),
            2 => run::<2, F>(pair, x, a_stride, out),
            3 => run::<3, F>(pair, x, a_stride, out),
            4 => run::<4, F>(pair, x, a_stride, out),
            5 => run::<5, F>(pair, x, a_stride, out),
            6 => run::<6, F>(pair, x, a_stride, out),
            7 => run::<7, F>(pair, x, a_stride, out),
            8 => run::<8, F>(pair, x, a_stride, out),
            n => panic!("pair kernels take 1..=8 tokens, got {n}"),
        }
    }
}

/// The AVX-512 pair kernels, in `TensorFormat::INTERLEAVED` order.
static FALLBACK: [QDotX16Fn; 3] = super::x8_avx2::PAIR_ENTRIES;

/// The AMX pair kernel of `format` (q8_0x8, q4_0x8, q4_1x8) with the fewest tokens it should
/// take, where `usable()`.
pub(super) fn pair_qdot(format: TensorFormat) -> Option<(QDotX16Fn, usize)> {
    const PAIRS: [(TensorFormat, QDotX16Fn, usize); 3] = [
        (TensorFormat::INTERLEAVED[0], entry::<0>, 2),
        (TensorFormat::INTERLEAVED[1], entry::<1>, 2),
        (TensorFormat::INTERLEAVED[2], entry::<2>, 2),
    ];
    if !usable() {
        return None;
    }
    PAIRS.iter().find(|(f, ..)| *f == format).map(|&(_, k, min)| (k, min))
}
