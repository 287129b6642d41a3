//! `CELLM_GPU_PROFILE`: where a step's time goes, printed to stderr.
//! - `1`: host seconds per phase of each one-token step (laying the step out and writing its
//!   buffers, recording, submitting, recording the next step ahead, waiting for the GPU,
//!   copying the logits out)
//!   and, where the device has timestamps, GPU seconds per launch shape. Stamped steps record
//!   in line, and every stamp drains the GPU: read the launches as shares, not as a step.
//! - `prefill`: the same for each step of several tokens.
//! - `span`: the host phases, and the GPU's busy time per one-token step and its idle time
//!   between steps, from two timestamps a step; steps are recorded ahead as when unprofiled,
//!   so this is the unprofiled step's split between GPU work and host turnaround.

use std::collections::BTreeMap;
use std::time::Instant;

use crate::device::Gpu;
use crate::ops::{Grid, Op};

/// One-token steps a report covers (and the span's query window).
const EVERY: u32 = 64;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Launches,
    Prefill,
    Span,
}

pub struct Profile {
    mode: Mode,
    steps: u32,
    phases: [f64; 6],
    gpu: BTreeMap<String, (f64, u32)>,
    /// Timestamps around every launch (`1`, `prefill`).
    pub stamps: Option<Stamps>,
    /// Two timestamps a step (`span`).
    pub span: Option<Span>,
}

/// A query set, the buffer its values resolve into, and a mappable copy.
struct Queries {
    set: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    read: wgpu::Buffer,
}

impl Queries {
    fn new(gpu: &Gpu, n: u32) -> Self {
        let buffer = |usage| {
            gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: None,
                size: u64::from(n) * 8,
                usage,
                mapped_at_creation: false,
            })
        };
        Self {
            set: gpu.device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("profile"),
                ty: wgpu::QueryType::Timestamp,
                count: n,
            }),
            resolve: buffer(wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC),
            read: buffer(wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST),
        }
    }

    fn resolve(&self, encoder: &mut wgpu::CommandEncoder, n: u32) {
        encoder.resolve_query_set(&self.set, 0..n, &self.resolve, 0);
        encoder.copy_buffer_to_buffer(&self.resolve, 0, &self.read, 0, u64::from(n) * 8);
    }

    /// The first `n` values in seconds (after the submission that resolved them).
    fn seconds(&self, gpu: &Gpu, n: u32) -> Vec<f64> {
        let slice = self.read.slice(..u64::from(n) * 8);
        slice.map_async(wgpu::MapMode::Read, |_| {});
        let _ = gpu.wait();
        let period = f64::from(gpu.queue.get_timestamp_period()) * 1e-9;
        let out = match slice.get_mapped_range() {
            Ok(view) => view
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])) as f64 * period)
                .collect(),
            Err(_) => Vec::new(),
        };
        self.read.unmap();
        out
    }
}

/// Timestamps around every launch of a step.
pub struct Stamps {
    queries: Queries,
    /// Name of each stamped launch, this step.
    names: Vec<String>,
}

impl Stamps {
    pub fn clear(&mut self) {
        self.names.clear();
    }

    /// Stamps the start of `op`'s launch (`suffix` names its build).
    pub fn launch(&mut self, pass: &mut wgpu::ComputePass<'_>, op: &Op, suffix: &str) {
        pass.write_timestamp(&self.queries.set, self.names.len() as u32);
        let name = &op.kernel.name;
        // Matvecs by shape (rows x columns), so that o, down and the head read apart.
        self.names.push(match op.grid {
            Grid::Rows { .. } | Grid::HeadRows { .. } => {
                format!("{name}{suffix} {}x{}", op.params[0], op.params[1])
            }
            _ => format!("{name}{suffix}"),
        });
    }

    /// Stamps the end of the last launch.
    pub fn finish(&self, pass: &mut wgpu::ComputePass<'_>) {
        pass.write_timestamp(&self.queries.set, self.names.len() as u32);
    }

    /// After the pass: the stamps into the mappable copy.
    pub fn resolve(&self, encoder: &mut wgpu::CommandEncoder) {
        self.queries.resolve(encoder, self.names.len() as u32 + 1);
    }
}

/// Two timestamps a one-token step (the pass's start and end), for `EVERY` steps.
pub struct Span {
    queries: Queries,
}

impl Span {
    /// The pass's timestamp writes for step `k` of the window.
    pub fn writes(&self, k: u32) -> wgpu::ComputePassTimestampWrites<'_> {
        wgpu::ComputePassTimestampWrites {
            query_set: &self.queries.set,
            beginning_of_pass_write_index: Some(2 * k),
            end_of_pass_write_index: Some(2 * k + 1),
        }
    }

    /// After the window's last step's pass: its values into the mappable copy.
    pub fn resolve(&self, encoder: &mut wgpu::CommandEncoder, k: u32) {
        if k == EVERY - 1 {
            self.queries.resolve(encoder, 2 * EVERY);
        }
    }
}

impl Profile {
    /// The profile `CELLM_GPU_PROFILE` asks for, with room for `ops` stamped launches.
    pub fn from_env(gpu: &Gpu, ops: usize) -> Option<Self> {
        let mode = match std::env::var("CELLM_GPU_PROFILE").ok()?.as_str() {
            "prefill" => Mode::Prefill,
            "span" => Mode::Span,
            _ => Mode::Launches,
        };
        let stamps = (gpu.timestamps && mode != Mode::Span)
            .then(|| Stamps { queries: Queries::new(gpu, ops as u32 + 1), names: Vec::new() });
        let span = (gpu.timestamps && mode == Mode::Span)
            .then(|| Span { queries: Queries::new(gpu, 2 * EVERY) });
        Some(Self { mode, steps: 0, phases: [0.0; 6], gpu: BTreeMap::new(), stamps, span })
    }

    /// Whether a step of `t` tokens is timed.
    pub fn times(&self, t: u32) -> bool {
        if self.mode == Mode::Prefill {
            t > 1
        } else {
            t == 1
        }
    }

    /// Where a timed step's launches are stamped (and so recorded in line).
    pub fn stamps_launches(&self, t: u32) -> bool {
        self.times(t) && self.stamps.is_some()
    }

    /// The window index of the next timed step, and of the one after it (the span's).
    pub fn span_steps(&self) -> Option<(u32, u32)> {
        self.span.as_ref().map(|_| (self.steps, (self.steps + 1) % EVERY))
    }

    /// Adds a timed step: its phases' boundaries, and its stamps once the GPU is done.
    pub fn add(&mut self, gpu: &Gpu, marks: &[Instant; 7]) {
        for (i, w) in marks.windows(2).enumerate() {
            self.phases[i] += (w[1] - w[0]).as_secs_f64();
        }
        if let Some(s) = &self.stamps {
            let n = s.names.len() as u32;
            let at = s.queries.seconds(gpu, n + 1);
            if at.len() > n as usize {
                for (i, name) in s.names.iter().enumerate() {
                    let e = self.gpu.entry(name.clone()).or_default();
                    e.0 += (at[i + 1] - at[i]).max(0.0);
                    e.1 += 1;
                }
            }
        }
        self.steps += 1;
        let every = if self.mode == Mode::Prefill { 1 } else { EVERY };
        if self.steps == every {
            self.report(gpu, every);
        }
    }

    fn report(&mut self, gpu: &Gpu, every: u32) {
        let f = f64::from(every);
        let ms = self.phases.map(|s| s * 1e3 / f);
        let what =
            if self.mode == Mode::Prefill { "steps of several tokens" } else { "one-token steps" };
        let mut line = format!(
            "cellm-gpu profile ({what}, ms per step, mean of {every}): write {:.3}, record \
             {:.3}, submit {:.3}, record the next ahead {:.3}, wait {:.3}, read {:.3}; wall {:.3}",
            ms[0],
            ms[1],
            ms[2],
            ms[3],
            ms[4],
            ms[5],
            ms.iter().sum::<f64>()
        );
        if !self.gpu.is_empty() {
            let total: f64 = self.gpu.values().map(|v| v.0).sum();
            line += &format!("; GPU {:.3} ms:", total * 1e3 / f);
            for (name, (t, n)) in &self.gpu {
                line += &format!(" {name} {:.3} ({} launches)", t * 1e3 / f, n / every);
            }
        }
        if let Some(s) = &self.span {
            let at = s.queries.seconds(gpu, 2 * EVERY);
            if at.len() == 2 * EVERY as usize {
                let mut busy: Vec<f64> = at.chunks_exact(2).map(|w| w[1] - w[0]).collect();
                let mut idle: Vec<f64> =
                    at[1..at.len() - 1].chunks_exact(2).map(|w| w[1] - w[0]).collect();
                line += &format!(
                    "; GPU busy {:.3} ms a step (median {:.3}), idle between steps {:.3} (median {:.3})",
                    mean(&busy) * 1e3,
                    median(&mut busy) * 1e3,
                    mean(&idle) * 1e3,
                    median(&mut idle) * 1e3
                );
            }
        }
        eprintln!("{line}");
        self.steps = 0;
        self.phases = [0.0; 6];
        self.gpu.clear();
    }
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}
