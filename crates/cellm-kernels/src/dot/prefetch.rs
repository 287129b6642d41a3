//! Software prefetch for the streaming kernels of the AVX2 family. One thread's demand loads
//! alone keep too few cache misses in flight to stream weights at the memory's rate, so the
//! kernels request what they will read about PREFETCH_BYTES later. A prefetch never faults,
//! whatever the address: past the end of a matrix it requests nothing useful, nothing worse.

use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};

/// How far ahead to read: 4 KiB did better than 1-13 KiB of whole columns and than 8 KiB in
/// the group kernels (`gemv`).
const PREFETCH_BYTES: usize = 4096;

/// Requests the lines holding `at..at + bytes` of a stream read in order, in address order,
/// one per 64 bytes from `at`. A line the span ends in without starting it is the next span's
/// to request, so spans shorter than a line cost one request, not one per line they touch.
/// (Requesting a column's lines last to first made q4_kx8 stream a third slower.) `HINT`:
/// [`INTO_L1`] or [`INTO_L2`].
#[inline(always)]
unsafe fn lines<const HINT: i32>(at: *const u8, bytes: usize) {
    for offset in (0..bytes).step_by(64) {
        // SAFETY (of the intrinsic): a prefetch reads nothing the program sees.
        unsafe { _mm_prefetch::<HINT>(at.wrapping_add(offset).cast()) };
    }
}

/// The span of `bytes` PREFETCH_BYTES after `p`: row kernels, a block or a step at a time.
#[inline(always)]
pub(super) unsafe fn ahead(p: *const u8, bytes: usize) {
    unsafe { lines::<INTO_L1>(p.wrapping_add(PREFETCH_BYTES), bytes) }
}

/// The distance of [`column_ahead`]: whole columns of `bytes`, at least one.
#[inline(always)]
fn column_distance(bytes: usize) -> usize {
    (PREFETCH_BYTES / bytes).max(1) * bytes
}

/// The whole column of `bytes` about PREFETCH_BYTES after `column` (group kernels).
#[inline(always)]
pub(super) unsafe fn column_ahead(column: *const u8, bytes: usize) {
    unsafe { lines::<INTO_L1>(column.wrapping_add(column_distance(bytes)), bytes) }
}

/// Part `part` of `parts` of [`column_ahead`]'s requests, for a wide column whose requests
/// are spread over its inner loop instead of sent in one burst.
#[inline(always)]
pub(super) unsafe fn column_ahead_part(column: *const u8, bytes: usize, part: usize, parts: usize) {
    let ahead = column.wrapping_add(column_distance(bytes));
    let count = bytes.div_ceil(64) + 1; // +1: an unaligned column touches one more line
    for line in part * count / parts..(part + 1) * count / parts {
        unsafe { _mm_prefetch::<INTO_L1>(ahead.wrapping_add(64 * line).cast()) };
    }
}

/// The two columns of `bytes` a pair kernel reads (`column` in the first group, the same
/// column `stride` later in the second) some way along its two streams: in the same groups
/// while they last, past their end in the next pair's groups, which follow (`2 * stride`
/// later), so that a task walking pair after pair streams memory in order. `HINT`:
/// [`INTO_L2`], [`PAIR_L2_BYTES`] ahead, or [`INTO_L1`], [`PAIR_BYTES`] ahead.
#[inline(always)]
pub(super) unsafe fn pair_ahead<const HINT: i32>(
    column: *const u8,
    offset: usize,
    bytes: usize,
    stride: usize,
) {
    let reach = if HINT == INTO_L2 { PAIR_L2_BYTES } else { PAIR_BYTES };
    let distance = (reach / bytes).max(1) * bytes;
    let to = offset + distance;
    let first = if to < stride {
        column.wrapping_add(distance)
    } else {
        column.wrapping_add(distance + stride)
    };
    unsafe {
        lines::<HINT>(first, bytes);
        lines::<HINT>(first.wrapping_add(stride), bytes);
    }
}

/// The prefetch hints: into L1, or into L2 only.
pub(super) const INTO_L1: i32 = _MM_HINT_T0;
pub(super) const INTO_L2: i32 = _MM_HINT_T1;

/// Each of a pair kernel's two streams runs this far ahead when it asks into L1.
const PAIR_BYTES: usize = 2048;

/// ... and this far when it asks into L2. A pair kernel that waits on memory (q8_0's at any
/// count, q4_0's and q4_1's below 8 tokens) keeps more lines in flight through L2's miss
/// queue than through L1's few fill buffers, whose requests also hold up its loads. On
/// session 34's Zen 4 (`GEMV_THREADS=2 gemv 196608 576 T`, streamed), q8_0x8 went 0.20 ->
/// 0.16 ns per 32 weights x token at 8 tokens and 0.39-0.42 -> 0.25-0.29 at 4, q4_1x8
/// 0.20-0.23 -> 0.17-0.20 at 4 (2 KiB ahead into L2: 0.30-0.32 for q8_0 at 4); a SmolLM2
/// Q4_1 step of 4 sessions ran 17-29% faster. At 8 tokens q4_1's kernel is compute-bound
/// and a step of 8 sessions ran 1.4-4.2% faster with its requests into L1 (steps
/// alternated in one engine), so it keeps them. The group kernels (AVX2's, and AVX-512's
/// below 4 tokens) ran slower asking into L2.
const PAIR_L2_BYTES: usize = 4096;
