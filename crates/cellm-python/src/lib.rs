//! `cellm._core`: thin bindings over the engine. Logic lives in the engine crates or in Python.

mod engine;
mod errors;
mod kernels;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<engine::Engine>()?;
    m.add_function(wrap_pyfunction!(kernels::selected_isa, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::available_isas, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::set_isa, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::matmul, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::read_bandwidth, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
