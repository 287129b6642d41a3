//! What a step runs, planned once at load: each kernel launch (`Op`) with its parameters,
//! the buffers it binds and its grid, and the sizes every step shares.

use std::sync::Arc;

use crate::kernels::Kernel;

/// A buffer a launch binds: a step buffer (resized with the step's capacity) or a weight.
#[derive(Clone)]
pub enum Buf {
    X,
    Qkv,
    Ctx,
    Act,
    Tmp,
    Logits,
    Rope,
    Pool,
    /// The attention splits' partial sums.
    Part,
    /// The attention's count of finished splits per (token, head) (`AttentionFused`).
    Done,
    Dummy,
    /// The split GEMM's f16 inputs (split_gemm.rs): one row per token, rounded up to a tile.
    Half,
    /// The split GEMM's dequantized weights (f16 rows).
    WHalf,
    /// The split GEMM's f32 sums.
    Acc,
    W(wgpu::Buffer),
}

/// The epilogue's matvec flags (`shaders/linear.wgsl`).
pub const NORM: u32 = 1;
pub const RESIDUAL: u32 = 2;
pub const BIAS: u32 = 4;
pub const SOFTCAP: u32 = 8;
/// The GLU's activation is gelu-tanh (else silu).
pub const GELU: u32 = 32;

/// How many workgroups a launch runs, as a function of the step's tokens.
#[derive(Clone, Copy)]
pub enum Grid {
    /// One per group of output rows (`groups` of them, a 2-D grid of `groups_x` columns)
    /// per 4 tokens.
    Rows { groups: u32, groups_x: u32 },
    /// The same over the rows whose logits are wanted.
    HeadRows { groups: u32, groups_x: u32 },
    /// `n` per token per attention split.
    Splits(u32),
    /// `heads` per block of `block` tokens, per split of the positions.
    QueryTiles { heads: u32, block: u32 },
    /// `n` per token.
    PerToken(u32),
    /// 64 columns of 4 per workgroup, per token.
    Columns(u32),
    /// Tiles of `tile` tokens (x) by `tile` of `rows` rows (y).
    Tiles { rows: u32, tile: u32 },
    /// A grid that does not depend on the step.
    Fixed(u32, u32),
}

/// One kernel launch of a step.
pub struct Op {
    pub kernel: Arc<Kernel>,
    pub params: [u32; 16],
    pub binds: Vec<(u32, Buf)>,
    pub grid: Grid,
    pub when: When,
}

/// Which steps launch an op.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum When {
    Always,
    /// Steps that run the tiled GEMM (from `GEMM_MIN_TOKENS` tokens): the RoPE and KV store
    /// that the matvec's rope build does itself.
    Gemm,
    /// Steps that run the matvec (below `GEMM_MIN_TOKENS` tokens): the q|k|v launch of two
    /// formats, which has no GEMM build.
    Matvec,
    /// Steps that run the decode attention (see `model::prefill_attention_wanted`).
    Decode,
    /// Steps that run the decode attention with more than one split (the combine).
    Splits,
    /// Steps that run the prefill attention.
    Prefill,
    /// Steps that run the prefill attention with more than one split (the combine).
    PrefillSplits,
    /// Steps that run the prefill attention and the split GEMM's passes (the coopmat2
    /// attention writing the o projection's f16 inputs).
    SplitPrefill,
    /// Steps that run the prefill attention but not the passes.
    UnsplitPrefill,
    /// Steps that run the passes and the decode attention (the o projection's prep, where
    /// the prefill attention writes its inputs on the others).
    SplitDecode,
    /// Steps that run the split GEMM's passes (from `split_gemm::MIN_TOKENS` tokens).
    Split,
    /// `Always`, except where the split GEMM runs instead.
    Unsplit,
    /// `Gemm`, except where the split GEMM runs instead.
    GemmUnsplit,
}

impl When {
    /// Whether the op is a prefill attention's (the plan has one where any op is).
    pub fn is_prefill_attention(self) -> bool {
        matches!(self, When::Prefill | When::SplitPrefill | When::UnsplitPrefill)
    }

    /// Whether a step of `t` tokens launches the op (`prefill`: it runs the prefill attention;
    /// `splits`: the decode attention's splits).
    pub fn runs(self, t: u32, prefill: bool, splits: u32) -> bool {
        use crate::kernels::GEMM_MIN_TOKENS;
        let split = t >= SPLIT_MIN_TOKENS;
        match self {
            When::Always => true,
            When::Gemm => t >= GEMM_MIN_TOKENS,
            When::Matvec => t < GEMM_MIN_TOKENS,
            When::Decode => !prefill,
            When::Splits => !prefill && splits > 1,
            When::Prefill => prefill,
            When::PrefillSplits => prefill && splits > 1,
            When::SplitPrefill => split && prefill,
            When::UnsplitPrefill => !split && prefill,
            When::SplitDecode => split && !prefill,
            When::Split => split,
            When::Unsplit => !split,
            When::GemmUnsplit => t >= GEMM_MIN_TOKENS && !split,
        }
    }
}

/// Static sizes every step shares.
#[derive(Clone, Copy)]
pub struct Dims {
    pub hidden: usize,
    pub q_dim: usize,
    pub kv_dim: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub qkv: usize,
    pub inter: usize,
    pub vocab: usize,
    pub layers: usize,
    pub kv_f16: bool,
    /// Rotated pairs of the widest RoPE (the cos/sin table's row).
    pub max_half: usize,
    pub ropes: usize,
    /// The split GEMM's scratch (split_gemm.rs), zero where no launch takes it.
    pub split: Scratch,
}

/// Tokens from which a step runs the split GEMM's passes (split_gemm.rs): a tile of the
/// cooperative GEMM.
pub const SPLIT_MIN_TOKENS: u32 = 128;

/// Sizes of the passes' scratch buffers (`Buf::Half`, `Buf::WHalf`, `Buf::Acc`), the most
/// any launch takes: f16 input columns per token, f16 weights, f32 sums per token.
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct Scratch {
    pub cols: usize,
    pub weights: usize,
    pub acc: usize,
}
