//! Instruction-set selection: detected once at run time, never fixed at compile time, so one
//! wheel runs on every x86-64 (or every aarch64) and uses the widest path the CPU offers.

use std::sync::atomic::{AtomicU8, Ordering};

/// The kernel paths, narrowest first within each architecture. Every x86 path from `Avx2` up
/// runs the AVX2 float kernels, and both aarch64 paths the NEON float kernels; the paths of
/// one family differ in how the integer kernels multiply bytes (`dot::bytes`,
/// `dot::bytes_neon`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Plain Rust; the reference every other path is tested against.
    Scalar,
    /// AVX2 + FMA + F16C: bytes multiplied by `vpmaddubsw` + `vpmaddwd`.
    Avx2,
    /// AVX2 plus the VEX-encoded `vpdpbusd` (Alder Lake, Sapphire Rapids, Zen 5).
    AvxVnni,
    /// AVX2 plus AVX-512 VL + VNNI: the EVEX `vpdpbusd` on 256-bit registers (Ice Lake
    /// server and later Xeons, Zen 4), which keeps the AVX2 kernels' data layout; the float
    /// GEMM's register tile (`panel::avx512`) runs on 512-bit registers.
    Avx512Vnni,
    /// aarch64 Advanced SIMD (every ARMv8-A core): bytes multiplied by `smull` and pairwise
    /// adds.
    Neon,
    /// NEON plus the dot product extension's `sdot` (ARMv8.2+: Cortex-A76 and later, Apple M).
    NeonDotprod,
}

const ALL: [Isa; 6] =
    [Isa::Scalar, Isa::Avx2, Isa::AvxVnni, Isa::Avx512Vnni, Isa::Neon, Isa::NeonDotprod];

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::AvxVnni => "avx-vnni",
            Isa::Avx512Vnni => "avx512-vnni",
            Isa::Neon => "neon",
            Isa::NeonDotprod => "neon-dotprod",
        }
    }

    pub fn parse(name: &str) -> Option<Isa> {
        ALL.into_iter().find(|i| i.name() == name)
    }

    /// Whether the path runs the AVX2 kernels (every x86 SIMD path does).
    pub fn has_avx2(self) -> bool {
        matches!(self, Isa::Avx2 | Isa::AvxVnni | Isa::Avx512Vnni)
    }

    /// Whether the path runs the NEON kernels (both aarch64 paths do).
    pub fn has_neon(self) -> bool {
        matches!(self, Isa::Neon | Isa::NeonDotprod)
    }

    /// Whether this CPU can run the path.
    pub fn supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = || {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            };
            match self {
                Isa::Scalar => true,
                Isa::Avx2 => avx2(),
                Isa::AvxVnni => avx2() && is_x86_feature_detected!("avxvnni"),
                Isa::Avx512Vnni => {
                    avx2()
                        && is_x86_feature_detected!("avx512f")
                        && is_x86_feature_detected!("avx512vl")
                        && is_x86_feature_detected!("avx512bw")
                        && is_x86_feature_detected!("avx512vnni")
                }
                Isa::Neon | Isa::NeonDotprod => false,
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            match self {
                Isa::Scalar => true,
                Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
                Isa::NeonDotprod => {
                    std::arch::is_aarch64_feature_detected!("neon")
                        && std::arch::is_aarch64_feature_detected!("dotprod")
                }
                _ => false,
            }
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        {
            self == Isa::Scalar
        }
    }

    /// Every path this CPU can run, narrowest first.
    pub fn available() -> Vec<Isa> {
        ALL.into_iter().filter(|i| i.supported()).collect()
    }
}

const UNSET: u8 = u8::MAX;
static SELECTED: AtomicU8 = AtomicU8::new(UNSET);

/// The path in use: the widest supported one unless overridden.
pub fn selected() -> Isa {
    match SELECTED.load(Ordering::Relaxed) {
        UNSET => {
            let best = *Isa::available().last().expect("scalar is always available");
            SELECTED.store(best as u8, Ordering::Relaxed);
            best
        }
        v => ALL[usize::from(v)],
    }
}

/// The one explicit override (tests, debugging). Refuses a path this CPU cannot run.
pub fn set_override(isa: Isa) -> Result<(), String> {
    if !isa.supported() {
        return Err(format!("this CPU cannot run the {} kernels", isa.name()));
    }
    SELECTED.store(isa as u8, Ordering::Relaxed);
    Ok(())
}

/// Serialises the tests that override the path or depend on one path being selected for
/// a whole comparison: the override is process-wide and tests run in parallel.
#[cfg(test)]
pub(crate) fn test_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `CELLM_REQUIRE_ISA=avx512-vnni,...` makes a run fail unless those paths are available,
    /// so a run meant to test a path (an emulator, a CI machine) cannot pass without it.
    #[test]
    fn required_paths_are_available() {
        let available = Isa::available();
        eprintln!("kernel paths on this CPU: {available:?}");
        for name in std::env::var("CELLM_REQUIRE_ISA").unwrap_or_default().split(',') {
            if name.is_empty() {
                continue;
            }
            let isa = Isa::parse(name).unwrap_or_else(|| panic!("unknown path {name}"));
            assert!(available.contains(&isa), "{name} is required but not available");
        }
    }

    #[test]
    fn names_round_trip() {
        for isa in ALL {
            assert_eq!(Isa::parse(isa.name()), Some(isa));
        }
    }
}
