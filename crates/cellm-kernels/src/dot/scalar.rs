//! The scalar reference kernels.

use cellm_format::TensorFormat;
use half::{bf16, f16};

use super::{cast, DotTileFn, HeadKernels, RowKernels};

pub fn kernels(format: TensorFormat) -> RowKernels {
    match format {
        TensorFormat::F32 => {
            RowKernels { dot: dot_f32, decode: decode_f32, axpy: axpy_f32, qdot: None }
        }
        TensorFormat::F16 => {
            RowKernels { dot: dot_f16, decode: decode_f16, axpy: axpy_f16, qdot: None }
        }
        TensorFormat::BF16 => {
            RowKernels { dot: dot_bf16, decode: decode_bf16, axpy: axpy_bf16, qdot: None }
        }
        other => unreachable!("{other:?} is a block format"),
    }
}

/// The head-group kernels as one row kernel call per head: the reference.
pub fn head_kernels(format: TensorFormat) -> HeadKernels {
    fn dot_heads<const F: usize>(row: &[u8], q: &[f32], out: &mut [f32]) {
        let k = kernels([TensorFormat::F32, TensorFormat::F16, TensorFormat::BF16][F]);
        let n = row.len() / [4, 2, 2][F];
        for (h, o) in out.iter_mut().enumerate() {
            *o = (k.dot)(row, &q[h * n..(h + 1) * n]);
        }
    }
    fn axpy_heads<const F: usize>(a: &[f32], row: &[u8], acc: &mut [f32]) {
        let k = kernels([TensorFormat::F32, TensorFormat::F16, TensorFormat::BF16][F]);
        let n = row.len() / [4, 2, 2][F];
        for (h, &ah) in a.iter().enumerate() {
            (k.axpy)(ah, row, &mut acc[h * n..(h + 1) * n]);
        }
    }
    match format {
        TensorFormat::F32 => HeadKernels { dot: dot_heads::<0>, axpy: axpy_heads::<0> },
        TensorFormat::F16 => HeadKernels { dot: dot_heads::<1>, axpy: axpy_heads::<1> },
        TensorFormat::BF16 => HeadKernels { dot: dot_heads::<2>, axpy: axpy_heads::<2> },
        other => unreachable!("{other:?} is not a cache format"),
    }
}

/// The float matmul tile as one row kernel call per (row, token): the reference.
pub fn dot_tiles(format: TensorFormat) -> DotTileFn {
    fn tile<const F: usize>(rows: &[&[u8]], x: &[f32], out: &mut [f32]) {
        let k = kernels([TensorFormat::F32, TensorFormat::F16, TensorFormat::BF16][F]);
        let n = rows.first().map_or(0, |r| r.len() / [4, 2, 2][F]);
        let tokens = x.len() / n.max(1);
        assert!(out.len() == rows.len() * tokens, "dot_tile: output size");
        for (r, row) in rows.iter().enumerate() {
            for t in 0..tokens {
                out[r * tokens + t] = (k.dot)(row, &x[t * n..(t + 1) * n]);
            }
        }
    }
    match format {
        TensorFormat::F32 => tile::<0>,
        TensorFormat::F16 => tile::<1>,
        TensorFormat::BF16 => tile::<2>,
        other => unreachable!("{other:?} is a block format"),
    }
}

/// Eight independent partial sums, so rounding follows the same pairing as the SIMD paths
/// more closely than one running sum would.
fn dot_with(x: &[f32], w: impl Fn(usize) -> f32) -> f32 {
    let mut acc = [0.0f32; 8];
    for (i, xi) in x.iter().enumerate() {
        acc[i % 8] += w(i) * xi;
    }
    acc.iter().sum()
}

fn dot_f32(row: &[u8], x: &[f32]) -> f32 {
    let w: &[f32] = cast(row);
    dot_with(&x[..w.len()], |i| w[i])
}

fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
    let w: &[u16] = cast(row);
    dot_with(&x[..w.len()], |i| f16::from_bits(w[i]).to_f32())
}

fn dot_bf16(row: &[u8], x: &[f32]) -> f32 {
    let w: &[u16] = cast(row);
    dot_with(&x[..w.len()], |i| bf16::from_bits(w[i]).to_f32())
}

fn decode_f32(row: &[u8], out: &mut [f32]) {
    out.copy_from_slice(cast::<f32>(row));
}

fn decode_f16(row: &[u8], out: &mut [f32]) {
    for (o, &b) in out.iter_mut().zip(cast::<u16>(row)) {
        *o = f16::from_bits(b).to_f32();
    }
}

fn decode_bf16(row: &[u8], out: &mut [f32]) {
    for (o, &b) in out.iter_mut().zip(cast::<u16>(row)) {
        *o = bf16::from_bits(b).to_f32();
    }
}

fn axpy_f32(a: f32, row: &[u8], acc: &mut [f32]) {
    for (o, &w) in acc.iter_mut().zip(cast::<f32>(row)) {
        *o += a * w;
    }
}

fn axpy_f16(a: f32, row: &[u8], acc: &mut [f32]) {
    for (o, &b) in acc.iter_mut().zip(cast::<u16>(row)) {
        *o += a * f16::from_bits(b).to_f32();
    }
}

fn axpy_bf16(a: f32, row: &[u8], acc: &mut [f32]) {
    for (o, &b) in acc.iter_mut().zip(cast::<u16>(row)) {
        *o += a * bf16::from_bits(b).to_f32();
    }
}
