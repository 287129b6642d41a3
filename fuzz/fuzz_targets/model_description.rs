//! Any bytes as a model description (the `model` section of a header, JSON): a file is made
//! up with every tensor that description asks for (`cellm_engine::synthetic`), so the loader,
//! the validation and the forward pass meet every combination of sizes, counts, floats and
//! sections with matching weights.
#![no_main]

use cellm_engine::cellm_format::CellmFile;
use cellm_engine::{synthetic, KvEncoding};

/// Weights a made-up file may hold, and layers its description may ask for: enough for
/// every shape the engine handles, small enough for thousands of runs a second.
const MAX_BYTES: usize = 4 << 20;
const MAX_LAYERS: u64 = 64;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Ok(model) = serde_json::from_slice::<serde_json::Value>(data) else { return };
    if model.get("num_layers").and_then(|n| n.as_u64()).is_some_and(|n| n > MAX_LAYERS) {
        return;
    }
    let Ok(specs) = cellm_models::expected_tensors(&model) else { return };
    let bytes = specs.iter().try_fold(0usize, |total, s| {
        let n = s.shape.iter().try_fold(4usize, |a, &d| a.checked_mul(d))?;
        total.checked_add(n).filter(|&t| t <= MAX_BYTES)
    });
    if bytes.is_none() {
        return;
    }
    let file = synthetic::model_file(&model, data.len() as u64).expect("planned above");
    let file = CellmFile::from_bytes(&file).expect("a made-up file opens");
    cellm_fuzz::exercise(file, KvEncoding::F16);
});
