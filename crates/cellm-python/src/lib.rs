//! `cellm._core`: thin bindings over the engine. Logic lives in the engine crates or in Python.

mod encoder;
mod engine;
mod errors;
mod kernels;
mod models;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    keep_scratch_in_heap();
    import_numpy(m.py())?;
    m.add_class::<engine::Engine>()?;
    m.add_class::<encoder::Encoder>()?;
    m.add_function(wrap_pyfunction!(kernels::selected_isa, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::available_isas, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::set_isa, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::matmul, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::read_bandwidth, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::fma_peak, m)?)?;
    m.add_function(wrap_pyfunction!(models::architectures, m)?)?;
    m.add_function(wrap_pyfunction!(models::expected_tensors, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}

/// Imports NumPy's C API (and rust-numpy's borrow checking) now, where a failure is an
/// ImportError. Done lazily by the first array instead, it ran Python code (NumPy's version
/// check) right after a step, where a pending Ctrl-C made it fail, and rust-numpy panics
/// on that failure: `PanicException: Failed to access NumPy array API capsule`.
fn import_numpy(py: Python<'_>) -> PyResult<()> {
    numpy::get_array_module(py)?;
    use numpy::PyArrayMethods;
    let probe = numpy::PyArray1::<f32>::zeros(py, 1, false);
    probe.try_readonly()?;
    Ok(())
}

/// A step's activations are megabytes at 512 tokens (SmolLM2's packed `ffn_down` input alone
/// is 3 MiB), freed and allocated again for every layer. With glibc's defaults such blocks
/// come from fresh mmaps, or are trimmed back to the OS when freed, so every layer faults its
/// pages in again: 668k page faults and a fifth of the time in a 512-token F16 prefill here,
/// 26k with these settings. Blocks up to glibc's largest mmap threshold (32 MiB) now stay in
/// the heap, which keeps up to 256 MiB of free memory. The user's own MALLOC_*_ variables win.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn keep_scratch_in_heap() {
    const MMAP_THRESHOLD: i32 = 32 << 20;
    const TRIM_THRESHOLD: i32 = 256 << 20;
    for (var, param, value) in [
        ("MALLOC_MMAP_THRESHOLD_", libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        ("MALLOC_TRIM_THRESHOLD_", libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD),
    ] {
        if std::env::var_os(var).is_none() {
            // SAFETY: mallopt only changes allocator parameters; a value it rejects is ignored.
            unsafe { libc::mallopt(param, value) };
        }
    }
}
