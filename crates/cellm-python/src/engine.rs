//! `cellm._core.Engine`: one loaded model with its sessions.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use cellm_engine::cellm_format::Error;
use cellm_engine::{Engine as Inner, EngineOptions, Given, GpuKind, LogitsMode, SessionId};
use numpy::{IntoPyArray, PyArray2, PyArrayMethods, PyReadonlyArray2};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::to_py;

/// One entry of `step`'s `embeds`: batch index, token positions, embedding rows.
type GivenRows<'py> = (usize, Vec<usize>, PyReadonlyArray2<'py, f32>);

#[pyclass(module = "cellm._core")]
pub struct Engine {
    inner: Inner,
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (path, *, threads=None, kv_encoding="f16", context_length=None, kv_capacity_tokens=None, max_layers=None, backend="cpu", gpu_max_binding=None, prefix_cache=true))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        threads: Option<usize>,
        kv_encoding: &str,
        context_length: Option<usize>,
        kv_capacity_tokens: Option<usize>,
        max_layers: Option<usize>,
        backend: &str,
        gpu_max_binding: Option<u64>,
        prefix_cache: bool,
    ) -> PyResult<Self> {
        let gpu = match backend {
            "cpu" => None,
            other => Some(GpuKind::parse(other).ok_or_else(|| {
                to_py(Error::InvalidArgument(format!(
                    "unknown backend '{other}' (expected cpu, vulkan, metal or gpu)"
                )))
            })?),
        };
        let opts = EngineOptions {
            threads,
            kv_encoding: cellm_engine::KvEncoding::parse(kv_encoding).map_err(to_py)?,
            context_length,
            kv_capacity_tokens,
            max_layers,
            gpu,
            gpu_max_binding,
            prefix_cache,
        };
        let inner = py.detach(|| Inner::open(&path, &opts)).map_err(to_py)?;
        Ok(Self { inner })
    }

    /// The file's JSON header (model description, tokenizer and generation config).
    fn header_json(&self) -> &str {
        self.inner.file().header_json()
    }

    /// A named blob embedded in the file (e.g. `tokenizer.json`), or None.
    fn blob<'py>(&self, py: Python<'py>, name: &str) -> Option<Bound<'py, PyBytes>> {
        self.inner.file().blob(name).map(|b| PyBytes::new(py, b))
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.model().config().vocab_size
    }

    #[getter]
    fn context_length(&self) -> usize {
        self.inner.context_length()
    }

    #[getter]
    fn threads(&self) -> usize {
        self.inner.threads()
    }

    /// KV pool usage: pages held by sessions, pages allocated, bytes per page, pages the
    /// prefix cache lists, positions reused from it so far.
    fn kv_stats(&self) -> (usize, usize, usize, usize, u64) {
        let p = self.inner.pool();
        let cache = (p.cached_pages(), p.prefix_hit_tokens());
        (p.pages_in_use(), p.pages_allocated(), p.page_bytes(), cache.0, cache.1)
    }

    /// Whether sessions share full KV pages by their token ids (off for models with
    /// recurrent state, on the GPU, or when asked).
    #[getter]
    fn prefix_cache(&self) -> bool {
        self.inner.pool().prefix_cache_enabled()
    }

    /// Starts the empty `session` with the longest cached prefix of `ids` (whole pages, all
    /// but at least the last id) and returns how many positions it holds; step the rest.
    fn reuse_prefix(&mut self, session: SessionId, ids: Vec<u32>) -> PyResult<usize> {
        self.inner.reuse_prefix(session, &ids).map_err(to_py)
    }

    fn create_session(&mut self) -> SessionId {
        self.inner.create_session()
    }

    fn free_session(&mut self, session: SessionId) -> PyResult<()> {
        self.inner.free_session(session).map_err(to_py)
    }

    fn truncate_session(&mut self, session: SessionId, length: usize) -> PyResult<()> {
        self.inner.truncate_session(session, length).map_err(to_py)
    }

    fn session_len(&self, session: SessionId) -> PyResult<usize> {
        self.inner.session_len(session).map_err(to_py)
    }

    /// Image features (float32, `tokens x hidden`) of preprocessed tiles: `patches` holds
    /// every tile's patch rows (`3 * patch * patch` wide), tile after tile; `grids` each
    /// tile's patch grid (rows, cols). Raises InvalidArgument on a text-only model.
    fn encode_images<'py>(
        &self,
        py: Python<'py>,
        patches: PyReadonlyArray2<'py, f32>,
        grids: Vec<(usize, usize)>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let patches: Vec<f32> = patches.as_array().iter().copied().collect();
        let inner = &self.inner;
        let features = py.detach(|| inner.encode_images(&patches, &grids)).map_err(to_py)?;
        let hidden = self.inner.model().config().hidden_size;
        let rows = features.len() / hidden;
        features.into_pyarray(py).reshape([rows, hidden])
    }

    /// Encodes one window of a speech model's log-mel features (float32, `bins x frames`),
    /// makes it the cross-attention memory of `session` (replacing the previous window's)
    /// and returns the encoder states (`positions x hidden`). Raises InvalidArgument on a
    /// model without an audio encoder or features of the wrong shape.
    fn encode_speech<'py>(
        &mut self,
        py: Python<'py>,
        session: SessionId,
        features: PyReadonlyArray2<'py, f32>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let mel: Vec<f32> = features.as_array().iter().copied().collect();
        let inner = &mut self.inner;
        let states = py.detach(|| inner.encode_speech(session, &mel)).map_err(to_py)?;
        let hidden = self.inner.model().config().hidden_size;
        let rows = states.len() / hidden;
        states.into_pyarray(py).reshape([rows, hidden])
    }

    /// One batched forward over `[(session, new_token_ids), ...]`; returns float32 logits of
    /// shape `(rows, vocab)`: the last new token of each session, or every new token when
    /// `all_logits`. The GIL is released while the engine runs; a signal handler that raises
    /// (Ctrl-C's KeyboardInterrupt) stops the step between layers, with every session as
    /// before it.
    ///
    /// `embeds`: `[(batch_index, token_positions, rows), ...]`, input embeddings (float32,
    /// `len(token_positions) x hidden`) that replace the looked-up ones of those new tokens
    /// (a vision-language model's image features).
    #[pyo3(signature = (batch, *, all_logits=false, embeds=None))]
    fn step<'py>(
        &mut self,
        py: Python<'py>,
        batch: Vec<(SessionId, Vec<u32>)>,
        all_logits: bool,
        embeds: Option<Vec<GivenRows<'py>>>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let refs: Vec<(SessionId, &[u32])> =
            batch.iter().map(|(s, t)| (*s, t.as_slice())).collect();
        let values: Vec<Vec<f32>> = embeds
            .iter()
            .flatten()
            .map(|(_, _, a)| a.as_array().iter().copied().collect())
            .collect();
        let given: Vec<Given> = embeds
            .iter()
            .flatten()
            .zip(&values)
            .map(|((entry, rows, _), values)| Given { entry: *entry, rows, values })
            .collect();
        let mode = if all_logits { LogitsMode::All } else { LogitsMode::Last };
        let inner = &mut self.inner;
        let signals = SignalPoll::new();
        let cancel = || signals.raised();
        match py.detach(|| inner.step_given(&refs, &given, mode, &cancel)) {
            Ok((logits, rows)) => {
                let vocab = self.inner.model().config().vocab_size;
                logits.into_pyarray(py).reshape([rows, vocab])
            }
            Err(Error::Interrupted) => Err(signals.into_error()),
            Err(e) => Err(to_py(e)),
        }
    }
}

/// How long a step runs between looks at Python's pending signals. Each look re-attaches
/// to the interpreter, which waits for the GIL if another thread holds it, so a decode
/// step (milliseconds) never looks; a long prefill looks between layers at most this often.
const SIGNAL_POLL: Duration = Duration::from_millis(50);

/// Runs Python's signal handlers now and then from a step that released the GIL, and keeps
/// the exception one raised.
struct SignalPoll {
    last: Mutex<Instant>,
    raised: Mutex<Option<PyErr>>,
}

impl SignalPoll {
    fn new() -> Self {
        Self { last: Mutex::new(Instant::now()), raised: Mutex::new(None) }
    }

    /// Whether a signal handler raised, looking only when SIGNAL_POLL has passed since the
    /// last look (on threads other than the main one, Python runs no handlers: never).
    fn raised(&self) -> bool {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if last.elapsed() < SIGNAL_POLL {
            return false;
        }
        let outcome = Python::attach(|py| py.check_signals());
        *last = Instant::now();
        match outcome {
            Ok(()) => false,
            Err(e) => {
                *self.raised.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                true
            }
        }
    }

    /// The handler's exception (KeyboardInterrupt for Ctrl-C).
    fn into_error(self) -> PyErr {
        let raised = self.raised.into_inner().unwrap_or_else(|e| e.into_inner());
        raised.unwrap_or_else(|| to_py(Error::Interrupted))
    }
}
