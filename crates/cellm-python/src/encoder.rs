//! `cellm._core.Encoder`: an encoder model (token classifier, sentence embedder).

use std::path::PathBuf;

use cellm_engine::EncoderEngine;
use numpy::{IntoPyArray, PyArray2, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::to_py;

#[pyclass(module = "cellm._core")]
pub struct Encoder {
    inner: EncoderEngine,
}

#[pymethods]
impl Encoder {
    #[new]
    #[pyo3(signature = (path, *, threads=None))]
    fn new(py: Python<'_>, path: PathBuf, threads: Option<usize>) -> PyResult<Self> {
        let inner = py.detach(|| EncoderEngine::open(&path, threads)).map_err(to_py)?;
        Ok(Self { inner })
    }

    /// The file's JSON header (model description, tokenizer).
    fn header_json(&self) -> &str {
        self.inner.file().header_json()
    }

    /// A named blob embedded in the file (e.g. `tokenizer.json`), or None.
    fn blob<'py>(&self, py: Python<'py>, name: &str) -> Option<Bound<'py, PyBytes>> {
        self.inner.file().blob(name).map(|b| PyBytes::new(py, b))
    }

    /// Values per output row: label logits or hidden width.
    #[getter]
    fn width(&self) -> usize {
        self.inner.model().width()
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.model().vocab_size()
    }

    /// The longest sequence one forward accepts.
    #[getter]
    fn max_tokens(&self) -> usize {
        self.inner.model().max_tokens()
    }

    #[getter]
    fn threads(&self) -> usize {
        self.inner.threads()
    }

    /// float32 `(sum of lengths, width)`: one row per token of each sequence, sequence after
    /// sequence; each sequence attends only to itself. The GIL is released meanwhile.
    fn forward<'py>(
        &self,
        py: Python<'py>,
        seqs: Vec<Vec<u32>>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let refs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
        let inner = &self.inner;
        let out = py.detach(|| inner.forward(&refs)).map_err(to_py)?;
        let width = self.inner.model().width();
        let rows = out.len() / width;
        out.into_pyarray(py).reshape([rows, width])
    }
}
