//! Pair kernels on AMX, the tile matrix unit of Intel's server cores from Sapphire Rapids on.
//! Several sessions decoding at once make the interleaved products compute-bound, and there
//! the AVX-512 pair kernels are held to one 512-bit `vpdpbusd` a cycle (one port has it).
//!
//! One `tdpbssd` takes two block columns (64 columns) of a pair of groups (16 rows) for up
//! to 8 tokens:
//! - tile A, the activations, built once per product (`activation_tiles`): 16 rows of 64
//!   bytes, row `8h + t` holding token `t`'s block `2p + h` in its half `h` and zeros in the
//!   other half, so the two blocks' sums stay apart;
//! - tile B, the weights: 16 rows of 16 dwords, row `k` holding columns 4k..4k + 4 of each of
//!   the 16 rows, which is what a pair's 4-byte chunks already are once their nibbles are
//!   split (staged through memory: a pass stages all its B tiles before its first tile load,
//!   since a tile load right after the stores it reads waits for them, about 20 ns);
//! - tile C: row `8h + t` holds the 16 rows' block sums of token `t`, block `2p + h`.
//!
//! The sums go back to memory and each block's scales apply with the AVX-512 pair kernels'
//! float operations, in their order, so every output is bitwise theirs and the group
//! kernels' (a session's logits do not depend on its batch).

use std::arch::asm;
use std::arch::x86_64::*;
use std::mem::MaybeUninit;
use std::sync::OnceLock;

use cellm_format::{TensorFormat, INTERLEAVE};

use super::x8::{check_group_args, TilePairFn, TilesFn, MAX_TOKENS};
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
        xgetbv0() & (3 << 17) == 3 << 17 && request_tile_data()
    }
}

/// XCR0, the state components the OS saves.
unsafe fn xgetbv0() -> u64 {
    let (lo, hi): (u32, u32);
    // SAFETY: the caller checked OSXSAVE.
    unsafe { asm!("xgetbv", in("ecx") 0, out("eax") lo, out("edx") hi, options(nomem, nostack)) };
    (u64::from(hi) << 32) | u64::from(lo)
}

/// Asks Linux for the tile data state, for the whole process (without it the first tile
/// instruction faults).
#[cfg(target_os = "linux")]
fn request_tile_data() -> bool {
    const SYS_ARCH_PRCTL: isize = 158;
    const ARCH_REQ_XCOMP_PERM: usize = 0x1023;
    const XFEATURE_XTILEDATA: usize = 18;
    let ret: isize;
    // SAFETY: a plain system call; it reads and writes no memory of ours.
    unsafe {
        asm!("syscall", inlateout("rax") SYS_ARCH_PRCTL => ret,
             in("rdi") ARCH_REQ_XCOMP_PERM, in("rsi") XFEATURE_XTILEDATA,
             lateout("rcx") _, lateout("r11") _, options(nostack));
    }
    ret == 0
}

#[cfg(not(target_os = "linux"))]
fn request_tile_data() -> bool {
    false
}

/// `ldtilecfg`'s 64 bytes: palette 1, then each tile's bytes a row and rows. Tiles 0-5 (A, B,
/// C and a second set, so neighbouring block pairs need not wait for each other) are all 16
/// rows of 64 bytes.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

const CONFIG: TileConfig = {
    let mut c = TileConfig { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
    let mut i = 0;
    while i < 6 {
        c.colsb[i] = 64;
        c.rows[i] = 16;
        i += 1;
    }
    c
};

thread_local! { static CONFIGURED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) }; }

/// Bytes of one block pair's activation tile (16 rows of 64).
const TILE_BYTES: usize = 1024;

/// The activation tiles of up to 8 tokens' rows (the tile kernels' `tiles`), one per block
/// pair: see the module's comment.
fn activation_tiles(x: &[Q8Row]) -> Vec<u8> {
    let cols = x[0].qs.len();
    let mut tiles = vec![0u8; cols.div_ceil(64) * TILE_BYTES];
    for (t, row) in x.iter().enumerate() {
        for (b, block) in row.qs.chunks(32).enumerate() {
            let (pair, h) = (b / 2, b % 2);
            let at = pair * TILE_BYTES + (8 * h + t) * 64 + 32 * h;
            for (dst, &q) in tiles[at..at + block.len()].iter_mut().zip(block) {
                *dst = q as u8;
            }
        }
    }
    tiles
}

/// Block pairs one pass stages, multiplies, then scales.
const PASS: usize = 8;

/// A pass's tiles in memory: B of each block pair (two blocks' 8 rows), then C of each.
#[repr(C, align(64))]
struct Scratch {
    b: [[[__m512i; 8]; 2]; PASS],
    c: [[[i32; 16]; 16]; PASS],
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

/// Bytes of one block column of a group in format `F` (`TensorFormat::INTERLEAVED` order:
/// q8_0x8, q4_0x8, q4_1x8), and where its quants start.
const fn layout(f: usize) -> (usize, usize) {
    match f {
        0 => (16 + 256, 16),
        1 => (16 + 128, 16),
        _ => (32 + 128, 32),
    }
}

/// Block column `b`'s 8 rows of tile B into `rows`; returns its scale fields (`d`, and q4's
/// offset factor: q4_0's `-8 d`, q4_1's `m`).
#[inline(always)]
unsafe fn stage_column<const F: usize>(
    base: *const u8,
    b: usize,
    stride: usize,
    rows: *mut __m512i,
) -> (__m512, __m512) {
    let (bytes, head) = layout(F);
    let blk = base.add(bytes * b);
    super::prefetch::pair_ahead(blk, bytes * b, bytes, stride);
    let d = halves_ph(blk, stride);
    let qs = blk.add(head);
    if F == 0 {
        for c in 0..8 {
            _mm512_store_si512(rows.add(c).cast(), load_pair(qs.add(32 * c), stride));
        }
        return (d, _mm512_setzero_ps());
    }
    let low = _mm512_set1_epi8(0x0F);
    for c in 0..4 {
        let q = load_pair(qs.add(32 * c), stride);
        _mm512_store_si512(rows.add(c).cast(), _mm512_and_si512(q, low));
        let high = _mm512_and_si512(_mm512_srli_epi16::<4>(q), low);
        _mm512_store_si512(rows.add(c + 4).cast(), high);
    }
    let offset = match F {
        1 => _mm512_mul_ps(d, _mm512_set1_ps(-8.0)),
        _ => halves_ph(blk.add(16), stride),
    };
    (d, offset)
}

/// C = A x B for one block pair, through tiles 0-2 or (`SET` 1) 3-5.
#[inline(always)]
unsafe fn multiply<const SET: usize>(a: *const u8, b: *const __m512i, c: *mut [i32; 16]) {
    if SET == 0 {
        asm!(
            "tileloadd tmm0, [{a} + {s}*1]",
            "tileloadd tmm1, [{b} + {s}*1]",
            "tilezero tmm2",
            "tdpbssd tmm2, tmm0, tmm1",
            "tilestored [{c} + {s}*1], tmm2",
            a = in(reg) a, b = in(reg) b, c = in(reg) c, s = in(reg) 64usize,
            options(nostack),
        );
    } else {
        asm!(
            "tileloadd tmm3, [{a} + {s}*1]",
            "tileloadd tmm4, [{b} + {s}*1]",
            "tilezero tmm5",
            "tdpbssd tmm5, tmm3, tmm4",
            "tilestored [{c} + {s}*1], tmm5",
            a = in(reg) a, b = in(reg) b, c = in(reg) c, s = in(reg) 64usize,
            options(nostack),
        );
    }
}

/// Adds block column `b`'s sums (`sums`: a row per token) times its scales into `acc`, as
/// the AVX-512 pair kernels do.
#[inline(always)]
unsafe fn scale_into<const N: usize, const F: usize>(
    acc: &mut [__m512; N],
    sums: *const [i32; 16],
    (d, offset): (__m512, __m512),
    x: &[Q8Row; N],
    b: usize,
) {
    for t in 0..N {
        let p = _mm512_cvtepi32_ps(_mm512_load_si512(sums.add(t).cast()));
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
    tiles: &[u8],
    out: &mut [[f32; 2 * INTERLEAVE]],
) {
    let x: &[Q8Row; N] = x.try_into().expect("N activation rows");
    let stride = pair.len() / 2;
    let blocks = stride / layout(F).0;
    let base = pair.as_ptr();
    if !CONFIGURED.with(|c| c.replace(true)) {
        asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly));
    }
    // Every B row is stored before the tile load that reads it, every C tile stored by the
    // tile unit before its rows are read.
    let mut scratch = MaybeUninit::<Scratch>::uninit();
    let sp = scratch.as_mut_ptr();
    let zero = _mm512_setzero_ps();
    let mut scales = [[(zero, zero); 2]; PASS];
    let mut acc = [zero; N];
    let pairs = blocks.div_ceil(2);
    for start in (0..pairs).step_by(PASS) {
        let n = PASS.min(pairs - start);
        for (j, s) in scales.iter_mut().enumerate().take(n) {
            for (h, scale) in s.iter_mut().enumerate() {
                let rows = (*sp).b[j][h].as_mut_ptr();
                let b = 2 * (start + j) + h;
                if b < blocks {
                    *scale = stage_column::<F>(base, b, stride, rows);
                } else {
                    // An odd count's last pair: its second block's activations are zeros.
                    (0..8).for_each(|r| _mm512_store_si512(rows.add(r).cast(), _mm512_setzero_si512()));
                }
            }
        }
        for j in 0..n {
            let a = tiles.as_ptr().add((start + j) * TILE_BYTES);
            let (b, c) = ((*sp).b[j].as_ptr().cast(), (*sp).c[j].as_mut_ptr());
            match j % 2 {
                0 => multiply::<0>(a, b, c),
                _ => multiply::<1>(a, b, c),
            }
        }
        for (j, s) in scales.iter().enumerate().take(n) {
            for (h, &scale) in s.iter().enumerate() {
                let b = 2 * (start + j) + h;
                if b < blocks {
                    let sums = (*sp).c[j].as_ptr().add(8 * h);
                    scale_into::<N, F>(&mut acc, sums, scale, x, b);
                }
            }
        }
    }
    for (o, v) in out.iter_mut().zip(acc) {
        _mm512_storeu_ps(o.as_mut_ptr(), v);
    }
}

/// The tile pair kernel of format `F` (q8_0x8, q4_0x8, q4_1x8) for 1..=8 tokens, their
/// activation tiles in `tiles` (`activation_tiles` of the same rows).
fn entry<const F: usize>(pair: &[u8], x: &[Q8Row], tiles: &[u8], out: &mut [[f32; 2 * INTERLEAVE]]) {
    let format = TensorFormat::INTERLEAVED[F];
    let (first, second) = pair.split_at(pair.len() / 2);
    check_group_args(format, first, x, out.len(), false);
    assert!(first.len() == second.len(), "{format:?} pair kernel: groups of unequal size");
    let blocks = first.len() / (INTERLEAVE * layout(F).0);
    assert!(tiles.len() >= blocks.div_ceil(2) * TILE_BYTES, "activation tiles too short");
    // SAFETY: only `tile_pair_qdot` hands this out, after `usable()` (AMX granted) on the
    // AVX-512 VNNI path (its table checked the CPU); the pair's loads stay inside its two
    // groups (checked above), the tile loads inside `tiles` (checked above), and the scales
    // read each token's blocks (its row covers the columns: `check_group_args`).
    unsafe {
        match x.len() {
            1 => run::<1, F>(pair, x, tiles, out),
            2 => run::<2, F>(pair, x, tiles, out),
            3 => run::<3, F>(pair, x, tiles, out),
            4 => run::<4, F>(pair, x, tiles, out),
            5 => run::<5, F>(pair, x, tiles, out),
            6 => run::<6, F>(pair, x, tiles, out),
            7 => run::<7, F>(pair, x, tiles, out),
            8 => run::<8, F>(pair, x, tiles, out),
            n => panic!("pair kernels take 1..=8 tokens, got {n}"),
        }
    }
}

/// The AMX pair kernel of `format` (q8_0x8, q4_0x8, q4_1x8) and its activation tiles'
/// builder, on the AVX-512 VNNI path (`P`) where `usable()`.
pub(super) fn tile_pair_qdot<const P: u8>(format: TensorFormat) -> Option<(TilePairFn, TilesFn)> {
    const KERNELS: [TilePairFn; 3] = [entry::<0>, entry::<1>, entry::<2>];
    if P != super::bytes::AVX512_VNNI || !usable() {
        return None;
    }
    let f = TensorFormat::INTERLEAVED[..3].iter().position(|&f| f == format)?;
    Some((KERNELS[f], activation_tiles))
}

const _: () = assert!(MAX_TOKENS == 8, "tile rows are 8 tokens x 2 blocks");
