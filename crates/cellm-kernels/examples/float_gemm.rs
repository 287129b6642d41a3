//! Times the float GEMM on the vision tower's shapes (f16 weights) beside the register
//! tile's ceiling on the same threads, alternating, best of several rounds:
//! `cargo run --release -p cellm-kernels --example float_gemm [THREADS [TOKENS,ROWS,COLS ...]]`.
//!
//! The ceiling runs the path's register tile over one L1-resident panel and token group on
//! every thread at once: the multiply-add rate the GEMM could reach if no load ever missed.
//! On one thread the rates are also given per second of the thread's own CPU time (Linux's
//! schedstat), which a machine shared with other work disturbs much less than the wall clock.

use std::time::Instant;

use cellm_format::TensorFormat;
use cellm_kernels::dense_attention::bidirectional_attention;
use cellm_kernels::gemm::GemmTile;
use cellm_kernels::peak::fma_chains;
use cellm_kernels::pool::{parallel_for, ThreadPool};
use cellm_kernels::{matmul_raw, WeightRows};

/// (tokens, rows, cols): SigLIP-base's q/k/v/out, fc1 and fc2 over one 26x36 NaFlex tile
/// (LFM2.5-VL) and over one 32x32 tile (SmolVLM's 512 px tiles), then its attention
/// (rows 0: 12 heads of 64 over `tokens` patches).
const SHAPES: [(usize, usize, usize); 8] = [
    (936, 768, 768),
    (936, 3072, 768),
    (936, 768, 3072),
    (1024, 768, 768),
    (1024, 3072, 768),
    (1024, 768, 3072),
    (936, 0, 768),
    (1024, 0, 768),
];

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let threads: usize = args.first().map_or(2, |t| t.parse().expect("THREADS"));
    let mut shapes: Vec<(usize, usize, usize)> = args
        .iter()
        .skip(1)
        .map(|a| {
            let v: Vec<usize> =
                a.split(',').map(|n| n.parse().expect("TOKENS,ROWS,COLS")).collect();
            (v[0], v[1], v[2])
        })
        .collect();
    if shapes.is_empty() {
        shapes = SHAPES.to_vec();
    }
    let pool = ThreadPool::new(threads).expect("thread pool");
    // Seconds per GFLOP, best of the rounds: wall clock, and this thread's CPU time.
    let mut wall = vec![f64::INFINITY; shapes.len() + 2];
    let mut cpu = wall.clone();
    let data: Vec<_> = shapes.iter().map(|&(t, r, c)| operands(t, r, c)).collect();
    // Each timing repeats its call for at least 50 ms (schedstat's clock is coarse).
    let mut record = |i: usize, gflop: f64, timed: &dyn Fn()| {
        let (start, cpu_start) = (Instant::now(), thread_cpu_s());
        let mut calls = 0;
        while calls == 0 || start.elapsed().as_secs_f64() < 0.05 {
            timed();
            calls += 1;
        }
        let done = gflop * calls as f64;
        wall[i] = wall[i].min(start.elapsed().as_secs_f64() / done);
        cpu[i] = cpu[i].min((thread_cpu_s() - cpu_start) / done);
    };
    for _ in 0..ROUNDS {
        record(0, ceiling_gflop(threads), &|| pool.install(|| ceiling(threads)));
        let peak_gflop = pool.install(|| fma_chains(threads, PEAK_STEPS)) / 1e9;
        record(shapes.len() + 1, peak_gflop, &|| {
            pool.install(|| fma_chains(threads, PEAK_STEPS));
        });
        for (i, ((t, r, c), (x, w))) in shapes.iter().zip(&data).enumerate() {
            if *r == 0 {
                // Attention over t patches, 12 heads of 64 (c = 768).
                let gflop = 4.0 * (t * t * c) as f64 / 1e9;
                record(i + 1, gflop, &|| {
                    pool.install(|| {
                        std::hint::black_box(bidirectional_attention(x, x, x, *t, 12, 64, 0.125));
                    })
                });
                continue;
            }
            let rows = WeightRows { format: TensorFormat::F16, bytes: w, rows: *r, cols: *c };
            let mut out = vec![0.0f32; t * r];
            let out = std::cell::RefCell::new(&mut out);
            let gflop = 2.0 * (t * r * c) as f64 / 1e9;
            record(i + 1, gflop, &|| {
                pool.install(|| matmul_raw(x, *t, rows, &mut out.borrow_mut()))
            });
        }
    }
    let peak = shapes.len() + 1;
    println!(
        "{threads} thread(s); FMA peak {:.1} GFLOP/s wall; register-tile ceiling {:.1} ({:.0}% of \
         peak){}",
        1.0 / wall[peak],
        1.0 / wall[0],
        100.0 * wall[peak] / wall[0],
        if threads == 1 { format!(", {:.1} per CPU second", 1.0 / cpu[0]) } else { String::new() }
    );
    for (i, (t, r, c)) in shapes.iter().enumerate() {
        let g = 1.0 / wall[i + 1];
        let what = if *r == 0 { "attention".to_string() } else { format!("-> {r:4}") };
        print!(
            "tokens {t:5} x {c:4} {what:>9}: {g:6.1} GFLOP/s ({:3.0}% of the tile, {:3.0}% of peak)",
            100.0 * wall[0] / wall[i + 1],
            100.0 * wall[peak] / wall[i + 1]
        );
        if threads == 1 {
            print!(
                "; per CPU second {:6.1} ({:3.0}% of peak)",
                1.0 / cpu[i + 1],
                100.0 * cpu[peak] / cpu[i + 1]
            );
        }
        println!();
    }
}

/// Seconds this thread has run on a CPU (the first field of Linux's schedstat, in ns); 0
/// where it cannot be read.
fn thread_cpu_s() -> f64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(0.0, |ns| ns / 1e9)
}

fn operands(tokens: usize, rows: usize, cols: usize) -> (Vec<f32>, Vec<u8>) {
    let rows = rows.max(1);
    let x = (0..tokens * cols).map(|i| ((i * 7919) % 251) as f32 / 125.0 - 1.0).collect();
    let w = (0..rows * cols)
        .flat_map(|i| half::f16::from_f32(((i * 104729) % 211) as f32 / 100.0 - 1.05).to_le_bytes())
        .collect();
    (x, w)
}

const ROUNDS: usize = 9;
const COLS: usize = 256;
const CALLS: usize = 20_000;

/// Steps of the FMA peak's chains per timing.
const PEAK_STEPS: usize = 2_000_000;

fn ceiling_gflop(threads: usize) -> f64 {
    let tile = GemmTile::selected();
    2.0 * (threads * CALLS * COLS * tile.len()) as f64 / 1e9
}

/// The selected path's register tile over L1-resident operands, on every thread at once.
fn ceiling(threads: usize) {
    let tile = GemmTile::selected();
    parallel_for(threads, |_| {
        let panel = vec![0.5f32; COLS * tile.rows];
        let x = vec![0.25f32; COLS * tile.tokens];
        let mut acc = vec![0.0f32; tile.len()];
        for _ in 0..CALLS {
            tile.run(&panel, &x, COLS, tile.tokens, &mut acc);
        }
        std::hint::black_box(&acc);
    });
}
