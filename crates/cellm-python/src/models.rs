//! What the model registry knows, for the converter: which architectures exist and which
//! tensors each reads (`cellm-models` is the only place that says).

use pyo3::prelude::*;

use crate::errors::to_py;
use cellm_engine::cellm_format::Error;

/// One tensor as Python sees it: name, shape, allowed format names.
type TensorTuple = (String, Vec<usize>, Vec<&'static str>);

/// The architecture names the engine runs.
#[pyfunction]
pub fn architectures() -> Vec<&'static str> {
    cellm_models::architectures().collect()
}

/// `(name, shape, allowed formats)` of every tensor the model described by `model_json` (a
/// `.cellm` header's `model` section) reads, in load order; allowed formats list f32 first.
#[pyfunction]
pub fn expected_tensors(py: Python<'_>, model_json: &str) -> PyResult<Vec<TensorTuple>> {
    let model: serde_json::Value = serde_json::from_str(model_json)
        .map_err(|e| to_py(Error::format(format!("bad model description: {e}"))))?;
    let specs = py.detach(|| cellm_models::expected_tensors(&model)).map_err(to_py)?;
    Ok(specs
        .into_iter()
        .map(|s| {
            let formats = s.storage.formats().into_iter().map(|f| f.name()).collect();
            (s.name, s.shape, formats)
        })
        .collect())
}
