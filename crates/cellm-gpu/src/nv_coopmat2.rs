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

/// The GEMM's workgroup (256 invocations) and its largest matrix side (128).
const WORKGROUP: u32 = 256;
const SIDE: u32 = 128;

/// The extension's features `adapter` (Vulkan) reports, where it has what
/// `shaders/gemm_cm2.comp` needs: workgroup scope, flexible dimensions and tensor addressing,
/// workgroups of 256 and matrices of 128 a side. (The f16 x f16 -> f32 configurations at 256
/// invocations are the driver's to check when the pipeline is made; NVIDIA's list them.)
fn features(adapter: &wgpu::Adapter) -> Option<Features> {
    // SAFETY: the hal adapter is only read, while `adapter` is alive.
    let hal_adapter = unsafe { adapter.as_hal::<hal::api::Vulkan>() }?;
    if !hal_adapter.physical_device_capabilities().supports_extension(EXTENSION) {
        return None;
    }
    let instance = hal_adapter.shared_instance().raw_instance();
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
    let usable = have.workgroup_scope == vk::TRUE
        && have.flexible_dimensions == vk::TRUE
        && have.tensor_addressing == vk::TRUE
        && props.workgroup_scope_max_workgroup_size >= WORKGROUP
        && props.flexible_dimensions_max_dimension >= SIDE;
    usable.then_some(Features { p_next: std::ptr::null_mut(), ..have })
}

/// Whether `adapter` has what the GEMM needs (`features`).
pub fn supported(adapter: &wgpu::Adapter) -> bool {
    features(adapter).is_some()
}

/// Opens `adapter` with `desc`'s features and limits plus every feature of the extension it
/// reports (as the standalone probe that ran on the H200 did).
pub fn open(
    adapter: &wgpu::Adapter,
    desc: &wgpu::DeviceDescriptor<'_>,
) -> Result<(wgpu::Device, wgpu::Queue), String> {
    // The structure must outlive vkCreateDevice, which runs inside `open_with_callback`.
    let mut enable = Box::new(features(adapter).ok_or("no VK_NV_cooperative_matrix2")?);
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

/// The SPIR-V of `gemm_cm2.comp`, one build per unroll (64-column loads per iteration).
const GEMM_SPIRV: [(u32, &[u8]); 4] = [
    (8, include_bytes!("shaders/spirv/gemm_cm2_un8.spv")),
    (4, include_bytes!("shaders/spirv/gemm_cm2_un4.spv")),
    (2, include_bytes!("shaders/spirv/gemm_cm2_un2.spv")),
    (1, include_bytes!("shaders/spirv/gemm_cm2_un1.spv")),
];

/// The SPIR-V of `attn_prefill_cm2.comp`, one build per head dim.
const ATTN_SPIRV: [(u32, &[u8]); 2] = [
    (64, include_bytes!("shaders/spirv/attn_prefill_cm2_hd64.spv")),
    (128, include_bytes!("shaders/spirv/attn_prefill_cm2_hd128.spv")),
];
/// The attention's workgroup (invocations) and query tokens per workgroup.
const ATTN_WORKGROUP: u32 = 128;
pub const ATTN_BLOCK: u32 = 64;
/// KV positions per page the attention assumes (the engine's page size).
pub const ATTN_PAGE: u32 = 16;

/// The largest unroll whose loads divide `cols` (a multiple of 64).
pub fn unroll(cols: u32) -> u32 {
    GEMM_SPIRV.iter().map(|&(un, _)| un).find(|&un| cols.is_multiple_of(64 * un)).unwrap_or(1)
}

/// Whether the attention has a build for heads of `head_dim`.
pub fn attention_head_dim(head_dim: u32) -> bool {
    ATTN_SPIRV.iter().any(|&(hd, _)| hd == head_dim)
}

/// The GEMM's pipeline at unroll `un`, on `layout` (its bindings and 64 bytes of
/// immediates: `split_gemm.wgsl`'s gemm pass's).
pub fn gemm_pipeline(
    device: &wgpu::Device,
    layout: &wgpu::PipelineLayout,
    un: u32,
    label: &str,
) -> wgpu::ComputePipeline {
    let bytes = GEMM_SPIRV.iter().find(|&&(u, _)| u == un).expect("a built unroll").1;
    pipeline(device, layout, bytes, WORKGROUP, label)
}

/// The prefill attention's pipeline for heads of `head_dim`, on `layout` (the prefill
/// attention's bindings and immediates).
pub fn attention_pipeline(
    device: &wgpu::Device,
    layout: &wgpu::PipelineLayout,
    head_dim: u32,
    label: &str,
) -> wgpu::ComputePipeline {
    let bytes = ATTN_SPIRV.iter().find(|&&(hd, _)| hd == head_dim).expect("a built head dim").1;
    pipeline(device, layout, bytes, ATTN_WORKGROUP, label)
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
    // (their hashes and declared bindings are checked by tests/test_spirv.py), on a device
    // opened with the extension and features it declares (`open`); its bindings and
    // immediates are the layout's.
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
