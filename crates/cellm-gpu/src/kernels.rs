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
const LINEAR: &str = include_str!("shaders/linear.wgsl");
const EMBED: &str = include_str!("shaders/embed.wgsl");
const ROPE_KV: &str = include_str!("shaders/rope_kv.wgsl");
const ATTENTION: &str = include_str!("shaders/attention.wgsl");
const ATTN_COMBINE: &str = include_str!("shaders/attn_combine.wgsl");
const NORM_ADD: &str = include_str!("shaders/norm_add.wgsl");

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
    Glu(Layout),
    Embed(Layout),
    RopeKv,
    Attention,
    AttnCombine,
    NormAdd,
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
        let mut all =
            vec![KernelId::RopeKv, KernelId::Attention, KernelId::AttnCombine, KernelId::NormAdd];
        for l in layouts {
            all.extend([KernelId::Matvec(l), KernelId::Glu(l), KernelId::Embed(l)]);
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
            KernelId::Attention => vec![(0, Uniform), (1, Read), (2, Write), (5, Read)],
            KernelId::AttnCombine => vec![(0, Uniform), (1, Read), (2, Write)],
            KernelId::NormAdd => vec![(0, Uniform), (1, Read), (2, Write), (3, Read)],
        };
        b.push((7, Read));
        b
    }

    /// Whether the kernel is built twice, for one token and for several.
    pub fn per_token_count(self) -> bool {
        matches!(self, KernelId::Matvec(_) | KernelId::Glu(_))
    }

    /// The kernel's full WGSL source: with subgroup reductions (`subgroups`) or shared-memory
    /// ones, for up to `tokens` tokens a workgroup where it batches tokens (1 or 4), or its
    /// tiled-GEMM build where `tokens` is `GEMM_BUILD` (matvec and GLU only).
    pub fn source(self, subgroups: bool, tokens: u32) -> String {
        let gemm = tokens == GEMM_BUILD && self.per_token_count();
        let (body, weights, glu): (&str, Option<Layout>, bool) = match self {
            KernelId::Matvec(l) => (if gemm { GEMM } else { MATVEC }, Some(l), false),
            KernelId::Glu(l) => (if gemm { GEMM } else { MATVEC }, Some(l), true),
            KernelId::Embed(l) => (EMBED, Some(l), false),
            KernelId::RopeKv => (ROPE_KV, None, false),
            KernelId::Attention => (ATTENTION, None, false),
            KernelId::AttnCombine => (ATTN_COMBINE, None, false),
            KernelId::NormAdd => (NORM_ADD, None, false),
        };
        let mut src = String::new();
        if self.per_token_count() && !gemm {
            src.push_str(&format!("const TT: u32 = {tokens}u;\n"));
        }
        src.push_str(STEP);
        if matches!(self, KernelId::RopeKv | KernelId::Attention) {
            src.push_str(KV);
        }
        if matches!(self, KernelId::Matvec(_) | KernelId::Glu(_)) {
            src.push_str(LINEAR);
        }
        src.push_str(&sections(body, &|name| match name {
            "glu" => glu,
            "sg" => subgroups,
            "nosg" => !subgroups,
            _ => false,
        }));
        if let Some(l) = weights {
            let accessor = sections(FORMATS, &|name| name == l.wgsl_name());
            src.push_str(&accessor_for(&accessor, "", 5, 6));
            if glu {
                src.push_str(&accessor_for(&accessor, "b", 8, 9));
            }
        }
        src
    }
}

/// A weight accessor with its names suffixed by `suffix`, bound at `quants` and `scales`.
fn accessor_for(text: &str, suffix: &str, quants: u32, scales: u32) -> String {
    text.replace("@binding($Q)", &format!("@binding({quants})"))
        .replace("@binding($S)", &format!("@binding({scales})"))
        .replace('$', suffix)
}

/// `text` with each `//# name` ... `//# end` section kept where `keep(name)`, else dropped.
fn sections(text: &str, keep: &dyn Fn(&str) -> bool) -> String {
    let mut out = String::new();
    let mut inside: Option<bool> = None;
    for line in text.lines() {
        let marker = line.trim_start().strip_prefix("//# ");
        match (marker, inside) {
            (Some("end"), Some(_)) => inside = None,
            (Some(name), None) => inside = Some(keep(name.trim())),
            (_, None) | (_, Some(true)) => {
                out.push_str(line);
                out.push('\n');
            }
            (_, Some(false)) => {}
        }
    }
    out
}

/// `KernelId::source`'s `tokens` for the tiled GEMM build.
pub const GEMM_BUILD: u32 = 0;
/// Tokens from which a matvec launch runs as the tiled GEMM.
pub const GEMM_MIN_TOKENS: u32 = 8;
/// Rows and tokens of one GEMM workgroup's tile (`BM`, `BN` in `shaders/gemm.wgsl`).
pub const GEMM_TILE: u32 = 64;

/// A compiled kernel and its binding layout; `single` is its one-token build and `gemm` its
/// tiled-GEMM build, where it has them (the same bindings).
pub struct Kernel {
    pub name: String,
    pub pipeline: wgpu::ComputePipeline,
    pub single: Option<wgpu::ComputePipeline>,
    pub gemm: Option<wgpu::ComputePipeline>,
    pub layout: wgpu::BindGroupLayout,
}

impl Kernel {
    /// The pipeline for a launch over `tokens` tokens (the GEMM is `gemm_for`'s).
    pub fn for_tokens(&self, tokens: u32) -> &wgpu::ComputePipeline {
        match (&self.single, tokens) {
            (Some(one), 1) => one,
            _ => &self.pipeline,
        }
    }

    /// The GEMM build, where a launch over `tokens` tokens should use it.
    pub fn gemm_for(&self, tokens: u32) -> Option<&wgpu::ComputePipeline> {
        self.gemm.as_ref().filter(|_| tokens >= GEMM_MIN_TOKENS)
    }
}

/// Kernels built so far on one device.
pub struct Kernels {
    subgroups: bool,
    built: HashMap<KernelId, Arc<Kernel>>,
}

impl Kernels {
    /// Kernels for `gpu`, with subgroup reductions where it has them.
    pub fn new(gpu: &crate::device::Gpu) -> Self {
        Self { subgroups: gpu.subgroups, built: HashMap::new() }
    }

    pub fn get(&mut self, device: &wgpu::Device, id: KernelId) -> Arc<Kernel> {
        let sg = self.subgroups;
        self.built.entry(id).or_insert_with(|| Arc::new(build(device, id, sg))).clone()
    }
}

fn build(device: &wgpu::Device, id: KernelId, subgroups: bool) -> Kernel {
    let label = format!("{id:?}");
    let entries: Vec<wgpu::BindGroupLayoutEntry> = id
        .bindings()
        .into_iter()
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
        immediate_size: 0,
    });
    let pipeline = |tokens: u32| {
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some(&label),
            source: wgpu::ShaderSource::Wgsl(id.source(subgroups, tokens).into()),
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
    let single = id.per_token_count().then(|| pipeline(1));
    let gemm = id.per_token_count().then(|| pipeline(GEMM_BUILD));
    let name = label.split('(').next().unwrap_or_default().to_string();
    Kernel { name, pipeline: pipeline(4), single, gemm, layout }
}
