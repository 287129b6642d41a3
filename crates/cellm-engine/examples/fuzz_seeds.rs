//! Writes the fuzz targets' seed corpora (`fuzz/`, run by `tools/fuzz.sh`):
//! `cargo run -p cellm-engine --example fuzz_seeds -- OUT_DIR [CELLM_FILE...]` puts a made-up file of every
//! family (`cellm_engine::synthetic::tiny_models`) in `OUT_DIR/cellm_file/`, and its
//! description in `OUT_DIR/model_description/`, plus each given `.cellm` file (the
//! converted test fixtures) and its description.

use std::path::PathBuf;

use cellm_engine::cellm_format::CellmFile;
use cellm_engine::synthetic::{model_file, tiny_models};

fn main() {
    let mut args = std::env::args().skip(1);
    let out = PathBuf::from(args.next().expect("usage: fuzz_seeds OUT_DIR [CELLM_FILE...]"));
    let (files, descriptions) = (out.join("cellm_file"), out.join("model_description"));
    std::fs::create_dir_all(&files).unwrap();
    std::fs::create_dir_all(&descriptions).unwrap();
    for (name, model) in tiny_models() {
        let bytes = model_file(&model, 1).unwrap();
        std::fs::write(files.join(format!("tiny-{name}.cellm")), bytes).unwrap();
        std::fs::write(descriptions.join(format!("tiny-{name}.json")), model.to_string()).unwrap();
    }
    for path in args {
        let path = PathBuf::from(path);
        let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
        let file = CellmFile::open(&path).unwrap();
        std::fs::copy(&path, files.join(format!("{stem}.cellm"))).unwrap();
        std::fs::write(descriptions.join(format!("{stem}.json")), file.header().model.to_string())
            .unwrap();
    }
}
