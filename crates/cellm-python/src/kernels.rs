//! Kernel-level functions: which ISA path runs, and decoding stored weights for inspection
//! and for tests against independent dequantizers.

use cellm_engine::cellm_format::{Error, TensorFormat};
use cellm_engine::isa;
use numpy::{IntoPyArray, PyArray2, PyArrayMethods, PyReadonlyArray2};
use pyo3::prelude::*;

use crate::errors::to_py;

/// The kernel path in use (`scalar`, `avx2`, ...).
#[pyfunction]
pub fn selected_isa() -> &'static str {
    isa::selected().name()
}

/// Every kernel path this CPU can run.
#[pyfunction]
pub fn available_isas() -> Vec<&'static str> {
    isa::Isa::available().into_iter().map(|i| i.name()).collect()
}

/// Forces a kernel path (tests and debugging).
#[pyfunction]
pub fn set_isa(name: &str) -> PyResult<()> {
    let chosen = isa::Isa::parse(name)
        .ok_or_else(|| Error::InvalidArgument(format!("unknown ISA '{name}'")));
    chosen.and_then(|i| isa::set_override(i).map_err(Error::InvalidArgument)).map_err(to_py)
}

/// Decodes `rows x cols` values stored in `format` (e.g. GGUF `q4_k` blocks) to float32 with
/// the engine's own row kernels.
#[pyfunction]
pub fn dequantize<'py>(
    py: Python<'py>,
    format: &str,
    data: &[u8],
    rows: usize,
    cols: usize,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let fmt = TensorFormat::parse(format).map_err(to_py)?;
    check_shape(rows, cols)?;
    let need = fmt.nbytes(&[rows, cols]).ok_or_else(|| {
        to_py(Error::InvalidArgument(format!("{cols} columns do not split into {format} blocks")))
    })?;
    if data.len() != need {
        let msg = format!("{format} {rows}x{cols} needs {need} bytes, got {}", data.len());
        return Err(to_py(Error::InvalidArgument(msg)));
    }
    let words = aligned_copy(data);
    let bytes = &as_bytes(&words)[..need];
    let w = cellm_engine::WeightRows { format: fmt, bytes, rows, cols };
    let mut out = vec![0.0f32; rows * cols];
    for (r, row) in out.chunks_exact_mut(cols).enumerate() {
        cellm_engine::decode_row_raw(w, r, row);
    }
    out.into_pyarray(py).reshape([rows, cols])
}

/// `x @ W.T` for `W` stored as `rows x cols` in `format`, with the engine's kernels (int8
/// activations for block formats): for tests against independent references and benches.
#[pyfunction]
pub fn matmul<'py>(
    py: Python<'py>,
    format: &str,
    data: &[u8],
    rows: usize,
    cols: usize,
    x: PyReadonlyArray2<'py, f32>,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let fmt = TensorFormat::parse(format).map_err(to_py)?;
    check_shape(rows, cols)?;
    let x = x.as_array();
    if x.nrows() == 0 {
        return Err(to_py(Error::InvalidArgument("x has no rows".into())));
    }
    if fmt.nbytes(&[rows, cols]) != Some(data.len()) || x.ncols() != cols {
        return Err(to_py(Error::InvalidArgument(format!(
            "shapes do not match {format} {rows}x{cols}"
        ))));
    }
    let words = aligned_copy(data);
    let bytes = &as_bytes(&words)[..data.len()];
    let xs: Vec<f32> = x.iter().copied().collect();
    let tokens = x.nrows();
    let mut out = vec![0.0f32; tokens * rows];
    let w = cellm_engine::WeightRows { format: fmt, bytes, rows, cols };
    py.detach(|| cellm_engine::matmul_raw(&xs, tokens, w, &mut out));
    out.into_pyarray(py).reshape([tokens, rows])
}

/// A weight of `rows x cols`, both at least 1 (the kernels split rows into chunks of `cols`).
fn check_shape(rows: usize, cols: usize) -> PyResult<()> {
    if rows == 0 || cols == 0 {
        let msg = format!("a {rows}x{cols} weight is empty: rows and cols must be at least 1");
        return Err(to_py(Error::InvalidArgument(msg)));
    }
    Ok(())
}

/// Copies bytes into word-aligned storage: float rows are read as typed slices.
fn aligned_copy(data: &[u8]) -> Vec<u32> {
    let mut words = vec![0u32; data.len().div_ceil(4)];
    // SAFETY: `words` holds at least `data.len()` bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(data.as_ptr(), words.as_mut_ptr().cast::<u8>(), data.len())
    };
    words
}

fn as_bytes(words: &[u32]) -> &[u8] {
    // SAFETY: any u32 storage is valid as bytes.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), words.len() * 4) }
}

const MAX_BANDWIDTH_MIB: usize = 1 << 20;
const MAX_BANDWIDTH_THREADS: usize = 1024;

/// Read bandwidth in GB/s: streams a `mib` MiB buffer `reps` times with `threads` threads
/// and keeps the best pass (the benchmark's roofline).
#[pyfunction]
#[pyo3(signature = (mib=1024, threads=2, reps=5))]
pub fn read_bandwidth(py: Python<'_>, mib: usize, threads: usize, reps: usize) -> PyResult<f64> {
    if !(1..=MAX_BANDWIDTH_MIB).contains(&mib) || !(1..=MAX_BANDWIDTH_THREADS).contains(&threads) {
        return Err(to_py(Error::InvalidArgument(format!(
            "read_bandwidth needs 1 to {MAX_BANDWIDTH_MIB} MiB and 1 to \
             {MAX_BANDWIDTH_THREADS} threads, not {mib} MiB and {threads} threads"
        ))));
    }
    let words = mib * (1 << 20) / 8;
    let mut buf: Vec<u64> = Vec::new();
    buf.try_reserve_exact(words)
        .map_err(|e| to_py(Error::InvalidArgument(format!("cannot allocate {mib} MiB: {e}"))))?;
    buf.extend((0..words).map(|i| i as u64));
    let pool = cellm_engine::ThreadPool::new(threads)
        .map_err(|e| to_py(Error::InvalidArgument(format!("cannot start threads: {e}"))))?;
    let best = py.detach(|| {
        pool.install(|| {
            (0..reps.max(1))
                .map(|_| {
                    let t = std::time::Instant::now();
                    std::hint::black_box(cellm_engine::stream_read(&buf));
                    t.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min)
        })
    });
    Ok((buf.len() * 8) as f64 / best / 1e9)
}

/// The float multiply-add peak in GFLOP/s on `threads` threads: independent FMA chains in
/// the selected path's widest vectors (`cellm_kernels::peak`), `reps` passes of about 50 ms,
/// the best kept (the benchmarks' compute roofline).
#[pyfunction]
#[pyo3(signature = (threads=2, reps=5))]
pub fn fma_peak(py: Python<'_>, threads: usize, reps: usize) -> PyResult<f64> {
    if !(1..=MAX_BANDWIDTH_THREADS).contains(&threads) {
        return Err(to_py(Error::InvalidArgument(format!(
            "fma_peak needs 1 to {MAX_BANDWIDTH_THREADS} threads, not {threads}"
        ))));
    }
    let pool = cellm_engine::ThreadPool::new(threads)
        .map_err(|e| to_py(Error::InvalidArgument(format!("cannot start threads: {e}"))))?;
    const STEPS: usize = 20_000_000;
    let best = py.detach(|| {
        pool.install(|| {
            (0..reps.max(1))
                .map(|_| {
                    let t = std::time::Instant::now();
                    let flop = cellm_engine::fma_chains(threads, STEPS);
                    flop / t.elapsed().as_secs_f64()
                })
                .fold(0.0, f64::max)
        })
    });
    Ok(best / 1e9)
}
