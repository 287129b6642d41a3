//! An encoder with its worker threads: a batch of token sequences in, one row per token out.
//! Encoders keep no sessions or caches: every call reads whole texts.

use std::path::Path;

use cellm_format::{CellmFile, Error, Result};
use cellm_kernels::pool::ThreadPool;
use cellm_models::Encoder;

pub struct EncoderEngine {
    file: CellmFile,
    model: Box<dyn Encoder>,
    workers: ThreadPool,
}

impl EncoderEngine {
    /// `threads`: default the physical cores.
    pub fn open(path: impl AsRef<Path>, threads: Option<usize>) -> Result<Self> {
        let path = path.as_ref();
        let named = |e| match e {
            Error::Format(m) => Error::Format(format!("{}: {m}", path.display())),
            other => other,
        };
        let file = CellmFile::open(path).map_err(named)?;
        let model = cellm_models::load_encoder(&file).map_err(named)?;
        Ok(Self { file, model, workers: super::start_workers(threads)? })
    }

    pub fn file(&self) -> &CellmFile {
        &self.file
    }

    pub fn model(&self) -> &dyn Encoder {
        self.model.as_ref()
    }

    pub fn threads(&self) -> usize {
        self.workers.threads()
    }

    /// `sum(len) x width` rows, the sequences' rows one after another.
    pub fn forward(&self, seqs: &[&[u32]]) -> Result<Vec<f32>> {
        self.workers.install(|| self.model.forward(seqs))
    }
}
