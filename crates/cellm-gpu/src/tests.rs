//! The GPU's weight layouts against the CPU's decoding (itself checked against llama.cpp's
//! `gguf.quants` in tests/test_quant_formats.py), and every kernel through naga's Metal
//! writer. Where no Vulkan adapter exists the device tests say so and pass, unless
//! CELLM_REQUIRE_GPU is set (CI sets it, with lavapipe installed).

use cellm_format::{TensorFormat, INTERLEAVE};
use cellm_kernels::dot::x8::group_of_rows;
use cellm_kernels::{decode_row_raw, WeightRows};
use half::f16;

use crate::device::{Gpu, GpuKind};
use crate::kernels::{KernelId, Kernels, OneShape, D16_DEFAULT, I8_DEFAULT};
use crate::model::{matvec_params, MatvecArgs};
use crate::repack::Layout;
use crate::weights::{as_bytes, Uploader};

fn gpu() -> Option<Gpu> {
    match Gpu::open(GpuKind::Vulkan) {
        Ok(g) => Some(g),
        Err(e) if std::env::var_os("CELLM_REQUIRE_GPU").is_some() => panic!("{e}"),
        Err(e) => {
            eprintln!("GPU test skipped: {e}");
            None
        }
    }
}

/// A small deterministic generator (xorshift).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// `rows` random rows of `format`: random bytes, with every f16 scale field of a block
/// set to a small finite value (random bytes there would be NaNs and infinities).
fn random_rows(format: TensorFormat, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let halves_at: &[usize] = match format {
        TensorFormat::Q8_0 | TensorFormat::Q4_0 | TensorFormat::Q5_0 => &[0],
        TensorFormat::Q4K | TensorFormat::Q4_1 => &[0, 2],
        TensorFormat::Q6K => &[208],
        _ => &[],
    };
    let floats = |n: usize, rng: &mut Rng| -> Vec<f32> { (0..n).map(|_| rng.uniform()).collect() };
    match format {
        TensorFormat::F32 => {
            floats(rows * cols, rng).iter().flat_map(|v| v.to_le_bytes()).collect()
        }
        TensorFormat::F16 => floats(rows * cols, rng)
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_bits().to_le_bytes())
            .collect(),
        TensorFormat::BF16 => floats(rows * cols, rng)
            .iter()
            .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
            .collect(),
        _ => {
            let (block, bytes) = (format.block_len(), format.block_bytes());
            let mut data: Vec<u8> =
                (0..rows * cols / block * bytes).map(|_| rng.next() as u8).collect();
            for b in data.chunks_exact_mut(bytes) {
                for &at in halves_at {
                    let h = f16::from_f32(0.05 * rng.uniform()).to_bits().to_le_bytes();
                    b[at..at + 2].copy_from_slice(&h);
                }
            }
            data
        }
    }
}

/// `data` (rows of `base`) regrouped 8 rows at a time into `x8`.
fn interleave(x8: TensorFormat, base: TensorFormat, data: &[u8], rows: usize) -> Vec<u8> {
    let stride = data.len() / rows;
    let mut out = Vec::with_capacity(data.len());
    for g in data.chunks_exact(stride * INTERLEAVE) {
        let r: Vec<&[u8]> = g.chunks_exact(stride).collect();
        let group: [&[u8]; INTERLEAVE] = r.try_into().expect("8 rows");
        out.extend(group_of_rows(x8, &group));
        let _ = base;
    }
    out
}

/// `W x` for `tokens` rows of x on the GPU, through the matvec kernel over every part of
/// the uploaded matrix (a binding cap of `cap` bytes splits it); one token through the wide
/// build where `wide` (and the device has it), else through the one-token build of shape
/// `one`.
#[allow(clippy::too_many_arguments)]
fn gpu_matvec(
    gpu: &Gpu,
    w: WeightRows,
    x: &[f32],
    tokens: usize,
    cap: u64,
    wide: bool,
    f16v4: bool,
    one: OneShape,
) -> (Vec<f32>, usize) {
    let mut up = Uploader::new(gpu, cap);
    let m = up.matrix_rows(&[("w", w)]).expect("upload");
    let mut kernels = Kernels::new(gpu);
    kernels.f16v4 = f16v4;
    kernels.one = one;
    let kernel = kernels.get(&gpu.device, KernelId::Matvec(m.layout));
    let dev = &gpu.device;
    let storage = |label: &str, words: &[u32], extra: wgpu::BufferUsages| {
        use wgpu::util::DeviceExt;
        dev.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some(label),
            contents: as_bytes(words),
            usage: wgpu::BufferUsages::STORAGE | extra,
        })
    };
    let none = wgpu::BufferUsages::empty();
    let xb = storage("x", &x.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), none);
    let yb = storage("y", &vec![0u32; tokens * w.rows], wgpu::BufferUsages::COPY_SRC);
    let dummy = storage("dummy", &[0; 4], none);
    let mut header = vec![0u32; 8];
    header[0] = tokens as u32;
    let step = storage("step", &header, none);
    let read = dev.create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size: (tokens * w.rows * 4) as u64,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let mut enc = dev.create_command_encoder(&Default::default());
    let mut keep = Vec::new();
    for part in &m.parts {
        let (params, groups_x, groups) = matvec_params(&MatvecArgs {
            rows: part.rows,
            cols: w.cols,
            x_stride: w.cols,
            y_stride: w.rows,
            y_col: 0,
            row0: part.row0,
            flags: 0,
            eps: 0.0,
            scale: 1.0,
            softcap: 0.0,
        });
        let pb = dev.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: 64,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        gpu.queue.write_buffer(&pb, 0, as_bytes(&params));
        let mut entries = vec![
            wgpu::BindGroupEntry { binding: 0, resource: pb.as_entire_binding() },
            wgpu::BindGroupEntry { binding: 1, resource: xb.as_entire_binding() },
            wgpu::BindGroupEntry { binding: 2, resource: yb.as_entire_binding() },
            wgpu::BindGroupEntry { binding: 3, resource: dummy.as_entire_binding() },
            wgpu::BindGroupEntry { binding: 4, resource: dummy.as_entire_binding() },
            wgpu::BindGroupEntry { binding: 5, resource: part.quants.as_entire_binding() },
            wgpu::BindGroupEntry { binding: 7, resource: step.as_entire_binding() },
        ];
        if let Some(s) = &part.scales {
            entries.push(wgpu::BindGroupEntry { binding: 6, resource: s.as_entire_binding() });
        }
        if kernel.immediates {
            entries.retain(|e| e.binding != 0);
        }
        let group = dev.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &kernel.layout,
            entries: &entries,
        });
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.set_bind_group(0, &group, &[]);
            let t = tokens as u32;
            let imm = |pass: &mut wgpu::ComputePass<'_>| {
                if kernel.immediates {
                    pass.set_immediates(0, as_bytes(&params));
                }
            };
            match kernel.gemm_for(t, w.cols as u32, groups) {
                Some((gemm, (x, y, z))) => {
                    pass.set_pipeline(gemm);
                    imm(&mut pass);
                    pass.dispatch_workgroups(x, y, z);
                }
                None => {
                    let split = match (&kernel.wide, wide && t == 1) {
                        (Some((p, _)), true) => {
                            pass.set_pipeline(p);
                            1
                        }
                        _ => {
                            let (p, split) = kernel.for_launch(t, 0, 0);
                            pass.set_pipeline(p);
                            split
                        }
                    };
                    imm(&mut pass);
                    let y = groups.div_ceil(groups_x);
                    pass.dispatch_workgroups(groups_x, y, t.div_ceil(4) * split);
                }
            }
        }
        keep.push(pb);
    }
    enc.copy_buffer_to_buffer(&yb, 0, &read, 0, read.size());
    gpu.queue.submit([enc.finish()]);
    read.slice(..).map_async(wgpu::MapMode::Read, |r| r.expect("map"));
    gpu.wait().expect("device");
    let y = read.slice(..).get_mapped_range().expect("mapped");
    let out = y.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    (out, m.parts.len())
}

/// One-token shapes besides the default that the tests run (`OneShape`).
/// (Each with and without `d16` somewhere, and `d16` with and without int8 x.)
const ONE_SHAPES: [OneShape; 11] = [
    OneShape::LEGACY,
    OneShape { rows: 1, threads: 32, scalar: true, d16: true, i8: false },
    OneShape { rows: 1, threads: 256, scalar: false, d16: false, i8: false },
    OneShape { rows: 4, threads: 64, scalar: true, d16: true, i8: false },
    OneShape { d16: !D16_DEFAULT, ..OneShape::DEFAULT },
    OneShape { d16: !D16_DEFAULT, ..OneShape::LEGACY },
    OneShape { d16: true, i8: !I8_DEFAULT, ..OneShape::DEFAULT },
    OneShape { d16: true, i8: !I8_DEFAULT, ..OneShape::LEGACY },
    OneShape { rows: 1, threads: 32, scalar: true, d16: true, i8: true },
    OneShape { rows: 4, threads: 128, scalar: true, d16: true, i8: true },
    OneShape { rows: 2, threads: 64, scalar: true, d16: true, i8: true },
];

/// Byte ranges of a block's quants (zeroed, the block decodes to its offsets alone) in the
/// formats with an int8-x path (`OneShape::i8`).
fn quant_bytes(format: TensorFormat) -> Option<std::ops::Range<usize>> {
    match format {
        TensorFormat::Q4K => Some(16..144),
        TensorFormat::Q6K => Some(0..192),
        _ => None,
    }
}

/// x as the int8 path rounds it (matvec.wgsl's `i8x`): units of 16 columns (q4_k: 8 at c and
/// 8 at c + 32; q6_k: 16 in a row), each to int8 of one scale max |x| / 127; the values
/// times their scale, and the largest scale.
fn int8_x(format: TensorFormat, x: &[f32]) -> (Vec<f64>, f64) {
    let mut out = vec![0f64; x.len()];
    let mut step = 0f64;
    for u in 0..x.len() / 16 {
        let (c, h) = match format {
            TensorFormat::Q4K => ((u / 4) * 64 + (u % 4) * 8, 32),
            _ => (u * 16, 8),
        };
        let cols: Vec<usize> = (c..c + 8).chain(c + h..c + h + 8).collect();
        let mx = cols.iter().map(|&i| x[i].abs()).fold(0f32, f32::max);
        let inv = if mx > 1e-30 { 127.0 / mx } else { 0.0 };
        let dx = mx * (1.0f32 / 127.0);
        step = step.max(f64::from(dx));
        for &i in &cols {
            out[i] = f64::from((x[i] * inv).round_ties_even()) * f64::from(dx);
        }
    }
    (out, step)
}

/// Every format the GPU runs, plain and interleaved, split into parts and whole, for 1 to 5
/// tokens: within f32 rounding of a float64 product of the CPU's decoded rows.
#[test]
fn matvec_matches_cpu_decoding_in_every_layout() {
    let Some(gpu) = gpu() else { return };
    eprintln!("{}: subgroups {}, coopmat {}", gpu.info.name, gpu.subgroups, gpu.coopmat);
    let coop = gpu.coopmat;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let rows = 24;
    let formats = [
        TensorFormat::F32,
        TensorFormat::F16,
        TensorFormat::BF16,
        TensorFormat::Q8_0,
        TensorFormat::Q4_0,
        TensorFormat::Q4_1,
        TensorFormat::Q5_0,
        TensorFormat::Q4K,
        TensorFormat::Q6K,
    ];
    // 512 columns (the 8-column path) everywhere, 516 (the 4-column one) for f16.
    let cases = formats.iter().map(|&f| (f, 512)).chain([(TensorFormat::F16, 516)]);
    for (base, cols) in cases {
        let data = random_rows(base, rows, cols, &mut rng);
        let mut variants = vec![(base, data.clone())];
        if let Some(x8) = base.interleaved_variant() {
            variants.push((x8, interleave(x8, base, &data, rows)));
        }
        // The rows with their quants zeroed (each block's offsets: q4_k's mins, q6_k's 32
        // times the scale), for the int8 path's reference.
        let offsets = quant_bytes(base).map(|q| {
            let mut z = data.clone();
            for b in z.chunks_exact_mut(base.block_bytes()) {
                b[q.clone()].fill(0);
            }
            z
        });
        for (format, bytes) in variants {
            assert!(Layout::of(format).is_some());
            let w = WeightRows { format, bytes: &bytes, rows, cols };
            for tokens in [1, 5, 70] {
                let x: Vec<f32> = (0..tokens * cols).map(|_| rng.uniform()).collect();
                let row_bytes = (data.len() / rows) as u64 * 2;
                let wide = if tokens == 1 { &[false, true][..] } else { &[false] };
                // f16 also 16 bytes a load (`f16v4`), every other format once.
                let v4s = if base == TensorFormat::F16 { &[false, true][..] } else { &[false] };
                let def = OneShape::DEFAULT;
                let runs = [u64::MAX, row_bytes * 5].into_iter().flat_map(|c| {
                    wide.iter().flat_map(move |&w| v4s.iter().map(move |&v| (c, w, v, def)))
                });
                // One token through the other one-token shapes (whole matrix and parts).
                let shapes = if tokens == 1 { &ONE_SHAPES[..] } else { &[] };
                let runs = runs.chain(shapes.iter().flat_map(|&s| {
                    [(u64::MAX, false, false, s), (row_bytes * 5, false, false, s)]
                }));
                for (cap, wide, v4, one) in runs {
                    let (got, parts) = gpu_matvec(&gpu, w, &x, tokens, cap, wide, v4, one);
                    assert_eq!(parts > 1, cap != u64::MAX, "{format:?}: {parts} parts");
                    let i8 = tokens == 1 && one.d16 && one.i8;
                    let zeroed = offsets.as_ref().filter(|_| i8);
                    let mut decoded = vec![0f32; cols];
                    let mut offset = vec![0f32; cols];
                    for r in 0..rows {
                        decode_row_raw(w, r, &mut decoded);
                        if let Some(z) = zeroed {
                            // The int8 path: x rounded to int8 times the quants' part of each
                            // weight, plus x times the offsets' part; within f32 rounding,
                            // plus two values rounded the other way at a tie (the GPU may
                            // round y * inv before adding 1.5 * 2^23).
                            let wz = WeightRows { format: base, bytes: z, rows, cols };
                            decode_row_raw(wz, r, &mut offset);
                            let (xq, step) = int8_x(base, &x);
                            let mut want = 0f64;
                            let mut mag = 0f64;
                            let mut wmax = 0f64;
                            for i in 0..cols {
                                let a = f64::from(decoded[i]) - f64::from(offset[i]);
                                let o = f64::from(offset[i]) * f64::from(x[i]);
                                want += a * xq[i] + o;
                                mag += (a * xq[i]).abs() + o.abs();
                                wmax = wmax.max(a.abs());
                            }
                            let g = f64::from(got[r]);
                            assert!(
                                (g - want).abs() <= 1e-5 * mag + 2.0 * wmax * step + 1e-6,
                                "{format:?} int8 x {one:?} row {r}: {g} vs {want}"
                            );
                            continue;
                        }
                        for t in 0..tokens {
                            let xs = &x[t * cols..(t + 1) * cols];
                            let want: f64 = decoded
                                .iter()
                                .zip(xs)
                                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                                .sum();
                            let mag: f64 =
                                decoded.iter().zip(xs).map(|(a, b)| f64::from((a * b).abs())).sum();
                            let g = f64::from(got[t * rows + r]);
                            // The cooperative-matrix GEMM rounds W and x to f16 (relative
                            // 2^-11 each, so 2^-10 a product at most), then sums in f32.
                            let rel = if coop && tokens >= 8 { 1.0 / 1024.0 } else { 1e-5 };
                            assert!(
                                (g - want).abs() <= rel * mag + 1e-6,
                                "{format:?} row {r} token {t}: {g} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Metal without a Mac: every kernel's WGSL validates and translates to MSL with naga.
#[test]
fn every_kernel_translates_to_metal() {
    use naga::back::msl;
    use naga::valid::{Capabilities, ValidationFlags, Validator};
    let variants = KernelId::all()
        .into_iter()
        .flat_map(|id| {
            [false, true]
                .map(|sg| [(id, sg, 4, 64), (id, sg, 1, 64), (id, sg, 1, 256), (id, sg, 0, 64)])
        })
        .flatten();
    let f16 = KernelId::all().into_iter().filter(|id| format!("{id:?}").contains("(F16"));
    let f16v4 = f16.flat_map(|id| {
        [false, true]
            .map(|sg| [(id, sg, 4, 64, true), (id, sg, 1, 64, true), (id, sg, 0, 64, true)])
    });
    let f16v4 = f16v4.flatten();
    let variants = variants.map(|(id, sg, t, wg)| (id, sg, t, wg, false, OneShape::LEGACY));
    let variants =
        variants.chain(f16v4.map(|(id, sg, t, wg, v)| (id, sg, t, wg, v, OneShape::LEGACY)));
    // The one-token build's other shapes.
    let shapes = KernelId::all().into_iter().filter(|id| id.per_token_count()).flat_map(|id| {
        ONE_SHAPES.into_iter().chain([OneShape::DEFAULT]).flat_map(move |s| {
            [false, true].map(|sg| {
                let s = s.for_device(sg);
                (id, sg, 1, s.threads, false, s)
            })
        })
    });
    for (id, subgroups, tokens, wg, v4, one) in variants.chain(shapes) {
        let src = id.source_shape(subgroups, tokens, wg, v4, one);
        let module = naga::front::wgsl::parse_str(&src)
            .unwrap_or_else(|e| panic!("{id:?}: {}", e.emit_to_string(&src)));
        // pack2x16float / unpack2x16float (f16 KV and weights in u32 words) need only this,
        // which wgpu grants on Metal and Vulkan alike.
        // Subgroup operations where the device has them (wgpu asks for them then).
        let caps = Capabilities::SHADER_FLOAT16_IN_FLOAT32 | Capabilities::SUBGROUP;
        let info = Validator::new(ValidationFlags::all(), caps)
            .subgroup_stages(naga::valid::ShaderStages::COMPUTE)
            .subgroup_operations(naga::valid::SubgroupOperationSet::all())
            .validate(&module)
            .unwrap_or_else(|e| panic!("{id:?}: {}", e.emit_to_string(&src)));
        let (msl, _) = msl::write_string(
            &module,
            &info,
            &msl::Options::default(),
            &msl::PipelineOptions::default(),
        )
        .unwrap_or_else(|e| panic!("{id:?}: {e}"));
        assert!(msl.contains("kernel void main_"), "{id:?}: no compute entry point in\n{msl}");
    }
}

/// The cooperative-matrix GEMM of every layout (plain and GLU), and the cooperative prefill
/// attention of every head dim it takes, validate with naga's
/// cooperative-matrix and f16 capabilities and translates to SPIR-V (it runs on Vulkan only;
/// lavapipe has no cooperative matrices, so on CI it is built here but not run).
#[test]
fn coop_gemm_translates_to_spirv() {
    use crate::kernels::{CoopPipe, CoopTile, PIPE_FOR_TEST, TILE_FOR_TEST};
    use naga::back::spv;
    use naga::valid::{Capabilities, ValidationFlags, Validator};
    let gemms = KernelId::all().into_iter().filter(|id| id.per_token_count());
    // And the cooperative prefill attention of every head dim it takes.
    let attn = [16, 32, 64, 80, 96, 128].map(KernelId::AttnPrefillCoop);
    // The default tiles, then the others `CELLM_GPU_COOP_TILE_MV` may pick (plain GEMMs).
    let tile = |sgr, sgc, wr, wc, bk| Some(CoopTile { sgr, sgc, wr, wc, bk });
    let others =
        [tile(2, 4, 4, 2, 32), tile(2, 2, 4, 4, 32), tile(2, 2, 4, 4, 64), tile(2, 2, 4, 2, 64)];
    let plain = KernelId::all().into_iter().filter(|id| id.per_token_count());
    let plain = plain.filter(|id| !matches!(id, KernelId::Glu(_)));
    // And every GEMM with and without the register prefetch, whatever its layout.
    let pipes = [Some(false), Some(true)].map(|prefetch| CoopPipe { prefetch });
    let gemms2 = KernelId::all().into_iter().filter(|id| id.per_token_count());
    let cases = gemms.chain(attn).map(|id| (id, None, None));
    let cases =
        cases.chain(gemms2.flat_map(move |id| pipes.into_iter().map(move |p| (id, None, Some(p)))));
    let cases =
        cases.chain(others.into_iter().flat_map(|t| plain.clone().map(move |id| (id, t, None))));
    for (id, t, p) in cases {
        if let Some(t) = t {
            assert!(t.valid(false), "{t:?}");
        }
        TILE_FOR_TEST.with(|c| c.set(t));
        PIPE_FOR_TEST.with(|c| c.set(p));
        let src = id.source(true, crate::kernels::COOP_BUILD);
        TILE_FOR_TEST.with(|c| c.set(None));
        PIPE_FOR_TEST.with(|c| c.set(None));
        if let Some(p) = p.filter(|_| id.has_gemm()) {
            assert_eq!(src.contains("let kn"), p.prefetch == Some(true), "{id:?}");
        }
        let module = naga::front::wgsl::parse_str(&src)
            .unwrap_or_else(|e| panic!("{id:?}: {}", e.emit_to_string(&src)));
        let caps = Capabilities::SHADER_FLOAT16_IN_FLOAT32
            | Capabilities::SUBGROUP
            | Capabilities::SHADER_FLOAT16
            | Capabilities::COOPERATIVE_MATRIX;
        let info = Validator::new(ValidationFlags::all(), caps)
            .subgroup_stages(naga::valid::ShaderStages::COMPUTE)
            .subgroup_operations(naga::valid::SubgroupOperationSet::all())
            .validate(&module)
            .unwrap_or_else(|e| panic!("{id:?}: {}", e.emit_to_string(&src)));
        let words = spv::write_vec(&module, &info, &spv::Options::default(), None)
            .unwrap_or_else(|e| panic!("{id:?}: {e}"));
        assert!(words.len() > 100, "{id:?}");
        if let Some(dir) = std::env::var_os("CELLM_DUMP_SPV") {
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            let name = format!("{id:?}.spv").replace(['(', ')'], "_");
            std::fs::write(std::path::Path::new(&dir).join(name), bytes).expect("dump");
        }
    }
}

mod attn;
