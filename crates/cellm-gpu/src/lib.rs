//! One GPU backend for Vulkan and Metal, on wgpu: the kernels are WGSL (naga turns them into
//! SPIR-V or MSL), the weights are uploaded once in the layouts those kernels read, the KV
//! cache lives on the device as pages (the engine's `PagePool` keeps the ids and tables),
//! and each step is one submission that reads back only the logits.

mod attn_prefill;
mod device;
pub mod kernels;
mod model;
mod nv_coopmat2;
mod ops;
mod profile;
pub mod repack;
mod split_gemm;
mod step;
mod weights;

use cellm_format::{CellmFile, Result};
use cellm_kv::KvEncoding;
use cellm_models::CausalLm;

pub use device::{Gpu, GpuKind};
pub use model::GPU_ARCHITECTURES;

/// How to open the model on a GPU.
#[derive(Debug, Clone)]
pub struct GpuOptions {
    pub kind: GpuKind,
    pub kv_encoding: KvEncoding,
    /// Positions per KV page (the engine's).
    pub page_size: usize,
    /// A cap on one binding below the device's own (tests use it to split matrices).
    pub max_binding: Option<u64>,
}

/// The model in `file` on a GPU of `opts.kind`; architectures and formats the GPU does not
/// run yet are refused by name (`Error::Unsupported`), a missing adapter is `Error::Device`.
pub fn load(file: &CellmFile, opts: &GpuOptions) -> Result<Box<dyn CausalLm>> {
    model::load(file, opts)
}

#[cfg(test)]
mod tests;
