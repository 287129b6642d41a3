//! NVIDIA's workgroup-scope cooperative matrices (`VK_NV_cooperative_matrix2`), which wgpu
//! does not expose: finding them on an adapter, opening the device with them through
//! wgpu-hal's Vulkan callback, and the prefill GEMM's pipeline from SPIR-V compiled ahead of
//! time (`shaders/gemm_cm2.comp`, `tools/compile_spirv.sh`), passed through as is. The driver
//! tiles the matrices and stages them in shared memory itself. On an H200 a standalone probe
//! of the same GEMM (unclamped loads, 8 a loop) ran the Llama-3.2-3B shapes at 146-231
//! TFLOP/s, against 77-125 for `gemm_coop.wgsl` in the engine, and in the engine it made
//! pp512 1.5x faster on the Llama-3.2-1B and 3B F16 shapes (docs/benchmarks.md). The device
//! opens with it wherever the adapter has it (`CELLM_GPU_COOPMAT2=0`: not).

use std::ffi::{c_void, CStr};

use ash::vk;
use wgpu::hal;

const EXTENSION: &CStr = c"VK_NV_cooperative_matrix2";
/// `VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_2_{FEATURES,PROPERTIES}_NV` (ash
/// 0.38 predates the extension).
const FEATURES: vk::StructureType = vk::StructureType::from_raw(1_000_593_000);
const PROPERTIES: vk::StructureType = vk::StructureType::from_raw(1_000_593_002);

/// `VkPhysicalDeviceCooperativeMatrix2FeaturesNV`.
#[repr(C)]
#[derive(Clone, Copy)]
struct Features {
    s_type: vk::StructureType,
    p_next: *mut c_void,
    workgroup_scope: vk::Bool32,
    flexible_dimensions: vk::Bool32,
    reductions: vk::Bool32,
    conversions: vk::Bool32,
    per_element_operations: vk::Bool32,
    tensor_addressing: vk::Bool32,
    block_loads: vk::Bool32,
}

/// `VkPhysicalDeviceCooperativeMatrix2PropertiesNV`.
#[repr(C)]
struct Properties {
    s_type: vk::StructureType,
    p_next: *mut c_void,
    workgroup_scope_max_workgroup_size: u32,
    flexible_dimensions_max_dimension: u32,
    workgroup_scope_reserved_shared_memory: u32,
}

impl Features {
    fn none() -> Self {
        Features {
            s_type: FEATURES,
            p_next: std::ptr::null_mut(),
            workgroup_scope: 0,
            flexible_dimensions: 0,
            reductions: 0,
            conversions: 0,
            per_element_operations: 0,
            tensor_addressing: 0,
            block_loads: 0,
        }
    }
}

/// `VkCooperativeMatrixFlexibleDimensionsPropertiesNV`: one configuration of
/// workgroup-scope matrices the driver runs, its sides multiples of the granularities.
#[repr(C)]
#[derive(Clone, Copy)]
struct Flexible {
    s_type: vk::StructureType,
    p_next: *mut c_void,
    m_granularity: u32,
    n_granularity: u32,
    k_granularity: u32,
    a_type: vk::ComponentTypeKHR,
    b_type: vk::ComponentTypeKHR,
    c_type: vk::ComponentTypeKHR,
    result_type: vk::ComponentTypeKHR,
    saturating_accumulation: vk::Bool32,
    scope: vk::ScopeKHR,
    workgroup_invocations: u32,
}
const FLEXIBLE: vk::StructureType = vk::StructureType::from_raw(1_000_593_001);
type FlexibleFn =
    unsafe extern "system" fn(vk::PhysicalDevice, *mut u32, *mut Flexible) -> vk::Result;

/// The GEMM's workgroup (256 invocations) and its largest matrix side (128).
const WORKGROUP: u32 = 256;
const SIDE: u32 = 128;
/// The (M, N, K) of every product a kernel takes, at its workgroup's invocations: the
/// GEMM's 128 x 64 weight tiles by 64 x 128 token tiles; the attention's query tile by an
/// iteration's 64 keys (head dims 64 and 128), its weights by the 64 values, and by ones.
const GEMM_SHAPES: (u32, &[(u32, u32, u32)]) = (WORKGROUP, &[(128, 128, 64)]);
const ATTN_SHAPES: (u32, &[(u32, u32, u32)]) =
    (ATTN_WORKGROUP, &[(64, 64, 64), (64, 64, 128), (64, 128, 64), (64, 16, 64)]);

/// The f16 x f16 -> f32 workgroup-scope configurations `device` lists.
fn flexible(shared: &hal::vulkan::InstanceShared, device: vk::PhysicalDevice) -> Vec<Flexible> {
    let name = c"vkGetPhysicalDeviceCooperativeMatrixFlexibleDimensionsPropertiesNV";
    let instance = shared.raw_instance().handle();
    // SAFETY: a lookup by name in a live instance.
    let Some(f) = (unsafe { shared.entry().get_instance_proc_addr(instance, name.as_ptr()) })
    else {
        return Vec::new();
    };
    // SAFETY: the extension's entry point has this signature (vulkan_core.h).
    let f: FlexibleFn = unsafe { std::mem::transmute(f) };
    let blank = Flexible {
        s_type: FLEXIBLE,
        p_next: std::ptr::null_mut(),
        m_granularity: 0,
        n_granularity: 0,
        k_granularity: 0,
        a_type: vk::ComponentTypeKHR::FLOAT16,
        b_type: vk::ComponentTypeKHR::FLOAT16,
        c_type: vk::ComponentTypeKHR::FLOAT16,
        result_type: vk::ComponentTypeKHR::FLOAT16,
        saturating_accumulation: 0,
        scope: vk::ScopeKHR::DEVICE,
        workgroup_invocations: 0,
    };
    let mut count = 0u32;
    // SAFETY: the usual two calls: the count, then that many structures, each typed.
    let mut all = unsafe {
        if f(device, &mut count, std::ptr::null_mut()) != vk::Result::SUCCESS {
            return Vec::new();
        }
        let mut all = vec![blank; count as usize];
        if f(device, &mut count, all.as_mut_ptr()) != vk::Result::SUCCESS {
            return Vec::new();
        }
        all
    };
    all.truncate(count as usize);
    all.retain(|c| {
        c.a_type == vk::ComponentTypeKHR::FLOAT16
            && c.b_type == vk::ComponentTypeKHR::FLOAT16
            && c.c_type == vk::ComponentTypeKHR::FLOAT32
            && c.result_type == vk::ComponentTypeKHR::FLOAT32
            && c.scope == vk::ScopeKHR::WORKGROUP
    });
    all
}

/// Whether one of `configs` takes every product of `shapes` at its invocations. (RADV lists
/// workgroup scope at 256 invocations only; NVIDIA's at 128 and 256, with granularities of
/// 32 x 16 x 16 at 128.)
fn runs(configs: &[Flexible], (invocations, shapes): (u32, &[(u32, u32, u32)])) -> bool {
    configs.iter().any(|c| {
        c.workgroup_invocations == invocations
            && shapes.iter().all(|&(m, n, k)| {
                m.is_multiple_of(c.m_granularity.max(1))
                    && n.is_multiple_of(c.n_granularity.max(1))
                    && k.is_multiple_of(c.k_granularity.max(1))
            })
    })
}

/// What the extension on `adapter` runs of ours: (the features to open the device with,
/// whether the prefill attention runs too), where the GEMM does: workgroup scope, flexible
/// dimensions and tensor addressing, workgroups of 256, matrices of 128 a side, and a
/// listed f16 x f16 -> f32 configuration for each kernel's shapes.
fn features(adapter: &wgpu::Adapter) -> Option<(Features, bool)> {
    // SAFETY: the hal adapter is only read, while `adapter` is alive.
    let hal_adapter = unsafe { adapter.as_hal::<hal::api::Vulkan>() }?;
    if !hal_adapter.physical_device_capabilities().supports_extension(EXTENSION) {
        return None;
    }
    let shared = hal_adapter.shared_instance();
    let instance = shared.raw_instance();
    let device = hal_adapter.raw_physical_device();
    let mut have = Features::none();
    let mut features = vk::PhysicalDeviceFeatures2 {
        p_next: (&mut have as *mut Features).cast(),
        ..Default::default()
    };
    let mut props = Properties {
        s_type: PROPERTIES,
        p_next: std::ptr::null_mut(),
        workgroup_scope_max_workgroup_size: 0,
        flexible_dimensions_max_dimension: 0,
        workgroup_scope_reserved_shared_memory: 0,
    };
    let mut properties = vk::PhysicalDeviceProperties2 {
        p_next: (&mut props as *mut Properties).cast(),
        ..Default::default()
    };
    // SAFETY: both chains hold one structure of the extension the device reports, each
    // with its own sType and a null pNext.
    unsafe {
        instance.get_physical_device_features2(device, &mut features);
        instance.get_physical_device_properties2(device, &mut properties);
    }
    let configs = flexible(shared, device);
    let usable = have.workgroup_scope == vk::TRUE
        && have.flexible_dimensions == vk::TRUE
        && have.tensor_addressing == vk::TRUE
        && props.workgroup_scope_max_workgroup_size >= WORKGROUP
        && props.flexible_dimensions_max_dimension >= SIDE
        // (Where the list cannot be read, the GEMM is still tried, as it ran on the H200
        // before this check; the attention is not.)
        && (configs.is_empty() || runs(&configs, GEMM_SHAPES));
    let attention = runs(&configs, ATTN_SHAPES);
    usable.then_some((Features { p_next: std::ptr::null_mut(), ..have }, attention))
}

/// Whether `adapter` runs the GEMM (`features`), and whether the prefill attention too.
pub fn supported(adapter: &wgpu::Adapter) -> Option<bool> {
    features(adapter).map(|(_, attention)| attention)
}

/// Opens `adapter` with `desc`'s features and limits plus every feature of the extension it
/// reports (as the standalone probe that ran on the H200 did).
pub fn open(
    adapter: &wgpu::Adapter,
    desc: &wgpu::DeviceDescriptor<'_>,
) -> Result<(wgpu::Device, wgpu::Queue), String> {
    // The structure must outlive vkCreateDevice, which runs inside `open_with_callback`.
    let mut enable = Box::new(features(adapter).ok_or("no VK_NV_cooperative_matrix2")?.0);
    let enable_ptr: *mut Features = &mut *enable;
    let opened = {
        // SAFETY: as in `features`.
        let hal_adapter =
            unsafe { adapter.as_hal::<hal::api::Vulkan>() }.ok_or("not a Vulkan adapter")?;
        let callback = move |args: hal::vulkan::CreateDeviceCallbackArgs<'_, '_, '_>| {
            args.extensions.push(EXTENSION);
            // SAFETY: `enable` lives until after the call; it is put at the head of the
            // chain wgpu built, which it links to.
            unsafe {
                (*enable_ptr).p_next = args.create_info.p_next as *mut c_void;
                args.create_info.p_next = enable_ptr as *const c_void;
            }
        };
        // SAFETY: the callback only adds an extension the adapter has and its features
        // structure as the adapter reported it; wgpu's own features and limits are `desc`'s.
        unsafe {
            hal_adapter.open_with_callback(
                desc.required_features,
                &desc.required_limits,
                &desc.memory_hints,
                Some(Box::new(callback)),
            )
        }
        .map_err(|e| e.to_string())?
    };
    drop(enable);
    // SAFETY: the device was opened from this adapter's hal adapter with `desc`'s features.
    unsafe { adapter.create_device_from_hal(opened, desc) }.map_err(|e| e.to_string())
}

/// The SPIR-V of `gemm_cm2.comp`, one build per unroll (64-column loads per iteration), and
/// of its GLU build.
const GEMM_SPIRV: [(u32, &[u8]); 4] = [
    (8, include_bytes!("shaders/spirv/gemm_cm2_un8.spv")),
    (4, include_bytes!("shaders/spirv/gemm_cm2_un4.spv")),
    (2, include_bytes!("shaders/spirv/gemm_cm2_un2.spv")),
    (1, include_bytes!("shaders/spirv/gemm_cm2_un1.spv")),
];
const GLU_SPIRV: [(u32, &[u8]); 4] = [
    (8, include_bytes!("shaders/spirv/gemm_cm2_glu_un8.spv")),
    (4, include_bytes!("shaders/spirv/gemm_cm2_glu_un4.spv")),
    (2, include_bytes!("shaders/spirv/gemm_cm2_glu_un2.spv")),
    (1, include_bytes!("shaders/spirv/gemm_cm2_glu_un1.spv")),
];

/// The SPIR-V of `attn_prefill_cm2.comp`, one build per head dim, writing f32 and f16.
const ATTN_SPIRV: [(u32, &[u8]); 2] = [
    (64, include_bytes!("shaders/spirv/attn_prefill_cm2_hd64.spv")),
    (128, include_bytes!("shaders/spirv/attn_prefill_cm2_hd128.spv")),
];
const ATTN_HALF_SPIRV: [(u32, &[u8]); 2] = [
    (64, include_bytes!("shaders/spirv/attn_prefill_cm2_hd64_half.spv")),
    (128, include_bytes!("shaders/spirv/attn_prefill_cm2_hd128_half.spv")),
];
/// The attention's workgroup (invocations) and query tokens per workgroup.
const ATTN_WORKGROUP: u32 = 128;
pub const ATTN_BLOCK: u32 = 64;
/// KV positions per page the attention assumes (the engine's page size), and pages an
/// iteration.
pub const ATTN_PAGE: u32 = 16;
const ATTN_PAGES: u32 = 2;

/// The largest unroll whose loads divide `cols` (a multiple of 64).
pub fn unroll(cols: u32) -> u32 {
    GEMM_SPIRV.iter().map(|&(un, _)| un).find(|&un| cols.is_multiple_of(64 * un)).unwrap_or(1)
}

/// Whether the attention has a build for heads of `head_dim` whose shared memory fits in
/// `limit` bytes: an iteration's keys and values (32 rows of f16 each and 16 bytes of
/// padding), and six words a query row.
pub fn attention_fits(head_dim: u32, limit: u32) -> bool {
    let shared = 2 * (ATTN_PAGES * ATTN_PAGE) * (head_dim * 2 + 16) + 6 * ATTN_BLOCK * 4;
    ATTN_SPIRV.iter().any(|&(hd, _)| hd == head_dim) && shared <= limit
}

/// The GEMM's pipeline (its GLU build where `glu`) at unroll `un`, on `layout` (its
/// bindings and 64 bytes of immediates: `split_gemm.wgsl`'s gemm pass's).
pub fn gemm_pipeline(
    device: &wgpu::Device,
    layout: &wgpu::PipelineLayout,
    un: u32,
    glu: bool,
    label: &str,
) -> wgpu::ComputePipeline {
    let (builds, name) = match glu {
        true => (&GLU_SPIRV, format!("gemm_cm2_glu_un{un}.spv")),
        false => (&GEMM_SPIRV, format!("gemm_cm2_un{un}.spv")),
    };
    let bytes = builds.iter().find(|&&(u, _)| u == un).expect("a built unroll").1;
    let bytes = trial_build(&name).unwrap_or(bytes.to_vec());
    pipeline(device, layout, &bytes, WORKGROUP, label)
}

/// The prefill attention's pipeline for heads of `head_dim`, writing f16 where `half`, on
/// `layout` (the prefill attention's bindings and immediates).
pub fn attention_pipeline(
    device: &wgpu::Device,
    layout: &wgpu::PipelineLayout,
    head_dim: u32,
    half: bool,
    label: &str,
) -> wgpu::ComputePipeline {
    let (builds, name) = match half {
        true => (&ATTN_HALF_SPIRV, format!("attn_prefill_cm2_hd{head_dim}_half.spv")),
        false => (&ATTN_SPIRV, format!("attn_prefill_cm2_hd{head_dim}.spv")),
    };
    let bytes = builds.iter().find(|&&(hd, _)| hd == head_dim).expect("a built head dim").1;
    let bytes = trial_build(&name).unwrap_or(bytes.to_vec());
    pipeline(device, layout, &bytes, ATTN_WORKGROUP, label)
}

/// For kernel trials on the GPU machine, which has no Rust toolchain: where
/// `CELLM_GPU_SPIRV_DIR` holds a file of the build's name (a variant compiled by
/// tools/compile_spirv.sh's recipe with the same bindings, immediates and workgroup), it
/// replaces the embedded build, read at load. Unchecked: a module that does not match the
/// layout is undefined behaviour in the driver, so this is for experiments only.
fn trial_build(name: &str) -> Option<Vec<u8>> {
    let dir = std::env::var_os("CELLM_GPU_SPIRV_DIR")?;
    std::fs::read(std::path::Path::new(&dir).join(name)).ok()
}

/// A compute pipeline from SPIR-V `bytes` whose `main` has `workgroup` invocations.
fn pipeline(
    device: &wgpu::Device,
    layout: &wgpu::PipelineLayout,
    bytes: &[u8],
    workgroup: u32,
    label: &str,
) -> wgpu::ComputePipeline {
    let words: Vec<u32> =
        bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    // SAFETY: the module is SPIR-V tools/compile_spirv.sh made from the sources in shaders/
    // (their hashes and declared bindings are checked by tests/test_spirv.py; a trial build's
    // are its user's to match), on a device opened with the extension and features it
    // declares (`open`); its bindings and immediates are the layout's.
    let module = unsafe {
        device.create_shader_module_passthrough(wgpu::ShaderModuleDescriptorPassthrough {
            label: Some(label),
            entry_points: std::borrow::Cow::Owned(vec![wgpu::PassthroughShaderEntryPoint {
                name: "main".into(),
                workgroup_size: (workgroup, 1, 1),
            }]),
            spirv: Some(std::borrow::Cow::Owned(words)),
            ..Default::default()
        })
    };
    device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some(label),
        layout: Some(layout),
        module: &module,
        entry_point: Some("main"),
        compilation_options: Default::default(),
        cache: None,
    })
}
