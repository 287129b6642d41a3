//! Prefill's GEMM in passes, where the device has an f16 GEMM faster than the fused
//! `gemm_coop.wgsl`: NVIDIA's workgroup-scope cooperative matrices (`nv_coopmat2`). A
//! matrix's launch becomes (`shaders/split_gemm.wgsl`):
//! 1. `prep`: the tokens' inputs, normed (times the norm's gamma) where the launch has a
//!    norm, rounded to f16;
//! 2. `dequant`: block formats written out as f16 rows (f16 files are read in place);
//! 3. the GEMM: f16 x f16 into f32 sums (`gemm_cm2.comp`; the GLU's gate and up as one
//!    matrix where they were dequantized together);
//! 4. `epilogue`: linear.wgsl's epilogue and store (bias, GLU, scale, soft-cap, residual)
//!    from the sums. Where the down projection takes the passes too, the GLU's epilogue
//!    writes its output as the down projection's f16 inputs, the same values its prep would
//!    write, and that prep is skipped (`Handoff`); on coopmat2 the GLU's GEMM build does
//!    the products and that epilogue in one launch (`Coopmat2Glu`, into `Buf::Act`). Where
//!    a launch leaves its epilogue nothing but a residual add (q|k|v without a bias; o and
//!    the down projection), the GEMM writes the output itself, its sums started from the
//!    output where they add to it. The coopmat2 prefill attention writes the o projection's
//!    f16 inputs itself on the steps it runs (`HalfInput::Attention`).
//!
//! The sums are the fused kernel's but for where the norm's scale is applied: the fused
//! kernels scale f32 sums of f16(x gamma), the passes sum f16(x gamma / rms(x)) (the same
//! rounding, of the normed value, which stays well inside f16's range); f32 sums either way,
//! in another order. Steps from `MIN_TOKENS` tokens take the passes; fewer keep the fused
//! kernels. `CELLM_GPU_SPLIT=1` runs the passes through the GEMM in WGSL (`gemm` in the same
//! file) on any device, so that tests check every pass but the fast GEMM on lavapipe.

use crate::kernels::{KernelId, Kernels};
use crate::nv_coopmat2;
use crate::ops::{Buf, Grid, Op, When, BIAS, GELU, NORM, RESIDUAL, SOFTCAP};
use crate::repack::Layout;
use crate::weights::Matrix;

pub use crate::ops::{Scratch, SPLIT_MIN_TOKENS as MIN_TOKENS};
/// Rows and tokens of the cooperative GEMM's tile, and the columns of its loads.
pub const TILE: u32 = 128;
const LOAD_COLS: usize = 64;
/// Rows and tokens of the WGSL GEMM's workgroup.
const WGSL_TILE: u32 = 16;

/// The GEMM the passes go through.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Gemm {
    Coopmat2,
    Wgsl,
}

impl Gemm {
    /// The GEMM on this device: NVIDIA's cooperative matrices where it opened with them;
    /// the WGSL one where `CELLM_GPU_SPLIT=1` (tests); else none (the fused kernels).
    /// `CELLM_GPU_SPLIT=0` turns the passes off.
    pub fn for_device(gpu: &crate::device::Gpu) -> Option<Self> {
        match std::env::var("CELLM_GPU_SPLIT").as_deref() {
            Ok("0") => None,
            _ if gpu.coopmat2 => Some(Gemm::Coopmat2),
            Ok("1") => Some(Gemm::Wgsl),
            _ => None,
        }
    }

    /// Whether `count` matrices like `m`, of `cols` columns and uploaded in one part, take
    /// the passes: columns a multiple of the loads, rows of the cooperative GEMM's tile (its
    /// loads are not clamped; the WGSL GEMM's epilogue needs a multiple of 4), and the
    /// dequantized f16 rows (the GLU's two matrices: `count`) within one
    /// binding.
    pub fn takes(self, m: &Matrix, cols: usize, count: usize, max_binding: u64) -> bool {
        // (The epilogue takes 4 rows an invocation, as vec4s of the sums.)
        let tile = if self == Gemm::Wgsl { 4 } else { TILE as usize };
        let rows_ok = m.rows.is_multiple_of(tile);
        m.parts.len() == 1
            && cols.is_multiple_of(LOAD_COLS)
            && rows_ok
            && (count * m.rows * cols * 2) as u64 <= max_binding
    }

    /// Whether the GEMM reads `layout` in place (else `dequant` writes it as f16 first).
    fn reads(self, layout: Layout) -> bool {
        layout == Layout::F16
    }

    /// Whether the GLU, where the down projection takes the passes too, is one launch that
    /// leaves the down projection's f16 inputs in `Buf::Act` (`Coopmat2Glu`: on the H200,
    /// pp512 1.09x on an 8-layer 3B-shaped F16 model and 1.07-1.11x on the 1B and 3B files,
    /// docs/benchmarks.md; `CELLM_GPU_GLU_CM2=0`: the GEMM and the epilogue pass).
    pub fn fuses_glu(self) -> bool {
        self == Gemm::Coopmat2 && !std::env::var("CELLM_GPU_GLU_CM2").is_ok_and(|v| v == "0")
    }

    fn kernel(self, kernels: &mut Kernels, device: &wgpu::Device, cols: usize) -> GemmKernel {
        let (id, tile) = match self {
            Gemm::Coopmat2 => (KernelId::Coopmat2Gemm(nv_coopmat2::unroll(cols as u32)), TILE),
            Gemm::Wgsl => (KernelId::SplitGemm, WGSL_TILE),
        };
        GemmKernel { kernel: kernels.get(device, id), tile }
    }
}

/// A GEMM kernel and its tile.
struct GemmKernel {
    kernel: std::sync::Arc<crate::kernels::Kernel>,
    tile: u32,
}

/// One output's launch in passes: `mats` (one, or the GLU's gate and up) of the same rows,
/// columns and layout over `input` (times `gamma` where normed) into `out`. `params` is the
/// fused launch's (matvec_params: its rows, columns, strides, flags, scale).
pub struct Linear<'a> {
    pub mats: &'a [&'a Matrix],
    pub input: Buf,
    pub gamma: Option<&'a wgpu::Buffer>,
    pub bias: Option<&'a wgpu::Buffer>,
    pub out: Buf,
    pub params: [u32; 16],
    /// How its input and output travel between launches in passes.
    pub handoff: Handoff,
}

/// Where a launch in passes finds its f16 inputs, and whether it leaves its output as the
/// next launch's (the GLU, when the down projection takes the passes too).
#[derive(Clone, Copy, Default, PartialEq, Eq, Debug)]
pub struct Handoff {
    pub input: HalfInput,
    pub output_half: bool,
}

/// Where a launch's f16 inputs come from.
#[derive(Clone, Copy, Default, PartialEq, Eq, Debug)]
pub enum HalfInput {
    /// Its own prep writes them to `Buf::Half`.
    #[default]
    Prep,
    /// The launch before left them in `Buf::Half` (the GLU's epilogue).
    Half,
    /// The launch before left them in `Buf::Act` (`Coopmat2Glu`).
    Act,
    /// The coopmat2 prefill attention writes them to `Buf::Half` on the steps it runs; on
    /// the others (the decode attention's) the prep does.
    Attention,
}

/// The epilogue's flag for `Handoff::output_half` (split_gemm.wgsl's HALF_OUT).
const HALF_OUT: u32 = 64;
/// The words of the flags, the norm's epsilon and the scale in the launch params
/// (linear.wgsl's Params).
const FLAGS: usize = 6;
const EPS: usize = 8;
const SCALE: usize = 9;

/// Appends `lin`'s passes to `ops` and grows `scratch` to take them.
pub fn push(
    gemm: Gemm,
    kernels: &mut Kernels,
    device: &wgpu::Device,
    lin: Linear<'_>,
    scratch: &mut Scratch,
    ops: &mut Vec<Op>,
) {
    let first = lin.mats[0];
    let (rows, cols, layout) = (first.rows, lin.params[1] as usize, first.layout);
    let when = When::Split;
    // (Each launch preps its own input: q|k and v stored apart may take the passes one
    // without the other.)
    // (The norm is prep's: a launch taking its inputs as the one before left them has none.)
    let input = lin.handoff.input;
    assert!(input == HalfInput::Prep || lin.gamma.is_none(), "a handed-off input is not normed");
    match input {
        HalfInput::Prep => ops.push(prep_op(kernels, device, &lin, cols)),
        HalfInput::Attention => {
            ops.push(Op { when: When::SplitDecode, ..prep_op(kernels, device, &lin, cols) })
        }
        HalfInput::Half | HalfInput::Act => {}
    }
    let xh = if input == HalfInput::Act { Buf::Act } else { Buf::Half };
    scratch.cols = scratch.cols.max(cols);
    let glu = lin.mats.len() == 2;
    if glu && lin.handoff.output_half && gemm.fuses_glu() {
        push_fused_glu(kernels, device, &lin, (rows, cols), scratch, ops);
        return;
    }
    // The sums: a row of every matrix's rows per token (the GLU's up after its gate).
    let acc_stride = rows * lin.mats.len();
    scratch.acc = scratch.acc.max(acc_stride);
    let kernel = gemm.kernel(kernels, device, cols);
    // The epilogue's params: the norm is prep's. Where nothing is left for it, the GEMM
    // stores y (at the fused launch's stride and column) in place of the sums.
    let mut params = lin.params;
    params[FLAGS] &= !NORM;
    // A residual add is the GEMM's too: its sums start from the output tile (on the H200
    // this took the 3B's 56 o and down epilogues, 0.94 ms, out of its step: pp512 1.03x).
    let direct = !glu
        && !lin.handoff.output_half
        && params[FLAGS] & (BIAS | SOFTCAP) == 0
        && f32::from_bits(params[SCALE]) == 1.0;
    let residual = if direct { params[FLAGS] & RESIDUAL } else { 0 };
    let (out, out_stride, out_col) = match direct {
        true => (lin.out.clone(), params[3] as usize, (params[4] + params[5]) as usize),
        false => (Buf::Acc, acc_stride, 0),
    };
    // GEMM params: rows, cols, -, floats per token of its output, its first column there,
    // RESIDUAL where it adds to the output.
    let gemm_op = |a: Buf, rows: usize, col: usize| Op {
        kernel: kernel.kernel.clone(),
        params: words(&[
            (0, rows as u32),
            (1, cols as u32),
            (3, out_stride as u32),
            (4, (out_col + col) as u32),
            (FLAGS, residual),
        ]),
        binds: vec![(5, a), (12, xh.clone()), (14, out.clone())],
        grid: Grid::Tiles { rows: rows as u32, tile: kernel.tile },
        when,
    };
    if gemm.reads(layout) {
        for (i, m) in lin.mats.iter().enumerate() {
            ops.push(gemm_op(Buf::W(m.parts[0].quants.clone()), rows, i * rows));
        }
    } else {
        push_dequant(kernels, device, lin.mats, (rows, cols), scratch, ops);
        ops.push(gemm_op(Buf::WHalf, acc_stride, 0));
    }
    if direct {
        return;
    }
    // (split_gemm.wgsl's `acc_stride()` and `up_col()`.)
    params[11] = acc_stride as u32;
    params[12] = rows as u32;
    let mut binds =
        vec![(2, lin.out), (4, lin.bias.map_or(Buf::Dummy, |b| Buf::W(b.clone()))), (14, Buf::Acc)];
    if glu {
        binds.push((12, Buf::Half));
    }
    if lin.handoff.output_half {
        assert!(glu, "only the GLU's epilogue writes f16 inputs");
        params[FLAGS] |= HALF_OUT;
    }
    ops.push(Op {
        kernel: kernels.get(device, KernelId::SplitEpilogue(glu)),
        params,
        binds,
        grid: Grid::Columns((rows / 4) as u32),
        when,
    });
}

/// The GLU's launches where `Gemm::fuses_glu`: the gate's and up's f16 rows (dequantized
/// one after the other into `Buf::WHalf` where the file holds a block format), then one
/// `Coopmat2Glu` over both, writing the down projection's f16 inputs to `Buf::Act`. (`Act`
/// holds f32 rows of the GLU's width per token; a step in passes has at least `MIN_TOKENS`,
/// a tile, so the f16 rows its down projection reads, up to a whole tile, fit in it.)
fn push_fused_glu(
    kernels: &mut Kernels,
    device: &wgpu::Device,
    lin: &Linear<'_>,
    (rows, cols): (usize, usize),
    scratch: &mut Scratch,
    ops: &mut Vec<Op>,
) {
    let [gate, up] = lin.mats else { unreachable!("the GLU's two matrices") };
    let (wg, wu, up_at) = if Gemm::Coopmat2.reads(gate.layout) {
        (Buf::W(gate.parts[0].quants.clone()), Buf::W(up.parts[0].quants.clone()), 0)
    } else {
        push_dequant(kernels, device, lin.mats, (rows, cols), scratch, ops);
        (Buf::WHalf, Buf::WHalf, rows * cols)
    };
    ops.push(Op {
        kernel: kernels.get(device, KernelId::Coopmat2Glu(nv_coopmat2::unroll(cols as u32))),
        // rows, cols, where up's rows start in its buffer, the activation.
        params: words(&[
            (0, rows as u32),
            (1, cols as u32),
            (4, up_at as u32),
            (FLAGS, lin.params[FLAGS] & GELU),
        ]),
        binds: vec![(5, wg), (6, wu), (12, Buf::Half), (14, Buf::Act)],
        grid: Grid::Tiles { rows: rows as u32, tile: TILE },
        when: When::Split,
    });
}

/// `mats` (of `rows` by `cols`, one layout) written as f16 rows into `Buf::WHalf`, one after
/// the other.
fn push_dequant(
    kernels: &mut Kernels,
    device: &wgpu::Device,
    mats: &[&Matrix],
    (rows, cols): (usize, usize),
    scratch: &mut Scratch,
    ops: &mut Vec<Op>,
) {
    let dequant = kernels.get(device, KernelId::SplitDequant(mats[0].layout));
    for (i, m) in mats.iter().enumerate() {
        let part = &m.parts[0];
        let mut binds = vec![(5, Buf::W(part.quants.clone())), (12, Buf::WHalf)];
        if let Some(s) = &part.scales {
            binds.push((6, Buf::W(s.clone())));
        }
        ops.push(Op {
            kernel: dequant.clone(),
            // rows, cols, first element of the f16 rows.
            params: words(&[(0, rows as u32), (1, cols as u32), (4, (i * rows * cols) as u32)]),
            binds,
            grid: Grid::Fixed((cols / 8).div_ceil(64) as u32, rows as u32),
            when: When::Split,
        });
    }
    scratch.weights = scratch.weights.max(mats.len() * rows * cols);
}

/// Launch params with `p`'s (index, word) set and the rest 0.
fn words(p: &[(usize, u32)]) -> [u32; 16] {
    let mut words = [0u32; 16];
    for &(i, v) in p {
        words[i] = v;
    }
    words
}

/// `lin`'s prep: its input of `cols`, normed where a gamma is bound, rounded to f16.
fn prep_op(kernels: &mut Kernels, device: &wgpu::Device, lin: &Linear<'_>, cols: usize) -> Op {
    Op {
        kernel: kernels.get(device, KernelId::SplitPrep),
        // rows, cols, x_stride, flags (NORM where a gamma is bound), the norm's epsilon.
        params: words(&[
            (1, cols as u32),
            (2, lin.params[2]),
            (FLAGS, if lin.gamma.is_some() { NORM } else { 0 }),
            (EPS, lin.params[EPS]),
        ]),
        binds: vec![
            (1, lin.input.clone()),
            (3, lin.gamma.map_or(Buf::Dummy, |g| Buf::W(g.clone()))),
            (12, Buf::Half),
        ],
        grid: Grid::PerToken(1),
        when: When::Split,
    }
}

/// The fused launch's `when` where the passes take over from `MIN_TOKENS` tokens.
pub fn below(when: When) -> When {
    match when {
        When::Always => When::Unsplit,
        When::Gemm => When::GemmUnsplit,
        other => other,
    }
}
