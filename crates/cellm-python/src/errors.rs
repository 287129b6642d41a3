//! Engine errors become the exception classes defined once in `cellm.errors`.

use cellm_engine::cellm_format::Error;
use pyo3::exceptions::PyKeyboardInterrupt;
use pyo3::prelude::*;
use pyo3::types::PyType;

pub fn to_py(e: Error) -> PyErr {
    let class = match &e {
        Error::Interrupted => return PyKeyboardInterrupt::new_err("interrupted"),
        Error::Format(_) => "FormatError",
        Error::Unsupported(_) => "UnsupportedArchitecture",
        Error::ContextOverflow(_) => "ContextOverflow",
        Error::InvalidArgument(_) => "InvalidArgument",
        Error::Device(_) => "DeviceError",
    };
    Python::attach(|py| {
        let class = py
            .import("cellm.errors")
            .and_then(|m| m.getattr(class))
            .and_then(|c| c.downcast_into::<PyType>().map_err(PyErr::from));
        match class {
            Ok(c) => PyErr::from_type(c, e.to_string()),
            Err(import_error) => import_error,
        }
    })
}
