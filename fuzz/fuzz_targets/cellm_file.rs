//! Any bytes as a `.cellm` file: the reader's validation, then (when it opens) the model
//! loader and a few engine steps. Seeds: `tools/fuzz.sh seeds` (made-up files of every
//! family, and the test fixtures converted).
#![no_main]

use cellm_engine::cellm_format::CellmFile;
use cellm_engine::KvEncoding;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(file) = CellmFile::from_bytes(data) {
        let encoding = if data.len() % 2 == 0 { KvEncoding::F16 } else { KvEncoding::F32 };
        cellm_fuzz::exercise(file, encoding);
    }
});
