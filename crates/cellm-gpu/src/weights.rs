//! Weights on the device, uploaded once, one part at a time: a matrix is split into row
//! ranges ("parts") whose arrays each fit the device's largest binding, and each part is
//! repacked and written on its own, so the host never holds a second copy of the model.

use cellm_format::{Error, Result, Tensor, TensorFormat};
use cellm_kernels::WeightRows;
use wgpu::util::DeviceExt;

use crate::device::Gpu;
use crate::repack::{repack, Layout, Packed};

/// Rows of a matrix that live in one pair of buffers.
pub struct Part {
    pub row0: usize,
    pub rows: usize,
    pub quants: wgpu::Buffer,
    pub scales: Option<wgpu::Buffer>,
}

/// A weight matrix on the device (one or more stored tensors stacked by rows).
pub struct Matrix {
    pub layout: Layout,
    pub rows: usize,
    pub parts: Vec<Part>,
}

/// Bytes written between two queue flushes while uploading (bounds wgpu's staging memory).
const FLUSH_BYTES: usize = 256 << 20;

/// Upload state: the binding cap and how much was written since the last flush.
pub struct Uploader<'g> {
    pub gpu: &'g Gpu,
    pub max_binding: u64,
    pending: usize,
}

impl<'g> Uploader<'g> {
    pub fn new(gpu: &'g Gpu, max_binding: u64) -> Self {
        Self { gpu, max_binding, pending: 0 }
    }

    fn buffer(&mut self, label: &str, words: &[u32]) -> Result<wgpu::Buffer> {
        // Whole 16-byte elements, for kernels that read them as vec4 (f16 with
        // CELLM_GPU_F16_VEC4); a copy only where the length is not already a multiple.
        let padded;
        let words = if words.len().is_multiple_of(4) && !words.is_empty() {
            words
        } else {
            padded = [words, &[0; 4][..(4 - words.len() % 4)]].concat();
            &padded[..]
        };
        let bytes: &[u8] = as_bytes(words);
        let b = self.gpu.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some(label),
            contents: bytes,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        });
        self.pending += bytes.len();
        if self.pending >= FLUSH_BYTES {
            self.gpu.queue.submit([]);
            self.gpu.wait()?;
            self.pending = 0;
        }
        self.gpu.check()?;
        Ok(b)
    }

    /// An f32 vector (norm weights, biases).
    pub fn vector(&mut self, t: &Tensor) -> Result<wgpu::Buffer> {
        let v = t.as_f32()?;
        self.buffer(&t.name, &v.iter().map(|f| f.to_bits()).collect::<Vec<_>>())
    }

    /// Several f32 vectors end to end (the fused q|k|v bias).
    pub fn vectors(&mut self, name: &str, ts: &[&Tensor]) -> Result<wgpu::Buffer> {
        let mut words = Vec::new();
        for t in ts {
            words.extend(t.as_f32()?.iter().map(|f| f.to_bits()));
        }
        self.buffer(name, &words)
    }

    /// The tensors `ts` (same columns and GPU layout) stacked by rows into one matrix.
    pub fn matrix(&mut self, ts: &[&Tensor]) -> Result<Matrix> {
        let named: Vec<_> = ts.iter().map(|t| (t.name.as_str(), WeightRows::of(t))).collect();
        self.matrix_rows(&named)
    }

    /// [`Uploader::matrix`] on raw stored rows, each with its tensor's name.
    pub fn matrix_rows(&mut self, ts: &[(&str, WeightRows)]) -> Result<Matrix> {
        let (first, first_rows) = ts[0];
        let layout = layout_of(first, first_rows.format)?;
        let cols = first_rows.cols;
        for (name, t) in ts {
            if layout_of(name, t.format)? != layout || t.cols != cols {
                return Err(Error::Unsupported(format!(
                    "{first} and {name} cannot share a GPU matrix"
                )));
            }
        }
        if !cols.is_multiple_of(layout.block()) {
            return Err(Error::Unsupported(format!(
                "tensor {first}: {cols} columns are not a multiple of {} (GPU {} layout)",
                layout.block(),
                layout.wgsl_name()
            )));
        }
        let (qw, sw) = layout.row_words(cols);
        // Rows per part: a multiple of 8 whose quant and scale arrays fit one binding.
        let widest = (qw.max(sw) * 4) as u64;
        let fit = (self.max_binding / widest.max(1)) as usize;
        let per_part = if fit >= 8 { fit / 8 * 8 } else { fit };
        if per_part == 0 {
            return Err(Error::Device(format!(
                "tensor {first}: one row ({widest} bytes) is larger than the device's largest \
                 binding ({} bytes)",
                self.max_binding
            )));
        }
        let rows: usize = ts.iter().map(|(_, t)| t.rows).sum();
        let mut parts = Vec::new();
        let mut row0 = 0;
        while row0 < rows {
            let n = per_part.min(rows - row0);
            let mut packed = Packed::default();
            // Gather rows row0..row0 + n across the stacked tensors.
            let mut at = 0;
            for (_, t) in ts {
                let tr = t.rows;
                let (lo, hi) = (row0.max(at), (row0 + n).min(at + tr));
                if lo < hi {
                    packed.append(repack(t, layout, lo - at..hi - at));
                }
                at += tr;
            }
            let quants = self.buffer(first, &packed.quants)?;
            let scales = match layout.has_scales() {
                true => Some(self.buffer(first, &packed.scale_words())?),
                false => None,
            };
            parts.push(Part { row0, rows: n, quants, scales });
            row0 += n;
        }
        Ok(Matrix { layout, rows, parts })
    }
}

fn layout_of(name: &str, format: TensorFormat) -> Result<Layout> {
    Layout::of(format).ok_or_else(|| {
        Error::Unsupported(format!(
            "tensor {name} is stored as {}, which runs on the CPU only for now (the GPU runs {})",
            format.name(),
            Layout::supported()
        ))
    })
}

pub fn as_bytes(words: &[u32]) -> &[u8] {
    // SAFETY: u32 storage viewed as its bytes.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), words.len() * 4) }
}
