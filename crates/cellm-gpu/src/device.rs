//! Picking an adapter and opening a device on it. Errors the device reports later
//! (validation, out of memory, a lost device) are kept and turned into one `Error::Device`
//! at the next check instead of wgpu's default panic.

use std::sync::{Arc, Mutex};

use cellm_format::{Error, Result};

/// Which adapters a caller accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuKind {
    Vulkan,
    Metal,
    /// The best adapter of any backend this build has.
    Any,
}

impl GpuKind {
    /// `vulkan`, `metal` or `gpu`.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "vulkan" => Some(Self::Vulkan),
            "metal" => Some(Self::Metal),
            "gpu" => Some(Self::Any),
            _ => None,
        }
    }

    fn backends(self) -> wgpu::Backends {
        match self {
            Self::Vulkan => wgpu::Backends::VULKAN,
            Self::Metal => wgpu::Backends::METAL,
            Self::Any => wgpu::Backends::VULKAN | wgpu::Backends::METAL,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Vulkan => "Vulkan",
            Self::Metal => "Metal",
            Self::Any => "Vulkan or Metal",
        }
    }
}

/// Whether `adapter` runs the cooperative-matrix GEMM: Vulkan, cooperative matrices and f16
/// in shaders, a 16x16x16 configuration of f16 inputs with f32 accumulation, and subgroups of
/// exactly 32 (the kernel's 256 invocations are 8 subgroups). `CELLM_GPU_NO_COOPMAT=1` turns
/// it off (the f32 GEMM runs instead).
fn coopmat_ok(adapter: &wgpu::Adapter, info: &wgpu::AdapterInfo) -> bool {
    let need = wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX | wgpu::Features::SHADER_F16;
    let config = |c: &wgpu::CooperativeMatrixProperties| {
        (c.m_size, c.n_size, c.k_size) == (16, 16, 16)
            && c.ab_type == wgpu::CooperativeScalarType::F16
            && c.cr_type == wgpu::CooperativeScalarType::F32
    };
    info.backend == wgpu::Backend::Vulkan
        && adapter.features().contains(need)
        && (info.subgroup_min_size, info.subgroup_max_size) == (32, 32)
        && adapter.cooperative_matrix_properties().iter().any(config)
        && std::env::var_os("CELLM_GPU_NO_COOPMAT").is_none()
}

/// How long `Gpu::wait_until` spins before it blocks: longer than a decode step of the
/// models this backend runs, a small share of a prefill step.
const SPIN_LIMIT: std::time::Duration = std::time::Duration::from_millis(10);

/// An open device and what it allows.
pub struct Gpu {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub limits: wgpu::Limits,
    pub info: wgpu::AdapterInfo,
    /// Whether the device was opened with subgroup operations (the kernels then reduce
    /// within subgroups, of whatever size the device runs).
    pub subgroups: bool,
    /// Whether the device was opened with timestamp queries inside passes (profiling).
    pub timestamps: bool,
    /// Whether prefill's GEMM runs on cooperative matrices (tensor cores): 16x16x16 tiles of
    /// f16 inputs accumulated in f32, on Vulkan with subgroups of 32 (see `coopmat_ok`).
    pub coopmat: bool,
    /// Whether prefill's GEMM runs on NVIDIA's workgroup-scope cooperative matrices
    /// (`nv_coopmat2`, through `split_gemm`).
    pub coopmat2: bool,
    /// Whether the driver also lists the configurations the coopmat2 prefill attention
    /// takes (workgroups of 128).
    pub coopmat2_attention: bool,
    /// Whether kernels take their 64 bytes of parameters as immediates (Vulkan push
    /// constants, set with each launch) instead of from a uniform buffer.
    pub immediates: bool,
    /// Whether waits for a step spin on the device's fence before blocking (see `wait_until`):
    /// on GPUs, unless CELLM_GPU_SPIN=0; anywhere with CELLM_GPU_SPIN=1.
    pub spin: bool,
    failure: Arc<Mutex<Option<String>>>,
}

impl Gpu {
    /// The best adapter of `kind` (a discrete GPU before an integrated one before a software
    /// one), opened with every limit it offers.
    pub fn open(kind: GpuKind) -> Result<Self> {
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
        desc.backends = kind.backends();
        let instance = wgpu::Instance::new(desc);
        let adapters = pollster::block_on(instance.enumerate_adapters(kind.backends()));
        let rank = |a: &wgpu::Adapter| match a.get_info().device_type {
            wgpu::DeviceType::DiscreteGpu => 0,
            wgpu::DeviceType::IntegratedGpu => 1,
            wgpu::DeviceType::VirtualGpu => 2,
            wgpu::DeviceType::Cpu => 3,
            wgpu::DeviceType::Other => 4,
        };
        let adapter = adapters.into_iter().min_by_key(rank).ok_or_else(|| {
            Error::Device(format!(
                "no {} adapter found (is a GPU driver, or Mesa's lavapipe, installed?)",
                kind.name()
            ))
        })?;
        let info = adapter.get_info();
        let limits = adapter.limits();
        // CELLM_GPU_NO_SUBGROUPS=1: the shared-memory reductions even where subgroups exist
        // (tests run both).
        let subgroups = adapter.features().contains(wgpu::Features::SUBGROUP)
            && std::env::var_os("CELLM_GPU_NO_SUBGROUPS").is_none();
        let mut required_features =
            if subgroups { wgpu::Features::SUBGROUP } else { wgpu::Features::empty() };
        // CELLM_GPU_PROFILE: GPU timestamps around every launch, where the device has them.
        let stamps =
            wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES;
        let timestamps =
            std::env::var_os("CELLM_GPU_PROFILE").is_some() && adapter.features().contains(stamps);
        if timestamps {
            required_features |= stamps;
        }
        let coopmat = subgroups && coopmat_ok(&adapter, &info);
        let mut experimental_features = wgpu::ExperimentalFeatures::disabled();
        if coopmat {
            required_features |=
                wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX | wgpu::Features::SHADER_F16;
            // SAFETY: the one experimental feature asked for is cooperative matrices, used by
            // one kernel (shaders/gemm_coop.wgsl) in the configuration the adapter reports.
            experimental_features = unsafe { wgpu::ExperimentalFeatures::enabled() };
        }
        // Immediates on Vulkan, where the adapter has 64 bytes of them
        // (CELLM_GPU_NO_IMMEDIATES=1: the uniform buffer, for comparison).
        let immediates = info.backend == wgpu::Backend::Vulkan
            && adapter.features().contains(wgpu::Features::IMMEDIATES)
            && limits.max_immediate_size >= 64
            && std::env::var_os("CELLM_GPU_NO_IMMEDIATES").is_none();
        if immediates {
            required_features |= wgpu::Features::IMMEDIATES;
        }
        // NVIDIA's workgroup-scope cooperative matrices for prefill's GEMM, where the
        // cooperative GEMM runs and parameters are immediates (its SPIR-V takes them so).
        // On an H200 it made pp512 up to 1.5x faster, none of six shapes slower beyond noise
        // (docs/benchmarks.md); CELLM_GPU_COOPMAT2=0 keeps the fused kernels.
        let wanted = coopmat
            && immediates
            && adapter.features().contains(wgpu::Features::PASSTHROUGH_SHADERS)
            && !std::env::var("CELLM_GPU_COOPMAT2").is_ok_and(|v| v == "0");
        let cm2_attention = wanted.then(|| crate::nv_coopmat2::supported(&adapter)).flatten();
        let coopmat2 = cm2_attention.is_some();
        if coopmat2 {
            required_features |= wgpu::Features::PASSTHROUGH_SHADERS;
        }
        let desc = wgpu::DeviceDescriptor {
            label: Some("cellm"),
            required_features,
            required_limits: limits.clone(),
            experimental_features,
            ..Default::default()
        };
        let plain = |desc: &wgpu::DeviceDescriptor<'_>| {
            pollster::block_on(adapter.request_device(desc)).map_err(|e| e.to_string())
        };
        // (Where the driver refuses the extension, the device opens without it.)
        let (opened, coopmat2) = match coopmat2 {
            true => match crate::nv_coopmat2::open(&adapter, &desc) {
                Ok(opened) => (Ok(opened), true),
                Err(_) => {
                    let desc = wgpu::DeviceDescriptor {
                        required_features: required_features - wgpu::Features::PASSTHROUGH_SHADERS,
                        ..desc.clone()
                    };
                    (plain(&desc), false)
                }
            },
            false => (plain(&desc), false),
        };
        let (device, queue) =
            opened.map_err(|e| Error::Device(format!("cannot open {}: {e}", info.name)))?;
        let coopmat2_attention = coopmat2 && cm2_attention == Some(true);
        let failure: Arc<Mutex<Option<String>>> = Arc::default();
        let slot = failure.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            let mut f = slot.lock().unwrap_or_else(|p| p.into_inner());
            f.get_or_insert_with(|| e.to_string());
        }));
        let slot = failure.clone();
        device.set_device_lost_callback(move |_, message| {
            let mut f = slot.lock().unwrap_or_else(|p| p.into_inner());
            f.get_or_insert_with(|| format!("the device was lost: {message}"));
        });
        // Not on a CPU device (lavapipe), whose own threads need the cores a spin would take,
        // unless CELLM_GPU_SPIN=1 (tests); CELLM_GPU_SPIN=0 never.
        let spin = match std::env::var("CELLM_GPU_SPIN").as_deref() {
            Ok("0") => false,
            Ok("1") => true,
            _ => info.device_type != wgpu::DeviceType::Cpu,
        };
        Ok(Self {
            device,
            queue,
            limits,
            info,
            subgroups,
            timestamps,
            coopmat,
            coopmat2,
            coopmat2_attention,
            immediates,
            spin,
            failure,
        })
    }

    /// The first error the device reported, if any (it stays failed).
    pub fn check(&self) -> Result<()> {
        let f = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        match &*f {
            Some(m) => Err(Error::Device(format!("{}: {m}", self.info.name))),
            None => Ok(()),
        }
    }

    /// The largest buffer one binding may cover.
    pub fn max_binding(&self) -> u64 {
        self.limits.max_storage_buffer_binding_size.min(self.limits.max_buffer_size)
    }

    /// Polls the device until `done()` (a map callback has run, say). A blocking wait costs
    /// an OS wake-up after the fence signals, a large share of a decode step's few hundred
    /// microseconds of host turnaround, so it spins on the fence for up to `SPIN_LIMIT`
    /// first (where `spin`); longer steps (prefill) then block.
    pub fn wait_until(&self, done: impl Fn() -> bool) -> Result<()> {
        if self.spin {
            let start = std::time::Instant::now();
            while start.elapsed() < SPIN_LIMIT {
                self.device
                    .poll(wgpu::PollType::Poll)
                    .map_err(|e| Error::Device(format!("{}: {e}", self.info.name)))?;
                if done() {
                    return self.check();
                }
                std::hint::spin_loop();
            }
        }
        self.wait()
    }

    /// Waits for the queue to drain.
    pub fn wait(&self) -> Result<()> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| Error::Device(format!("{}: {e}", self.info.name)))?;
        self.check()
    }
}
