//! PyO3 bindings: the only file that knows about Python.
//!
//! Each binding copies its input out of Python objects while attached to the interpreter,
//! runs the work detached from it (so other Python threads, e.g. gRPC handlers, keep
//! running) and returns flat vectors, never one Python object per message.

use pyo3::buffer::PyBuffer;
use pyo3::create_exception;
use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple};

use std::sync::{PoisonError, RwLock};

use crate::bm25;
use crate::error::CoreError;
use crate::models;
use crate::relevance;
use crate::specifics;
use crate::text;
use crate::tokens::Encoding;
use crate::trim;

create_exception!(
    contextd._core,
    UnknownModelError,
    PyKeyError,
    "No model registry entry matches the requested model name."
);

impl From<CoreError> for PyErr {
    fn from(err: CoreError) -> PyErr {
        match err {
            CoreError::UnknownModel(_) => UnknownModelError::new_err(err.to_string()),
            CoreError::UnknownEncoding(_)
            | CoreError::LengthMismatch { .. }
            | CoreError::InvalidArgument(_) => PyValueError::new_err(err.to_string()),
        }
    }
}

/// Seed 004's estimate for each text, in order.
#[pyfunction]
fn estimate_tokens_batch(py: Python<'_>, texts: Vec<String>) -> Vec<u64> {
    run_sized(py, total_len(&texts), move || {
        texts.iter().map(|t| crate::estimate_tokens(t)).collect()
    })
}

/// Below this many bytes of input a call runs attached: handing the GIL over and taking
/// it back costs more than the work, and under many threads (a busy gRPC server) taking
/// it back can wait a whole switch interval.
const DETACH_ABOVE_BYTES: usize = 64 * 1024;

fn total_len(texts: &[String]) -> usize {
    texts.iter().map(String::len).sum()
}

/// Run `work` detached from the interpreter when the input is large enough to pay for it.
fn run_sized<T, F>(py: Python<'_>, input_bytes: usize, work: F) -> T
where
    T: Send,
    F: FnOnce() -> T + Send,
{
    if input_bytes > DETACH_ABOVE_BYTES {
        py.detach(work)
    } else {
        work()
    }
}

/// Seed 004's estimate for one text.
#[pyfunction]
fn estimate_tokens(text: &str) -> u64 {
    crate::estimate_tokens(text)
}

/// Token count of one text with the named encoding.
#[pyfunction]
fn count_tokens(py: Python<'_>, text: &str, encoding: &str) -> PyResult<u64> {
    let encoding: Encoding = encoding.parse()?;
    if encoding.is_exact() {
        Ok(py.detach(|| encoding.count(text)))
    } else {
        Ok(encoding.count(text))
    }
}

/// Token counts of many texts with the named encoding, in order.
#[pyfunction]
fn count_tokens_batch(py: Python<'_>, texts: Vec<String>, encoding: &str) -> PyResult<Vec<u64>> {
    let encoding: Encoding = encoding.parse()?;
    Ok(run_sized(py, total_len(&texts), move || {
        encoding.count_batch(&texts)
    }))
}

/// Budget cost of each text for a model: its tokenizer's count times its safety margin.
#[pyfunction]
fn count_tokens_for_model_batch(
    py: Python<'_>,
    texts: Vec<String>,
    model: &str,
) -> PyResult<Vec<u64>> {
    let info = models::model_info(model)?;
    Ok(run_sized(py, total_len(&texts), move || {
        info.count_batch(&texts)
    }))
}

/// What contextd knows about one model (see `data/models.toml`).
#[pyclass(frozen, name = "ModelInfo", module = "contextd._core")]
struct PyModelInfo(&'static models::ModelInfo);

#[pymethods]
impl PyModelInfo {
    #[getter]
    fn name(&self) -> &'static str {
        &self.0.name
    }
    #[getter]
    fn context_window(&self) -> u64 {
        self.0.context_window
    }
    #[getter]
    fn max_output(&self) -> u64 {
        self.0.max_output
    }
    #[getter]
    fn output_reserve(&self) -> u64 {
        self.0.output_reserve
    }
    #[getter]
    fn tokenizer(&self) -> &'static str {
        self.0.tokenizer.name()
    }
    #[getter]
    fn margin(&self) -> f64 {
        self.0.margin()
    }
    #[getter]
    fn prompt_budget(&self) -> u64 {
        self.0.prompt_budget()
    }
    fn apply_margin(&self, count: u64) -> u64 {
        self.0.apply_margin(count)
    }
    fn __repr__(&self) -> String {
        let m = self.0;
        format!(
            "ModelInfo(name={:?}, context_window={}, max_output={}, output_reserve={}, \
             tokenizer={:?}, margin={})",
            m.name,
            m.context_window,
            m.max_output,
            m.output_reserve,
            m.tokenizer.name(),
            m.margin()
        )
    }
}

/// Registry entry for a model name (exact, or the longest '-'-separated prefix).
#[pyfunction]
fn model_info(model: &str) -> PyResult<PyModelInfo> {
    Ok(PyModelInfo(models::model_info(model)?))
}

/// Every registry name, sorted.
#[pyfunction]
fn list_models() -> Vec<&'static str> {
    models::list_models()
}

/// Outcome of `trim_to_budget`, as flat lists.
#[pyclass(frozen, name = "TrimResult", module = "contextd._core")]
struct PyTrimResult(trim::Trimmed);

#[pymethods]
impl PyTrimResult {
    #[getter]
    fn kept(&self) -> Vec<usize> {
        self.0.kept.clone()
    }
    #[getter]
    fn truncated(&self) -> Vec<usize> {
        self.0.truncated.clone()
    }
    #[getter]
    fn truncated_chars(&self) -> Vec<u64> {
        self.0.truncated_chars.clone()
    }
    #[getter]
    fn total_tokens(&self) -> u64 {
        self.0.total_tokens
    }
    fn __repr__(&self) -> String {
        format!(
            "TrimResult(kept={:?}, truncated={:?}, truncated_chars={:?}, total_tokens={})",
            self.0.kept, self.0.truncated, self.0.truncated_chars, self.0.total_tokens
        )
    }
}

/// Choose the newest suffix of a conversation that fits `budget` tokens.
#[pyfunction]
#[pyo3(signature = (roles, tokens, chars, groups, budget, max_chars_per_message = 4000, truncated_tokens = None))]
#[allow(clippy::too_many_arguments)]
fn trim_to_budget(
    py: Python<'_>,
    roles: Vec<u8>,
    tokens: Vec<u64>,
    chars: Vec<u64>,
    groups: Vec<i64>,
    budget: u64,
    max_chars_per_message: u64,
    truncated_tokens: Option<Vec<u64>>,
) -> PyResult<PyTrimResult> {
    let trimmed = py.detach(move || {
        let messages = trim::Messages {
            roles: &roles,
            tokens: &tokens,
            chars: &chars,
            groups: &groups,
            truncated_tokens: truncated_tokens.as_deref(),
        };
        trim::trim_to_budget(&messages, budget, max_chars_per_message)
    })?;
    Ok(PyTrimResult(trimmed))
}

/// `trim_to_budget` over columns given as buffers (e.g. NumPy arrays of a DuckDB/Arrow
/// result: uint8 roles, uint64 tokens and chars, int64 groups), so a window of 100,000
/// messages crosses into Rust as four memory copies instead of 400,000 Python ints.
#[pyfunction]
#[pyo3(signature = (roles, tokens, chars, groups, budget, max_chars_per_message = 4000))]
fn trim_columns_to_budget(
    py: Python<'_>,
    roles: PyBuffer<u8>,
    tokens: PyBuffer<u64>,
    chars: PyBuffer<u64>,
    groups: PyBuffer<i64>,
    budget: u64,
    max_chars_per_message: u64,
) -> PyResult<PyTrimResult> {
    let roles = roles.to_vec(py)?;
    let tokens = tokens.to_vec(py)?;
    let chars = chars.to_vec(py)?;
    let groups = groups.to_vec(py)?;
    let trimmed = py.detach(move || {
        let messages = trim::Messages {
            roles: &roles,
            tokens: &tokens,
            chars: &chars,
            groups: &groups,
            truncated_tokens: None,
        };
        trim::trim_to_budget(&messages, budget, max_chars_per_message)
    })?;
    Ok(PyTrimResult(trimmed))
}

/// The words of `text` as relevance scoring sees them.
#[pyfunction]
#[pyo3(signature = (text, stop_words = false))]
fn tokenize(text: &str, stop_words: bool) -> Vec<String> {
    text::tokenize(text, stop_words)
}

/// For each text, how many distinct query words it contains (seed 001).
#[pyfunction]
#[pyo3(signature = (query, texts, stop_words = false))]
fn keyword_scores(py: Python<'_>, query: &str, texts: Vec<String>, stop_words: bool) -> Vec<u32> {
    py.detach(move || relevance::keyword_scores(query, &texts, stop_words))
}

/// Indices of the texts sharing a word with the query, in order; all when none does.
#[pyfunction]
#[pyo3(signature = (query, texts, stop_words = false))]
fn keyword_select(py: Python<'_>, query: &str, texts: Vec<String>, stop_words: bool) -> Vec<usize> {
    py.detach(move || relevance::keyword_select(query, &texts, stop_words))
}

/// Verbatim details a summary must keep: URLs, inline code, paths, numbers with units,
/// identifiers and error lines, in order of first appearance, without duplicates.
#[pyfunction]
fn extract_specifics(py: Python<'_>, text: &str) -> Vec<String> {
    py.detach(|| specifics::extract_specifics(text))
}

/// Incremental BM25 (Okapi) index; share one between threads freely.
///
/// Bm25Index(k1=1.2, b=0.75, stop_words=False): the usual Okapi defaults. Scores use
/// idf = ln(1 + (N - n + 0.5) / (n + 0.5)) (never negative, so a word found in every
/// message still counts a little) and each distinct query word once.
///
/// - add(doc_ids, texts): index a batch, tokenized in parallel without the GIL in chunks
///   of 8,192 texts (borrowed from the Python strings, not copied), so a bulk add's
///   working memory stays small; an id already present is replaced. Nothing is rebuilt:
///   postings are appended.
/// - remove(doc_ids) -> int: tombstones; N, avgdl and document frequencies are exact at
///   once, and storage is compacted when dead entries pass a quarter of the live ones.
/// - search(query, k=10) -> (ids, scores): the k best, best first, ties by ascending id;
///   only documents sharing a word with the query are returned.
/// - len(index), doc_id in index, and the k1, b, stop_words, vocabulary_size properties.
///
/// Searches run concurrently under a read lock; add and remove take the write lock; all
/// of it runs detached from the interpreter.
#[pyclass(frozen, name = "Bm25Index", module = "contextd._core")]
struct PyBm25Index {
    inner: RwLock<bm25::Bm25Index>,
    stop_words: bool,
}

impl PyBm25Index {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, bm25::Bm25Index> {
        self.inner.read().unwrap_or_else(PoisonError::into_inner)
    }
    fn write(&self) -> std::sync::RwLockWriteGuard<'_, bm25::Bm25Index> {
        self.inner.write().unwrap_or_else(PoisonError::into_inner)
    }
}

#[pymethods]
impl PyBm25Index {
    #[new]
    #[pyo3(signature = (k1 = 1.2, b = 0.75, stop_words = false))]
    fn new(k1: f64, b: f64, stop_words: bool) -> PyResult<Self> {
        Ok(PyBm25Index {
            inner: RwLock::new(bm25::Bm25Index::new(k1, b, stop_words)?),
            stop_words,
        })
    }

    /// Add (or replace) documents.
    ///
    /// The texts are not copied: each is borrowed as UTF-8 from its Python string (kept
    /// alive by the references held here) and read detached from the interpreter. The
    /// first chunk is tokenized outside the lock; the index is then locked once for the
    /// whole batch (searches never see half of it) while later chunks are tokenized in
    /// parallel with folding the previous one in, so the working memory is two chunks.
    fn add(
        &self,
        py: Python<'_>,
        doc_ids: Vec<i64>,
        texts: Vec<Bound<'_, PyString>>,
    ) -> PyResult<()> {
        if doc_ids.len() != texts.len() {
            return Err(CoreError::LengthMismatch {
                column: "texts",
                expected: doc_ids.len(),
                actual: texts.len(),
            }
            .into());
        }
        // `texts` (the references keeping the strings alive) outlives the borrows below.
        let borrowed: Vec<&str> = texts.iter().map(|t| t.to_str()).collect::<PyResult<_>>()?;
        let stop_words = self.stop_words;
        py.detach(|| {
            let first = &borrowed[..borrowed.len().min(bm25::ADD_CHUNK)];
            let head = bm25::prepare_all(first, stop_words);
            self.write().add_batch_with_head(&doc_ids, &borrowed, head)
        })?;
        Ok(())
    }

    /// Remove documents by id; unknown ids are ignored. Returns how many were removed.
    fn remove(&self, py: Python<'_>, doc_ids: Vec<i64>) -> usize {
        py.detach(move || self.write().remove(&doc_ids))
    }

    /// The `k` best documents for `query`, best first, ties by ascending id.
    #[pyo3(signature = (query, k = 10))]
    fn search(&self, py: Python<'_>, query: &str, k: usize) -> (Vec<i64>, Vec<f64>) {
        py.detach(|| self.read().search(query, k).into_iter().unzip())
    }

    fn __len__(&self) -> usize {
        self.read().len()
    }

    fn __contains__(&self, doc_id: i64) -> bool {
        self.read().contains(doc_id)
    }

    #[getter]
    fn k1(&self) -> f64 {
        self.read().k1()
    }

    #[getter]
    fn b(&self) -> f64 {
        self.read().b()
    }

    #[getter]
    fn stop_words(&self) -> bool {
        self.stop_words
    }

    #[getter]
    fn vocabulary_size(&self) -> usize {
        self.read().vocabulary_size()
    }

    fn __repr__(&self) -> String {
        let ix = self.read();
        format!(
            "Bm25Index(k1={}, b={}, stop_words={}, len={})",
            ix.k1(),
            ix.b(),
            if ix.stop_words() { "True" } else { "False" },
            ix.len()
        )
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(estimate_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(estimate_tokens_batch, m)?)?;
    m.add_function(wrap_pyfunction!(count_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(count_tokens_batch, m)?)?;
    m.add_function(wrap_pyfunction!(count_tokens_for_model_batch, m)?)?;
    m.add_function(wrap_pyfunction!(model_info, m)?)?;
    m.add_function(wrap_pyfunction!(list_models, m)?)?;
    m.add_function(wrap_pyfunction!(trim_to_budget, m)?)?;
    m.add_function(wrap_pyfunction!(trim_columns_to_budget, m)?)?;
    m.add_function(wrap_pyfunction!(tokenize, m)?)?;
    m.add_function(wrap_pyfunction!(keyword_scores, m)?)?;
    m.add_function(wrap_pyfunction!(keyword_select, m)?)?;
    m.add_function(wrap_pyfunction!(extract_specifics, m)?)?;
    m.add_class::<PyBm25Index>()?;
    m.add_class::<PyModelInfo>()?;
    m.add_class::<PyTrimResult>()?;
    m.add("UnknownModelError", m.py().get_type::<UnknownModelError>())?;
    m.add("ENCODINGS", PyTuple::new(m.py(), Encoding::NAMES)?)?;
    m.add("DEFAULT_MAX_CHARS", trim::DEFAULT_MAX_CHARS)?;
    m.add("STOP_WORDS", PyTuple::new(m.py(), text::STOP_WORDS)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
