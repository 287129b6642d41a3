//! The scalar reference kernels.

use cellm_format::TensorFormat;
use half::{bf16, f16};

use super::floats::cast;

float_row_kernels!();

head_kernels_by_rows!();

dot_tiles_by_rows!();
gemm_tiles_in_order!(false);

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
