//! Stored weight formats -> the GPU layouts `shaders/formats.wgsl` reads. Block formats
//! whose blocks are not 4-byte aligned are split into a quant array and a scale array;
//! interleaved (`*x8`) tensors are read back row by row in their base format first.

use std::borrow::Cow;

use cellm_format::{TensorFormat, INTERLEAVE};
use cellm_kernels::dot::x8::row_of_group;
use cellm_kernels::WeightRows;
use half::f16;

/// A GPU weight layout: one section of `formats.wgsl`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Layout {
    F32,
    F16,
    Bf16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q4K,
    Q6K,
}

impl Layout {
    /// The layout of a stored format; None where the GPU has no kernel for it yet.
    pub fn of(format: TensorFormat) -> Option<Self> {
        let base = format.interleaved().map_or(format, |i| i.base);
        Some(match base {
            TensorFormat::F32 => Self::F32,
            TensorFormat::F16 => Self::F16,
            TensorFormat::BF16 => Self::Bf16,
            TensorFormat::Q8_0 => Self::Q8_0,
            TensorFormat::Q4_0 => Self::Q4_0,
            TensorFormat::Q4_1 => Self::Q4_1,
            TensorFormat::Q5_0 => Self::Q5_0,
            TensorFormat::Q4K => Self::Q4K,
            TensorFormat::Q6K => Self::Q6K,
            _ => return None,
        })
    }

    /// The names of the formats the GPU runs, for error messages.
    pub fn supported() -> &'static str {
        "f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q4_k, q6_k (and their x8 variants)"
    }

    pub fn wgsl_name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Bf16 => "bf16",
            Self::Q8_0 => "q8_0",
            Self::Q4_0 => "q4_0",
            Self::Q4_1 => "q4_1",
            Self::Q5_0 => "q5_0",
            Self::Q4K => "q4_k",
            Self::Q6K => "q6_k",
        }
    }

    /// Whether the layout has a scale array beside its quants.
    pub fn has_scales(self) -> bool {
        !matches!(self, Self::F32 | Self::F16 | Self::Bf16)
    }

    /// Elements a block covers (the columns must be a multiple).
    pub fn block(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::Bf16 => 4,
            Self::Q8_0 | Self::Q4_0 | Self::Q4_1 | Self::Q5_0 => 32,
            Self::Q4K | Self::Q6K => 256,
        }
    }

    /// Quant and scale words of one row of `cols` elements.
    pub fn row_words(self, cols: usize) -> (usize, usize) {
        match self {
            Self::F32 => (cols, 0),
            Self::F16 | Self::Bf16 => (cols / 2, 0),
            // Scales are f16 pairs over the whole part, so a row holds half a word each.
            Self::Q8_0 => (cols / 4, cols / 32),
            Self::Q4_0 => (cols / 8, cols / 32),
            // d and m, one word a block.
            Self::Q4_1 => (cols / 8, cols / 32),
            // 4 words of nibbles and the word of fifth bits a block; f16 scales as q4_0.
            Self::Q5_0 => (cols / 32 * 5, cols / 32),
            Self::Q4K => (cols / 256 * 32, cols / 256 * 5),
            Self::Q6K => (cols / 256 * 48, cols / 256 * 5),
        }
    }
}

/// Row `r` of `t` as its base format's bytes (an interleaved row is taken out of its group).
fn raw_row<'t>(t: &WeightRows<'t>, r: usize, scratch: &mut Vec<u8>) -> Cow<'t, [u8]> {
    let (rows, bytes) = (t.rows, t.bytes);
    if t.format.interleaved().is_some() {
        let group = bytes.len() / (rows / INTERLEAVE);
        let g = r / INTERLEAVE;
        row_of_group(t.format, &bytes[g * group..(g + 1) * group], r % INTERLEAVE, scratch);
        return Cow::Owned(std::mem::take(scratch));
    }
    let stride = bytes.len() / rows;
    Cow::Borrowed(&bytes[r * stride..(r + 1) * stride])
}

fn word(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

fn half_at(b: &[u8]) -> u16 {
    u16::from_le_bytes([b[0], b[1]])
}

/// Rows of a matrix in a GPU layout. q8_0 / q4_0 scales come as f16 `halves`, which
/// [`Packed::scale_words`] pairs once a part's rows are all in.
#[derive(Default)]
pub struct Packed {
    pub quants: Vec<u32>,
    pub scales: Vec<u32>,
    pub halves: Vec<u16>,
}

impl Packed {
    pub fn append(&mut self, other: Packed) {
        self.quants.extend(other.quants);
        self.scales.extend(other.scales);
        self.halves.extend(other.halves);
    }

    /// The scale array: the K formats' words, or the f16 scales two to a word.
    pub fn scale_words(&self) -> Vec<u32> {
        let pairs = self
            .halves
            .chunks(2)
            .map(|p| u32::from(p[0]) | u32::from(p.get(1).copied().unwrap_or(0)) << 16);
        self.scales.iter().copied().chain(pairs).collect()
    }
}

/// Rows `rows` of `t` in `layout`.
pub fn repack(t: &WeightRows, layout: Layout, rows: std::ops::Range<usize>) -> Packed {
    let cols = t.cols;
    let (qw, sw) = layout.row_words(cols);
    let mut quants = Vec::with_capacity(rows.len() * qw);
    let mut scales = Vec::with_capacity(rows.len() * sw);
    let mut halves: Vec<u16> = Vec::new();
    let mut scratch = Vec::new();
    for r in rows {
        let row = raw_row(t, r, &mut scratch);
        match layout {
            Layout::F32 | Layout::F16 | Layout::Bf16 => {
                quants.extend(row.chunks_exact(4).map(word));
            }
            Layout::Q8_0 => {
                for b in row.chunks_exact(34) {
                    halves.push(half_at(b));
                    quants.extend(b[2..].chunks_exact(4).map(word));
                }
            }
            Layout::Q4_0 => {
                for b in row.chunks_exact(18) {
                    halves.push(half_at(b));
                    quants.extend(b[2..].chunks_exact(4).map(word));
                }
            }
            Layout::Q4_1 => {
                for b in row.chunks_exact(20) {
                    scales.push(word(b));
                    quants.extend(b[4..].chunks_exact(4).map(word));
                }
            }
            Layout::Q5_0 => {
                for b in row.chunks_exact(22) {
                    // f16 d, 4 bytes of fifth bits (bit j: element j), 16 bytes of nibbles.
                    halves.push(half_at(b));
                    quants.extend(b[6..].chunks_exact(4).map(word));
                    quants.push(word(&b[2..6]));
                }
            }
            Layout::Q4K => {
                for b in row.chunks_exact(144) {
                    // d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles.
                    scales.push(u32::from(half_at(b)) | u32::from(half_at(&b[2..])) << 16);
                    let (sc, m) = unpack_k4_scales(&b[4..16]);
                    scales.extend([word(&sc[..4]), word(&sc[4..]), word(&m[..4]), word(&m[4..])]);
                    quants.extend(b[16..].chunks_exact(4).map(word));
                }
            }
            Layout::Q6K => {
                for b in row.chunks_exact(210) {
                    // ql (128), qh (64), 16 int8 scales, f16 d.
                    let (ql, qh, sc) = (&b[..128], &b[128..192], &b[192..208]);
                    let mut q = [0u8; 256];
                    for (n, q) in q.chunks_exact_mut(128).enumerate() {
                        let (ql, qh) = (&ql[64 * n..], &qh[32 * n..]);
                        for l in 0..32 {
                            q[l] = (ql[l] & 15) | ((qh[l] & 3) << 4);
                            q[l + 32] = (ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4);
                            q[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                            q[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                        }
                    }
                    quants.extend(q.chunks_exact(8).map(|e| {
                        e.iter()
                            .enumerate()
                            .fold(0u32, |w, (k, &v)| w | u32::from(v & 15) << (4 * k))
                    }));
                    quants.extend(q.chunks_exact(16).map(|e| {
                        e.iter()
                            .enumerate()
                            .fold(0u32, |w, (k, &v)| w | u32::from(v >> 4) << (2 * k))
                    }));
                    scales.push(f16::from_bits(half_at(&b[208..])).to_f32().to_bits());
                    scales.extend(sc.chunks_exact(4).map(word));
                }
            }
        }
    }
    Packed { quants, scales, halves }
}

/// Q4_K's 12 bytes of packed 6-bit sub-block scales and mins, as 8 of each.
fn unpack_k4_scales(q: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut m) = ([0u8; 8], [0u8; 8]);
    for j in 0..8 {
        if j < 4 {
            sc[j] = q[j] & 63;
            m[j] = q[j + 4] & 63;
        } else {
            sc[j] = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
            m[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        }
    }
    (sc, m)
}
