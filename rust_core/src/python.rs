//! PyO3 bindings: the only file that knows about Python.
//!
//! Each binding copies its input out of Python objects while attached to the interpreter,
//! runs the work detached from it (so other Python threads, e.g. gRPC handlers, keep
//! running) and returns flat vectors.

use pyo3::prelude::*;

/// Seed 004's estimate for each text, in order.
#[pyfunction]
fn estimate_tokens_batch(py: Python<'_>, texts: Vec<String>) -> Vec<u64> {
    py.detach(move || texts.iter().map(|t| crate::estimate_tokens(t)).collect())
}

/// Seed 004's estimate for one text.
#[pyfunction]
fn estimate_tokens(text: &str) -> u64 {
    crate::estimate_tokens(text)
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(estimate_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(estimate_tokens_batch, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
