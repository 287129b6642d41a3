//! `cellm._core`: thin bindings over the engine. Logic lives in the engine crates or in Python.

mod engine;
mod errors;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<engine::Engine>()?;
    m.add_function(wrap_pyfunction!(engine::selected_isa, m)?)?;
    m.add_function(wrap_pyfunction!(engine::available_isas, m)?)?;
    m.add_function(wrap_pyfunction!(engine::set_isa, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
