//! The prefill attention kernel, and the decode kernel with its combine, against a float64
//! attention over the same paged KV pool: sessions that start mid-context, blocks of query
//! tokens that span sessions, page boundaries inside key tiles, GQA, sliding windows,
//! soft-capping, f16 and f32 KV, head dims 16 to 256 (8 and 4 lanes a query row).

use half::f16;
use wgpu::util::DeviceExt;

use super::{gpu, Rng};
use crate::attn_prefill::{Tile, BQ};
use crate::device::Gpu;
use crate::kernels::{KernelId, Kernels};
use crate::weights::as_bytes;

const PAGE: usize = 16;
const LAYERS: usize = 2;
/// The layer attended to (layer 0's page tables point at the wrong pages).
const LAYER: usize = 1;

#[derive(Clone, Copy, Debug)]
struct Case {
    head_dim: usize,
    heads: usize,
    kv_heads: usize,
    f16: bool,
    window: usize,
    softcap: f32,
}

/// A step over paged KV: per token its position and session, per session its pages.
struct Setup {
    case: Case,
    pos: Vec<usize>,
    session: Vec<usize>,
    tables: Vec<Vec<u32>>,
    /// The pool as the kernels read it, and decoded to f32.
    pool_words: Vec<u32>,
    pool: Vec<f32>,
    q: Vec<f32>,
}

impl Setup {
    /// Sessions as (cached positions before the step, new tokens).
    fn new(case: Case, sessions: &[(usize, usize)], rng: &mut Rng) -> Self {
        let kv_dim = case.kv_heads * case.head_dim;
        let pages: usize = sessions.iter().map(|&(s, n)| (s + n).div_ceil(PAGE)).sum();
        // Pages handed out in a scrambled order, so neighbours in a table are not in the pool.
        let mut ids: Vec<u32> = (0..pages as u32).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.next() as usize % (i + 1));
        }
        let mut tables = Vec::new();
        let (mut pos, mut session) = (Vec::new(), Vec::new());
        for (i, &(start, n)) in sessions.iter().enumerate() {
            tables.push(ids.drain(..(start + n).div_ceil(PAGE)).collect());
            pos.extend(start..start + n);
            session.extend(std::iter::repeat_n(i, n));
        }
        let values = pages * 2 * PAGE * kv_dim;
        let mut pool: Vec<f32> = (0..values).map(|_| rng.uniform()).collect();
        let pool_words = if case.f16 {
            let h: Vec<f16> = pool.iter().map(|&v| f16::from_f32(v)).collect();
            pool = h.iter().map(|v| v.to_f32()).collect();
            h.chunks_exact(2)
                .map(|p| u32::from(p[0].to_bits()) | u32::from(p[1].to_bits()) << 16)
                .collect()
        } else {
            pool.iter().map(|v| v.to_bits()).collect()
        };
        let row = (case.heads + 2 * case.kv_heads) * case.head_dim;
        // Queries scaled up so the softmax is far from flat.
        let q = (0..pos.len() * row).map(|_| 3.0 * rng.uniform()).collect();
        Setup { case, pos, session, tables, pool_words, pool, q }
    }

    fn scale(&self) -> f32 {
        1.0 / (self.case.head_dim as f32).sqrt()
    }

    /// Float64 attention of every token and head: out[(t * heads + h) * head_dim + d].
    fn reference(&self) -> Vec<f64> {
        let Case { head_dim: hd, heads, kv_heads, window, softcap, .. } = self.case;
        let kv_dim = kv_heads * hd;
        let row = (heads + 2 * kv_heads) * hd;
        let mut out = vec![0f64; self.pos.len() * heads * hd];
        for (t, &pos) in self.pos.iter().enumerate() {
            let table = &self.tables[self.session[t]];
            let first = if window != 0 { (pos + 1).saturating_sub(window) } else { 0 };
            for h in 0..heads {
                let kvh = h / (heads / kv_heads);
                let q = &self.q[t * row + h * hd..t * row + (h + 1) * hd];
                let at = |p: usize, plane: usize| {
                    let page = table[p / PAGE] as usize;
                    ((page * 2 + plane) * PAGE + p % PAGE) * kv_dim + kvh * hd
                };
                let scores: Vec<f64> = (first..=pos)
                    .map(|p| {
                        let k = &self.pool[at(p, 0)..at(p, 0) + hd];
                        let s: f64 =
                            q.iter().zip(k).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum();
                        let s = s * f64::from(self.scale());
                        if softcap != 0.0 {
                            let c = f64::from(softcap);
                            c * (s / c).tanh()
                        } else {
                            s
                        }
                    })
                    .collect();
                let m = scores.iter().copied().fold(f64::MIN, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let l: f64 = e.iter().sum();
                for (j, p) in (first..=pos).enumerate() {
                    let v = &self.pool[at(p, 1)..at(p, 1) + hd];
                    for d in 0..hd {
                        out[(t * heads + h) * hd + d] += e[j] / l * f64::from(v[d]);
                    }
                }
            }
        }
        out
    }

    /// The step buffer (`shaders/step.wgsl`) with `split_len` positions a split.
    fn step_words(&self, split_len: usize) -> Vec<u32> {
        let t = self.pos.len();
        let ctx = self.pos.iter().max().map_or(1, |p| p + 1);
        let offsets: Vec<usize> =
            self.tables.iter().scan(0, |o, tb| Some(std::mem::replace(o, *o + tb.len()))).collect();
        let stride: usize = self.tables.iter().map(Vec::len).sum();
        let mut w = vec![t as u32, 0, stride as u32, t as u32, 0, 0];
        w.extend([split_len as u32, ctx.div_ceil(split_len) as u32]);
        for (i, &p) in self.pos.iter().enumerate() {
            w.extend([0, p as u32, offsets[self.session[i]] as u32, 0]);
        }
        for layer in 0..LAYERS {
            for tb in &self.tables {
                w.extend(tb.iter().map(|&id| if layer == LAYER { id } else { 0 }));
            }
        }
        w
    }

    /// The attention kernels' parameters (`Params` of `shaders/attention.wgsl`).
    fn params(&self) -> [u32; 16] {
        let c = self.case;
        let mut p = [0u32; 16];
        p[..12].copy_from_slice(&[
            PAGE as u32,
            (c.kv_heads * c.head_dim) as u32,
            u32::from(c.f16),
            0,
            c.heads as u32,
            c.kv_heads as u32,
            c.head_dim as u32,
            ((c.heads + 2 * c.kv_heads) * c.head_dim) as u32,
            LAYER as u32,
            c.window as u32,
            self.scale().to_bits(),
            c.softcap.to_bits(),
        ]);
        p
    }
}

struct Bufs<'a> {
    gpu: &'a Gpu,
    step: wgpu::Buffer,
    params: wgpu::Buffer,
    /// The same parameters, for kernels that take them as immediates.
    params_words: [u32; 16],
    qkv: wgpu::Buffer,
    pool: wgpu::Buffer,
    ctx: wgpu::Buffer,
}

impl<'a> Bufs<'a> {
    fn new(gpu: &'a Gpu, s: &Setup, split_len: usize) -> Self {
        let init = |words: &[u32], usage: wgpu::BufferUsages| {
            gpu.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: None,
                contents: as_bytes(words),
                usage,
            })
        };
        let read = wgpu::BufferUsages::STORAGE;
        let q: Vec<u32> = s.q.iter().map(|v| v.to_bits()).collect();
        let out = vec![0u32; s.pos.len() * s.case.heads * s.case.head_dim];
        Bufs {
            gpu,
            step: init(&s.step_words(split_len), read),
            params: init(&s.params(), wgpu::BufferUsages::UNIFORM),
            params_words: s.params(),
            qkv: init(&q, read),
            pool: init(&s.pool_words, read),
            ctx: init(&out, read | wgpu::BufferUsages::COPY_SRC),
        }
    }

    /// Runs `id` over `grid` with `binds` (besides the params at 0 and the step at 7).
    fn launch(
        &self,
        kernels: &mut Kernels,
        id: KernelId,
        binds: &[(u32, &wgpu::Buffer)],
        grid: (u32, u32, u32),
    ) {
        let dev = &self.gpu.device;
        let kernel = kernels.get(dev, id);
        let mut entries = vec![
            wgpu::BindGroupEntry { binding: 0, resource: self.params.as_entire_binding() },
            wgpu::BindGroupEntry { binding: 7, resource: self.step.as_entire_binding() },
        ];
        entries.extend(binds.iter().map(|(b, buf)| wgpu::BindGroupEntry {
            binding: *b,
            resource: buf.as_entire_binding(),
        }));
        if kernel.immediates {
            entries.retain(|e| e.binding != 0);
        }
        let group = dev.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &kernel.layout,
            entries: &entries,
        });
        let mut enc = dev.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.set_pipeline(kernel.for_launch(4, 0, 0).0);
            pass.set_bind_group(0, &group, &[]);
            if kernel.immediates {
                pass.set_immediates(0, as_bytes(&self.params_words));
            }
            pass.dispatch_workgroups(grid.0, grid.1, grid.2);
        }
        self.gpu.queue.submit([enc.finish()]);
    }

    fn read_ctx(&self) -> Vec<f32> {
        let dev = &self.gpu.device;
        let size = self.ctx.size();
        let read = dev.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut enc = dev.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(&self.ctx, 0, &read, 0, size);
        self.gpu.queue.submit([enc.finish()]);
        read.slice(..).map_async(wgpu::MapMode::Read, |r| r.expect("map"));
        self.gpu.wait().expect("device");
        let view = read.slice(..).get_mapped_range().expect("mapped");
        view.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }
}

/// Largest |got - want|.
fn max_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter().zip(want).map(|(g, w)| (f64::from(*g) - w).abs()).fold(0.0, f64::max)
}

#[test]
fn attention_kernels_match_float64() {
    let Some(gpu) = gpu() else { return };
    let mut kernels = Kernels::new(&gpu);
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let case = |head_dim, heads, kv_heads, f16, window, softcap| Case {
        head_dim,
        heads,
        kv_heads,
        f16,
        window,
        softcap,
    };
    let cases = [
        case(64, 4, 2, true, 0, 0.0),
        case(128, 2, 1, false, 20, 0.0),
        case(256, 4, 1, true, 0, 50.0),
        case(32, 3, 3, false, 7, 30.0),
        case(96, 2, 1, true, 33, 0.0),
        case(16, 4, 2, false, 0, 0.0),
        case(80, 4, 2, true, 9, 0.0),
    ];
    // A prefill from scratch (37 tokens: blocks of 16 end mid-session), a continuation from
    // position 50, a lone decode token, and a prefill whose window starts mid-page.
    let sessions = [(0, 37), (50, 21), (100, 1), (3, 40)];
    for c in cases {
        let s = Setup::new(c, &sessions, &mut rng);
        let want = s.reference();
        let t = s.pos.len() as u32;
        let (heads, hd) = (c.heads as u32, c.head_dim as u32);
        // Outputs are convex combinations of values in [-1, 1]; f32 dot products of at most
        // 256 terms and softmax sums over at most 141 positions round at a few 1e-6.
        let tol = 2e-5;
        let split_len = 32;
        let b = Bufs::new(&gpu, &s, split_len);
        b.launch(
            &mut kernels,
            KernelId::AttnPrefill(hd),
            &[(1, &b.qkv), (2, &b.ctx), (5, &b.pool)],
            (heads, t.div_ceil(BQ), 1),
        );
        let err = max_err(&b.read_ctx(), &want);
        eprintln!("{c:?}: prefill kernel within {err:.2e}");
        assert!(err <= tol, "{c:?}: prefill kernel off by {err}");
        // The decode kernels for splits of 32 positions (4 threads score a position), 64 (2)
        // and 100 (1).
        for split_len in [32, 64, 100] {
            // The decode kernel and its combine, as the harness's own check.
            let ctx = s.pos.iter().max().unwrap() + 1;
            let splits = ctx.div_ceil(split_len) as u32;
            let part = vec![0u32; s.pos.len() * c.heads * splits as usize * (c.head_dim + 2)];
            let part = gpu.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: None,
                contents: as_bytes(&part),
                usage: wgpu::BufferUsages::STORAGE,
            });
            let d = Bufs::new(&gpu, &s, split_len);
            d.launch(
                &mut kernels,
                KernelId::Attention,
                &[(1, &d.qkv), (2, &part), (3, &d.ctx), (5, &d.pool), (6, &d.pool)],
                (heads, t, splits),
            );
            let mut p = [0u32; 16];
            p[..2].copy_from_slice(&[heads, hd]);
            let combine = Bufs {
                params: gpu.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: None,
                    contents: as_bytes(&p),
                    usage: wgpu::BufferUsages::UNIFORM,
                }),
                params_words: p,
                ..d
            };
            // One split writes its output itself; more are merged by the combine (as in a step).
            if splits > 1 {
                combine.launch(
                    &mut kernels,
                    KernelId::AttnCombine,
                    &[(1, &part), (2, &combine.ctx)],
                    (heads, t, 1),
                );
            }
            let err = max_err(&combine.read_ctx(), &want);
            eprintln!("{c:?}: decode kernel within {err:.2e}");
            assert!(err <= tol, "{c:?}: decode kernel off by {err}");
            // The build whose last split merges the splits itself, twice over the same counts
            // (the last split of each (token, head) sets its count back to zero).
            let done = gpu.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: None,
                contents: as_bytes(&vec![0u32; s.pos.len() * c.heads]),
                usage: wgpu::BufferUsages::STORAGE,
            });
            for round in 0..2 {
                let f = Bufs::new(&gpu, &s, split_len);
                f.launch(
                    &mut kernels,
                    KernelId::AttentionFused,
                    &[(1, &f.qkv), (2, &part), (3, &f.ctx), (4, &done), (5, &f.pool), (6, &f.pool)],
                    (heads, t, splits),
                );
                let err = max_err(&f.read_ctx(), &want);
                eprintln!("{c:?}: fused decode kernel within {err:.2e} (round {round})");
                assert!(err <= tol, "{c:?}: fused decode kernel off by {err} (round {round})");
            }
        }
    }
}

/// Every head dim the prefill kernel takes fits 32 KiB of shared memory with whole lanes.
#[test]
fn prefill_tiles_fit_32_kib() {
    for hd in (16..=256).step_by(16) {
        let tile = Tile::new(hd).expect("a multiple of 16");
        assert!(tile.shared_bytes(hd) <= 32 << 10, "{hd}: {tile:?}");
        assert!(tile.keys.is_multiple_of(tile.lanes) && hd.is_multiple_of(4 * tile.lanes));
    }
    assert_eq!(Tile::new(72), None);
}
