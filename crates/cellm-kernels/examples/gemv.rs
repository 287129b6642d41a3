//! Times one matrix-vector product per block format on random blocks, single-threaded, on
//! every SIMD path in turn: `cargo run --release -p cellm-kernels --example gemv`.

use std::time::Instant;

use cellm_format::TensorFormat;
use cellm_kernels::{isa, matmul_raw, Isa, WeightRows};

fn main() {
    // `gemv [ROWS COLS [TOKENS]]`: the default matrix is larger than any cache; small ones
    // time the kernel alone, and TOKENS > 1 times the prefill path.
    let args: Vec<usize> =
        std::env::args().skip(1).map(|a| a.parse().expect("ROWS COLS [TOKENS]")).collect();
    let (rows, cols, tokens) = match args[..] {
        [r, c] => (r, c, 1),
        [r, c, t] => (r, c, t),
        _ => (8192, 2048, 1),
    };
    let x: Vec<f32> = (0..cols * tokens).map(|i| ((i * 7919) % 251) as f32 / 125.0 - 1.0).collect();
    let mut out = vec![0.0f32; rows * tokens];
    let paths: Vec<Isa> = Isa::available().into_iter().filter(|i| *i != Isa::Scalar).collect();
    // GEMV_FORMATS=f16,q8_0x8 times only those formats.
    let only = std::env::var("GEMV_FORMATS").ok();
    let wanted =
        |f: TensorFormat| only.as_ref().is_none_or(|o| o.split(',').any(|n| n == f.name()));
    // GEMV_THREADS=2 runs the products on a pool of that many threads (default: one).
    let threads: usize =
        std::env::var("GEMV_THREADS").map_or(1, |t| t.parse().expect("GEMV_THREADS"));
    let pool = cellm_kernels::pool::ThreadPool::new(threads).expect("thread pool");
    pool.install(|| run(rows, cols, tokens, &paths, &x, &mut out, &wanted));
}

fn run(
    rows: usize,
    cols: usize,
    tokens: usize,
    paths: &[Isa],
    x: &[f32],
    out: &mut [f32],
    wanted: &dyn Fn(TensorFormat) -> bool,
) {
    let floats = [TensorFormat::F16, TensorFormat::BF16, TensorFormat::F32];
    for format in floats.into_iter().chain(TensorFormat::BLOCKS).chain(TensorFormat::INTERLEAVED) {
        if !wanted(format) {
            continue;
        }
        let Some(n) = format.nbytes(&[rows, cols]) else {
            continue; // rows that do not split into this format's blocks
        };
        let mut bytes: Vec<u8> = (0..n).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
        for blk in bytes.chunks_exact_mut(format.block_bytes()) {
            // A small finite f16 scale at the front of every block (q6_k's is at the end, and
            // its value does not change the timing).
            blk[0] = 0x00;
            blk[1] = 0x20;
        }
        let w = WeightRows { format, bytes: &bytes, rows, cols };
        // Paths alternate, best of five rounds, so a noisy machine hits them alike.
        let mut best = vec![f64::INFINITY; paths.len()];
        for _ in 0..5 {
            for (b, &path) in best.iter_mut().zip(paths) {
                isa::set_override(path).expect("available");
                let t = Instant::now();
                for _ in 0..10 {
                    matmul_raw(x, tokens, w, out);
                }
                *b = b.min(t.elapsed().as_secs_f64() / 10.0);
            }
        }
        for (dt, path) in best.iter().zip(paths) {
            let gbs = n as f64 / dt / 1e9;
            let ns_per_block = dt * 1e9 / (rows * cols / 32 * tokens) as f64;
            println!(
                "{:5} {:11} {:6.1} MB {:7.3} ms {gbs:6.2} GB/s {ns_per_block:5.2} ns/(32 weights x token)",
                format.name(),
                path.name(),
                n as f64 / 1e6,
                dt * 1e3
            );
        }
    }
}
