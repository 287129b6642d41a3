//! Cache hints for code outside the SIMD kernels (the float GEMM's panels, attention's pages).

/// A hint to bring the line at `p` into cache; a no-op where there is no such instruction.
#[inline(always)]
pub fn prefetch_line(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing the program sees and never faults.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// [`prefetch_line`] for every line `bytes` touches.
#[inline]
pub fn prefetch_all(bytes: &[u8]) {
    let start = bytes.as_ptr() as usize;
    let first = start & !63;
    for line in (first..start + bytes.len()).step_by(64) {
        prefetch_line(line as *const u8);
    }
}
