//! Instruction-set selection: detected once at run time, never fixed at compile time, so one
//! wheel runs on every x86-64 and uses the widest path the CPU offers.

use std::sync::atomic::{AtomicU8, Ordering};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Plain Rust; the reference every other path is tested against.
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
        }
    }

    pub fn parse(name: &str) -> Option<Isa> {
        match name {
            "scalar" => Some(Isa::Scalar),
            "avx2" => Some(Isa::Avx2),
            _ => None,
        }
    }

    /// Whether this CPU can run the path.
    pub fn supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 => false,
        }
    }

    /// Every path this CPU can run, narrowest first.
    pub fn available() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2].into_iter().filter(|i| i.supported()).collect()
    }
}

const UNSET: u8 = u8::MAX;
static SELECTED: AtomicU8 = AtomicU8::new(UNSET);

fn encode(isa: Isa) -> u8 {
    isa as u8
}

fn decode(v: u8) -> Isa {
    if v == Isa::Avx2 as u8 {
        Isa::Avx2
    } else {
        Isa::Scalar
    }
}

/// The path in use: the widest supported one unless overridden.
pub fn selected() -> Isa {
    match SELECTED.load(Ordering::Relaxed) {
        UNSET => {
            let best = *Isa::available().last().expect("scalar is always available");
            SELECTED.store(encode(best), Ordering::Relaxed);
            best
        }
        v => decode(v),
    }
}

/// The one explicit override (tests, debugging). Refuses a path this CPU cannot run.
pub fn set_override(isa: Isa) -> Result<(), String> {
    if !isa.supported() {
        return Err(format!("this CPU cannot run the {} kernels", isa.name()));
    }
    SELECTED.store(encode(isa), Ordering::Relaxed);
    Ok(())
}
