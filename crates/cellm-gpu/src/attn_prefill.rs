//! Prefill attention (`shaders/attn_prefill.wgsl`): a tile of query tokens per workgroup
//! sharing each key/value load, for steps whose sessions bring many tokens each. Decode-like
//! steps keep the split decode kernel and its combine (`shaders/attention.wgsl`), which
//! spreads one token's context over many workgroups instead.

use std::sync::Arc;

use crate::kernels::{KernelId, Kernels};
use crate::ops::{Buf, Grid, Op, When};
use crate::step::Token;

/// Query tokens per workgroup (`BQ`; 8 threads each).
pub const BQ: u32 = 16;
/// Shared memory the kernel may take: 32 KiB, what lavapipe, Metal and NVIDIA's Vulkan offer.
const SHARED_BYTES: u32 = 32 << 10;
/// Tokens per session (on average over a step's sessions) from which the prefill kernel
/// runs: one workgroup's full tile (not measured yet; below it the decode kernel's splits
/// keep a large GPU busy).
pub const MIN_TOKENS_PER_SESSION: usize = BQ as usize;

/// The kernel's tile for heads of `head_dim`: positions per key/value tile (`BK`), or None
/// where it does not run (head dims not a multiple of 32, or a tile that leaves no room).
pub fn key_tile(head_dim: u32) -> Option<u32> {
    if !head_dim.is_multiple_of(32) || head_dim > 256 {
        return None;
    }
    // Floats: the query tile and a key/value tile (rows padded by 4), the scores, and the
    // reduction slots.
    let row = head_dim + 4;
    let free = (SHARED_BYTES / 4).checked_sub(BQ * row + BQ * 8)?;
    let bk = (free / (row + BQ)).min(64) / 8 * 8;
    (bk >= 8).then_some(bk)
}

/// Bytes of shared memory the kernel takes for `head_dim`.
fn shared_bytes(head_dim: u32, bk: u32) -> u32 {
    4 * ((BQ + bk) * (head_dim + 4) + BQ * bk + BQ * 8)
}

/// The kernel's WGSL for heads of `head_dim` (after the step and KV accessors): the
/// decode kernel's `Params` (both launch with the same parameters), then the kernel.
pub fn source(head_dim: u32, attention: &str, kernel: &str) -> String {
    let bk = key_tile(head_dim).expect("a supported head dim");
    let start = attention.find("struct Params").expect("attention.wgsl declares Params");
    let len = attention[start..].find("\n}\n").expect("Params ends") + 3;
    format!(
        "const HD: u32 = {head_dim}u;\nconst BQ: u32 = {BQ}u;\nconst BK: u32 = {bk}u;\n{}{kernel}",
        &attention[start..start + len]
    )
}

/// The prefill launch of one layer, taking the decode attention's `params`: None where the
/// head dim has no tile or the device lacks the shared memory.
pub fn op(
    gpu: &crate::device::Gpu,
    kernels: &mut Kernels,
    head_dim: usize,
    heads: usize,
    params: [u32; 16],
) -> Option<Op> {
    let hd = head_dim as u32;
    let bk = key_tile(hd)?;
    if shared_bytes(hd, bk) > gpu.limits.max_compute_workgroup_storage_size {
        return None;
    }
    let kernel: Arc<_> = kernels.get(&gpu.device, KernelId::AttnPrefill(hd));
    Some(Op {
        kernel,
        params,
        binds: vec![(1, Buf::Qkv), (2, Buf::Ctx), (5, Buf::Pool)],
        grid: Grid::QueryTiles(heads as u32),
        when: When::Prefill,
    })
}

/// Whether a chunk of `tokens` runs the prefill kernel: enough tokens per session (a
/// session's tokens are consecutive rows sharing one page-table offset).
pub fn wanted(tokens: &[Token]) -> bool {
    let sessions = 1 + tokens.windows(2).filter(|w| w[0].table != w[1].table).count();
    tokens.len() >= MIN_TOKENS_PER_SESSION * sessions
}
