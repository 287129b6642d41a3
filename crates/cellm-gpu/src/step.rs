//! Per-step data and the buffers sized for it. The host side (`HostStep`) lays out token
//! ids, positions, page tables and RoPE angles; `StepBuffers` holds the device buffers at
//! some capacity, grows them (and rebuilds every bind group) when a step needs more, and
//! reads the logits back.

use std::sync::{Arc, Mutex};

use cellm_format::{Error, Result};
use cellm_models::{RopeConfig, Step};

use crate::device::Gpu;
use crate::ops::{Buf, Dims, Op};
use crate::split_gemm::TILE;
use crate::weights::as_bytes;

/// Words before the per-token records (`shaders/step.wgsl`).
const HEADER: usize = 8;
/// Tokens one submission takes at most (a longer prefill is split).
const MAX_CHUNK: usize = 512;
/// The cooperative prefill attention's shortest split of the positions (`prefill_splits`).
const PREFILL_SPLIT_MIN: usize = 128;
/// Workgroups of its unsplit launch under which it splits. On an H200 (132 SMs), pp512 with
/// splits of 128: SmolLM2-135M's shape (9 heads, 72 workgroups) 1.10x; Qwen2.5-0.5B's (112)
/// 0.99x; Llama-3.2-1B's and 3B's (256, 192) 0.88-0.93x, the combine included
/// (docs/benchmarks.md).
const PREFILL_SPLIT_BELOW: usize = 96;

/// The attention a step runs, which decides how it splits the positions.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Attention {
    /// The decode attention (and its combine).
    Decode,
    /// The prefill attention, one launch over all positions.
    Prefill,
    /// The cooperative prefill attention, split (`prefill_splits`), then the combine.
    PrefillSplit,
}

/// One token of a step: id, position, offset of its session's page table.
#[derive(Clone, Copy)]
pub struct Token {
    pub id: u32,
    pub pos: usize,
    pub table: u32,
}

/// A step laid out for the device.
pub struct HostStep {
    pub tokens: Vec<Token>,
    /// Rows whose logits are wanted, increasing.
    pub logit_rows: Vec<usize>,
    /// Every layer's page tables, layer after layer, sessions end to end.
    pub tables: Vec<u32>,
    pub stride: usize,
}

/// The tokens one submission runs.
pub struct Chunk {
    pub tokens: Vec<Token>,
    /// Logit rows, relative to the chunk's first token.
    pub logit_rows: Vec<u32>,
}

impl HostStep {
    pub fn new(step: &Step, layers: usize) -> Result<Self> {
        let mut tokens = vec![Token { id: 0, pos: 0, table: 0 }; step.tokens.len()];
        let mut offset = 0;
        for span in step.spans {
            for i in 0..span.len {
                let row = span.row0 + i;
                tokens[row] =
                    Token { id: step.tokens[row], pos: span.start + i, table: offset as u32 };
            }
            offset += span.kv.page_table(0).len();
        }
        let stride = offset;
        let mut tables = Vec::with_capacity(layers * stride);
        for layer in 0..layers {
            for span in step.spans {
                tables.extend_from_slice(span.kv.page_table(layer));
            }
        }
        if !step.logit_rows.windows(2).all(|w| w[0] < w[1]) {
            return Err(Error::InvalidArgument("logit rows must be increasing on the GPU".into()));
        }
        Ok(Self { tokens, logit_rows: step.logit_rows.to_vec(), tables, stride })
    }

    /// The step in submissions of at most `max_tokens` tokens and `max_rows` logit rows.
    pub fn chunks(&self, max_tokens: usize, max_rows: usize) -> Vec<Chunk> {
        let mut chunks = Vec::new();
        let mut start = 0;
        let mut rows = self.logit_rows.iter().peekable();
        while start < self.tokens.len() {
            let mut end = (start + max_tokens).min(self.tokens.len());
            let mut logit_rows = Vec::new();
            while let Some(&&r) = rows.peek() {
                if r >= end {
                    break;
                }
                if logit_rows.len() == max_rows {
                    end = r;
                    break;
                }
                logit_rows.push((r - start) as u32);
                rows.next();
            }
            chunks.push(Chunk { tokens: self.tokens[start..end].to_vec(), logit_rows });
            start = end;
        }
        chunks
    }
}

/// Capacities the buffers were made for.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
struct Caps {
    tokens: usize,
    rows: usize,
    table: usize,
    pages: usize,
}

struct Buffers {
    x: wgpu::Buffer,
    qkv: wgpu::Buffer,
    ctx: wgpu::Buffer,
    act: wgpu::Buffer,
    tmp: wgpu::Buffer,
    logits: wgpu::Buffer,
    readback: wgpu::Buffer,
    step: wgpu::Buffer,
    rope: wgpu::Buffer,
    pool: wgpu::Buffer,
    part: wgpu::Buffer,
    done: wgpu::Buffer,
    /// The split GEMM's scratch (`split_gemm::Scratch`).
    half: wgpu::Buffer,
    whalf: wgpu::Buffer,
    acc: wgpu::Buffer,
}

pub struct StepBuffers {
    caps: Caps,
    bufs: Option<Buffers>,
    groups: Vec<wgpu::BindGroup>,
    params: wgpu::Buffer,
    params_stride: u64,
    dummy: wgpu::Buffer,
    page_bytes: u64,
    dims: Dims,
    /// (token, split) pairs the attention's partial-sum buffer holds.
    part_slots: usize,
    /// The decode attention's splits: about this many workgroups a step, splits of at least
    /// this many positions (`CELLM_GPU_ATTN_SPLIT=workgroups,positions`, for measuring).
    split_target: (usize, usize),
    /// Counts the times the buffers (and so the bind groups) were made: a command buffer
    /// recorded against one generation is valid until the next.
    generation: u64,
}

/// `CELLM_GPU_ATTN_SPLIT=workgroups,positions` (any separator), else (512, 32).
fn split_target() -> (usize, usize) {
    let knob = std::env::var("CELLM_GPU_ATTN_SPLIT").unwrap_or_default();
    let mut v = knob.split(|c: char| !c.is_ascii_digit()).filter_map(|n| n.parse().ok());
    match (v.next(), v.next()) {
        (Some(w), Some(p)) if w > 0 && p > 0 => (w, p),
        _ => (512, 32),
    }
}

fn storage(gpu: &Gpu, label: &str, bytes: u64, extra: wgpu::BufferUsages) -> wgpu::Buffer {
    gpu.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some(label),
        size: bytes.max(16).next_multiple_of(4),
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | extra,
        mapped_at_creation: false,
    })
}

impl StepBuffers {
    pub fn new(gpu: &Gpu, dims: &Dims, page_size: usize, ops: &[Op]) -> Result<Self> {
        let stride = u64::from(gpu.limits.min_uniform_buffer_offset_alignment).max(64);
        let mut words = vec![0u32; ops.len() * (stride as usize / 4)];
        for (i, op) in ops.iter().enumerate() {
            let at = i * stride as usize / 4;
            words[at..at + 16].copy_from_slice(&op.params);
        }
        let params = gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("params"),
            size: (words.len() * 4).max(16) as u64,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        gpu.queue.write_buffer(&params, 0, as_bytes(&words));
        let value_bytes = if dims.kv_f16 { 2 } else { 4 };
        Ok(Self {
            caps: Caps::default(),
            bufs: None,
            groups: Vec::new(),
            params,
            params_stride: stride,
            dummy: storage(gpu, "dummy", 16, wgpu::BufferUsages::empty()),
            page_bytes: (2 * page_size * dims.kv_dim * value_bytes) as u64,
            dims: *dims,
            part_slots: 0,
            split_target: split_target(),
            generation: 0,
        })
    }

    /// The most tokens and logit rows one submission may take: every activation buffer
    /// within one binding.
    pub fn max_chunk(&self, gpu: &Gpu, d: &Dims) -> (usize, usize) {
        let limit = gpu.max_binding() as usize;
        let widest = d.hidden.max(d.qkv).max(d.inter).max(self.part_row()).max(d.split.acc) * 4;
        let tokens = (limit / widest).clamp(1, MAX_CHUNK);
        let rows = (limit / (d.vocab * 4)).clamp(1, MAX_CHUNK);
        (tokens, rows)
    }

    /// Floats of one (token, split) of the attention's partial sums: per head its sums, max
    /// and denominator.
    fn part_row(&self) -> usize {
        self.dims.heads * (self.dims.head_dim + 2)
    }

    pub fn groups(&self) -> &[wgpu::BindGroup] {
        &self.groups
    }

    /// Which set of buffers and bind groups is current (see `generation`).
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Makes room for `(tokens, logit rows, page-table words, KV pages)`, keeping the
    /// pool's rows; every bind group is rebuilt when anything grew.
    pub fn fit(
        &mut self,
        gpu: &Gpu,
        d: &Dims,
        ops: &[Op],
        need: (usize, usize, usize, usize),
    ) -> Result<()> {
        let (tokens, rows, table, pages) = need;
        let old = self.caps;
        let grow =
            |have: usize, want: usize| if want <= have { have } else { want.next_power_of_two() };
        let caps = Caps {
            tokens: grow(old.tokens, tokens),
            rows: grow(old.rows, rows.max(1)),
            table: grow(old.table, table.max(1)),
            pages: grow(old.pages, pages.max(1)),
        };
        if self.bufs.is_some() && caps == old {
            return Ok(());
        }
        let pool_bytes = caps.pages as u64 * self.page_bytes;
        if pool_bytes > gpu.max_binding() {
            return Err(Error::Device(format!(
                "the KV cache needs {} pages ({pool_bytes} bytes), more than the device's \
                 largest binding ({} bytes): lower kv_capacity_tokens or the context",
                caps.pages,
                gpu.max_binding()
            )));
        }
        let f = |n: usize| (n * 4) as u64;
        let t = caps.tokens;
        let none = wgpu::BufferUsages::empty();
        let pool = storage(gpu, "kv pool", pool_bytes, wgpu::BufferUsages::COPY_SRC);
        let row_bytes = (self.part_row() * 4) as u64;
        let slots = ((caps.tokens * 4).max(64) as u64).min(gpu.max_binding() / row_bytes);
        let part_slots = (slots as usize).max(caps.tokens);
        if let Some(b) = &self.bufs {
            let mut enc = gpu.device.create_command_encoder(&Default::default());
            enc.copy_buffer_to_buffer(&b.pool, 0, &pool, 0, b.pool.size().min(pool.size()));
            gpu.queue.submit([enc.finish()]);
        }
        let bufs = Buffers {
            x: storage(gpu, "x", f(t * d.hidden), none),
            qkv: storage(gpu, "qkv", f(t * d.qkv), none),
            ctx: storage(gpu, "ctx", f(t * d.q_dim), none),
            act: storage(gpu, "act", f(t * d.inter), none),
            tmp: storage(gpu, "tmp", f(t * d.hidden), none),
            logits: storage(gpu, "logits", f(caps.rows * d.vocab), wgpu::BufferUsages::COPY_SRC),
            readback: gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("readback"),
                size: f(caps.rows * d.vocab),
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }),
            step: storage(gpu, "step", f(HEADER + 4 * t + caps.rows + d.layers * caps.table), none),
            rope: storage(gpu, "rope", (d.ropes.max(1) * t * d.max_half.max(1) * 8) as u64, none),
            pool,
            part: storage(gpu, "attention splits", part_slots as u64 * row_bytes, none),
            // Zeroed at creation; the last split of each (token, head) zeroes its count.
            done: storage(gpu, "attention counts", f(t * d.heads), none),
            // f16 inputs: token rows up to a whole tile of the cooperative GEMM.
            half: storage(
                gpu,
                "f16 inputs",
                (t.next_multiple_of(TILE as usize) * d.split.cols * 2) as u64,
                none,
            ),
            whalf: storage(gpu, "f16 weights", (d.split.weights * 2) as u64, none),
            acc: storage(gpu, "gemm sums", f(t * d.split.acc), none),
        };
        self.part_slots = part_slots;
        self.groups = ops.iter().enumerate().map(|(i, op)| self.group(gpu, &bufs, i, op)).collect();
        self.bufs = Some(bufs);
        self.caps = caps;
        self.generation += 1;
        gpu.check()
    }

    fn group(&self, gpu: &Gpu, b: &Buffers, i: usize, op: &Op) -> wgpu::BindGroup {
        fn whole(binding: u32, buf: &wgpu::Buffer) -> wgpu::BindGroupEntry<'_> {
            wgpu::BindGroupEntry { binding, resource: buf.as_entire_binding() }
        }
        let mut entries = Vec::new();
        if !op.kernel.immediates {
            entries.push(wgpu::BindGroupEntry {
                binding: 0,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: &self.params,
                    offset: i as u64 * self.params_stride,
                    size: Some(std::num::NonZeroU64::new(64).expect("non-zero")),
                }),
            });
        }
        for (binding, buf) in &op.binds {
            let buffer = match buf {
                Buf::X => &b.x,
                Buf::Qkv => &b.qkv,
                Buf::Ctx => &b.ctx,
                Buf::Act => &b.act,
                Buf::Tmp => &b.tmp,
                Buf::Logits => &b.logits,
                Buf::Rope => &b.rope,
                Buf::Pool => &b.pool,
                Buf::Part => &b.part,
                Buf::Done => &b.done,
                Buf::Dummy => &self.dummy,
                Buf::Half => &b.half,
                Buf::WHalf => &b.whalf,
                Buf::Acc => &b.acc,
                Buf::W(w) => w,
            };
            entries.push(whole(*binding, buffer));
        }
        entries.push(whole(7, &b.step));
        gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &op.kernel.layout,
            entries: &entries,
        })
    }

    /// How the attention splits the positions of a chunk of `t` tokens whose longest
    /// context is `ctx`: (positions per split, splits). Enough splits that the launch fills
    /// a large GPU (about 512 workgroups; 1024 made tg64@2048 on the H200 5% slower on the
    /// Llama-3.2-3B and Qwen2.5-0.5B shapes, docs/benchmarks.md), none shorter than 32
    /// positions, and no more than the partial-sum buffer holds. (One split of up to 256
    /// positions, which needs no combine launch, made tg64@128 on the H200 21% slower for
    /// SmolLM2 and 11% for Llama-3.2-1B: a workgroup's positions run one after another.)
    pub fn splits(&self, t: usize, ctx: usize) -> (usize, usize) {
        let (workgroups, least) = self.split_target;
        let want = workgroups.div_ceil(self.dims.heads * t);
        let mut len = ctx.div_ceil(want).max(least).next_multiple_of(16);
        let most = (self.part_slots / t).max(1);
        if ctx.div_ceil(len) > most {
            len = ctx.div_ceil(most);
        }
        (len, ctx.div_ceil(len).max(1))
    }

    /// How the cooperative prefill attention splits the positions of a chunk of `t` tokens
    /// whose longest context is `ctx`: (positions per split, splits). Only where its
    /// unsplit launch has fewer than `PREFILL_SPLIT_BELOW` workgroups (heads by query blocks
    /// of `block`); then splits of at least `PREFILL_SPLIT_MIN` positions (a multiple of its
    /// 32-position tiles), as many as the partial-sum buffer holds (4 a token).
    /// `CELLM_GPU_PREFILL_SPLIT=positions` (0: none) overrides both, for measuring (read at
    /// each step, so that one engine can time the variants alternately).
    pub fn prefill_splits(&self, t: usize, ctx: usize, block: usize) -> (usize, usize) {
        let knob = std::env::var("CELLM_GPU_PREFILL_SPLIT").ok().and_then(|v| v.parse().ok());
        let least = match knob {
            Some(0) => ctx,
            Some(n) => n,
            None if self.dims.heads * t.div_ceil(block) >= PREFILL_SPLIT_BELOW => ctx,
            None => PREFILL_SPLIT_MIN,
        };
        let most = (self.part_slots / t).max(1);
        let len = ctx.div_ceil(most).max(least).next_multiple_of(32);
        (len, ctx.div_ceil(len).max(1))
    }

    /// Writes the chunk's step buffer and cos/sin tables (queued before the next submit);
    /// returns the splits of the step's `attention`.
    pub fn write(
        &self,
        gpu: &Gpu,
        chunk: &Chunk,
        host: &HostStep,
        ropes: &[RopeConfig],
        attention: Attention,
    ) -> u32 {
        let b = self.bufs.as_ref().expect("fit first");
        let (t, caps) = (chunk.tokens.len(), self.caps);
        let ctx = chunk.tokens.iter().map(|k| k.pos + 1).max().unwrap_or(1);
        let (split_len, splits) = match attention {
            Attention::Decode => self.splits(t.max(1), ctx),
            Attention::Prefill => (ctx, 1),
            Attention::PrefillSplit => {
                self.prefill_splits(t.max(1), ctx, crate::attn_prefill::coop_block() as usize)
            }
        };
        let mut words = vec![0u32; HEADER + 4 * caps.tokens + caps.rows];
        words[..8].copy_from_slice(&[
            t as u32,
            chunk.logit_rows.len() as u32,
            host.stride as u32,
            caps.tokens as u32,
            caps.rows as u32,
            (t * self.dims.max_half.max(1)) as u32,
            split_len as u32,
            splits as u32,
        ]);
        for (i, tok) in chunk.tokens.iter().enumerate() {
            words[HEADER + 4 * i..HEADER + 4 * i + 3].copy_from_slice(&[
                tok.id,
                tok.pos as u32,
                tok.table,
            ]);
        }
        let rows_at = HEADER + 4 * caps.tokens;
        words[rows_at..rows_at + chunk.logit_rows.len()].copy_from_slice(&chunk.logit_rows);
        gpu.queue.write_buffer(&b.step, 0, as_bytes(&words));
        // Page tables: layer l at l * stride words after the rows.
        if !host.tables.is_empty() {
            gpu.queue.write_buffer(&b.step, (words.len() * 4) as u64, as_bytes(&host.tables));
        }
        // cos/sin per token and pair, as the CPU computes them (angle rounded to f32 first);
        // the chunk's tokens only (a decode step writes one row, not the capacity's).
        let stride = t * self.dims.max_half.max(1);
        let mut table = vec![0f32; 2 * ropes.len() * stride];
        for (r, rope) in ropes.iter().enumerate() {
            let half = rope.inv_freq.len();
            for (i, tok) in chunk.tokens.iter().enumerate() {
                for (j, &f) in rope.inv_freq.iter().enumerate() {
                    let angle = f64::from(tok.pos as f32 * f);
                    let at = 2 * (r * stride + i * half + j);
                    table[at] = (angle.cos() as f32) * rope.attention_factor;
                    table[at + 1] = (angle.sin() as f32) * rope.attention_factor;
                }
            }
        }
        if !table.is_empty() {
            let words: Vec<u32> = table.iter().map(|v| v.to_bits()).collect();
            gpu.queue.write_buffer(&b.rope, 0, as_bytes(&words));
        }
        splits as u32
    }

    pub fn copy_logits(&self, encoder: &mut wgpu::CommandEncoder, values: usize) {
        let b = self.bufs.as_ref().expect("fit first");
        encoder.copy_buffer_to_buffer(&b.logits, 0, &b.readback, 0, (values * 4) as u64);
    }

    /// Waits for the submission and appends `values` logits to `out` (one copy out of the
    /// mapped buffer); returns when the wait ended (for the profile).
    pub fn read_logits(
        &self,
        gpu: &Gpu,
        values: usize,
        out: &mut Vec<f32>,
    ) -> Result<std::time::Instant> {
        let b = self.bufs.as_ref().expect("fit first");
        let slice = b.readback.slice(..(values * 4) as u64);
        let mapped = Arc::new(Mutex::new(None));
        let slot = mapped.clone();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
        });
        gpu.wait_until(|| mapped.lock().unwrap_or_else(|p| p.into_inner()).is_some())?;
        let waited = std::time::Instant::now();
        let result = mapped.lock().unwrap_or_else(|p| p.into_inner()).take();
        result
            .ok_or_else(|| Error::Device("the logits never arrived".into()))?
            .map_err(|e| Error::Device(format!("cannot read the logits back: {e}")))?;
        {
            let view = slice
                .get_mapped_range()
                .map_err(|e| Error::Device(format!("cannot read the logits back: {e}")))?;
            append_f32(out, &view);
        }
        b.readback.unmap();
        Ok(waited)
    }
}

/// Appends little-endian f32 values, given as bytes, to `out`.
fn append_f32(out: &mut Vec<f32>, bytes: &[u8]) {
    let n = bytes.len() / 4;
    out.reserve(n);
    #[cfg(target_endian = "little")]
    // SAFETY: `reserve` made room for n more values past the length; the bytes are n f32
    // values in this machine's order (any bits are a valid f32), copied as bytes, so the
    // source's alignment does not matter.
    unsafe {
        let at = out.as_mut_ptr().add(out.len()).cast::<u8>();
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), at, n * 4);
        out.set_len(out.len() + n);
    }
    #[cfg(not(target_endian = "little"))]
    out.extend(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])));
}
