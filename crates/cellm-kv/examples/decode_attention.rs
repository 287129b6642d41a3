//! Times decode attention alone: one new token attending to a cached context, every layer.
//!
//! `cargo run --release -p cellm-kv --example decode_attention -- CONTEXT LAYERS THREADS
//! [PAGE_SIZE] [--hot] [--encoding f16|f32|int8|int4] [--sessions N] [--steps S]` fills a
//! SmolLM2-shaped cache (9 query heads, 3 kv heads of 64; f16 unless told) for N sessions (1
//! unless told), each CONTEXT tokens long, and prints the best of S steps (20 unless told)
//! that decode one token of every session, with the cache bytes a step reads per second
//! (many steps of a hot one-layer cache make a profile of the arithmetic). Between
//! steps it streams 80 MiB, as a model's weights would, so the cache comes from memory;
//! `--hot` skips that and times the arithmetic on a cache that fits the caches.

use std::process::ExitCode;
use std::time::Instant;

use cellm_kernels::pool::{stream_read, ThreadPool};
use cellm_kv::{AttentionCall, AttentionShape, KvConfig, KvEncoding, PagePool, SeqSpan};

const HEADS: usize = 9;
const KV_HEADS: usize = 3;
const HEAD_DIM: usize = 64;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let hot = args.iter().any(|a| a == "--hot");
    let at = args.iter().position(|a| a == "--encoding");
    let at_sessions = args.iter().position(|a| a == "--sessions");
    let at_steps = args.iter().position(|a| a == "--steps");
    let count_after = |at: Option<usize>, default: usize, flag: &str| match at
        .map(|i| args.get(i + 1).map(|n| n.parse::<usize>()))
    {
        None => Ok(default),
        Some(Some(Ok(n))) if n > 0 => Ok(n),
        _ => Err(format!("error: {flag} needs a count of at least 1")),
    };
    let (sessions, steps) =
        match (count_after(at_sessions, 1, "--sessions"), count_after(at_steps, 20, "--steps")) {
            (Ok(sessions), Ok(steps)) => (sessions, steps),
            (Err(e), _) | (_, Err(e)) => {
                eprintln!("{e}");
                return ExitCode::from(2);
            }
        };
    let encoding = match at.map(|i| args.get(i + 1).map(|n| KvEncoding::parse(n))) {
        None => KvEncoding::F16,
        Some(Some(Ok(e))) => e,
        Some(Some(Err(e))) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
        Some(None) => {
            eprintln!("error: --encoding needs a name");
            return ExitCode::from(2);
        }
    };
    let counts: Result<Vec<usize>, _> = args
        .iter()
        .enumerate()
        .filter(|&(i, a)| {
            let flag = |at: Option<usize>| at.is_some_and(|e| i == e || i == e + 1);
            a != "--hot" && !flag(at) && !flag(at_sessions) && !flag(at_steps)
        })
        .map(|(_, a)| a.parse::<usize>())
        .collect();
    let (context, layers, threads, page_size) = match counts.as_deref() {
        Ok(&[c, l, t]) => (c, l, t, 16),
        Ok(&[c, l, t, p]) => (c, l, t, p),
        _ => {
            eprintln!(
                "usage: decode_attention CONTEXT LAYERS THREADS [PAGE_SIZE] [--hot] \
                 [--encoding NAME] [--sessions N] [--steps S]"
            );
            return ExitCode::from(2);
        }
    };
    if [context, layers, threads, page_size].contains(&0) {
        eprintln!("error: every count must be at least 1");
        return ExitCode::from(2);
    }
    let ms = time_steps(context, layers, (threads, sessions, steps), page_size, hot, encoding);
    let bytes = (sessions * context * layers * KV_HEADS * encoding.head_bytes(HEAD_DIM) * 2) as f64;
    println!(
        "context {context}, {layers} layers, {threads} threads, {sessions} sessions, pages of \
         {page_size}, {encoding:?}{}: {ms:.3} ms a step, {:.1} GB/s of cache",
        if hot { ", hot" } else { "" },
        bytes / ms / 1e6
    );
    ExitCode::SUCCESS
}

/// The best of `steps` steps, in ms.
fn time_steps(
    context: usize,
    layers: usize,
    (threads, sessions, steps): (usize, usize, usize),
    page_size: usize,
    hot: bool,
    encoding: KvEncoding,
) -> f64 {
    let mut pool = PagePool::new(KvConfig {
        num_layers: layers,
        kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        page_size,
        max_pages: (context + 1).div_ceil(page_size) * layers * sessions,
        encoding,
        windows: Vec::new(),
        values_in_keys: false,
    });
    let row = |seed: usize| -> Vec<f32> {
        (0..KV_HEADS * HEAD_DIM).map(|i| ((i * 7 + seed) % 13) as f32 * 0.1 - 0.6).collect()
    };
    let mut seqs: Vec<_> = (0..sessions).map(|_| pool.new_seq()).collect();
    for (s, seq) in seqs.iter_mut().enumerate() {
        pool.reserve(seq, context).expect("pages for the context");
        for pos in 0..context {
            for layer in 0..layers {
                pool.write(seq, (layer, HEAD_DIM), pos, &[], &row(pos + s), &row(pos + s + 5));
            }
        }
        pool.commit(seq, context);
    }
    let q: Vec<f32> = (0..sessions * HEADS * HEAD_DIM).map(|i| (i % 7) as f32 * 0.05).collect();
    let (k, v) = (row(1).repeat(sessions), row(2).repeat(sessions));
    let shape = AttentionShape {
        n_heads: HEADS,
        n_kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        scale: 0.125,
        window: None,
        softcap: None,
    };
    let mut out = vec![0.0f32; sessions * HEADS * HEAD_DIM];
    let workers = ThreadPool::new(threads).expect("thread pool");
    let other = vec![1u64; 80 << 17]; // 80 MiB
    let mut best = f64::MAX;
    for _ in 0..steps {
        if !hot {
            workers.install(|| stream_read(&other));
        }
        // The step's own row needs a slot, as the engine reserves one before each step.
        for seq in &mut seqs {
            pool.reserve(seq, context + 1).expect("a page for the new row");
        }
        let start = Instant::now();
        workers.install(|| {
            for layer in 0..layers {
                let spans: Vec<SeqSpan> = (seqs.iter().enumerate())
                    .map(|(row0, kv)| SeqSpan { kv, start: context, len: 1, row0 })
                    .collect();
                let call =
                    AttentionCall { layer, spans: &spans, q: &q, k: &k, v: &v, shape: &shape };
                call.run(&mut pool, &mut out);
            }
        });
        best = best.min(start.elapsed().as_secs_f64());
        for seq in &mut seqs {
            pool.truncate(seq, context);
        }
    }
    best * 1e3
}
