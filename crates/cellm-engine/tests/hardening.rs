//! The engine on made-up model files (`cellm_engine::synthetic`): cancelled steps change
//! nothing, sizes at the edges of what a description may say, and more attention heads than
//! one attention task holds.

use std::sync::atomic::{AtomicUsize, Ordering};

use cellm_engine::cellm_format::{CellmFile, Error};
use cellm_engine::synthetic::{model_file, tiny_models};
use cellm_engine::{Engine, EngineOptions, KvEncoding, LogitsMode};
use serde_json::{json, Value};

fn options() -> EngineOptions {
    EngineOptions { threads: Some(2), kv_encoding: KvEncoding::F32, ..Default::default() }
}

fn open(model: &Value, opts: &EngineOptions) -> Result<Engine, Error> {
    let bytes = model_file(model, 7)?;
    Engine::from_file(CellmFile::from_bytes(&bytes)?, opts)
}

fn engine(model: &Value) -> Engine {
    open(model, &options()).unwrap()
}

fn ids(n: usize) -> Vec<u32> {
    (0..n).map(|i| (i * 37 % 61) as u32).collect()
}

/// In every family, a step stopped at each point its cancel hook is asked (before it starts,
/// then before each layer's mixer and feed-forward) leaves the session as it was: its length,
/// its KV pages, its recurrent state. Going on afterwards gives the logits of a session that
/// was never stopped, bit for bit.
#[test]
fn a_cancelled_step_changes_nothing() {
    let ids = ids(40);
    for (name, model) in tiny_models() {
        let checks = 1 + 2 * model["num_layers"].as_u64().unwrap() as usize;
        let mut reference = engine(&model);
        let r = reference.create_session();
        reference.step(&[(r, &ids[..10])], LogitsMode::Last).unwrap();
        let want = reference.step(&[(r, &ids[10..])], LogitsMode::All).unwrap().0;
        let want_next = reference.step(&[(r, &ids[..1])], LogitsMode::Last).unwrap().0;

        let mut e = engine(&model);
        let s = e.create_session();
        e.step(&[(s, &ids[..10])], LogitsMode::Last).unwrap();
        let pages = e.pool().pages_in_use();
        for stop_at in 0..checks {
            let asked = AtomicUsize::new(0);
            let cancel = || asked.fetch_add(1, Ordering::Relaxed) >= stop_at;
            let got = e.step_cancellable(&[(s, &ids[10..])], LogitsMode::All, &cancel);
            assert_eq!(got.err(), Some(Error::Interrupted), "{name}, stopped at {stop_at}");
            assert_eq!(e.session_len(s).unwrap(), 10, "{name}, stopped at {stop_at}");
            assert_eq!(e.pool().pages_in_use(), pages, "{name}, stopped at {stop_at}");
        }
        let got = e.step(&[(s, &ids[10..])], LogitsMode::All).unwrap().0;
        assert!(got == want, "{name}: logits after cancelled steps differ");
        // A decode step stops only before it starts in models with recurrent state (their
        // state is not copied for one token); in the others, anywhere.
        let stateful = ["lfm2", "qwen3_5"].contains(&name);
        let asked = AtomicUsize::new(0);
        let cancel = || asked.fetch_add(1, Ordering::Relaxed) >= 1;
        match e.step_cancellable(&[(s, &ids[..1])], LogitsMode::Last, &cancel) {
            Ok((next, _)) => assert!(stateful && next == want_next, "{name}"),
            Err(e) => assert!(!stateful && e == Error::Interrupted, "{name}: {e}"),
        }
    }
}

/// A step stopped before it starts in a batch of sessions leaves all of them alone, and a
/// session that is not in the batch too.
#[test]
fn a_cancelled_batch_changes_no_session() {
    let (_, model) = &tiny_models()[0];
    let mut e = engine(model);
    let ids = ids(50);
    let (a, b, c) = (e.create_session(), e.create_session(), e.create_session());
    e.step(&[(a, &ids[..5])], LogitsMode::Last).unwrap();
    e.step(&[(c, &ids[..20])], LogitsMode::Last).unwrap();
    let pages = e.pool().pages_in_use();
    for stop_at in 0..5 {
        let asked = AtomicUsize::new(0);
        let cancel = || asked.fetch_add(1, Ordering::Relaxed) >= stop_at;
        let batch: [(u64, &[u32]); 2] = [(a, &ids[5..40]), (b, &ids[..30])];
        let got = e.step_cancellable(&batch, LogitsMode::Last, &cancel);
        assert_eq!(got.err(), Some(Error::Interrupted));
        let lens: Vec<usize> = [a, b, c].iter().map(|&s| e.session_len(s).unwrap()).collect();
        assert_eq!((lens, e.pool().pages_in_use()), (vec![5, 0, 20], pages));
    }
}

/// A description or an option asking for more positions (or threads) than the engine can
/// address is refused by name (2^61 positions used to wrap `context * 8` into a "KV cache is
/// full"; a million threads were started one by one until the OS said no).
#[test]
fn context_lengths_at_the_edge() {
    let (_, model) = &tiny_models()[0];
    let mut huge = model.clone();
    huge["max_position_embeddings"] = json!(1usize << 61);
    match open(&huge, &options()) {
        Err(Error::Format(m)) => assert!(m.contains("max_position_embeddings is"), "{m}"),
        other => panic!("{:?}", other.err()),
    }
    for context in [0, 1usize << 61, usize::MAX] {
        let opts = EngineOptions { context_length: Some(context), ..options() };
        match open(model, &opts) {
            Err(Error::InvalidArgument(m)) => assert!(m.contains("context_length"), "{m}"),
            other => panic!("{:?}", other.err()),
        }
    }
    for threads in [0, 1 << 20] {
        let opts = EngineOptions { threads: Some(threads), ..options() };
        match open(model, &opts) {
            Err(Error::InvalidArgument(m)) => assert!(m.contains("threads must be 1 to"), "{m}"),
            other => panic!("{:?}", other.err()),
        }
    }
    // The largest context and KV capacity allowed: pages come on demand, so this costs
    // nothing until used.
    let most = EngineOptions {
        context_length: Some(cellm_models::MAX_CONTEXT),
        kv_capacity_tokens: Some(usize::MAX),
        ..options()
    };
    let mut e = open(model, &most).unwrap();
    let s = e.create_session();
    e.step(&[(s, &ids(20))], LogitsMode::Last).unwrap();
}

/// More query heads than one row-attention task holds (64), as valid HF configs may have:
/// decoding token by token (the row path, in passes of heads) gives the logits of one
/// prefill (query tiles) of the same tokens. This used to panic at the first decode.
#[test]
fn more_than_64_heads_decode() {
    let (_, base) = &tiny_models()[0];
    for (heads, kv_heads) in [(72, 8), (72, 1), (130, 2)] {
        let mut model = base.clone();
        model["num_heads"] = json!(heads);
        model["num_kv_heads"] = json!(kv_heads);
        let mut e = engine(&model);
        let ids = ids(24);
        let s = e.create_session();
        let (all, _) = e.step(&[(s, &ids)], LogitsMode::All).unwrap();
        let vocab = e.model().config().vocab_size;
        let t = e.create_session();
        for (i, id) in ids.iter().enumerate() {
            let (one, _) = e.step(&[(t, std::slice::from_ref(id))], LogitsMode::Last).unwrap();
            let want = &all[i * vocab..(i + 1) * vocab];
            let worst = one.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            assert!(worst < 1e-4, "{heads} heads, position {i}: {worst}");
        }
    }
}
