//! The WGSL kernels: their sources assembled from the files in `shaders/` (a kernel, the
//! step-buffer accessors, and the weight accessors of the formats it reads), and their
//! pipelines with explicit binding layouts, built once per (kernel, formats).

use std::collections::HashMap;
use std::sync::Arc;

use crate::repack::Layout;

const FORMATS: &str = include_str!("shaders/formats.wgsl");
const STEP: &str = include_str!("shaders/step.wgsl");
const KV: &str = include_str!("shaders/kvpage.wgsl");
const MATVEC: &str = include_str!("shaders/matvec.wgsl");
const GEMM: &str = include_str!("shaders/gemm.wgsl");
const GEMM_COOP: &str = include_str!("shaders/gemm_coop.wgsl");
const LINEAR: &str = include_str!("shaders/linear.wgsl");
const EMBED: &str = include_str!("shaders/embed.wgsl");
const ROPE_KV: &str = include_str!("shaders/rope_kv.wgsl");
const ATTENTION: &str = include_str!("shaders/attention.wgsl");
const ATTN_COMBINE: &str = include_str!("shaders/attn_combine.wgsl");
const ATTN_PREFILL: &str = include_str!("shaders/attn_prefill.wgsl");
const ATTN_PREFILL_COOP: &str = include_str!("shaders/attn_prefill_coop.wgsl");
const NORM_ADD: &str = include_str!("shaders/norm_add.wgsl");
const SPLIT_GEMM: &str = include_str!("shaders/split_gemm.wgsl");

/// How a kernel binds one buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bind {
    Uniform,
    Read,
    Write,
}

/// Each kernel, and the weight layouts it reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelId {
    Matvec(Layout),
    /// The q|k|v matvec that also rotates q and k and stores k and v into the KV pool (its
    /// GEMM build is the plain one's: prefill runs `RopeKv` after it).
    MatvecRope(Layout),
    /// `MatvecRope` over q|k in one layout and v in another (one launch; no GEMM build).
    MatvecRope2(Layout, Layout),
    Glu(Layout),
    Embed(Layout),
    RopeKv,
    Attention,
    /// `Attention` whose last split of each (token, head) merges the splits itself (no
    /// `AttnCombine` launch).
    AttentionFused,
    AttnCombine,
    /// Prefill attention for heads of this dim.
    AttnPrefill(u32),
    /// Prefill attention on cooperative matrices for heads of this dim (where the GEMM has
    /// them; `attn_prefill::coop_head_dim_ok`).
    AttnPrefillCoop(u32),
    NormAdd,
    /// The split GEMM's passes (`split_gemm`): the inputs in f16 and their sums of squares,
    /// a matrix in f16, the f16 GEMM in WGSL, and the epilogue (the GLU's where true).
    SplitPrep,
    SplitDequant(Layout),
    SplitGemm,
    SplitEpilogue(bool),
    /// The split GEMM on NVIDIA's cooperative matrices at this unroll (SPIR-V,
    /// `nv_coopmat2`; not WGSL).
    Coopmat2Gemm(u32),
    /// Its GLU build: the gate and up products and the GLU's epilogue in one launch,
    /// writing the down projection's f16 inputs.
    Coopmat2Glu(u32),
    /// The prefill attention on NVIDIA's cooperative matrices for this head dim, writing
    /// ctx in f16 where true (SPIR-V, `nv_coopmat2`; not WGSL).
    Coopmat2Attn(u32, bool),
}

impl KernelId {
    /// Every kernel's WGSL source, for each layout where it takes one.
    pub fn all() -> Vec<KernelId> {
        let layouts = [
            Layout::F32,
            Layout::F16,
            Layout::Bf16,
            Layout::Q8_0,
            Layout::Q4_0,
            Layout::Q4_1,
            Layout::Q5_0,
            Layout::Q4K,
            Layout::Q6K,
        ];
        let mut all = vec![
            KernelId::RopeKv,
            KernelId::Attention,
            KernelId::AttentionFused,
            KernelId::AttnCombine,
            KernelId::NormAdd,
            KernelId::SplitPrep,
            KernelId::SplitGemm,
            KernelId::SplitEpilogue(false),
            KernelId::SplitEpilogue(true),
        ];
        all.extend([16, 64, 80, 96, 128, 256].map(KernelId::AttnPrefill));
        for l in layouts {
            all.extend([
                KernelId::Matvec(l),
                KernelId::MatvecRope(l),
                KernelId::MatvecRope2(l, Layout::Q6K),
                KernelId::Glu(l),
                KernelId::Embed(l),
                KernelId::SplitDequant(l),
            ]);
        }
        all
    }

    /// The kernel's bindings, by binding number.
    pub fn bindings(self) -> Vec<(u32, Bind)> {
        use Bind::*;
        let weights = |l: Layout, q: u32, s: u32| {
            let mut w = vec![(q, Read)];
            if l.has_scales() {
                w.push((s, Read));
            }
            w
        };
        let mut b = match self {
            KernelId::Matvec(l) => {
                [vec![(0, Uniform), (1, Read), (2, Write), (3, Read), (4, Read)], weights(l, 5, 6)]
                    .concat()
            }
            KernelId::MatvecRope(l) => [
                vec![(0, Uniform), (1, Read), (2, Write), (3, Read), (4, Read)],
                weights(l, 5, 6),
                vec![(10, Read), (11, Write)],
            ]
            .concat(),
            KernelId::MatvecRope2(a, b) => [
                vec![(0, Uniform), (1, Read), (2, Write), (3, Read), (4, Read)],
                weights(a, 5, 6),
                weights(b, 8, 9),
                vec![(10, Read), (11, Write)],
            ]
            .concat(),
            KernelId::Glu(l) => [
                vec![(0, Uniform), (1, Read), (2, Write), (3, Read), (4, Read)],
                weights(l, 5, 6),
                weights(l, 8, 9),
            ]
            .concat(),
            KernelId::Embed(l) => [vec![(0, Uniform), (2, Write)], weights(l, 5, 6)].concat(),
            KernelId::RopeKv => {
                vec![(0, Uniform), (1, Write), (2, Read), (3, Read), (4, Read), (5, Write)]
            }
            // (6: the pool again, 16 bytes an element.)
            KernelId::Attention => {
                vec![(0, Uniform), (1, Read), (2, Write), (3, Write), (5, Read), (6, Read)]
            }
            KernelId::AttentionFused => vec![
                (0, Uniform),
                (1, Read),
                (2, Write),
                (3, Write),
                (4, Write),
                (5, Read),
                (6, Read),
            ],
            KernelId::AttnCombine => vec![(0, Uniform), (1, Read), (2, Write)],
            KernelId::AttnPrefill(_) | KernelId::Coopmat2Attn(..) => {
                vec![(0, Uniform), (1, Read), (2, Write), (5, Read)]
            }
            KernelId::AttnPrefillCoop(_) => {
                vec![(0, Uniform), (1, Read), (2, Write), (3, Write), (5, Read)]
            }
            KernelId::NormAdd => vec![(0, Uniform), (1, Read), (2, Write), (3, Read)],
            KernelId::SplitPrep => {
                vec![(0, Uniform), (1, Read), (3, Read), (12, Write)]
            }
            KernelId::SplitDequant(l) => {
                [vec![(0, Uniform), (12, Write)], weights(l, 5, 6)].concat()
            }
            KernelId::SplitGemm | KernelId::Coopmat2Gemm(_) => {
                vec![(0, Uniform), (5, Read), (12, Read), (14, Write)]
            }
            KernelId::Coopmat2Glu(_) => {
                vec![(0, Uniform), (5, Read), (6, Read), (12, Read), (14, Write)]
            }
            KernelId::SplitEpilogue(glu) => {
                let mut b = vec![(0, Uniform), (2, Write), (4, Read), (14, Read)];
                if glu {
                    b.push((12, Write));
                }
                b
            }
        };
        b.push((7, Read));
        b
    }

    /// Whether the kernel is built twice, for one token and for several.
    pub fn per_token_count(self) -> bool {
        matches!(
            self,
            KernelId::Matvec(_)
                | KernelId::MatvecRope(_)
                | KernelId::MatvecRope2(..)
                | KernelId::Glu(_)
        )
    }

    /// Whether the kernel is one of the split GEMM's WGSL passes.
    pub fn is_split(self) -> bool {
        matches!(
            self,
            KernelId::SplitPrep
                | KernelId::SplitDequant(_)
                | KernelId::SplitGemm
                | KernelId::SplitEpilogue(_)
        )
    }

    /// Whether the kernel has a tiled-GEMM build.
    pub fn has_gemm(self) -> bool {
        self.per_token_count() && !matches!(self, KernelId::MatvecRope2(..))
    }

    /// The kernel's full WGSL source: with subgroup reductions (`subgroups`) or shared-memory
    /// ones, for up to `tokens` tokens a workgroup where it batches tokens (1 or 4), or its
    /// tiled-GEMM build where `tokens` is `GEMM_BUILD` (matvec and GLU only).
    pub fn source(self, subgroups: bool, tokens: u32) -> String {
        self.source_wg(subgroups, tokens, MATVEC_WG)
    }

    /// `source`, with `wg` threads a workgroup in the matvec builds (`WG` in matvec.wgsl).
    pub fn source_wg(self, subgroups: bool, tokens: u32, wg: u32) -> String {
        self.source_opts(subgroups, tokens, wg, f16_vec4())
    }

    /// `source_wg`, with f16 weights read 16 bytes a load (`f16v4` in formats.wgsl) where
    /// `f16v4`.
    pub fn source_opts(self, subgroups: bool, tokens: u32, wg: u32, f16v4: bool) -> String {
        self.source_shape(subgroups, tokens, wg, f16v4, OneShape::LEGACY)
    }

    /// `source_opts`, with the one-token build (`tokens` 1) of `one.rows` rows a workgroup
    /// and its reduction as `one.scalar` says (`one.threads` is `wg`'s business; the rope
    /// builds keep 4 rows).
    pub fn source_shape(
        self,
        subgroups: bool,
        tokens: u32,
        wg: u32,
        f16v4: bool,
        one: OneShape,
    ) -> String {
        let coop = tokens == COOP_BUILD && self.per_token_count();
        let gemm = (tokens == GEMM_BUILD || coop) && self.per_token_count();
        // (The GEMM builds keep 8-byte loads: 16-byte ones were not measured there.)
        let v4 = f16v4 && !gemm;
        let fmt = |l: Layout| if v4 && l == Layout::F16 { "f16v4" } else { l.wgsl_name() };
        let rope = matches!(self, KernelId::MatvecRope(_) | KernelId::MatvecRope2(..)) && !gemm;
        let second = match self {
            KernelId::MatvecRope2(_, b) if !gemm => Some(b),
            _ => None,
        };
        let pipe = CoopPipe::get();
        let coop_body = coop.then(|| coop_source(CoopTile::get(matches!(self, KernelId::Glu(_)))));
        let gemm_body = coop_body.as_deref().unwrap_or(GEMM);
        let prefill = match self {
            KernelId::AttnPrefill(hd) => crate::attn_prefill::source(hd, ATTENTION, ATTN_PREFILL),
            KernelId::AttnPrefillCoop(hd) => {
                crate::attn_prefill::coop_source(hd, ATTENTION, ATTN_PREFILL_COOP)
            }
            _ => String::new(),
        };
        let (body, weights, glu): (&str, Option<Layout>, bool) = match self {
            KernelId::Matvec(l) | KernelId::MatvecRope(l) | KernelId::MatvecRope2(l, _) => {
                (if gemm { gemm_body } else { MATVEC }, Some(l), false)
            }
            KernelId::Glu(l) => (if gemm { gemm_body } else { MATVEC }, Some(l), true),
            KernelId::Embed(l) => (EMBED, Some(l), false),
            KernelId::RopeKv => (ROPE_KV, None, false),
            KernelId::Attention | KernelId::AttentionFused => (ATTENTION, None, false),
            KernelId::AttnCombine => (ATTN_COMBINE, None, false),
            KernelId::AttnPrefill(_) | KernelId::AttnPrefillCoop(_) => (&prefill, None, false),
            KernelId::NormAdd => (NORM_ADD, None, false),
            KernelId::SplitPrep | KernelId::SplitGemm => (SPLIT_GEMM, None, false),
            KernelId::SplitDequant(l) => (SPLIT_GEMM, Some(l), false),
            KernelId::SplitEpilogue(glu) => (SPLIT_GEMM, None, glu),
            KernelId::Coopmat2Gemm(_) | KernelId::Coopmat2Glu(_) | KernelId::Coopmat2Attn(..) => {
                ("", None, false)
            }
        };
        let mut src = String::new();
        if coop || matches!(self, KernelId::AttnPrefillCoop(_)) {
            src.push_str("enable f16;\nenable wgpu_cooperative_matrix;\n");
        }
        if self.per_token_count() && !gemm {
            // Column steps in flight per pass (matvec.wgsl).
            // (CELLM_GPU_MATVEC_STEPS=n: n for one token, for comparison.)
            let one = std::env::var("CELLM_GPU_MATVEC_STEPS").ok().and_then(|v| v.parse().ok());
            let un = if tokens == 1 { one.unwrap_or(MATVEC_STEPS_ONE).max(1) } else { 1 };
            src.push_str(&format!("const TT: u32 = {tokens}u;\nconst UN: u32 = {un}u;\n"));
        }
        src.push_str(STEP);
        let attention = matches!(
            self,
            KernelId::RopeKv
                | KernelId::Attention
                | KernelId::AttentionFused
                | KernelId::AttnPrefill(_)
                | KernelId::AttnPrefillCoop(_)
        );
        if attention || rope {
            src.push_str(KV);
        }
        if self.per_token_count() || self.is_split() {
            src.push_str(LINEAR);
        }
        let rpw = if tokens == 1 && !rope { one.rows } else { 4 };
        let scalar = tokens == 1 && one.scalar && subgroups;
        let body = body.replace("$WG", &wg.to_string()).replace("$RPW", &rpw.to_string());
        // The one-token build takes the formats' own `d8` where every format of the launch
        // has one; otherwise, and with CELLM_GPU_MATVEC_PLAIN=1 (for A/B), it dequantizes 8
        // columns (`w8`) and takes two dots, as the batched one does (on the H200 the f16
        // files decoded 6-12% faster that way than through a generic `d8`).
        let own_d8 = |l: Layout| sections(FORMATS, &|name| name == fmt(l)).contains(OWN_D8);
        let all_d8 = weights.is_some_and(own_d8) && second.is_none_or(own_d8);
        let plain = !all_d8 || std::env::var_os("CELLM_GPU_MATVEC_PLAIN").is_some();
        // 16 columns a step (`d16`) where every format of the launch has one, with the same
        // distance between its halves.
        let half = |l: Layout| d16_half(fmt(l));
        let h16 = weights.and_then(half).filter(|&h| second.is_none_or(|b| half(b) == Some(h)));
        let h16 = h16.filter(|_| tokens == 1 && !plain && one.d16 && !gemm);
        if self.per_token_count() && !gemm {
            src.push_str(&format!(
                "const D16: bool = {};\nconst H16: u32 = {}u;\nconst I8EO: bool = {};\n",
                h16.is_some(),
                h16.unwrap_or(8),
                weights.is_some_and(|l| i8_even_odd(fmt(l)))
            ));
        }
        src.push_str(&sections(&body, &|name| match name {
            "glu" => glu,
            "noglu" => !glu,
            "dot" => tokens == 1 && !plain,
            "d16" => h16.is_some(),
            "i8" => h16.is_some() && one.i8,
            "f32x" => !(h16.is_some() && one.i8),
            "fuse" => self == KernelId::AttentionFused,
            "tpn" => attn_tp(),
            "tp1" => !attn_tp(),
            "vv" => attn_vv(),
            "pool4" => attn_tp() || attn_vv(),
            "nodot" => tokens != 1 || plain,
            "rope" => rope,
            "plain" => !rope,
            "two" => second.is_some(),
            "one" => second.is_none(),
            "vred" => !scalar,
            "sred" => scalar,
            "sg" => subgroups,
            "nosg" => !subgroups,
            "pf" => pipe.prefetch_for(weights),
            "nopf" => !pipe.prefetch_for(weights),
            "prep" => self == KernelId::SplitPrep,
            "dequant" => matches!(self, KernelId::SplitDequant(_)),
            "gemm" => self == KernelId::SplitGemm,
            "epilogue" => matches!(self, KernelId::SplitEpilogue(_)),
            _ => false,
        }));
        if let Some(l) = weights {
            let accessor = with_dot(sections(FORMATS, &|name| name == fmt(l)));
            src.push_str(&accessor_for(&accessor, "", 5, 6));
            if glu {
                src.push_str(&accessor_for(&accessor, "b", 8, 9));
            }
            if let Some(b) = second {
                let accessor = with_dot(sections(FORMATS, &|name| name == fmt(b)));
                src.push_str(&accessor_for(&accessor, "b", 8, 9));
            }
        }
        src
    }
}

/// How a format's accessor in formats.wgsl begins its own `d8`.
const OWN_D8: &str = "fn d8$(r: u32";

/// A format's accessor, with the plain `d8$` (w8 and two dots) where it has none of its own.
fn with_dot(mut accessor: String) -> String {
    if !accessor.contains(OWN_D8) {
        accessor.push_str(
            "fn d8$(r: u32, i: u32, x0: vec4<f32>, x1: vec4<f32>, xs: f32) -> f32 {\n    \
             let w = w8$(r, i);\n    return dot(x0, w[0]) + dot(x1, w[1]);\n}\n",
        );
    }
    accessor
}

/// A weight accessor with its names suffixed by `suffix`, bound at `quants` and `scales`.
fn accessor_for(text: &str, suffix: &str, quants: u32, scales: u32) -> String {
    text.replace("@binding($Q)", &format!("@binding({quants})"))
        .replace("@binding($S)", &format!("@binding({scales})"))
        .replace('$', suffix)
}

/// `text` with each `//# name` ... `//# end` section kept where `keep(name)`, else dropped
/// (sections nest: a line is kept where every section around it is).
fn sections(text: &str, keep: &dyn Fn(&str) -> bool) -> String {
    let mut out = String::new();
    let mut open: Vec<bool> = Vec::new();
    for line in text.lines() {
        match line.trim_start().strip_prefix("//# ").map(str::trim) {
            Some("end") => {
                open.pop();
            }
            Some(name) => open.push(keep(name)),
            None if open.iter().all(|&k| k) => {
                out.push_str(line);
                out.push('\n');
            }
            None => {}
        }
    }
    out
}

/// Output rows one matvec workgroup computes (`RPW` in `shaders/matvec.wgsl`).
pub(crate) const ROWS_PER_GROUP: usize = 4;

/// Whether f16 weights are read as one 16-byte load per 8 columns (`f16v4` in
/// formats.wgsl) instead of two 8-byte ones in the matvec builds: on by default (on the H200 tg64@128 / @2048
/// +1.9% / +0.9% and +3.3% / +2.2% on Llama-3.2-1B F16, +1.5% / +0.9% and +0.0% / +1.9% on
/// 3B F16, two calls; docs/benchmarks.md, "Decode: d16, one launch fewer, attention");
/// `CELLM_GPU_F16_VEC4=0` for two loads (the upload pads every weight buffer to 16 bytes
/// either way).
pub fn f16_vec4() -> bool {
    std::env::var("CELLM_GPU_F16_VEC4").map_or(true, |v| v != "0")
}

/// Threads of a matvec workgroup (`WG` in `shaders/matvec.wgsl`).
pub const MATVEC_WG: u32 = 64;

/// The shape of the one-token matvec build of the plain and GLU kernels (not the q|k|v
/// rope builds, which keep 4 rows): output rows a workgroup (1, 2 or 4; the grid still
/// counts groups of 4 rows and takes 4 / rows workgroups a group along z), threads a
/// workgroup (32 to 256, a power of two), and whether the subgroup reduction takes only the
/// first lane of the slots in use (`scalar`) instead of every slot as a `vec4`.
/// `CELLM_GPU_MATVEC_ONE=rows,threads[,scalar]` (any separator; scalar 0 or 1) picks
/// another, for measuring (`4,64,0` is the shape before: `LEGACY`).
///
/// The default, 2 rows and 128 threads with the scalar reduction (more workgroups and more
/// loads in flight for the decode launches, as llama.cpp's Vulkan matvec does on NVIDIA
/// with 2 rows of k-quants and 128 threads), was the fastest of 10 shapes on the H200
/// (docs/benchmarks.md, "One-token matvec shape"): tg64@128 against `LEGACY` +10%
/// (Llama-3.2-1B Q4_K_M), +11% (3B Q4_K_M), +5% (3B F16), +17% (SmolLM2 Q4_1), +5%
/// (Gemma 3), +10% (1B F16). Devices without subgroups keep `LEGACY` (a 128-thread
/// shared-memory tree was not measured) unless the knob asks otherwise and the tree fits
/// 16 KiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OneShape {
    pub rows: u32,
    pub threads: u32,
    pub scalar: bool,
    /// Whether formats with a `d16` (q4_k, q6_k: formats.wgsl) take 16 columns a thread
    /// and step from one pair of words (both nibbles of each byte) instead of 8 (`d8`), in
    /// every one-token build (the rope and wide ones too). `CELLM_GPU_MATVEC_D16=0` / `=1`
    /// turns it off / on (for measuring).
    pub d16: bool,
    /// Whether the `d16` loop quantizes x to int8 (one scale per thread's 16 values) and
    /// takes the formats' `d16i` (packed 4 x 8-bit integer dots, `dot4I8Packed`) instead of
    /// their float `d16`. `CELLM_GPU_MATVEC_I8=1` / `=0` (for measuring).
    pub i8: bool,
}

/// Threads of the q|k|v rope matvec's one-token build (4 rows a workgroup):
/// `CELLM_GPU_MATVEC_ROPE_WG` (64 to 256, a power of two; for measuring), else 64.
pub fn rope_threads() -> u32 {
    let v = std::env::var("CELLM_GPU_MATVEC_ROPE_WG").ok().and_then(|v| v.parse().ok());
    v.filter(|t: &u32| (64..=256).contains(t) && t.is_power_of_two()).unwrap_or(MATVEC_WG)
}

impl OneShape {
    /// The shape before: 4 rows, 64 threads, every slot reduced as a vec4 (also the rope,
    /// wide and batched builds' rows and reduction).
    pub const LEGACY: OneShape =
        OneShape { rows: 4, threads: MATVEC_WG, scalar: false, d16: D16_DEFAULT, i8: I8_DEFAULT };
    /// The default (see above).
    pub const DEFAULT: OneShape =
        OneShape { rows: 2, threads: 128, scalar: true, d16: D16_DEFAULT, i8: I8_DEFAULT };

    pub fn get() -> Self {
        let d16 = match std::env::var("CELLM_GPU_MATVEC_D16").ok() {
            Some(v) => v != "0",
            None => D16_DEFAULT,
        };
        let i8 = match std::env::var("CELLM_GPU_MATVEC_I8").ok() {
            Some(v) => v != "0",
            None => I8_DEFAULT,
        };
        let Some(v) = std::env::var("CELLM_GPU_MATVEC_ONE").ok() else {
            return OneShape { d16, i8, ..Self::DEFAULT };
        };
        let n: Vec<u32> =
            v.split(|c: char| !c.is_ascii_digit()).filter_map(|x| x.parse().ok()).collect();
        let shape = match n[..] {
            [rows, threads] => OneShape { rows, threads, scalar: false, d16, i8 },
            [rows, threads, s] => OneShape { rows, threads, scalar: s != 0, d16, i8 },
            _ => return OneShape { d16, i8, ..Self::DEFAULT },
        };
        if shape.valid() {
            shape
        } else {
            OneShape { d16, i8, ..Self::DEFAULT }
        }
    }

    /// `self` on `backend`: int8 x (`I8_DEFAULT`) on Vulkan only, unless
    /// `CELLM_GPU_MATVEC_I8` says.
    pub fn for_backend(self, backend: wgpu::Backend) -> Self {
        let asked = std::env::var_os("CELLM_GPU_MATVEC_I8").is_some();
        OneShape { i8: self.i8 && (asked || backend == wgpu::Backend::Vulkan), ..self }
    }

    /// The rows, threads and reduction of `self` are the default's (whatever `d16`, `i8`).
    fn default_shape(self) -> bool {
        OneShape { d16: D16_DEFAULT, i8: I8_DEFAULT, ..self } == Self::DEFAULT
    }

    pub fn valid(self) -> bool {
        matches!(self.rows, 1 | 2 | 4)
            && (32..=256).contains(&self.threads)
            && self.threads.is_power_of_two()
    }

    /// Workgroups a group of 4 rows takes (along the grid's z).
    pub fn split(self) -> u32 {
        4 / self.rows
    }

    /// The shape as built on a device with or without subgroups: without, `LEGACY` for the
    /// default and where the shared-memory tree (2 * rows + 1 vec4 slots a thread) would
    /// pass 16 KiB, and never the scalar reduction (a subgroup one).
    pub fn for_device(self, subgroups: bool) -> Self {
        if subgroups {
            self
        } else if !self.default_shape() && (2 * self.rows + 1) * self.threads * 16 <= 16 << 10 {
            OneShape { scalar: false, ..self }
        } else {
            OneShape { d16: self.d16, i8: self.i8, ..Self::LEGACY }
        }
    }
}

/// The one-token matvec's wide build: its threads, and which launches take it (at least
/// `cols` columns and fewer than `rows` rows): more threads along a row where a launch has
/// too few rows to fill the GPU with 64-thread workgroups, so that each thread has fewer
/// column steps to walk. On the H200 this helped Qwen2.5-0.5B's down projection (896 rows
/// of 4864 columns: tg64@128 +9%) and Gemma 3's (640 of 2048: +2%), and cost 9-25% where
/// it also took the Llamas' launches of 2048 and 3072 rows, hence at most 1024 rows.
/// `CELLM_GPU_MATVEC_WIDE=threads,cols,rows` picks others (threads a power of two from 64
/// to 256, 64 for none; for measuring). Only built with subgroups (its shared-memory tree
/// would not fit 16 KiB).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wide {
    pub threads: u32,
    pub cols: u32,
    pub rows: u32,
}

impl Wide {
    pub fn get() -> Self {
        let default = Wide { threads: 256, cols: 2048, rows: 1025 };
        let Some(v) = std::env::var("CELLM_GPU_MATVEC_WIDE").ok() else { return default };
        // Any separator: `256,2048,8192` or `256.2048.8192`.
        let n: Vec<u32> =
            v.split(|c: char| !c.is_ascii_digit()).filter_map(|x| x.parse().ok()).collect();
        match n[..] {
            [threads, cols, rows] if (64..=256).contains(&threads) && threads.is_power_of_two() => {
                Wide { threads, cols, rows }
            }
            _ => default,
        }
    }
}

/// Whether the decode attention scores a position with several threads where its splits
/// are short, reading f16 keys 16 bytes a load (`tpn` in attention.wgsl), or one thread a
/// position, 4 bytes a load (`CELLM_GPU_ATTN_TP=0` / `=1`, for measuring).
pub fn attn_tp() -> bool {
    match std::env::var("CELLM_GPU_ATTN_TP").ok() {
        Some(v) => v != "0",
        None => ATTN_TP_DEFAULT,
    }
}

/// Whether the decode attention reads f16 values 16 bytes a load, 8 dims a thread, where
/// rows allow (`vv` in attention.wgsl), or 4 bytes, 2 dims (`CELLM_GPU_ATTN_VV=0` / `=1`,
/// for measuring).
pub fn attn_vv() -> bool {
    match std::env::var("CELLM_GPU_ATTN_VV").ok() {
        Some(v) => v != "0",
        None => ATTN_VV_DEFAULT,
    }
}

/// `attn_vv()` without the knob (on the H200 +11% on Gemma 3, +4-7% on the 3B shapes, +2% /
/// +1% on 1B Q4_K_M; Qwen2.5 +5% / -5%; docs/benchmarks.md).
pub const ATTN_VV_DEFAULT: bool = true;

/// `attn_tp()` without the knob (on the H200 +4% / +6% on Llama-3.2-1B Q4_K_M, +7% / +10% on
/// Gemma 3 against one thread a position; docs/benchmarks.md).
pub const ATTN_TP_DEFAULT: bool = true;

/// Whether the one-token builds take `d16` where the formats have it (`OneShape::d16`). On
/// the H200 d16 with the fused combine took Llama-3.2-1B Q4_K_M from 504 / 440 to 552 / 483
/// tok/s (tg64@128 / @2048), each alone 518 / 479 and 506 / 468 (docs/benchmarks.md,
/// "Decode: d16, the attention's own combine, attention loads").
pub const D16_DEFAULT: bool = true;

/// Whether the plain and GLU one-token builds of formats with a `d16` run 64 threads (the
/// shape's rows) for launches whose rows hold more than 128 units of 16 columns but not a
/// multiple of 128 (`t64_cols`), e.g. 3072 columns (192 units: 3 a thread rather than 2 or
/// 1): `CELLM_GPU_MATVEC_T64=0` / `=1`. On the H200 Llama-3.2-3B Q4_K_M (3072 columns) +2%
/// / +2% (tg64@128 / @2048) in two calls with int8 x; on every launch whose units are not a
/// multiple of 128 it cost Qwen2.5-0.5B (896 columns: 56 units) 1-3%, hence more than 128
/// (docs/benchmarks.md, "int8 x").
pub fn t64() -> bool {
    std::env::var("CELLM_GPU_MATVEC_T64").map_or(true, |v| v != "0")
}

/// Whether a one-token launch of rows of `cols` columns takes the 64-thread build (`t64`).
pub fn t64_cols(cols: u32) -> bool {
    let units = cols / 16;
    units > 128 && !units.is_multiple_of(128)
}

/// Columns from which a one-token launch with int8 x (`OneShape::i8`, default shape) runs
/// 4 rows a workgroup instead of 2 (more rows share each thread's rounding of x): 2048, or
/// `CELLM_GPU_MATVEC_R4=cols` (0: never). On the H200 (docs/benchmarks.md, "int8 x" and
/// "4 rows from 2048 columns"), from 2048 columns: Llama-3.2-1B Q4_K_M +3% to +6.5% in three
/// of four calls (-1% in the other), 3B +1-2%, Qwen2.5-0.5B and Gemma-3-270M within noise (only
/// their down projections are that wide); 4 rows everywhere cost Qwen2.5 2-4%.
pub fn r4_cols() -> Option<u32> {
    let v = std::env::var("CELLM_GPU_MATVEC_R4").ok().and_then(|v| v.parse().ok());
    Some(v.unwrap_or(R4_COLS)).filter(|&c| c > 0)
}

/// [`r4_cols`]'s default.
const R4_COLS: u32 = 2048;

/// Whether the one-token `d16` loop takes x as int8 (`OneShape::i8`) on Vulkan (wgpu
/// writes `dot4I8Packed` as SPIR-V's packed `OpSDot` where the device has integer dot
/// products, core in Vulkan 1.3); Metal, whose shading language has no packed dot (naga
/// writes it out byte by byte), keeps the float `d16` unless `CELLM_GPU_MATVEC_I8=1`. On the
/// H200 (two calls, tg64@128 / @2048 against the float `d16`): Llama-3.2-1B Q4_K_M +7% /
/// +7% and +9% / +8%, 3B +13% / +10% and +10% / +11%, Qwen2.5-0.5B +6% / +3% and +2% /
/// +4%, Gemma 3 +0-2% (docs/benchmarks.md, "int8 x").
pub const I8_DEFAULT: bool = true;

/// Columns between the two halves of a format's `d16` (the 8 columns in the low nibbles of
/// a pair of words and the 8 in their high nibbles; formats.wgsl), where it has one.
fn d16_half(format: &str) -> Option<u32> {
    match format {
        "q4_k" => Some(32),
        "q6_k" => Some(8),
        _ => None,
    }
}

/// Whether a format's `d16i` takes x's int8 values as the even columns then the odd ones
/// of each 8 (q6_k's quants pair up that way), rather than in column order.
fn i8_even_odd(format: &str) -> bool {
    format == "q6_k"
}

/// The one-token matvec's column steps a pass (`UN` in `shaders/matvec.wgsl`). On the H200,
/// 4 was 0-5% slower at tg64@128 than 1 or 2 (SmolLM2 Q4_1, Llama-3.2-1B Q4_K_M, 3B F16),
/// and 1 and 2 were within noise of each other.
const MATVEC_STEPS_ONE: u32 = 1;
/// `KernelId::source`'s `tokens` for the tiled GEMM build.
pub const GEMM_BUILD: u32 = 0;
/// Tokens from which a matvec launch runs as the tiled GEMM.
pub const GEMM_MIN_TOKENS: u32 = 8;
/// Rows and tokens of one GEMM workgroup's tile (`BM`, `BN` in `shaders/gemm.wgsl`).
pub const GEMM_TILE: u32 = 64;

/// `KernelId::source`'s `tokens` for the cooperative-matrix GEMM build.
pub const COOP_BUILD: u32 = u32::MAX;

/// The cooperative-matrix GEMM's tile: its 8 or 4 subgroups as `SGR` x `SGC` along rows and
/// tokens, each computing `WR` x `WC` tiles of 16 x 16, `bk` (32 or 64) columns a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CoopTile {
    pub sgr: u32,
    pub sgc: u32,
    pub wr: u32,
    pub wc: u32,
    pub bk: u32,
}

#[cfg(test)]
thread_local! {
    /// A tile `CoopTile::get` returns instead of its own (tests that build every shape).
    pub(crate) static TILE_FOR_TEST: std::cell::Cell<Option<CoopTile>> =
        const { std::cell::Cell::new(None) };
}

impl CoopTile {
    /// The tile of the GLU's kernel (`glu`) or the plain matvec's: 128 rows by 128 tokens,
    /// subgroups 2 x 4 of 4 x 2 tiles, 32 columns a step for the GLU (its three f16 tiles of
    /// 64 columns would take 54 KiB) and 64 for the plain matvec (on the H200, pp512 1.12x-1.14x
    /// the step of 32 on Llama-3.2-1B/3B F16 and Q4_K_M; 4 subgroups of 4 x 4 tiles were
    /// 0.83x-0.91x, docs/benchmarks.md). Plain matvecs whose columns are not a multiple of 64
    /// run the f32 GEMM (`gemm_for`). `CELLM_GPU_COOP_TILE=sgr,sgc,wr,wc` picks another for
    /// both, `CELLM_GPU_COOP_TILE_MV` for the plain one alone (for measuring; an optional
    /// fifth number is the step, 32 or 64; any non-digits separate them; 8 or 4 subgroups,
    /// at most 48 KiB of shared memory, each invocation loading whole chunks).
    pub fn get(glu: bool) -> Self {
        #[cfg(test)]
        if let Some(t) = TILE_FOR_TEST.with(|t| t.get()) {
            return t;
        }
        let default = CoopTile { sgr: 2, sgc: 4, wr: 4, wc: 2, bk: if glu { 32 } else { 64 } };
        let var = |name: &str| std::env::var(name).ok();
        let chosen = if glu { None } else { var("CELLM_GPU_COOP_TILE_MV") };
        let Some(v) = chosen.or_else(|| var("CELLM_GPU_COOP_TILE")) else { return default };
        let n: Vec<u32> =
            v.split(|c: char| !c.is_ascii_digit()).filter_map(|x| x.parse().ok()).collect();
        let tile = match n[..] {
            [sgr, sgc, wr, wc] => CoopTile { sgr, sgc, wr, wc, bk: 32 },
            [sgr, sgc, wr, wc, bk] => CoopTile { sgr, sgc, wr, wc, bk },
            _ => return default,
        };
        if tile.valid(glu) {
            tile
        } else {
            default
        }
    }

    /// Whether the kernel can take this tile: 8 or 4 subgroups, a step of 32 or 64, every
    /// invocation loading the same whole number of weight and x chunks, 48 KiB of shared
    /// memory at most.
    pub fn valid(self, glu: bool) -> bool {
        let wg = self.invocations();
        (self.sgr * self.sgc == 8 || self.sgr * self.sgc == 4)
            && self.wr > 0
            && self.wc > 0
            && (self.bk == 32 || self.bk == 64)
            && (self.rows() * self.bk / 8).is_multiple_of(wg)
            && (self.tokens() * self.bk / 4).is_multiple_of(wg)
            && self.shared_bytes(glu) <= 48 << 10
    }

    /// Invocations of a workgroup (32 a subgroup).
    pub fn invocations(self) -> u32 {
        self.sgr * self.sgc * 32
    }

    /// Bytes of shared memory the kernel takes (f16 tiles of W, of the GLU's second matrix
    /// where `glu`, and of x; the stage; the sums of x^2).
    pub fn shared_bytes(self, glu: bool) -> u32 {
        let row = (self.bk / 4 + 2) * 8;
        self.rows() * row * (1 + u32::from(glu))
            + self.tokens() * row
            + self.sgr * self.sgc * 1024
            + self.tokens() * 4
    }

    /// Rows of a workgroup's tile.
    pub fn rows(self) -> u32 {
        self.sgr * self.wr * 16
    }

    /// Tokens of a workgroup's tile.
    pub fn tokens(self) -> u32 {
        self.sgc * self.wc * 16
    }
}

/// How the cooperative-matrix GEMM runs its steps, read at load (see docs/benchmarks.md,
/// "Prefill GEMM without the register prefetch"): `prefetch`, whether each step's loads are
/// issued into registers before the previous step's multiplies, or go straight to shared
/// memory at the step's start (fewer registers: on the H200 pp512 1.11x-1.13x on
/// Llama-3.2-3B F16 and 1.06x-1.07x on 1B F16, 1.00x on 3B Q4_K_M, whose decode the prefetch
/// hides). `None`, the default, prefetches for the block formats only;
/// `CELLM_GPU_COOP_PREFETCH=1` / `=0` forces it on / off for every layout (for measuring).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CoopPipe {
    pub prefetch: Option<bool>,
}

#[cfg(test)]
thread_local! {
    /// A `CoopPipe` that `CoopPipe::get` returns instead of the environment's (tests).
    pub(crate) static PIPE_FOR_TEST: std::cell::Cell<Option<CoopPipe>> =
        const { std::cell::Cell::new(None) };
}

impl CoopPipe {
    pub fn get() -> Self {
        #[cfg(test)]
        if let Some(p) = PIPE_FOR_TEST.with(|p| p.get()) {
            return p;
        }
        CoopPipe { prefetch: std::env::var("CELLM_GPU_COOP_PREFETCH").ok().map(|v| v != "0") }
    }

    /// Whether the build for weights in `layout` prefetches into registers.
    pub fn prefetch_for(self, layout: Option<Layout>) -> bool {
        self.prefetch.unwrap_or(!matches!(layout, Some(Layout::F32 | Layout::F16 | Layout::Bf16)))
    }
}

/// `shaders/gemm_coop.wgsl` for `tile`: its sizes, and the accumulators, the multiply-adds
/// and the epilogue of each of a subgroup's tiles written out (one variable a tile).
fn coop_source(tile: CoopTile) -> String {
    let (bm, bn) = (tile.rows(), tile.tokens());
    let tiles: Vec<(u32, u32)> =
        (0..tile.wr).flat_map(|i| (0..tile.wc).map(move |j| (i, j))).collect();
    // Lines at `indent` (the `//# glu` sections are kept or dropped later, by `sections`).
    let block = |indent: usize, lines: &[String]| -> String {
        lines.iter().map(|l| format!("{:indent$}{l}\n", "")).collect()
    };
    let glu = |lines: &[String]| -> Vec<String> {
        [vec!["//# glu".to_string()], lines.to_vec(), vec!["//# end".to_string()]].concat()
    };
    let mut zero = Vec::new();
    for &(i, j) in &tiles {
        zero.push(format!("var c{i}_{j} = coopLoad<coop_mat16x16<f32, C>>(&stage[0], 16u);"));
        zero.extend(glu(&[format!("var d{i}_{j} = c{i}_{j};")]));
    }
    let mut mma = Vec::new();
    for i in 0..tile.wr {
        let at = format!("(m0 + {}u) * LD + kk / 4u", 16 * i);
        mma.push(format!("let a{i} = coopLoadT<coop_mat16x16<f16, A>>(&ta[{at}], LD);"));
        mma.extend(glu(&[format!("let b{i} = coopLoadT<coop_mat16x16<f16, A>>(&tb[{at}], LD);")]));
    }
    for j in 0..tile.wc {
        let at = format!("(n0 + {}u) * LD + kk / 4u", 16 * j);
        mma.push(format!("let x{j} = coopLoad<coop_mat16x16<f16, B>>(&tx[{at}], LD);"));
    }
    for &(i, j) in &tiles {
        mma.push(format!("c{i}_{j} = coopMultiplyAdd(a{i}, x{j}, c{i}_{j});"));
        mma.extend(glu(&[format!("d{i}_{j} = coopMultiplyAdd(b{i}, x{j}, d{i}_{j});")]));
    }
    let mut store = Vec::new();
    for &(i, j) in &tiles {
        let (rb, tb) = (format!("r0 + m0 + {}u", 16 * i), format!("n0 + {}u", 16 * j));
        store.push(format!("coopStore(c{i}_{j}, &stage[sg * 256u], 16u);"));
        store.push("workgroupBarrier();".into());
        store.push(format!("var g{i}_{j}: array<f32, 8>;"));
        store.extend(glu(&[
            format!("g{i}_{j} = gate(sg * 256u, lane, {rb}, {tb});"),
            "workgroupBarrier();".into(),
            format!("coopStore(d{i}_{j}, &stage[sg * 256u], 16u);"),
            "workgroupBarrier();".into(),
        ]));
        store.push(format!("emit(sg * 256u, lane, {rb}, t0, {tb}, n, g{i}_{j});"));
        store.push("workgroupBarrier();".into());
    }
    GEMM_COOP
        .replace("$BM", &bm.to_string())
        .replace("$BN", &bn.to_string())
        .replace("$SGC", &tile.sgc.to_string())
        .replace("$WR", &tile.wr.to_string())
        .replace("$WC", &tile.wc.to_string())
        .replace("$BK", &tile.bk.to_string())
        .replace("$WG", &tile.invocations().to_string())
        .replace("$TA", &(bm * (tile.bk / 4 + 2)).to_string())
        .replace("$TX", &(bn * (tile.bk / 4 + 2)).to_string())
        .replace("$ST", &(tile.sgr * tile.sgc * 256).to_string())
        .replace("//@ZERO\n", &block(4, &zero))
        .replace("//@MMA\n", &block(12, &mma))
        .replace("//@STORE\n", &block(4, &store))
}

/// A compiled kernel and its binding layout; `single` is its one-token build, `gemm` its
/// tiled-GEMM build and `coop` its cooperative-matrix GEMM, where it has them (the same
/// bindings).
pub struct Kernel {
    pub name: String,
    pub pipeline: wgpu::ComputePipeline,
    pub single: Option<wgpu::ComputePipeline>,
    /// Workgroups a group of 4 rows takes in the one-token build (`OneShape::split`).
    pub single_split: u32,
    /// The one-token build at 64 threads, for launches whose rows' 16-column units (`d16`)
    /// are more than 128 and not a multiple of 128 (`t64()`, `t64_cols`), where built.
    pub single64: Option<wgpu::ComputePipeline>,
    /// The int8-x one-token build at 4 rows a workgroup, and the columns from which a
    /// launch takes it (`r4_cols()`), where built.
    pub single_r4: Option<(wgpu::ComputePipeline, u32)>,
    /// The one-token build with `Wide::get()` threads, and which launches take it (where the
    /// device has subgroups).
    pub wide: Option<(wgpu::ComputePipeline, Wide)>,
    pub gemm: Option<wgpu::ComputePipeline>,
    pub coop: Option<(wgpu::ComputePipeline, CoopTile)>,
    pub layout: wgpu::BindGroupLayout,
    /// Whether the parameters are immediates (`set_immediates` before each launch) rather
    /// than binding 0.
    pub immediates: bool,
}

impl Kernel {
    /// A kernel of one build.
    fn plain(
        name: String,
        pipeline: wgpu::ComputePipeline,
        layout: wgpu::BindGroupLayout,
        immediates: bool,
    ) -> Self {
        Kernel {
            name,
            pipeline,
            single: None,
            single_split: 1,
            single64: None,
            single_r4: None,
            wide: None,
            gemm: None,
            coop: None,
            layout,
            immediates,
        }
    }

    /// The pipeline for a launch over `tokens` tokens of
    /// `rows` x `cols` (the GEMM is `gemm_for`'s), and the factor on its grid's z (the
    /// one-token build's `single_split`, else 1).
    pub fn for_launch(&self, tokens: u32, rows: u32, cols: u32) -> (&wgpu::ComputePipeline, u32) {
        match (&self.wide, &self.single, tokens) {
            (Some((wide, w)), _, 1) if cols >= w.cols && rows < w.rows => (wide, 1),
            (_, Some(_), 1) if self.single64.is_some() && t64_cols(cols) => {
                (self.single64.as_ref().expect("built"), self.single_split)
            }
            (_, Some(_), 1) if self.single_r4.as_ref().is_some_and(|r| cols >= r.1) => {
                (&self.single_r4.as_ref().expect("built").0, 1)
            }
            (_, Some(one), 1) => (one, self.single_split),
            _ => (&self.pipeline, 1),
        }
    }

    /// The GEMM build, where a launch over `tokens` tokens of `cols` columns and
    /// `row_groups` groups of `ROWS_PER_GROUP` rows should use it, with its grid: the
    /// cooperative-matrix one (token tiles along x) where the device has it and the columns
    /// are a multiple of its step (32 or 64), else the f32 one (row tiles along x).
    pub fn gemm_for(
        &self,
        tokens: u32,
        cols: u32,
        row_groups: u32,
    ) -> Option<(&wgpu::ComputePipeline, (u32, u32, u32))> {
        if tokens < GEMM_MIN_TOKENS {
            return None;
        }
        let per = ROWS_PER_GROUP as u32;
        match &self.coop {
            Some((coop, tile)) if cols.is_multiple_of(tile.bk) => Some((
                coop,
                (tokens.div_ceil(tile.tokens()), row_groups.div_ceil(tile.rows() / per), 1),
            )),
            _ => self.gemm.as_ref().map(|g| {
                (g, (row_groups.div_ceil(GEMM_TILE / per), tokens.div_ceil(GEMM_TILE), 1))
            }),
        }
    }
}

/// Kernels built so far on one device.
pub struct Kernels {
    subgroups: bool,
    coopmat: bool,
    immediates: bool,
    /// f16 weights 16 bytes a load (`f16_vec4()`; tests set it).
    pub f16v4: bool,
    /// The one-token build's shape (`OneShape::get()`; tests set it).
    pub one: OneShape,
    built: HashMap<KernelId, Arc<Kernel>>,
}

impl Kernels {
    /// Kernels for `gpu`, with subgroup reductions where it has them, and the
    /// cooperative-matrix GEMM where it has that.
    pub fn new(gpu: &crate::device::Gpu) -> Self {
        // The default tiles take 38.5 (GLU) and 44.5 KiB: where a device offers less (none with cooperative
        // matrices is known to), the f32 GEMM runs.
        let fits = [true, false].into_iter().all(|glu| {
            CoopTile::get(glu).shared_bytes(glu) <= gpu.limits.max_compute_workgroup_storage_size
        });
        Self {
            subgroups: gpu.subgroups,
            coopmat: gpu.coopmat && fits,
            immediates: gpu.immediates,
            f16v4: f16_vec4(),
            one: OneShape::get().for_backend(gpu.info.backend),
            built: HashMap::new(),
        }
    }

    /// Whether the cooperative-matrix GEMM runs (and so the cooperative prefill attention
    /// may).
    pub fn coopmat(&self) -> bool {
        self.coopmat
    }

    pub fn get(&mut self, device: &wgpu::Device, id: KernelId) -> Arc<Kernel> {
        let opts = (self.subgroups, self.coopmat, self.immediates, self.f16v4, self.one);
        self.built.entry(id).or_insert_with(|| Arc::new(build(device, id, opts))).clone()
    }
}

/// The parameters' declaration in every kernel, and what it becomes with immediates.
const PARAMS_UNIFORM: &str = "@group(0) @binding(0) var<uniform> p: Params;";
const PARAMS_IMMEDIATE: &str = "var<immediate> p: Params;";
/// Bytes of every kernel's `Params`.
pub const PARAMS_BYTES: u32 = 64;

fn build(
    device: &wgpu::Device,
    id: KernelId,
    (subgroups, coopmat, immediates, f16v4, one): (bool, bool, bool, bool, OneShape),
) -> Kernel {
    let label = format!("{id:?}");
    let entries: Vec<wgpu::BindGroupLayoutEntry> = id
        .bindings()
        .into_iter()
        .filter(|&(_, kind)| !(immediates && kind == Bind::Uniform))
        .map(|(binding, kind)| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: match kind {
                    Bind::Uniform => wgpu::BufferBindingType::Uniform,
                    Bind::Read => wgpu::BufferBindingType::Storage { read_only: true },
                    Bind::Write => wgpu::BufferBindingType::Storage { read_only: false },
                },
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        })
        .collect();
    let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
        label: Some(&label),
        entries: &entries,
    });
    let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
        label: Some(&label),
        bind_group_layouts: &[Some(&layout)],
        immediate_size: if immediates { PARAMS_BYTES } else { 0 },
    });
    if let KernelId::Coopmat2Gemm(un) | KernelId::Coopmat2Glu(un) = id {
        let glu = matches!(id, KernelId::Coopmat2Glu(_));
        let pipeline = crate::nv_coopmat2::gemm_pipeline(device, &pipeline_layout, un, glu, &label);
        let name = if glu { "Coopmat2Glu" } else { "Coopmat2Gemm" };
        return Kernel::plain(name.into(), pipeline, layout, immediates);
    }
    if let KernelId::Coopmat2Attn(hd, half) = id {
        let pipeline =
            crate::nv_coopmat2::attention_pipeline(device, &pipeline_layout, hd, half, &label);
        return Kernel::plain("Coopmat2Attn".into(), pipeline, layout, immediates);
    }
    let pipeline_shape = |tokens: u32, wg: u32, shape: OneShape| {
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some(&label),
            source: wgpu::ShaderSource::Wgsl(
                params_decl(id.source_shape(subgroups, tokens, wg, f16v4, shape), immediates)
                    .into(),
            ),
        };
        // SAFETY: every index a kernel computes is clamped into its buffer by the kernel
        // itself (rows, tokens, columns and positions past the end read in-bounds data that
        // is never stored), and every loop ends on its own, so naga's per-access bounds
        // clamps and loop counters are dead weight in the inner loops (Vulkan's robust
        // buffer access stays on under wgpu either way).
        let module = unsafe {
            device.create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked())
        };
        device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(&label),
            layout: Some(&pipeline_layout),
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        })
    };
    let pipeline_wg = |tokens: u32, wg: u32| {
        pipeline_shape(tokens, wg, OneShape { d16: one.d16, i8: one.i8, ..OneShape::LEGACY })
    };
    let pipeline = |tokens: u32| pipeline_wg(tokens, MATVEC_WG);
    // The rope builds keep 4 rows (rotated pairs of a head), with `rope_threads()`.
    let rope = matches!(id, KernelId::MatvecRope(_) | KernelId::MatvecRope2(..));
    let one = match rope {
        true => OneShape { threads: rope_threads(), d16: one.d16, i8: one.i8, ..OneShape::LEGACY }
            .for_device(subgroups),
        false => one.for_device(subgroups),
    };
    let single = id.per_token_count().then(|| pipeline_shape(1, one.threads, one));
    let w = Wide::get();
    let wide = (id.per_token_count() && subgroups && w.threads != MATVEC_WG)
        .then(|| (pipeline_wg(1, w.threads), w));
    let gemm = id.has_gemm().then(|| pipeline(GEMM_BUILD));
    let glu = matches!(id, KernelId::Glu(_));
    let coop = (coopmat && id.has_gemm()).then(|| (pipeline(COOP_BUILD), CoopTile::get(glu)));
    let name = label.split('(').next().unwrap_or_default().to_string();
    let single_split = one.split();
    // 64 threads where a row's d16 units leave some of 128 threads idle (`t64()`).
    let d16 = |sh: OneShape| id.source_shape(subgroups, 1, sh.threads, f16v4, sh);
    let single64 = (t64() && id.per_token_count() && !rope && subgroups && one.threads == 128)
        .then_some(OneShape { threads: 64, ..one })
        .filter(|&sh| d16(sh).contains("const D16: bool = true"))
        .map(|sh| pipeline_shape(1, 64, sh));
    // 4 rows where x is int8 and the rows are long (`r4_cols()`).
    let single_r4 = r4_cols()
        .filter(|_| id.per_token_count() && !rope && subgroups && one.i8 && one.rows == 2)
        .map(|c| (OneShape { rows: 4, ..one }, c))
        .filter(|&(sh, _)| d16(sh).contains("const D16: bool = true"))
        .map(|(sh, c)| (pipeline_shape(1, sh.threads, sh), c));
    Kernel {
        name,
        pipeline: pipeline(4),
        single,
        single_split,
        single64,
        single_r4,
        wide,
        gemm,
        coop,
        layout,
        immediates,
    }
}

/// `src` with its parameters as immediates where `immediates`.
fn params_decl(src: String, immediates: bool) -> String {
    if immediates {
        assert!(src.contains(PARAMS_UNIFORM), "a kernel declares its parameters otherwise");
        src.replace(PARAMS_UNIFORM, PARAMS_IMMEDIATE)
    } else {
        src
    }
}
