//! Times one matrix-vector product per block format on random blocks, single-threaded:
//! `cargo run --release -p cellm-kernels --example gemv`.

use std::time::Instant;

use cellm_format::TensorFormat;
use cellm_kernels::{matmul_raw, WeightRows};

fn main() {
    let (rows, cols) = (8192usize, 2048usize);
    let x: Vec<f32> = (0..cols).map(|i| ((i * 7919) % 251) as f32 / 125.0 - 1.0).collect();
    let mut out = vec![0.0f32; rows];
    for format in TensorFormat::BLOCKS {
        let n = format.nbytes(&[rows, cols]).unwrap();
        let mut bytes: Vec<u8> = (0..n).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
        for blk in bytes.chunks_exact_mut(format.block_bytes()) {
            // Small finite f16 scales wherever a format keeps them.
            blk[0] = 0x00;
            blk[1] = 0x20;
        }
        let w = WeightRows { format, bytes: &bytes, rows, cols };
        matmul_raw(&x, 1, w, &mut out);
        let reps = 50;
        let t = Instant::now();
        for _ in 0..reps {
            matmul_raw(&x, 1, w, &mut out);
        }
        let dt = t.elapsed().as_secs_f64() / reps as f64;
        println!(
            "{:5} {:6.1} MB {:7.3} ms {:6.2} GB/s",
            format.name(),
            n as f64 / 1e6,
            dt * 1e3,
            n as f64 / dt / 1e9
        );
    }
}
