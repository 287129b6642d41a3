//! What both fuzz targets do with a file that opens: build the engine and run it the way a
//! user would (a prefill, a decode step, all-position logits, a rewind), within bounds that
//! keep one execution to milliseconds. Any panic, abort or sanitizer report is a finding;
//! errors are fine (they are what bad input should give).

use cellm_engine::cellm_format::CellmFile;
use cellm_engine::{Engine, EngineOptions, KvEncoding, LogitsMode};

/// Floats of recurrent state a fuzzed model may ask of one session (larger is valid, but
/// slow to run thousands of times a second).
const MAX_STATE_FLOATS: usize = 1 << 22;

/// Reads every tensor and blob of `file`, loads its model and runs a few steps: a prefill
/// long enough for the query-tile path (8 rows), a batch of a decode row and a short span,
/// a decode batch, a rewind, a step past the context (an error) and a cancelled step, which
/// must leave its session as it was.
pub fn exercise(file: CellmFile, encoding: KvEncoding) {
    for t in &file.header().tensors {
        if let Ok(tensor) = file.tensor(&t.name) {
            let bytes = tensor.bytes();
            std::hint::black_box((bytes.first(), bytes.last()));
            let _ = tensor.as_f32();
            let _ = tensor.as_u16();
        }
    }
    for b in &file.header().blobs {
        std::hint::black_box(file.blob(&b.name).map(|b| (b.first(), b.last())));
    }
    let opts = EngineOptions {
        threads: Some(1),
        kv_encoding: encoding,
        context_length: Some(12),
        kv_capacity_tokens: Some(48),
        // Every other option (GPU, prefix cache, layer limit) as a user gets it by default.
        ..EngineOptions::default()
    };
    let Ok(mut engine) = Engine::from_file(file, &opts) else { return };
    let state: usize = engine.model().cache_layout().state.iter().sum();
    if state > MAX_STATE_FLOATS {
        return;
    }
    let vocab = engine.model().config().vocab_size as u32;
    let ids: Vec<u32> = (0..10u32).map(|i| (i * 7919) % vocab).collect();
    let (a, b) = (engine.create_session(), engine.create_session());
    let _ = engine.step(&[(a, &ids[..8])], LogitsMode::Last);
    let _ = engine.step(&[(a, &ids[8..9]), (b, &ids[..3])], LogitsMode::All);
    let _ = engine.step(&[(a, &[vocab - 1]), (b, &ids[3..4])], LogitsMode::Last);
    if engine.truncate_session(a, 3).is_ok() {
        let _ = engine.step(&[(a, &ids[3..5])], LogitsMode::All);
    }
    // Past the context: an error.
    let _ = engine.step(&[(b, &ids)], LogitsMode::Last);
    // A step cancelled after `stop` checks (Ctrl-C) changes no session and no page.
    let stop = ids[9] as usize % 8;
    let (len, pages) = (engine.session_len(b), engine.pool().pages_in_use());
    let asked = std::sync::atomic::AtomicUsize::new(0);
    let cancel = || asked.fetch_add(1, std::sync::atomic::Ordering::Relaxed) >= stop;
    if engine.step_cancellable(&[(b, &ids[4..7])], LogitsMode::All, &cancel).is_err() {
        assert_eq!((engine.session_len(b), engine.pool().pages_in_use()), (len, pages));
    }
    let _ = engine.free_session(a);
}
