//! Cache hints for code outside the SIMD kernels (the float GEMM's panels, attention's pages).

/// x86's hint numbers: into L1 (and L2), and into L2 only.
const INTO_L1: i32 = 3;
const INTO_L2: i32 = 2;

/// A hint to bring the line at `p` into the cache level `HINT` names; a no-op where there is
/// no such instruction.
#[inline(always)]
fn prefetch<const HINT: i32>(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing the program sees and never faults.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<HINT>(p.cast())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// A hint to bring the line at `p` into cache.
#[inline(always)]
pub fn prefetch_line(p: *const u8) {
    prefetch::<INTO_L1>(p);
}

/// A hint to bring every line `bytes` touches into the L2 cache, not L1: for a burst of
/// requests well ahead of their use, which into L1 would wait for its few fill buffers and
/// hold up the loads behind them.
#[inline]
pub fn prefetch_all_l2(bytes: &[u8]) {
    let start = bytes.as_ptr() as usize;
    for line in ((start & !63)..start + bytes.len()).step_by(64) {
        prefetch::<INTO_L2>(line as *const u8);
    }
}
