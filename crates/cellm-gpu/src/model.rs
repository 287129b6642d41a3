//! The llama-like families and Gemma 3 on the GPU: their weights on the device, and the
//! list of kernel launches one step makes (`Op`), built once. A step writes the step buffer
//! (token ids, positions, page tables, cos/sin), records every launch into one command
//! encoder, submits once, and reads back only the logits.

use std::sync::{Arc, Mutex};

use cellm_format::{CellmFile, Error, Result};
use cellm_kv::{KvEncoding, PagePool, SeqState};
use cellm_models::blocks::{ATTENTION_NAMES, MLP_NAMES};
use cellm_models::{
    Activation, CacheLayout, CausalLm, ForwardError, LayerType, ModelConfig, RopeConfig, Step,
    Weights,
};

use crate::attn_prefill;
use crate::device::Gpu;
use crate::kernels::{KernelId, Kernels, ROWS_PER_GROUP};
use crate::ops::{Buf, Dims, Grid, Op, When, BIAS, GELU, NORM, RESIDUAL, SOFTCAP};
use crate::profile::{Profile, Span, Stamps};
use crate::split_gemm::{self, Gemm as SplitGemm, Scratch};
use crate::step::{Attention, HostStep, StepBuffers, Token};
use crate::weights::{as_bytes, Matrix, Uploader};
use crate::GpuOptions;

/// The families this backend runs; every other architecture stays on the CPU.
pub const GPU_ARCHITECTURES: &[&str] = &["llama", "gemma3"];
/// The widest attention head the attention kernel holds.
const MAX_HEAD_DIM: usize = 256;

/// Matvec flags (`shaders/linear.wgsl`; the epilogue's in `ops`).
const HEAD: u32 = 16;
const ROPE: u32 = 64;
const MAX_GROUPS: usize = 65535;
/// Whether the decode attention merges its splits itself (`KernelId::AttentionFused`): one
/// launch fewer per layer (docs/benchmarks.md, "Decode: d16, the attention's own combine,
/// attention loads").
pub const ATTN_FUSE_DEFAULT: bool = true;

pub struct GpuModel {
    cfg: ModelConfig,
    layout: CacheLayout,
    runner: Mutex<Runner>,
}

pub struct Runner {
    pub gpu: Gpu,
    pub dims: Dims,
    pub ops: Vec<Op>,
    pub ropes: Vec<RopeConfig>,
    pub bufs: StepBuffers,
    /// CELLM_GPU_PROFILE (see `profile`).
    profile: Option<Profile>,
    /// The next decode step's launches, recorded ahead (see `Ahead`).
    ahead: Option<Ahead>,
    /// Whether to record ahead (CELLM_GPU_NO_AHEAD=1 turns it off, for comparison).
    prerecord: bool,
    /// Whether long steps go to the queue in parts as they are recorded (`Runner::record`;
    /// CELLM_GPU_EARLY_SUBMIT=0 turns it off, for comparison).
    submit_early: bool,
    /// Whether the plan has the prefill attention (its head dim has a tile that fits).
    has_prefill: bool,
    /// Whether its kernel splits the positions (the cooperative one; then a combine runs).
    prefill_splits: bool,
}

/// Refuses what this backend does not run yet, naming it.
fn check_supported(cfg: &ModelConfig) -> Result<()> {
    let cpu_only = |what: String| {
        Err(Error::Unsupported(format!("{what} runs on the CPU only for now (use backend='cpu')")))
    };
    if !GPU_ARCHITECTURES.contains(&cfg.architecture.as_str()) {
        return cpu_only(format!(
            "architecture '{}' (the GPU runs {})",
            cfg.architecture,
            GPU_ARCHITECTURES.join(", ")
        ));
    }
    if cfg.attn_output_gate || cfg.mlp_bias {
        return cpu_only("a gated attention output or an MLP bias".into());
    }
    if cfg.head_dim > MAX_HEAD_DIM || !cfg.head_dim.is_multiple_of(2) {
        return cpu_only(format!("head_dim {} (the GPU takes even sizes to 256)", cfg.head_dim));
    }
    if !cfg.hidden_size.is_multiple_of(4) || !cfg.intermediate_size.is_multiple_of(4) {
        return cpu_only("a hidden or intermediate size that is not a multiple of 4".into());
    }
    if !cfg.num_heads.is_multiple_of(cfg.num_kv_heads) {
        return cpu_only("query heads that do not share KV heads evenly".into());
    }
    Ok(())
}

struct Layer {
    input_norm: wgpu::Buffer,
    /// q|k|v stacked (one matrix) or apart (differing formats), with their joint bias.
    qkv: Vec<Matrix>,
    qkv_bias: Option<wgpu::Buffer>,
    q_norm: Option<wgpu::Buffer>,
    k_norm: Option<wgpu::Buffer>,
    o: Matrix,
    o_bias: Option<wgpu::Buffer>,
    /// Llama: the MLP's input norm. Gemma: the norm after attention.
    post_attn_norm: wgpu::Buffer,
    /// Gemma's norms before and after the MLP.
    pre_mlp_norm: Option<wgpu::Buffer>,
    post_mlp_norm: Option<wgpu::Buffer>,
    gate: Matrix,
    up: Matrix,
    down: Matrix,
    rope: Option<usize>,
    window: Option<usize>,
}

pub fn load(file: &CellmFile, opts: &GpuOptions) -> Result<Box<dyn CausalLm>> {
    let page_size = opts.page_size;
    let cfg = ModelConfig::from_json(&file.header().model)?;
    check_supported(&cfg)?;
    if !matches!(opts.kv_encoding, KvEncoding::F16 | KvEncoding::F32) {
        return Err(Error::Unsupported(format!(
            "kv_encoding {:?} runs on the CPU only; the GPU keeps f16 or f32 pages",
            opts.kv_encoding
        )));
    }
    let gpu = Gpu::open(opts.kind)?;
    let max_binding = opts.max_binding.unwrap_or(u64::MAX).min(gpu.max_binding());
    let w = Weights::from_file(file);
    let mut up = Uploader::new(&gpu, max_binding);
    let gemma = cfg.architecture == "gemma3";
    let (h, hd) = (cfg.hidden_size, cfg.head_dim);
    let embed =
        Arc::new(up.matrix(&[&w.tensor("model.embed_tokens.weight", &[cfg.vocab_size, h])?])?);
    let mut ropes: Vec<RopeConfig> = vec![cfg.rope.clone()];
    if let (true, Some(local)) = (gemma, &cfg.rope_local) {
        ropes.push(local.clone());
    }
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for i in 0..cfg.num_layers {
        let p = format!("model.layers.{i}");
        let norm = |n: &str| w.vector(&format!("{p}.{n}.weight"), h);
        let a = format!("{p}.self_attn");
        let [qn, kn, vn, on, qnn, knn] = ATTENTION_NAMES;
        let (q_out, kv_out) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
        let lin =
            |n: &str, rows: usize, cols: usize| w.tensor(&format!("{a}.{n}.weight"), &[rows, cols]);
        let (q, k, v) = (lin(qn, q_out, h)?, lin(kn, kv_out, h)?, lin(vn, kv_out, h)?);
        let qkv_bias = if cfg.attention_bias {
            let b = |n: &str, len| w.vector(&format!("{a}.{n}.bias"), len);
            Some(up.vectors("qkv.bias", &[&b(qn, q_out)?, &b(kn, kv_out)?, &b(vn, kv_out)?])?)
        } else {
            None
        };
        let qkv = match up.matrix(&[&q, &k, &v]) {
            Ok(m) => vec![m],
            // Mixed formats (Q4_K_M files often keep v in q6_k): q|k stacked where they
            // share one, v apart.
            Err(Error::Unsupported(_)) if q.format != v.format || q.format != k.format => {
                match up.matrix(&[&q, &k]) {
                    Ok(qk) => vec![qk, up.matrix(&[&v])?],
                    Err(Error::Unsupported(_)) => {
                        vec![up.matrix(&[&q])?, up.matrix(&[&k])?, up.matrix(&[&v])?]
                    }
                    Err(e) => return Err(e),
                }
            }
            Err(e) => return Err(e),
        };
        let (q_norm, k_norm) = match cfg.qk_norm {
            true => (
                Some(up.vector(&w.vector(&format!("{a}.{qnn}.weight"), hd)?)?),
                Some(up.vector(&w.vector(&format!("{a}.{knn}.weight"), hd)?)?),
            ),
            false => (None, None),
        };
        let o = up.matrix(&[&lin(on, h, q_out)?])?;
        let o_bias = match cfg.attention_out_bias {
            true => Some(up.vector(&w.vector(&format!("{a}.{on}.bias"), h)?)?),
            false => None,
        };
        let input_norm = up.vector(&norm("input_layernorm")?)?;
        let post_attn_norm = up.vector(&norm("post_attention_layernorm")?)?;
        let (pre_mlp_norm, post_mlp_norm) = match gemma {
            true => (
                Some(up.vector(&norm("pre_feedforward_layernorm")?)?),
                Some(up.vector(&norm("post_feedforward_layernorm")?)?),
            ),
            false => (None, None),
        };
        let m = format!("{p}.mlp");
        let [gn, un, dn] = MLP_NAMES;
        let inter = cfg.intermediate_size;
        let mat = |n: &str, rows, cols| w.tensor(&format!("{m}.{n}.weight"), &[rows, cols]);
        let gate = up.matrix(&[&mat(gn, inter, h)?])?;
        let upm = up.matrix(&[&mat(un, inter, h)?])?;
        if gate.layout != upm.layout {
            return Err(Error::Unsupported(format!(
                "{m}: gate and up stored in different formats run on the CPU only for now"
            )));
        }
        let down = up.matrix(&[&mat(dn, h, inter)?])?;
        let sliding = cfg.layer_type(i) == LayerType::SlidingAttention;
        let rope = match (gemma, cfg.layer_uses_rope(i)) {
            (true, _) => Some(if sliding && ropes.len() > 1 { 1 } else { 0 }),
            (false, true) => Some(0),
            (false, false) => None,
        };
        layers.push(Layer {
            input_norm,
            qkv,
            qkv_bias,
            q_norm,
            k_norm,
            o,
            o_bias,
            post_attn_norm,
            pre_mlp_norm,
            post_mlp_norm,
            gate,
            up: upm,
            down,
            rope,
            window: cfg.window(i),
        });
    }
    let final_norm = up.vector(&w.vector("model.norm.weight", h)?)?;
    let head = match cfg.tie_word_embeddings {
        true => embed.clone(),
        false => Arc::new(up.matrix(&[&w.tensor("lm_head.weight", &[cfg.vocab_size, h])?])?),
    };
    gpu.wait()?;
    let dims = Dims {
        hidden: h,
        q_dim: cfg.num_heads * hd,
        kv_dim: cfg.num_kv_heads * hd,
        heads: cfg.num_heads,
        head_dim: hd,
        qkv: (cfg.num_heads + 2 * cfg.num_kv_heads) * hd,
        inter: cfg.intermediate_size,
        vocab: cfg.vocab_size,
        layers: cfg.num_layers,
        kv_f16: opts.kv_encoding == KvEncoding::F16,
        max_half: ropes.iter().map(|r| r.inv_freq.len()).max().unwrap_or(0),
        ropes: ropes.len(),
        split: Scratch::default(),
    };
    let mut kernels = Kernels::new(&gpu);
    let mut split =
        SplitPlan { gemm: SplitGemm::for_device(&gpu), max_binding, scratch: Scratch::default() };
    let ops = plan(
        &gpu,
        &mut kernels,
        &mut split,
        &cfg,
        &dims,
        &embed,
        &layers,
        &final_norm,
        &head,
        page_size,
    )?;
    let dims = Dims { split: split.scratch, ..dims };
    let bufs = StepBuffers::new(&gpu, &dims, page_size, &ops)?;
    let layout = CacheLayout {
        kv_layers: cfg.num_layers,
        kv_heads: cfg.num_kv_heads,
        head_dim: hd,
        windows: (0..cfg.num_layers).map(|i| cfg.window(i)).collect(),
        state: Vec::new(),
        values_in_keys: false,
        state_fixed: false,
    };
    gpu.check()?;
    if std::env::var_os("CELLM_GPU_INFO").is_some() {
        // For benchmarks: what runs where, and how many launches one step records.
        let gemm = match gpu.coopmat {
            true => {
                let (g, m) =
                    (crate::kernels::CoopTile::get(true), crate::kernels::CoopTile::get(false));
                format!(
                    "cooperative matrices (f16 in, f32 sums), tiles {}x{} (GLU) and {}x{}",
                    g.rows(),
                    g.tokens(),
                    m.rows(),
                    m.tokens()
                )
            }
            false => "f32".to_string(),
        };
        let passes = ops.iter().filter(|o| o.when == When::Split).count();
        let gemm = match split.gemm {
            Some(g) if passes > 0 => format!(
                "{gemm}; from {} tokens in passes ({passes} launches) through {}",
                split_gemm::MIN_TOKENS,
                match g {
                    SplitGemm::Coopmat2 =>
                        "NVIDIA's cooperative matrices (VK_NV_cooperative_matrix2)",
                    SplitGemm::Wgsl => "the WGSL f16 GEMM",
                }
            ),
            _ => gemm,
        };
        let attention = ops
            .iter()
            .find(|o| o.when.is_prefill_attention())
            .map_or_else(|| "the decode kernel".to_string(), |o| o.kernel.name.clone());
        eprintln!(
            "cellm-gpu: {} ({:?}, {:?}), {} dispatches per one-token step ({} more with \
             several attention splits; {} planned in all), one submit per step \
             (subgroups {}, parameters as {}), prefill GEMM: {gemm}; prefill attention: \
             {attention}",
            gpu.info.name,
            gpu.info.backend,
            gpu.info.device_type,
            ops.iter().filter(|o| o.when.runs(1, false, 1)).count(),
            ops.iter().filter(|o| o.when == When::Splits).count(),
            ops.len(),
            gpu.subgroups,
            if gpu.immediates { "immediates" } else { "a uniform buffer" }
        );
    }
    let profile = Profile::from_env(&gpu, ops.len());
    let prerecord = std::env::var_os("CELLM_GPU_NO_AHEAD").is_none();
    let submit_early = !std::env::var("CELLM_GPU_EARLY_SUBMIT").is_ok_and(|v| v == "0");
    let has_prefill = ops.iter().any(|op| op.when.is_prefill_attention());
    let prefill_splits = ops.iter().any(|op| op.when == When::PrefillSplits);
    let runner = Runner {
        gpu,
        dims,
        ops,
        ropes,
        bufs,
        profile,
        ahead: None,
        prerecord,
        submit_early,
        has_prefill,
        prefill_splits,
    };
    Ok(Box::new(GpuModel { cfg, layout, runner: Mutex::new(runner) }))
}

/// The split GEMM's planning (`split_gemm`): its GEMM (none: the fused kernels only), the
/// largest binding, and the scratch its passes take so far.
struct SplitPlan {
    gemm: Option<SplitGemm>,
    max_binding: u64,
    scratch: Scratch,
}

impl SplitPlan {
    /// The GEMM for `mats` (one matrix or the GLU's pair) of `cols` columns where they take
    /// the passes.
    fn takes(&self, mats: &[&Matrix], cols: usize) -> Option<SplitGemm> {
        self.gemm.filter(|g| g.takes(mats[0], cols, mats.len(), self.max_binding))
    }
}

/// The params of one matvec launch over one part.
#[derive(Clone, Copy)]
pub(crate) struct MatvecArgs {
    pub rows: usize,
    pub cols: usize,
    pub x_stride: usize,
    pub y_stride: usize,
    pub y_col: usize,
    pub row0: usize,
    pub flags: u32,
    pub eps: f32,
    pub scale: f32,
    pub softcap: f32,
}

/// The params of a matvec launch, its workgroups (row groups) and their grid's width.
pub(crate) fn matvec_params(a: &MatvecArgs) -> ([u32; 16], u32, u32) {
    let groups = a.rows.div_ceil(ROWS_PER_GROUP);
    let groups_x = groups.min(MAX_GROUPS) as u32;
    let mut p = [0u32; 16];
    p[..8].copy_from_slice(&[
        a.rows as u32,
        a.cols as u32,
        a.x_stride as u32,
        a.y_stride as u32,
        a.y_col as u32,
        a.row0 as u32,
        a.flags,
        groups_x,
    ]);
    p[8] = a.eps.to_bits();
    p[9] = a.scale.to_bits();
    p[10] = a.softcap.to_bits();
    (p, groups_x, groups as u32)
}

/// Launches of a matrix (each of its parts) over `x` into `y`; `offset` is the matrix's first
/// row among the rows it is stacked with (q, k, v apart).
#[allow(clippy::too_many_arguments)]
fn matvec_ops(
    gpu: &Gpu,
    kernels: &mut Kernels,
    split: &mut SplitPlan,
    m: &Matrix,
    offset: usize,
    (x, y): (Buf, Buf),
    gamma: Option<&wgpu::Buffer>,
    bias: Option<&wgpu::Buffer>,
    args: MatvecArgs,
    rope: Option<[u32; 5]>,
    when: When,
    handoff: split_gemm::Handoff,
    ops: &mut Vec<Op>,
) {
    let id = match rope {
        Some(_) => KernelId::MatvecRope(m.layout),
        None => KernelId::Matvec(m.layout),
    };
    let kernel = kernels.get(&gpu.device, id);
    // Prefill in passes where the matrix takes them (never the logits' rows).
    let passes = split.takes(&[m], args.cols).filter(|_| args.flags & HEAD == 0);
    let flags =
        args.flags | if gamma.is_some() { NORM } else { 0 } | if bias.is_some() { BIAS } else { 0 };
    if let Some(gemm) = passes {
        let (params, _, _) =
            matvec_params(&MatvecArgs { rows: m.rows, row0: offset, flags, ..args });
        let lin = split_gemm::Linear {
            mats: &[m],
            input: x.clone(),
            gamma,
            bias,
            out: y.clone(),
            params,
            handoff,
        };
        split_gemm::push(gemm, kernels, &gpu.device, lin, &mut split.scratch, ops);
    }
    let when = if passes.is_some() { split_gemm::below(when) } else { when };
    for part in &m.parts {
        let (mut params, groups_x, groups) = matvec_params(&MatvecArgs {
            rows: part.rows,
            row0: offset + part.row0,
            flags: flags | if rope.is_some() { ROPE } else { 0 },
            ..args
        });
        let mut binds = vec![
            (1, x.clone()),
            (2, y.clone()),
            (3, gamma.map_or(Buf::Dummy, |g| Buf::W(g.clone()))),
            (4, bias.map_or(Buf::Dummy, |b| Buf::W(b.clone()))),
            (5, Buf::W(part.quants.clone())),
        ];
        if let Some(s) = &part.scales {
            binds.push((6, Buf::W(s.clone())));
        }
        if let Some(words) = rope {
            params[11..16].copy_from_slice(&words);
            binds.extend([(10, Buf::Rope), (11, Buf::Pool)]);
        }
        let grid = match args.flags & HEAD {
            0 => Grid::Rows { groups, groups_x },
            _ => Grid::HeadRows { groups, groups_x },
        };
        ops.push(Op { kernel: kernel.clone(), params, binds, grid, when });
    }
}

/// The one launch of a q|k|v matvec stored as two matrices of different formats (q|k, then
/// v), with RoPE and the KV store: the one-token and few-token steps' (prefill runs each
/// matrix's GEMM and RopeKv).
fn qkv_two_formats(
    gpu: &Gpu,
    kernels: &mut Kernels,
    l: &Layer,
    args: MatvecArgs,
    rope: [u32; 5],
) -> Op {
    let (a, b) = (&l.qkv[0].parts[0], &l.qkv[1].parts[0]);
    let kernel = kernels.get(&gpu.device, KernelId::MatvecRope2(l.qkv[0].layout, l.qkv[1].layout));
    let (mut params, groups_x, groups) = matvec_params(&MatvecArgs {
        rows: l.qkv[0].rows + l.qkv[1].rows,
        row0: 0,
        flags: args.flags | NORM | ROPE | if l.qkv_bias.is_some() { BIAS } else { 0 },
        ..args
    });
    params[11..16].copy_from_slice(&rope);
    let mut binds = vec![
        (1, Buf::X),
        (2, Buf::Qkv),
        (3, Buf::W(l.input_norm.clone())),
        (4, l.qkv_bias.clone().map_or(Buf::Dummy, Buf::W)),
        (5, Buf::W(a.quants.clone())),
        (8, Buf::W(b.quants.clone())),
        (10, Buf::Rope),
        (11, Buf::Pool),
    ];
    if let Some(s) = &a.scales {
        binds.push((6, Buf::W(s.clone())));
    }
    if let Some(s) = &b.scales {
        binds.push((9, Buf::W(s.clone())));
    }
    Op { kernel, params, binds, grid: Grid::Rows { groups, groups_x }, when: When::Matvec }
}

#[allow(clippy::too_many_arguments)]
fn plan(
    gpu: &Gpu,
    kernels: &mut Kernels,
    split: &mut SplitPlan,
    cfg: &ModelConfig,
    d: &Dims,
    embed: &Matrix,
    layers: &[Layer],
    final_norm: &wgpu::Buffer,
    head: &Matrix,
    page_size: usize,
) -> Result<Vec<Op>> {
    let mut ops = Vec::new();
    let eps = cfg.norm_eps;
    let gemma = cfg.architecture == "gemma3";
    let res = cfg.residual_multiplier;
    // CELLM_GPU_NO_FUSE=1: RoPE and the KV store in their own launch (for comparison).
    let fuse_rope = std::env::var_os("CELLM_GPU_NO_FUSE").is_none();
    // The attention's last split merges the splits (`AttentionFused`) instead of a combine
    // launch: CELLM_GPU_ATTN_FUSE=1 / =0 (for measuring).
    let fuse_combine = match std::env::var("CELLM_GPU_ATTN_FUSE").ok() {
        Some(v) => v != "0",
        None => ATTN_FUSE_DEFAULT,
    };
    let kernel = kernels.get(&gpu.device, KernelId::Embed(embed.layout));
    for part in &embed.parts {
        let mut params = [0u32; 16];
        params[..4].copy_from_slice(&[
            part.rows as u32,
            d.hidden as u32,
            part.row0 as u32,
            cfg.embedding_multiplier.to_bits(),
        ]);
        let mut binds = vec![(2, Buf::X), (5, Buf::W(part.quants.clone()))];
        if let Some(s) = &part.scales {
            binds.push((6, Buf::W(s.clone())));
        }
        ops.push(Op {
            kernel: kernel.clone(),
            params,
            binds,
            grid: Grid::Columns((d.hidden / 4) as u32),
            when: When::Always,
        });
    }
    let kv_words = [page_size as u32, d.kv_dim as u32, d.kv_f16 as u32, 0];
    let base = MatvecArgs {
        rows: 0,
        cols: d.hidden,
        x_stride: d.hidden,
        y_stride: d.hidden,
        y_col: 0,
        row0: 0,
        flags: 0,
        eps,
        scale: 1.0,
        softcap: 0.0,
    };
    for (i, l) in layers.iter().enumerate() {
        // q|k|v = W (rmsnorm(x) * g) + b. Without per-head norms and with RoPE over whole
        // heads, the matvec's one-token builds rotate q and k and store k and v in the pool
        // themselves (prefill's GEMM leaves that to RopeKv).
        let half = l.rope.map_or(0, |r| match r {
            0 => cfg.rope.inv_freq.len(),
            _ => cfg.rope_local.as_ref().map_or(0, |r| r.inv_freq.len()),
        });
        let fused = fuse_rope
            && l.rope.is_some()
            && l.q_norm.is_none()
            && cfg.head_dim.is_multiple_of(4)
            && 2 * half == cfg.head_dim
            && l.qkv.iter().all(|m| m.parts.len() == 1);
        let rope_words = fused.then(|| {
            [
                d.q_dim as u32,
                d.kv_dim as u32,
                cfg.head_dim as u32,
                i as u32,
                page_size as u32 | u32::from(d.kv_f16) << 16 | (l.rope.unwrap_or(0) as u32) << 17,
            ]
        });
        // q|k and v in two formats (Q4_K_M's q6_k v): one launch for both where fused.
        let two = rope_words.filter(|_| {
            l.qkv.len() == 2 && l.qkv[0].layout != l.qkv[1].layout && d.hidden.is_multiple_of(8)
        });
        let qkv_args = MatvecArgs { y_stride: d.qkv, ..base };
        if let Some(words) = two {
            ops.push(qkv_two_formats(gpu, kernels, l, qkv_args, words));
        }
        let mut offset = 0;
        for m in &l.qkv {
            matvec_ops(
                gpu,
                kernels,
                split,
                m,
                offset,
                (Buf::X, Buf::Qkv),
                Some(&l.input_norm),
                l.qkv_bias.as_ref(),
                qkv_args,
                if two.is_some() { None } else { rope_words },
                if two.is_some() { When::Gemm } else { When::Always },
                split_gemm::Handoff::default(),
                &mut ops,
            );
            offset += m.rows;
        }
        // Per-head norms, RoPE, and the new keys and values into the pool.
        let mut p = [0u32; 16];
        p[..4].copy_from_slice(&kv_words);
        p[4..12].copy_from_slice(&[
            cfg.num_heads as u32,
            cfg.num_kv_heads as u32,
            cfg.head_dim as u32,
            half as u32,
            d.qkv as u32,
            i as u32,
            u32::from(l.q_norm.is_some()),
            eps.to_bits(),
        ]);
        p[12] = l.rope.unwrap_or(0) as u32;
        ops.push(Op {
            kernel: kernels.get(&gpu.device, KernelId::RopeKv),
            params: p,
            binds: vec![
                (1, Buf::Qkv),
                (2, l.q_norm.clone().map_or(Buf::Dummy, Buf::W)),
                (3, l.k_norm.clone().map_or(Buf::Dummy, Buf::W)),
                (4, Buf::Rope),
                (5, Buf::Pool),
            ],
            grid: Grid::PerToken((cfg.num_heads + cfg.num_kv_heads) as u32),
            when: if fused { When::Gemm } else { When::Always },
        });
        let mut p = [0u32; 16];
        p[..4].copy_from_slice(&kv_words);
        p[4..12].copy_from_slice(&[
            cfg.num_heads as u32,
            cfg.num_kv_heads as u32,
            cfg.head_dim as u32,
            d.qkv as u32,
            i as u32,
            l.window.unwrap_or(0) as u32,
            cfg.attention_scale().to_bits(),
            cfg.attn_logit_softcap.unwrap_or(0.0).to_bits(),
        ]);
        // Where the o projection takes the coopmat2 passes, the coopmat2 prefill attention
        // writes its f16 inputs and its prep runs only after the decode attention.
        let o_half = split.takes(&[&l.o], d.q_dim) == Some(SplitGemm::Coopmat2)
            && !std::env::var("CELLM_GPU_ATTN_HALF").is_ok_and(|v| v == "0");
        let mut o_input = split_gemm::HalfInput::Prep;
        if let Some(attn) =
            prefill_attention_op(gpu, kernels, cfg.head_dim, cfg.num_heads, p, o_half)
        {
            if attn.half {
                o_input = split_gemm::HalfInput::Attention;
            }
            ops.extend(attn.ops);
            if attn.splits {
                ops.push(combine_op(kernels, &gpu.device, cfg, When::PrefillSplits));
            }
        }
        let mut binds =
            vec![(1, Buf::Qkv), (2, Buf::Part), (3, Buf::Ctx), (5, Buf::Pool), (6, Buf::Pool)];
        if fuse_combine {
            binds.push((4, Buf::Done));
        }
        ops.push(Op {
            kernel: kernels.get(
                &gpu.device,
                if fuse_combine { KernelId::AttentionFused } else { KernelId::Attention },
            ),
            params: p,
            binds,
            grid: Grid::Splits(cfg.num_heads as u32),
            when: When::Decode,
        });
        if !fuse_combine {
            ops.push(combine_op(kernels, &gpu.device, cfg, When::Splits));
        }
        // x += o(ctx); Gemma writes o(ctx) aside and adds it through its post-attention norm.
        let o_args = MatvecArgs { cols: d.q_dim, x_stride: d.q_dim, ..base };
        let (out, args) = match gemma {
            true => (Buf::Tmp, o_args),
            false => (Buf::X, MatvecArgs { flags: RESIDUAL, scale: res, ..o_args }),
        };
        let o_bias = l.o_bias.as_ref();
        let always = When::Always;
        matvec_ops(
            gpu,
            kernels,
            split,
            &l.o,
            0,
            (Buf::Ctx, out),
            None,
            o_bias,
            args,
            None,
            always,
            split_gemm::Handoff { input: o_input, output_half: false },
            &mut ops,
        );
        if gemma {
            ops.push(norm_add(gpu, kernels, d, &l.post_attn_norm, eps, res));
        }
        // act = act(gate(n)) * up(n), n the normed x.
        let mlp_norm = l.pre_mlp_norm.as_ref().unwrap_or(&l.post_attn_norm);
        let glu = kernels.get(&gpu.device, KernelId::Glu(l.gate.layout));
        let gelu = if cfg.hidden_act == Activation::GeluTanh { GELU } else { 0 };
        let glu_args = MatvecArgs { y_stride: d.inter, flags: NORM | gelu, ..base };
        let passes = split.takes(&[&l.gate, &l.up], glu_args.cols);
        // Where the down projection takes the passes too, the GLU's epilogue writes its
        // f16 inputs and its prep is skipped (with the wider prep, pp512 1.03-1.04x on the
        // H200's 1B and 3B F16 shapes; CELLM_GPU_HANDOFF=0: not, for comparison).
        let half = passes.is_some()
            && split.takes(&[&l.down], d.inter).is_some()
            && !std::env::var("CELLM_GPU_HANDOFF").is_ok_and(|v| v == "0");
        let down_input = match (half, passes) {
            (true, Some(gemm)) if gemm.fuses_glu() => split_gemm::HalfInput::Act,
            (true, _) => split_gemm::HalfInput::Half,
            (false, _) => split_gemm::HalfInput::Prep,
        };
        let down_handoff = split_gemm::Handoff { input: down_input, output_half: false };
        if let Some(gemm) = passes {
            let (params, _, _) = matvec_params(&MatvecArgs { rows: l.gate.rows, ..glu_args });
            let lin = split_gemm::Linear {
                mats: &[&l.gate, &l.up],
                input: Buf::X,
                gamma: Some(mlp_norm),
                bias: None,
                out: Buf::Act,
                params,
                handoff: split_gemm::Handoff {
                    input: split_gemm::HalfInput::Prep,
                    output_half: half,
                },
            };
            split_gemm::push(gemm, kernels, &gpu.device, lin, &mut split.scratch, &mut ops);
        }
        for (g, u) in l.gate.parts.iter().zip(&l.up.parts) {
            let (params, groups_x, groups) =
                matvec_params(&MatvecArgs { rows: g.rows, row0: g.row0, ..glu_args });
            let mut binds = vec![
                (1, Buf::X),
                (2, Buf::Act),
                (3, Buf::W(mlp_norm.clone())),
                (4, Buf::Dummy),
                (5, Buf::W(g.quants.clone())),
                (8, Buf::W(u.quants.clone())),
            ];
            if let (Some(gs), Some(us)) = (&g.scales, &u.scales) {
                binds.extend([(6, Buf::W(gs.clone())), (9, Buf::W(us.clone()))]);
            }
            ops.push(Op {
                kernel: glu.clone(),
                params,
                binds,
                grid: Grid::Rows { groups, groups_x },
                when: if passes.is_some() { When::Unsplit } else { When::Always },
            });
        }
        let down_args = MatvecArgs { cols: d.inter, x_stride: d.inter, ..base };
        if let Some(post) = &l.post_mlp_norm {
            matvec_ops(
                gpu,
                kernels,
                split,
                &l.down,
                0,
                (Buf::Act, Buf::Tmp),
                None,
                None,
                down_args,
                None,
                When::Always,
                down_handoff,
                &mut ops,
            );
            ops.push(norm_add(gpu, kernels, d, post, eps, res));
        } else {
            let args = MatvecArgs { flags: RESIDUAL, scale: res, ..down_args };
            matvec_ops(
                gpu,
                kernels,
                split,
                &l.down,
                0,
                (Buf::Act, Buf::X),
                None,
                None,
                args,
                None,
                When::Always,
                down_handoff,
                &mut ops,
            );
        }
    }
    // logits = scale * lm_head(rmsnorm(x) * g), soft-capped, for the wanted rows.
    let (softcap, flag) = match cfg.final_logit_softcap {
        Some(c) => (c, SOFTCAP),
        None => (0.0, 0),
    };
    let args = MatvecArgs {
        y_stride: d.vocab,
        flags: HEAD | flag,
        scale: cfg.logits_scale,
        softcap,
        ..base
    };
    matvec_ops(
        gpu,
        kernels,
        split,
        head,
        0,
        (Buf::X, Buf::Logits),
        Some(final_norm),
        None,
        args,
        None,
        When::Always,
        split_gemm::Handoff::default(),
        &mut ops,
    );
    gpu.check()?;
    Ok(ops)
}

fn norm_add(
    gpu: &Gpu,
    kernels: &mut Kernels,
    d: &Dims,
    gamma: &wgpu::Buffer,
    eps: f32,
    scale: f32,
) -> Op {
    let mut p = [0u32; 16];
    p[..3].copy_from_slice(&[d.hidden as u32, eps.to_bits(), scale.to_bits()]);
    Op {
        kernel: kernels.get(&gpu.device, KernelId::NormAdd),
        params: p,
        binds: vec![(1, Buf::Tmp), (2, Buf::X), (3, Buf::W(gamma.clone()))],
        grid: Grid::PerToken(1),
        when: When::Always,
    }
}

impl CausalLm for GpuModel {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn cache_layout(&self) -> CacheLayout {
        self.layout.clone()
    }

    fn forward(
        &self,
        step: &Step,
        kv: &mut PagePool,
        _states: &mut [&mut SeqState],
    ) -> std::result::Result<Vec<f32>, ForwardError> {
        // One submission runs the whole step, so the cancel hook is asked once, before it.
        if (step.cancel)() {
            return Err(ForwardError::Cancelled);
        }
        if !step.embeds.rows.is_empty() {
            return Err(ForwardError::Failed(Error::Unsupported(
                "given input embeddings run on the CPU only for now".into(),
            )));
        }
        let mut runner = self.runner.lock().unwrap_or_else(|p| p.into_inner());
        runner.run(step, kv).map_err(ForwardError::Failed)
    }
}

/// Steps of at least this many tokens go to the queue in parts of `EARLY_SUBMIT_LAUNCHES`
/// launches as they are recorded (`Runner::record`): recording the Llama-3.2-3B shape's
/// 512-token step took 1.2-2.1 ms of host time before the GPU began.
const EARLY_SUBMIT_TOKENS: u32 = 64;
const EARLY_SUBMIT_LAUNCHES: usize = 64;

/// A command buffer recorded ahead for the step expected next (a decode step: the same
/// tokens and logit rows, one position further), while the GPU runs the current one; used
/// when the step that comes matches its shape and the buffers are the ones it bound.
struct Ahead {
    commands: wgpu::CommandBuffer,
    /// (tokens, logit rows, attention splits, prefill attention, buffer generation, the
    /// span profile's step index).
    key: (u32, u32, u32, bool, u64, Option<u32>),
}

impl Runner {
    /// Records every launch of a chunk of `t` tokens with `r` logit rows and `splits`
    /// attention splits, or the prefill attention where `prefill` (GPU timestamps around
    /// each where `stamps`), then the logits' copy. Where `submit_early` (and nothing is
    /// profiled), every `EARLY_SUBMIT_LAUNCHES` launches go to the queue as soon as they are
    /// recorded, so the GPU starts on a long step while the host records the rest; the
    /// rest is returned.
    #[allow(clippy::too_many_arguments)]
    fn record(
        &self,
        t: u32,
        r: u32,
        splits: u32,
        prefill: bool,
        mut stamps: Option<&mut Stamps>,
        span: Option<(&Span, u32)>,
        submit_early: bool,
    ) -> wgpu::CommandBuffer {
        if let Some(s) = &mut stamps {
            s.clear();
        }
        let submit_early = submit_early && stamps.is_none() && span.is_none();
        let device = &self.gpu.device;
        let mut encoder = device.create_command_encoder(&Default::default());
        {
            let mut pass = encoder
                .begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: None,
                    timestamp_writes: span.map(|(s, k)| s.writes(k)),
                })
                .forget_lifetime();
            let mut launches = 0;
            for (op, group) in self.ops.iter().zip(self.bufs.groups()) {
                if !op.when.runs(t, prefill, splits) {
                    continue;
                }
                if submit_early && launches == EARLY_SUBMIT_LAUNCHES {
                    drop(pass);
                    let done = std::mem::replace(
                        &mut encoder,
                        device.create_command_encoder(&Default::default()),
                    );
                    self.gpu.queue.submit([done.finish()]);
                    pass = encoder.begin_compute_pass(&Default::default()).forget_lifetime();
                    launches = 0;
                }
                launches += 1;
                // Row groups of ROWS_PER_GROUP, over `count` tokens: a tiled GEMM
                // from GEMM_MIN_TOKENS on.
                if let Grid::Rows { groups, .. } | Grid::HeadRows { groups, .. } = op.grid {
                    let count = if matches!(op.grid, Grid::Rows { .. }) { t } else { r };
                    if let Some((gemm, (x, y, z))) = op.kernel.gemm_for(count, op.params[1], groups)
                    {
                        if let Some(s) = &mut stamps {
                            s.launch(&mut pass, op, "-gemm");
                        }
                        pass.set_pipeline(gemm);
                        pass.set_bind_group(0, group, &[]);
                        if op.kernel.immediates {
                            pass.set_immediates(0, as_bytes(&op.params));
                        }
                        pass.dispatch_workgroups(x, y, z);
                        continue;
                    }
                }
                let ((x, y, mut z), count) = match op.grid {
                    Grid::Rows { groups, groups_x } => {
                        ((groups_x, groups.div_ceil(groups_x), t.div_ceil(4)), t)
                    }
                    Grid::HeadRows { groups, groups_x } => {
                        ((groups_x, groups.div_ceil(groups_x), r.div_ceil(4)), r)
                    }
                    Grid::PerToken(n) => ((n, t, 1), t),
                    Grid::Splits(n) => ((n, t, splits), t),
                    Grid::QueryTiles { heads, block } => ((heads, t.div_ceil(block), splits), t),
                    Grid::Columns(c) => ((c.div_ceil(64), t, 1), t),
                    Grid::Tiles { rows, tile } => ((t.div_ceil(tile), rows.div_ceil(tile), 1), t),
                    Grid::Fixed(x, y) => ((x, y, 1), t),
                };
                if x * y * z == 0 {
                    continue;
                }
                if let Some(s) = &mut stamps {
                    s.launch(&mut pass, op, "");
                }
                let (pipeline, split) = op.kernel.for_launch(count, op.params[0], op.params[1]);
                if matches!(op.grid, Grid::Rows { .. } | Grid::HeadRows { .. }) {
                    z *= split;
                }
                pass.set_pipeline(pipeline);
                pass.set_bind_group(0, group, &[]);
                if op.kernel.immediates {
                    pass.set_immediates(0, as_bytes(&op.params));
                }
                pass.dispatch_workgroups(x, y, z);
            }
            if let Some(s) = &stamps {
                s.finish(&mut pass);
            }
        }
        if let Some(s) = stamps {
            s.resolve(&mut encoder);
        }
        if let Some((s, k)) = span {
            s.resolve(&mut encoder, k);
        }
        if r > 0 {
            self.bufs.copy_logits(&mut encoder, r as usize * self.dims.vocab);
        }
        encoder.finish()
    }

    fn run(&mut self, step: &Step, kv: &PagePool) -> Result<Vec<f32>> {
        let mut logits = Vec::with_capacity(step.logit_rows.len() * self.dims.vocab);
        let host = HostStep::new(step, self.dims.layers)?;
        let (max_tokens, max_rows) = self.bufs.max_chunk(&self.gpu, &self.dims);
        let chunks = host.chunks(max_tokens, max_rows);
        let single = chunks.len() == 1;
        for chunk in chunks {
            let now = std::time::Instant::now;
            let mut marks = [now(); 7];
            let rows = chunk.logit_rows.len();
            let need = (chunk.tokens.len(), rows, host.tables.len(), kv.pages_allocated());
            self.bufs.fit(&self.gpu, &self.dims, &self.ops, need)?;
            // Prefill attention where the model has it and the chunk's sessions bring many
            // tokens each (else the decode attention and its combine).
            let prefill = self.has_prefill && prefill_attention_wanted(&chunk.tokens);
            let attention = match (prefill, self.prefill_splits) {
                (false, _) => Attention::Decode,
                (true, false) => Attention::Prefill,
                (true, true) => Attention::PrefillSplit,
            };
            let splits = self.bufs.write(&self.gpu, &chunk, &host, &self.ropes, attention);
            marks[1] = now();
            let (t, r) = (chunk.tokens.len() as u32, rows as u32);
            let stamped = self.profile.as_ref().is_some_and(|p| p.stamps_launches(t));
            // The span profile's window index of this step and of the next (one-token steps).
            let span_steps =
                self.profile.as_ref().filter(|p| p.times(t)).and_then(Profile::span_steps);
            let key = (t, r, splits, prefill, self.bufs.generation(), span_steps.map(|k| k.0));
            let ahead = self.ahead.take().filter(|a| a.key == key && !stamped);
            let commands = match ahead {
                Some(a) => a.commands,
                None => {
                    // The profile is taken out while recording into its timestamps.
                    let mut profile = self.profile.take();
                    let (stamps, span) = match &mut profile {
                        Some(p) => {
                            let span = p.span.as_ref().zip(span_steps.map(|k| k.0));
                            let stamps = p.stamps.as_mut().filter(|_| stamped);
                            (stamps, span)
                        }
                        None => (None, None),
                    };
                    let long = self.submit_early && t >= EARLY_SUBMIT_TOKENS;
                    let c = self.record(t, r, splits, prefill, stamps, span, long);
                    self.profile = profile;
                    c
                }
            };
            marks[2] = now();
            self.gpu.queue.submit([commands]);
            marks[3] = now();
            // A decode-shaped step (every token wants its logits): record the next one's
            // launches while the GPU runs this one (the next step's tokens, positions and
            // page tables go into the step buffer, which no launch's shape depends on).
            if single && t == r && self.prerecord && !stamped {
                let ctx = chunk.tokens.iter().map(|k| k.pos + 2).max().unwrap_or(1);
                let (_, next_splits) = self.bufs.splits(chunk.tokens.len(), ctx);
                // Valid while the buffers stay (a step that grows them rebuilds the groups).
                // The next step has this one's sessions and token counts, so the same
                // attention kernel.
                let next_span = span_steps.map(|k| k.1);
                let key = (t, r, next_splits as u32, prefill, self.bufs.generation(), next_span);
                let span = self.profile.as_ref().and_then(|p| p.span.as_ref()).zip(next_span);
                let commands = self.record(t, r, next_splits as u32, prefill, None, span, false);
                self.ahead = Some(Ahead { commands, key });
            }
            marks[4] = now();
            marks[5] = if rows > 0 {
                self.bufs.read_logits(&self.gpu, rows * self.dims.vocab, &mut logits)?
            } else {
                self.gpu.wait()?;
                now()
            };
            marks[6] = now();
            if let Some(p) = self.profile.as_mut().filter(|p| p.times(t)) {
                p.add(&self.gpu, &marks);
            }
        }
        Ok(logits)
    }
}

/// The launch merging the attention's splits (`attn_combine.wgsl`) on steps `when`.
fn combine_op(kernels: &mut Kernels, device: &wgpu::Device, cfg: &ModelConfig, when: When) -> Op {
    let mut p = [0u32; 16];
    p[..2].copy_from_slice(&[cfg.num_heads as u32, cfg.head_dim as u32]);
    Op {
        kernel: kernels.get(device, KernelId::AttnCombine),
        params: p,
        binds: vec![(1, Buf::Part), (2, Buf::Ctx)],
        grid: Grid::PerToken(cfg.num_heads as u32),
        when,
    }
}

/// The prefill attention's launches of one layer.
struct PrefillAttention {
    ops: Vec<Op>,
    /// Whether it splits the positions (the cooperative kernel: a combine follows it).
    splits: bool,
    /// Whether its steps in passes write the o projection's f16 inputs (`Buf::Half`).
    half: bool,
}

/// The prefill attention (`attn_prefill`) launch of one layer, taking the decode attention's
/// `params`: None where the head dim has no tile or the device lacks the shared memory, and
/// under `CELLM_GPU_NO_PREFILL_ATTN=1` (prefill then runs the decode attention; for
/// measuring). Where `half` is asked and the coopmat2 kernel runs, two builds of it: the f16
/// one on steps in passes, the f32 one on the others.
fn prefill_attention_op(
    gpu: &crate::device::Gpu,
    kernels: &mut Kernels,
    head_dim: usize,
    heads: usize,
    params: [u32; 16],
    half: bool,
) -> Option<PrefillAttention> {
    let hd = head_dim as u32;
    let limit = gpu.limits.max_compute_workgroup_storage_size;
    if std::env::var_os("CELLM_GPU_NO_PREFILL_ATTN").is_some() {
        return None;
    }
    // On NVIDIA's workgroup-scope cooperative matrices, one pass over f16 KV pages of the
    // size it assumes: on an H200 it took 2.55 ms of the 3B F16 shape's pp512 step where the
    // WGSL cooperative kernel took 7.5 (docs/benchmarks.md). CELLM_GPU_ATTN_CM2=0: not.
    let cm2 = gpu.coopmat2_attention
        && crate::nv_coopmat2::attention_fits(hd, limit)
        && params[0] == crate::nv_coopmat2::ATTN_PAGE
        && params[2] != 0
        && !std::env::var("CELLM_GPU_ATTN_CM2").is_ok_and(|v| v == "0");
    // On cooperative matrices where the GEMM runs on them and the head dim fits
    // (`CELLM_GPU_NO_COOP_ATTN=1`: the f32 kernel, for measuring).
    let coop = !cm2
        && kernels.coopmat()
        && attn_prefill::coop_head_dim_ok(hd)
        && attn_prefill::coop_shared_bytes(hd) <= limit
        && std::env::var_os("CELLM_GPU_NO_COOP_ATTN").is_none();
    let (id, block) = if cm2 {
        (KernelId::Coopmat2Attn(hd, false), crate::nv_coopmat2::ATTN_BLOCK)
    } else if coop {
        (KernelId::AttnPrefillCoop(hd), attn_prefill::coop_block())
    } else {
        let tile = attn_prefill::Tile::new(hd)?;
        if tile.shared_bytes(hd) > limit {
            return None;
        }
        (KernelId::AttnPrefill(hd), attn_prefill::BQ)
    };
    let grid = Grid::QueryTiles { heads: heads as u32, block };
    let mut binds = vec![(1, Buf::Qkv), (2, Buf::Ctx), (5, Buf::Pool)];
    if coop {
        binds.push((3, Buf::Part));
    }
    let half = half && cm2;
    let mut ops = vec![Op {
        kernel: kernels.get(&gpu.device, id),
        params,
        binds,
        grid,
        when: if half { When::UnsplitPrefill } else { When::Prefill },
    }];
    if half {
        ops.push(Op {
            kernel: kernels.get(&gpu.device, KernelId::Coopmat2Attn(hd, true)),
            params,
            binds: vec![(1, Buf::Qkv), (2, Buf::Half), (5, Buf::Pool)],
            grid,
            when: When::SplitPrefill,
        });
    }
    Some(PrefillAttention { ops, splits: coop, half })
}

/// Whether a chunk of `tokens` runs the prefill attention: enough tokens per session (a
/// session's tokens are consecutive rows sharing one page-table offset).
fn prefill_attention_wanted(tokens: &[Token]) -> bool {
    let sessions = 1 + tokens.windows(2).filter(|w| w[0].table != w[1].table).count();
    tokens.len() >= attn_prefill::MIN_TOKENS_PER_SESSION * sessions
}
