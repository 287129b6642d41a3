//! One kernel table per ISA path, and the one place that maps an [`Isa`] to its table.
//!
//! A table holds, per kind of kernel, the path's lookup by format. The x86 SIMD paths share
//! the AVX2 float kernels and differ only in how the integer kernels multiply bytes (the
//! const-generic `P` of `bytes`), so their tables come from one `const fn`; likewise the two
//! NEON paths (`bytes_neon`).

use cellm_format::TensorFormat;

use super::kinds::{DotTileFn, DotTokensFn, HeadKernels, PanelFn, QDot4Fn, QDotFn, RowKernels};
use super::x8::{self, QDotX16Fn, QDotX8Fn};
use super::{blocks, int_scalar, scalar};
use crate::isa::{self, Isa};
use crate::panel::{self, TileFn};

#[cfg(target_arch = "x86_64")]
use super::{avx2, bytes, int_avx2, x8_avx2};
#[cfg(target_arch = "aarch64")]
use super::{bytes_neon, int_neon, neon, x8_neon};

/// The kernels of one ISA path.
pub struct PathKernels {
    floats: fn(TensorFormat) -> RowKernels,
    integer: fn(TensorFormat) -> Option<(QDotFn, QDot4Fn)>,
    groups: fn(TensorFormat) -> Option<QDotX8Fn>,
    /// Two groups per call, where a path has wider registers than its group kernels use.
    pairs: fn(TensorFormat) -> Option<(QDotX16Fn, usize)>,
    heads: fn(TensorFormat) -> HeadKernels,
    /// Head-group kernels that read int8 KV rows as stored, where the path has them.
    int8_heads: Option<HeadKernels>,
    dot_tiles: fn(TensorFormat) -> DotTileFn,
    /// None where a row dot per token is all there is (scalar, NEON).
    dot_tokens: Option<fn(TensorFormat) -> DotTokensFn>,
    /// The GEMM's order for a prompt of 1..=3 tokens.
    gemm_tiles: fn(TensorFormat) -> DotTileFn,
    /// None where `gemm` widens row by row (scalar, NEON).
    panel_widener: Option<fn(TensorFormat) -> PanelFn>,
    tile: TileFn,
}

static SCALAR: PathKernels = PathKernels {
    floats: scalar::kernels,
    integer: int_scalar::qdot,
    groups: x8::scalar,
    pairs: no_pairs,
    heads: scalar::head_kernels,
    int8_heads: None,
    dot_tiles: scalar::dot_tiles,
    dot_tokens: None,
    gemm_tiles: scalar::gemm_tiles,
    panel_widener: None,
    tile: panel::tile_scalar,
};

/// The AVX2 float kernels with the integer kernels of byte path `P` and the GEMM's register
/// `tile`.
#[cfg(target_arch = "x86_64")]
const fn avx2_family<const P: u8>(tile: TileFn) -> PathKernels {
    PathKernels {
        floats: avx2::kernels,
        integer: int_avx2::entries::<P>,
        groups: x8_avx2::qdot::<P>,
        pairs: x8_avx2::pair_qdot::<P>,
        heads: if P == bytes::AVX512_VNNI { avx2::head_kernels_512 } else { avx2::head_kernels },
        int8_heads: if P == bytes::AVX512_VNNI { Some(avx2::INT8_HEADS_512) } else { None },
        dot_tiles: avx2::dot_tiles,
        dot_tokens: Some(avx2::dot_tokens_kernel),
        gemm_tiles: avx2::gemm_tiles,
        panel_widener: Some(avx2::panel_widener),
        tile,
    }
}

#[cfg(target_arch = "x86_64")]
static AVX2: PathKernels = avx2_family::<{ bytes::AVX2 }>(panel::avx2::tile);
#[cfg(target_arch = "x86_64")]
static AVX_VNNI: PathKernels = avx2_family::<{ bytes::AVX_VNNI }>(panel::avx2::tile);
/// AVX-512's register tile for the float GEMM and dense attention (twice the AVX2 tile's
/// multiply-adds per instruction) and its attention page kernels; the row kernels stay
/// AVX2's.
#[cfg(target_arch = "x86_64")]
static AVX512_VNNI: PathKernels = avx2_family::<{ bytes::AVX512_VNNI }>(panel::avx512::tile);
/// The VNNI paths' kernel code on AVX2 with `vpdpbusd` emulated (tests).
#[cfg(all(test, target_arch = "x86_64"))]
static EMULATED_VNNI: PathKernels = avx2_family::<{ bytes::EMULATED_VNNI }>(panel::avx2::tile);

/// The NEON float kernels with the integer kernels of byte path `P`.
#[cfg(target_arch = "aarch64")]
const fn neon_family<const P: u8>() -> PathKernels {
    PathKernels {
        floats: neon::kernels,
        integer: int_neon::entries::<P>,
        groups: x8_neon::qdot::<P>,
        pairs: no_pairs,
        heads: neon::head_kernels,
        int8_heads: None,
        dot_tiles: neon::dot_tiles,
        dot_tokens: None,
        gemm_tiles: neon::gemm_tiles,
        panel_widener: None,
        tile: panel::neon::tile,
    }
}

#[cfg(target_arch = "aarch64")]
static NEON: PathKernels = neon_family::<{ bytes_neon::NEON }>();
#[cfg(target_arch = "aarch64")]
static NEON_DOTPROD: PathKernels = neon_family::<{ bytes_neon::NEON_DOTPROD }>();

impl PathKernels {
    /// The table of `isa`. Panics unless this CPU can run it: the SIMD kernels in a table
    /// rely on this check, made here once for all of them.
    pub fn of(isa: Isa) -> &'static PathKernels {
        assert!(isa.supported(), "{} kernels requested on this CPU", isa.name());
        match isa {
            Isa::Scalar => &SCALAR,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => &AVX2,
            #[cfg(target_arch = "x86_64")]
            Isa::AvxVnni => &AVX_VNNI,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => &AVX512_VNNI,
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => &NEON,
            #[cfg(target_arch = "aarch64")]
            Isa::NeonDotprod => &NEON_DOTPROD,
            _ => unreachable!("{isa:?} is supported only on another architecture"),
        }
    }

    /// The table of the path in use ([`isa::selected`]).
    pub fn selected() -> &'static PathKernels {
        Self::of(isa::selected())
    }

    /// The row kernels of a format. Interleaved formats have none: see
    /// [`Self::group_kernel`] and `matmul::decode_row_raw`.
    pub fn row_kernels(&self, format: TensorFormat) -> RowKernels {
        assert!(format.interleaved().is_none(), "{format:?} is read by group kernels, not by rows");
        // Block formats decode with the scalar reference and multiply with integer kernels.
        match blocks::kernels(format) {
            Some(k) => RowKernels { qdot: (self.integer)(format), ..k },
            None => (self.floats)(format),
        }
    }

    /// The group kernel of an interleaved format (None for other formats).
    pub fn group_kernel(&self, format: TensorFormat) -> Option<QDotX8Fn> {
        (self.groups)(format)
    }

    /// The pair kernel of an interleaved format, where the path has one, and the fewest
    /// tokens a call should have for it to beat two group-kernel calls.
    pub fn pair_kernel(&self, format: TensorFormat) -> Option<(QDotX16Fn, usize)> {
        (self.pairs)(format)
    }

    /// The head-group kernels of a float (cache) format.
    pub fn head_kernels(&self, format: TensorFormat) -> HeadKernels {
        (self.heads)(format)
    }

    /// The head-group kernels of int8 KV rows (`kv_rows::encode_i8`), where this path reads
    /// them as stored; elsewhere the pages are widened to f32 first.
    pub fn int8_head_kernels(&self) -> Option<HeadKernels> {
        self.int8_heads
    }

    /// The float matmul's tile kernel of a float format.
    pub fn dot_tiles(&self, format: TensorFormat) -> DotTileFn {
        (self.dot_tiles)(format)
    }

    /// The GEMM-order tile kernel of a float format (1..=3 tokens, bitwise the GEMM's sums).
    pub fn gemm_tiles(&self, format: TensorFormat) -> DotTileFn {
        (self.gemm_tiles)(format)
    }

    /// The several-token row dot of a float format, where the path has one.
    pub fn dot_tokens(&self, format: TensorFormat) -> Option<DotTokensFn> {
        self.dot_tokens.map(|k| k(format))
    }

    /// The SIMD panel widener of a float format (None where `gemm` widens row by row).
    pub fn panel_widener(&self, format: TensorFormat) -> Option<PanelFn> {
        self.panel_widener.map(|widener| widener(format))
    }

    /// The register tile of `gemm` (attention's query tiles use it too).
    pub fn tile_kernel(&self) -> TileFn {
        self.tile
    }
}

fn no_pairs(_: TensorFormat) -> Option<(QDotX16Fn, usize)> {
    None
}

/// `pick` of every table this CPU can run, by path name, plus the VNNI kernel code on AVX2
/// with `vpdpbusd` emulated: what the kernel tests check.
#[cfg(test)]
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
pub(super) fn to_test<T>(pick: impl Fn(&PathKernels) -> T) -> Vec<(&'static str, T)> {
    let mut out: Vec<_> =
        Isa::available().into_iter().map(|i| (i.name(), pick(PathKernels::of(i)))).collect();
    #[cfg(target_arch = "x86_64")]
    if Isa::Avx2.supported() {
        out.push(("emulated vnni", pick(&EMULATED_VNNI)));
    }
    out
}
