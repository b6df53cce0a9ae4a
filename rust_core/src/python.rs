//! PyO3 bindings: the only file that knows about Python.
//!
//! Each binding borrows its input from the Python objects (texts as UTF-8 views of the
//! `str` objects, columns as views of the buffers), runs large work detached from the
//! interpreter (so other Python threads, e.g. gRPC handlers, keep running; see
//! [`run_sized`]) and returns flat vectors, never one Python object per message.
//!
//! Errors: every failure the core reports is a [`CoreError`], raised through the one
//! `From<CoreError> for PyErr` below. Each binding's work also runs inside
//! [`catch_panic`]: a panic is a bug, never a verdict on the input, but if one happens it
//! must reach Python as `contextd._core.InternalError` (a `RuntimeError`). Left to pyo3,
//! it would become `pyo3_runtime.PanicException`, a `BaseException`: gRPC handlers'
//! `except Exception` would miss it and the call could end without a status. Getters that
//! only copy a field out of a frozen object are not wrapped: they cannot panic.

use pyo3::buffer::{Element, PyBuffer};
use pyo3::create_exception;
use pyo3::exceptions::{PyBufferError, PyKeyError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple, PyType};

use std::collections::HashSet;

use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard, TryLockError};

use crate::bm25;
use crate::build_wire;
use crate::error::{catch_panic, CoreError, CoreResult};
use crate::models;
use crate::pairs;
use crate::relevance;
use crate::request_filter::{self, OffsetWidth};
use crate::snippet;
use crate::specifics;
use crate::text;
use crate::tokens::{self, Encoding};
use crate::trim;
use crate::wire;

create_exception!(
    contextd._core,
    UnknownModelError,
    PyKeyError,
    "No model registry entry matches the requested model name."
);

create_exception!(
    contextd._core,
    InternalError,
    PyRuntimeError,
    "A bug in contextd's Rust core (a caught panic), never a verdict on the input."
);

impl From<CoreError> for PyErr {
    fn from(err: CoreError) -> PyErr {
        match err {
            CoreError::UnknownModel(_) => UnknownModelError::new_err(err.to_string()),
            CoreError::UnknownEncoding(_)
            | CoreError::LengthMismatch { .. }
            | CoreError::InvalidArgument(_) => PyValueError::new_err(err.to_string()),
            CoreError::Internal(_) => InternalError::new_err(err.to_string()),
        }
    }
}

/// Run attached work (it holds the GIL), turning a panic into `InternalError`.
fn guarded<T>(work: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    catch_panic(work)
}

/// The character estimate for each text, in order: `(code points + 3) / 4`.
///
/// A Python `str` knows its length in code points (O(1)), which for any string that is
/// valid Unicode is its number of scalar values, so nothing is read or copied.
#[pyfunction]
fn estimate_tokens_batch(texts: Vec<Bound<'_, PyString>>) -> PyResult<Vec<u64>> {
    guarded(|| {
        texts
            .iter()
            .map(|t| Ok((t.len()? as u64).div_ceil(4)))
            .collect()
    })
}

/// The PostgreSQL search vector literal of each message (content, tool_calls), or None
/// where only the database can make it exactly (see `search_vector.rs`). Words in byte
/// order. Detached from the interpreter for large input (see `run_sized`): about 5 us
/// per message of 500 characters, so a 1,000-message append held the GIL for ~5 ms.
#[pyfunction]
fn search_vectors(
    py: Python<'_>,
    contents: Vec<Bound<'_, PyString>>,
    tool_calls: Vec<Bound<'_, PyString>>,
) -> PyResult<Vec<Option<String>>> {
    if contents.len() != tool_calls.len() {
        return Err(PyValueError::new_err(
            "contents and tool_calls must be as long",
        ));
    }
    let contents = borrow_texts(&contents)?;
    let tool_calls = borrow_texts(&tool_calls)?;
    let bytes = total_len(&contents) + total_len(&tool_calls);
    run_sized(py, bytes, || {
        Ok(contents
            .iter()
            .zip(&tool_calls)
            .map(|(c, t)| crate::search_vector::search_vector(c, t))
            .collect())
    })
}

/// The serialized `contextd.v1.AppendMessagesResponse` of an append's receipts, one per
/// row of the five columns (see `wire.rs`). Attached: about 20 us for 1,000 receipts,
/// less than handing the GIL over.
#[pyfunction]
fn encode_receipts<'py>(
    py: Python<'py>,
    ids: Vec<i64>,
    create_time_us: Vec<i64>,
    token_estimates: Vec<i64>,
    token_counts: Vec<i64>,
    sequences: Vec<i64>,
) -> PyResult<Bound<'py, PyBytes>> {
    let bytes = guarded(|| {
        Ok(wire::encode_receipts(&wire::Receipts {
            ids: &ids,
            create_time_us: &create_time_us,
            token_estimates: &token_estimates,
            token_counts: &token_counts,
            sequences: &sequences,
        })?)
    })?;
    Ok(PyBytes::new(py, &bytes))
}

/// The kept messages of a BuildContextResponse as its field 4 entries (see
/// `build_wire.rs`): one `ContextMessage` per history item (read from the items'
/// attributes `id`, `role`, `content`, `tool_calls`, `tool_call_id`, `token_count`,
/// `is_summary`; its stamp, when `stamps` has one for its id, from `create_time_us`,
/// `source_time_us` and `sequence`), flagged truncated or elided when its id is in those
/// lists, then the new message when there is one: `(content, token_count, truncated)`,
/// role user. What `contextd.api.convert._add_messages` builds, serialized, without a
/// protobuf object per message.
#[pyfunction]
fn encode_context_messages<'py>(
    py: Python<'py>,
    items: &Bound<'py, PyAny>,
    stamps: &Bound<'py, PyDict>,
    truncated_ids: Vec<i64>,
    elided_ids: Vec<i64>,
    new_message: Option<(Bound<'py, PyString>, i64, bool)>,
) -> PyResult<Bound<'py, PyBytes>> {
    let truncated: HashSet<i64> = truncated_ids.into_iter().collect();
    let elided: HashSet<i64> = elided_ids.into_iter().collect();
    let mut out = Vec::with_capacity(4096);
    let mut body = Vec::with_capacity(1024);
    for item in items.try_iter()? {
        let item = item?;
        let id_obj = item.getattr(intern!(py, "id"))?;
        let id: i64 = id_obj.extract()?;
        let content = item.getattr(intern!(py, "content"))?;
        let content = content.cast::<PyString>()?;
        let tool_calls = item.getattr(intern!(py, "tool_calls"))?;
        let tool_calls = tool_calls.cast::<PyString>()?;
        let tool_call_id = item.getattr(intern!(py, "tool_call_id"))?;
        let tool_call_id = tool_call_id.cast::<PyString>()?;
        let mut message = build_wire::ContextMessage {
            id,
            role: item.getattr(intern!(py, "role"))?.extract()?,
            content: content.to_str()?,
            tool_calls: tool_calls.to_str()?,
            tool_call_id: tool_call_id.to_str()?,
            token_count: item.getattr(intern!(py, "token_count"))?.extract()?,
            truncated: truncated.contains(&id),
            elided: elided.contains(&id),
            is_summary: item.getattr(intern!(py, "is_summary"))?.extract()?,
            ..Default::default()
        };
        if let Some(stamp) = stamps.get_item(&id_obj)? {
            message.create_time_us = Some(stamp.getattr(intern!(py, "create_time_us"))?.extract()?);
            message.source_time_us = stamp.getattr(intern!(py, "source_time_us"))?.extract()?;
            message.sequence = stamp.getattr(intern!(py, "sequence"))?.extract()?;
        }
        build_wire::put_context_message(&mut out, &mut body, &message);
    }
    if let Some((content, token_count, truncated)) = new_message {
        let message = build_wire::ContextMessage {
            role: 1, // ROLE_USER
            content: content.to_str()?,
            token_count,
            truncated,
            ..Default::default()
        };
        build_wire::put_context_message(&mut out, &mut body, &message);
    }
    Ok(PyBytes::new(py, &out))
}

/// `values` (a 1-D C-contiguous int64 buffer, e.g. a NumPy array, read in place) as the
/// packed repeated int64 field numbered `field`: key, length and varints; empty bytes
/// for no values. About 20 us for 10,000 ids.
#[pyfunction]
fn encode_packed_int64<'py>(
    py: Python<'py>,
    field: u32,
    values: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    let column = Column::<i64>::new(values, "values", "int64")?;
    let bytes = build_wire::packed_int64(field, column.as_slice(py));
    Ok(PyBytes::new(py, &bytes))
}

/// The messages of an AppendMessagesRequest, read from its serialized bytes (see
/// `wire::decode_append_messages`), as instances of `new_message` (the domain's
/// NewMessage), and the indices of the messages the caller must convert one by one (a
/// role outside 1..=4, a tool output reference or a source time), which are None in the
/// list. `roles` maps a role's number (1..=4) to its Role; `fields` names the seven slots
/// to fill, in the order role, content, tool_calls, tool_call_id, external_id, metadata,
/// source_time_us (None here).
///
/// Why the instances are made here: building 1,000 frozen dataclasses through their
/// `__init__` costs about 1 ms of Python (seven `object.__setattr__` calls each), five
/// times the decoding. They are made as `copy` and `pickle` make them: allocated by the
/// type and their slots set with `object.__setattr__` (`PyObject_GenericSetAttr`, which a
/// frozen dataclass's own `__init__` calls), so an instance is exactly what `__init__`
/// gives for these values; the caller checks the type has no `__post_init__` and the
/// fields named, and tests hold the result equal to the plain conversion.
#[pyfunction]
fn decode_append_messages<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyBytes>,
    roles: Vec<Bound<'py, PyAny>>,
    new_message: &Bound<'py, PyType>,
    fields: Vec<Bound<'py, PyString>>,
) -> PyResult<(Bound<'py, PyList>, Vec<usize>)> {
    if roles.len() != 5 {
        return Err(PyValueError::new_err(
            "roles must hold 5 entries (role numbers 0 to 4)",
        ));
    }
    if fields.len() != 7 {
        return Err(PyValueError::new_err("fields must name 7 slots"));
    }
    let buf = data.as_bytes();
    let messages = run_sized(py, buf.len(), || wire::decode_append_messages(buf))?;
    guarded(|| {
        let none = py.None().into_bound(py);
        let mut odd: Vec<usize> = Vec::new();
        let mut out = Vec::with_capacity(messages.len());
        let tp = new_message.as_type_ptr();
        for (i, m) in messages.iter().enumerate() {
            let regular =
                (1..=4).contains(&m.role) && m.tool_output_id.is_empty() && !m.has_source_time;
            if !regular {
                odd.push(i);
                out.push(none.clone());
                continue;
            }
            let values: [Bound<'py, PyAny>; 7] = [
                roles[m.role as usize].clone(),
                PyString::new(py, m.content).into_any(),
                PyString::new(py, m.tool_calls).into_any(),
                PyString::new(py, m.tool_call_id).into_any(),
                PyString::new(py, m.external_id).into_any(),
                PyString::new(py, m.metadata).into_any(),
                none.clone(),
            ];
            // SAFETY: `tp` is a live type object (borrowed from `new_message` for this
            // call); PyType_GenericAlloc returns a new reference or NULL with an
            // exception set, and PyObject_GenericSetAttr borrows its arguments.
            let obj = unsafe {
                let raw = pyo3::ffi::PyType_GenericAlloc(tp, 0);
                if raw.is_null() {
                    return Err(PyErr::fetch(py));
                }
                Bound::from_owned_ptr(py, raw)
            };
            for (name, value) in fields.iter().zip(&values) {
                // SAFETY: as above; all three pointers are live for the call.
                let status = unsafe {
                    pyo3::ffi::PyObject_GenericSetAttr(obj.as_ptr(), name.as_ptr(), value.as_ptr())
                };
                if status < 0 {
                    return Err(PyErr::fetch(py));
                }
            }
            out.push(obj);
        }
        Ok((PyList::new(py, out)?, odd))
    })
}

/// Below this many bytes of input a call runs attached: handing the GIL over and taking
/// it back costs more than the work, and under many threads (a busy gRPC server) taking
/// it back can wait a whole switch interval. The same size below which batches are not
/// worth spreading over rayon's pool.
const DETACH_MIN_BYTES: usize = tokens::PARALLEL_MIN_BYTES;

/// Borrow each Python string as UTF-8 (CPython keeps a string's UTF-8 form: for ASCII it
/// is the string's own storage, otherwise it is made on first use and cached in the
/// string), so no text is copied per call. The borrows live as long as `texts`, whose
/// references keep the strings alive.
fn borrow_texts<'a>(texts: &'a [Bound<'_, PyString>]) -> PyResult<Vec<&'a str>> {
    texts.iter().map(|t| t.to_str()).collect()
}

fn total_len(texts: &[&str]) -> usize {
    texts.iter().map(|t| t.len()).sum()
}

/// Run `work` detached from the interpreter. A panic is caught inside, on the thread
/// that ran the work (see [`catch_panic`]), so unwinding never crosses pyo3's
/// detach/attach, and it reaches Python as `InternalError`.
fn detached<T: Send>(py: Python<'_>, work: impl FnOnce() -> CoreResult<T> + Send) -> PyResult<T> {
    Ok(py.detach(|| catch_panic(work))?)
}

/// Run `work` detached from the interpreter when the input is large enough to pay for it,
/// else attached; guarded against panics either way.
fn run_sized<T: Send>(
    py: Python<'_>,
    input_bytes: usize,
    work: impl FnOnce() -> CoreResult<T> + Send,
) -> PyResult<T> {
    if input_bytes >= DETACH_MIN_BYTES {
        detached(py, work)
    } else {
        Ok(catch_panic(work)?)
    }
}

/// The character estimate for one text.
#[pyfunction]
fn estimate_tokens(text: &str) -> PyResult<u64> {
    guarded(|| Ok(crate::estimate_tokens(text)))
}

/// Token count of one text with the named encoding.
#[pyfunction]
fn count_tokens(py: Python<'_>, text: &str, encoding: &str) -> PyResult<u64> {
    let encoding: Encoding = encoding.parse()?;
    run_sized(py, text.len(), || Ok(encoding.count(text)))
}

/// Token counts of many texts with the named encoding, in order.
#[pyfunction]
fn count_tokens_batch(
    py: Python<'_>,
    texts: Vec<Bound<'_, PyString>>,
    encoding: &str,
) -> PyResult<Vec<u64>> {
    let encoding: Encoding = encoding.parse()?;
    let texts = borrow_texts(&texts)?;
    run_sized(py, total_len(&texts), || Ok(encoding.count_batch(&texts)))
}

/// Budget cost of each text for a model: its tokenizer's count times its safety margin.
#[pyfunction]
fn count_tokens_for_model_batch(
    py: Python<'_>,
    texts: Vec<Bound<'_, PyString>>,
    model: &str,
) -> PyResult<Vec<u64>> {
    let info = guarded(|| Ok(models::model_info(model)?))?;
    let texts = borrow_texts(&texts)?;
    run_sized(py, total_len(&texts), || Ok(info.count_batch(&texts)))
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
    fn apply_margin(&self, count: u64) -> PyResult<u64> {
        guarded(|| Ok(self.0.apply_margin(count)))
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
    guarded(|| Ok(PyModelInfo(models::model_info(model)?)))
}

/// Every registry name, sorted.
#[pyfunction]
fn list_models() -> PyResult<Vec<&'static str>> {
    // The registry is parsed on first use (and checked by `cargo test`): guarded anyway.
    guarded(|| Ok(models::list_models()))
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
    /// First kept index (`kept[0]`) without building the list; `None` when nothing is kept.
    #[getter]
    fn kept_start(&self) -> Option<usize> {
        self.0.kept.first().copied()
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

/// The part both trim bindings share. It runs attached: the walk stops at the budget, so
/// it costs what fits the budget, which is less than handing the interpreter over and back.
fn trim_messages(
    messages: &trim::Messages<'_>,
    budget: u64,
    max_chars_per_message: u64,
) -> PyResult<PyTrimResult> {
    guarded(|| {
        Ok(PyTrimResult(trim::trim_to_budget(
            messages,
            budget,
            max_chars_per_message,
        )?))
    })
}

/// Choose the newest suffix of a conversation that fits `budget` tokens.
#[pyfunction]
#[pyo3(signature = (
    roles, tokens, chars, groups, budget,
    max_chars_per_message = trim::DEFAULT_MAX_CHARS, truncated_tokens = None
))]
#[allow(clippy::too_many_arguments)]
fn trim_to_budget(
    roles: Vec<u8>,
    tokens: Vec<u64>,
    chars: Vec<u64>,
    groups: Vec<i64>,
    budget: u64,
    max_chars_per_message: u64,
    truncated_tokens: Option<Vec<u64>>,
) -> PyResult<PyTrimResult> {
    let messages = trim::Messages {
        roles: &roles,
        tokens: &tokens,
        chars: &chars,
        groups: &groups,
        truncated_tokens: truncated_tokens.as_deref(),
    };
    trim_messages(&messages, budget, max_chars_per_message)
}

/// One column of `trim_columns_to_budget`: a buffer checked to be 1-D, C-contiguous and
/// of items of exactly `T` (format, size and alignment are checked by [`PyBuffer::get`]).
/// Only [`Column::new`] makes one, so [`Column::as_slice`] can rely on the checks.
struct Column<T: Element>(PyBuffer<T>);

impl<T: Element> Column<T> {
    fn new(obj: &Bound<'_, PyAny>, name: &str, dtype: &str) -> PyResult<Self> {
        let py = obj.py();
        let expected = format!(
            "column {name:?} must be a 1-D C-contiguous buffer of {dtype} \
             (e.g. numpy.ascontiguousarray(x, dtype=numpy.{dtype}))"
        );
        let buf = PyBuffer::<T>::get(obj).map_err(|err| {
            let msg = format!("{expected}: {}", err.value(py));
            if err.is_instance_of::<PyBufferError>(py) {
                PyBufferError::new_err(msg)
            } else {
                PyTypeError::new_err(msg)
            }
        })?;
        if buf.dimensions() != 1 {
            return Err(PyBufferError::new_err(format!(
                "{expected}; got {} dimensions",
                buf.dimensions()
            )));
        }
        if !buf.is_c_contiguous() {
            return Err(PyBufferError::new_err(format!(
                "{expected}; got a strided (non-contiguous) view"
            )));
        }
        Ok(Column(buf))
    }

    /// The column as a slice, read in place. `_attached` proves the GIL is held for as
    /// long as the slice lives.
    fn as_slice<'a>(&'a self, _attached: Python<'a>) -> &'a [T] {
        let n = self.0.item_count();
        if n == 0 {
            return &[]; // an empty buffer's pointer may be null or dangling
        }
        // SAFETY: `Column::new` checked one dimension, C-contiguity, and items of exactly
        // `T`'s format, size and alignment, so `buf_ptr()` points at `n` initialised `T`s.
        // The export held by `self.0` (which outlives the slice) keeps the memory from being
        // freed or resized. The GIL is held for the slice's whole life and no Python code
        // runs meanwhile (the trim walk never calls back into Python), so no Python code
        // can write to it; the view is only read (a read-only export is fine). Native code
        // writing the buffer after releasing the GIL would break this, as it would for any
        // buffer-protocol consumer; contextd passes arrays it owns.
        unsafe { std::slice::from_raw_parts(self.0.buf_ptr() as *const T, n) }
    }
}

/// `trim_to_budget` over columns given as buffers (e.g. NumPy arrays of a DuckDB/Arrow
/// result: uint8 roles, uint64 tokens and chars, int64 groups). The buffers are read in
/// place, not copied, so a call costs what the walk keeps, whatever the window's length.
#[pyfunction]
#[pyo3(signature = (
    roles, tokens, chars, groups, budget, max_chars_per_message = trim::DEFAULT_MAX_CHARS
))]
fn trim_columns_to_budget(
    py: Python<'_>,
    roles: &Bound<'_, PyAny>,
    tokens: &Bound<'_, PyAny>,
    chars: &Bound<'_, PyAny>,
    groups: &Bound<'_, PyAny>,
    budget: u64,
    max_chars_per_message: u64,
) -> PyResult<PyTrimResult> {
    guarded(|| {
        let roles = Column::<u8>::new(roles, "roles", "uint8")?;
        let tokens = Column::<u64>::new(tokens, "tokens", "uint64")?;
        let chars = Column::<u64>::new(chars, "chars", "uint64")?;
        let groups = Column::<i64>::new(groups, "groups", "int64")?;
        let messages = trim::Messages {
            roles: roles.as_slice(py),
            tokens: tokens.as_slice(py),
            chars: chars.as_slice(py),
            groups: groups.as_slice(py),
            truncated_tokens: None,
        };
        trim_messages(&messages, budget, max_chars_per_message)
    })
}

/// The orphans of a window's tool pairs over its columns read in place (int64 ids, uint8
/// roles, int64 groups): `(orphan results, orphan calls)` as ascending positions. Attached,
/// as the trim bindings are (the columns are borrowed under the interpreter's lock): one
/// pass that skips ungrouped rows in blocks, about one read of the columns.
#[pyfunction]
fn pair_orphans_columns(
    py: Python<'_>,
    ids: &Bound<'_, PyAny>,
    roles: &Bound<'_, PyAny>,
    groups: &Bound<'_, PyAny>,
) -> PyResult<(Vec<usize>, Vec<usize>)> {
    guarded(|| {
        let ids = Column::<i64>::new(ids, "ids", "int64")?;
        let roles = Column::<u8>::new(roles, "roles", "uint8")?;
        let groups = Column::<i64>::new(groups, "groups", "int64")?;
        let found = pairs::pair_orphans(ids.as_slice(py), roles.as_slice(py), groups.as_slice(py))?;
        Ok((found.results, found.calls))
    })
}

/// The words of `text` as relevance scoring sees them (with `cjk_bigrams`, the terms of
/// a search index: CJK runs as overlapping pairs of characters).
#[pyfunction]
#[pyo3(signature = (text, stop_words = false, cjk_bigrams = false))]
fn tokenize(text: &str, stop_words: bool, cjk_bigrams: bool) -> PyResult<Vec<String>> {
    guarded(|| Ok(text::tokenize_terms(text, stop_words, cjk_bigrams)))
}

/// A search hit's snippet: (text, spans of the query's terms as character offsets).
#[pyfunction(name = "snippet")]
#[pyo3(signature = (
    text, query, max_chars = snippet::DEFAULT_SNIPPET_CHARS, stop_words = false,
    cjk_bigrams = false
))]
fn snippet_of(
    py: Python<'_>,
    text: &str,
    query: &str,
    max_chars: usize,
    stop_words: bool,
    cjk_bigrams: bool,
) -> PyResult<(String, Vec<(usize, usize)>)> {
    run_sized(py, text.len(), || {
        let cut = snippet::snippet(text, query, max_chars, stop_words, cjk_bigrams);
        Ok((cut.text, cut.spans))
    })
}

/// For each text, how many distinct query words it contains.
#[pyfunction]
#[pyo3(signature = (query, texts, stop_words = false))]
fn keyword_scores(
    py: Python<'_>,
    query: &str,
    texts: Vec<Bound<'_, PyString>>,
    stop_words: bool,
) -> PyResult<Vec<u32>> {
    let texts = borrow_texts(&texts)?;
    run_sized(py, total_len(&texts), || {
        Ok(relevance::keyword_scores(query, &texts, stop_words))
    })
}

/// Indices of the texts sharing a word with the query, in order; all when none does.
#[pyfunction]
#[pyo3(signature = (query, texts, stop_words = false))]
fn keyword_select(
    py: Python<'_>,
    query: &str,
    texts: Vec<Bound<'_, PyString>>,
    stop_words: bool,
) -> PyResult<Vec<usize>> {
    let texts = borrow_texts(&texts)?;
    run_sized(py, total_len(&texts), || {
        Ok(relevance::keyword_select(query, &texts, stop_words))
    })
}

/// Verbatim details a summary must keep (errors, commands, URLs, ids, versions, numbers
/// with units and currencies, paths, identifiers), in order of first appearance, without
/// duplicates.
#[pyfunction]
fn extract_specifics(py: Python<'_>, text: &str) -> PyResult<Vec<String>> {
    run_sized(py, text.len(), || Ok(specifics::extract_specifics(text)))
}

/// The specifics of each text as (kind, text) pairs, in order of first appearance within
/// the text, without duplicates within it. Large batches run in parallel, without the GIL.
#[pyfunction]
fn extract_specifics_batch(
    py: Python<'_>,
    texts: Vec<Bound<'_, PyString>>,
) -> PyResult<Vec<Vec<(&'static str, String)>>> {
    let texts = borrow_texts(&texts)?;
    let tagged = |t: &&str| -> Vec<(&'static str, String)> {
        specifics::extract_tagged(t)
            .into_iter()
            .map(|s| (s.kind.as_str(), s.text))
            .collect()
    };
    let total = total_len(&texts);
    run_sized(py, total, || {
        if total >= DETACH_MIN_BYTES {
            use rayon::prelude::*;
            Ok(texts.par_iter().map(tagged).collect())
        } else {
            Ok(texts.iter().map(tagged).collect())
        }
    })
}

/// Incremental BM25 (Okapi) index; share one between threads freely.
///
/// Bm25Index(k1=1.2, b=0.75, stop_words=False, cjk_bigrams=False): the usual Okapi
/// defaults; with cjk_bigrams, runs of CJK characters are indexed and queried as
/// overlapping pairs of characters (see `tokenize`). Scores use
/// idf = ln(1 + (N - n + 0.5) / (n + 0.5)) (never negative, so a word found in every
/// message still counts a little) and each distinct query word once.
///
/// - add(doc_ids, texts): index a batch, tokenized in parallel without the GIL in chunks
///   of 8,192 texts (borrowed from the Python strings, not copied), so a bulk add's
///   working memory stays small; an id already present is replaced. Nothing is rebuilt:
///   postings are appended.
/// - remove(doc_ids) -> int: tombstones; N, avgdl and document frequencies are exact at
///   once, and storage is compacted when dead entries (removed or replaced documents)
///   pass a quarter of the live ones, checked after every add and remove.
/// - search(query, k=10, within=None) -> (ids, scores): the k best, best first, ties by
///   ascending id; only documents sharing a word with the query are returned, and with
///   `within` (a 1-D int64 buffer, e.g. a NumPy array, of ids) only those among them;
///   statistics stay the whole index's.
/// - len(index), doc_id in index, and the k1, b, stop_words, cjk_bigrams,
///   vocabulary_size and memory_bytes (about how much memory it holds) properties.
///
/// Searches run concurrently under a read lock; add and remove take the write lock; all
/// of it runs detached from the interpreter. k1, b and stop_words are read without the
/// lock; len, `in` and vocabulary_size wait for it detached when an add or remove holds it.
///
/// An internal error (a bug) during add or remove may leave the index half-updated: from
/// then on every method that reads it raises contextd._core.InternalError; build a new one.
#[pyclass(frozen, name = "Bm25Index", module = "contextd._core")]
struct PyBm25Index {
    inner: RwLock<bm25::Bm25Index>,
    // The settings never change after construction: kept here too so their getters (and
    // `__repr__`) read them without the lock.
    k1: f64,
    b: f64,
    stop_words: bool,
    cjk_bigrams: bool,
}

/// The lock is poisoned when a panic (caught as `InternalError`) unwound out of an add or
/// remove holding it: the index may hold half a document, so it is refused rather than read.
fn poisoned() -> CoreError {
    CoreError::Internal(
        "this Bm25Index was left half-updated by an earlier internal error; build a new one".into(),
    )
}

impl PyBm25Index {
    /// Run `f` under the read lock. A long `add` holds the write lock with the GIL released,
    /// so waiting for it while attached would freeze every Python thread: when the lock is
    /// not free at once, wait for it detached.
    fn with_read<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&bm25::Bm25Index) -> T + Send,
    ) -> PyResult<T> {
        let guard: RwLockReadGuard<'_, bm25::Bm25Index> = match self.inner.try_read() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(_)) => return Err(poisoned().into()),
            Err(TryLockError::WouldBlock) => {
                return detached(py, || Ok(f(&*self.read()?)));
            }
        };
        guarded(|| Ok(f(&guard)))
    }
    fn read(&self) -> CoreResult<RwLockReadGuard<'_, bm25::Bm25Index>> {
        self.inner.read().map_err(|_| poisoned())
    }
    fn write(&self) -> CoreResult<RwLockWriteGuard<'_, bm25::Bm25Index>> {
        self.inner.write().map_err(|_| poisoned())
    }
}

#[pymethods]
impl PyBm25Index {
    #[new]
    #[pyo3(signature = (
        k1 = bm25::DEFAULT_K1, b = bm25::DEFAULT_B, stop_words = false, cjk_bigrams = false
    ))]
    fn new(k1: f64, b: f64, stop_words: bool, cjk_bigrams: bool) -> PyResult<Self> {
        guarded(|| {
            Ok(PyBm25Index {
                inner: RwLock::new(bm25::Bm25Index::with_terms(k1, b, stop_words, cjk_bigrams)?),
                k1,
                b,
                stop_words,
                cjk_bigrams,
            })
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
        let borrowed = borrow_texts(&texts)?;
        let stop_words = self.stop_words;
        let cjk_bigrams = self.cjk_bigrams;
        detached(py, || {
            let first = &borrowed[..borrowed.len().min(bm25::ADD_CHUNK)];
            let head = bm25::prepare_all_terms(first, stop_words, cjk_bigrams);
            self.write()?.add_batch_with_head(&doc_ids, &borrowed, head)
        })
    }

    /// Remove documents by id; unknown ids are ignored. Returns how many were removed.
    fn remove(&self, py: Python<'_>, doc_ids: Vec<i64>) -> PyResult<usize> {
        detached(py, move || Ok(self.write()?.remove(&doc_ids)))
    }

    /// The `k` best documents for `query`, best first, ties by ascending id.
    #[pyo3(signature = (query, k = 10, within = None))]
    fn search(
        &self,
        py: Python<'_>,
        query: &str,
        k: usize,
        within: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(Vec<i64>, Vec<f64>)> {
        // Copied while attached (the buffer may only be read with the GIL held): 8 bytes
        // an id, far less than the search itself.
        let within: Option<Vec<i64>> = match within {
            Some(obj) => Some(guarded(|| {
                Ok(Column::<i64>::new(obj, "within", "int64")?
                    .as_slice(py)
                    .to_vec())
            })?),
            None => None,
        };
        detached(py, || {
            Ok(self
                .read()?
                .search_within(query, k, within.as_deref())
                .into_iter()
                .unzip())
        })
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        self.with_read(py, bm25::Bm25Index::len)
    }

    fn __contains__(&self, py: Python<'_>, doc_id: i64) -> PyResult<bool> {
        self.with_read(py, |ix| ix.contains(doc_id))
    }

    #[getter]
    fn k1(&self) -> f64 {
        self.k1
    }

    #[getter]
    fn b(&self) -> f64 {
        self.b
    }

    #[getter]
    fn stop_words(&self) -> bool {
        self.stop_words
    }

    #[getter]
    fn cjk_bigrams(&self) -> bool {
        self.cjk_bigrams
    }

    #[getter]
    fn vocabulary_size(&self, py: Python<'_>) -> PyResult<usize> {
        self.with_read(py, bm25::Bm25Index::vocabulary_size)
    }

    #[getter]
    fn memory_bytes(&self, py: Python<'_>) -> PyResult<usize> {
        self.with_read(py, bm25::Bm25Index::memory_bytes)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "Bm25Index(k1={}, b={}, stop_words={}, len={})",
            self.k1,
            self.b,
            if self.stop_words { "True" } else { "False" },
            self.__len__(py)?
        ))
    }
}

/// The bytes of a buffer (e.g. a `pyarrow.Buffer`, whose format is signed bytes), kept
/// exported for as long as this lives.
enum ByteBuffer {
    Unsigned(PyBuffer<u8>),
    Signed(PyBuffer<i8>),
}

impl ByteBuffer {
    fn new(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        let buf = match PyBuffer::<u8>::get(obj) {
            Ok(buf) => ByteBuffer::Unsigned(buf),
            Err(_) => ByteBuffer::Signed(PyBuffer::<i8>::get(obj).map_err(|err| {
                PyTypeError::new_err(format!(
                    "{name} must be a buffer of bytes (e.g. a pyarrow.Buffer): {}",
                    err.value(obj.py())
                ))
            })?),
        };
        let (dimensions, contiguous) = match &buf {
            ByteBuffer::Unsigned(b) => (b.dimensions(), b.is_c_contiguous()),
            ByteBuffer::Signed(b) => (b.dimensions(), b.is_c_contiguous()),
        };
        if dimensions != 1 || !contiguous {
            return Err(PyBufferError::new_err(format!(
                "{name} must be a 1-D C-contiguous buffer of bytes"
            )));
        }
        Ok(buf)
    }

    fn raw(&self) -> (*const u8, usize) {
        match self {
            ByteBuffer::Unsigned(b) => (b.buf_ptr() as *const u8, b.item_count()),
            ByteBuffer::Signed(b) => (b.buf_ptr() as *const u8, b.item_count()),
        }
    }

    /// The bytes, read in place.
    ///
    /// SAFETY (the caller's promise): nothing writes the buffer while the slice lives,
    /// also while the interpreter's lock is released. Arrow buffers are immutable once
    /// built, which is what `RequestFilter.add_column` is documented to take.
    unsafe fn as_bytes(&self) -> &[u8] {
        let (ptr, n) = self.raw();
        if n == 0 {
            return &[]; // an empty buffer's pointer may be null or dangling
        }
        // SAFETY: one dimension, C-contiguous and byte-sized items were checked in `new`,
        // so `ptr` points at `n` bytes; the export held by `self` keeps them from being
        // freed or resized for as long as the slice (borrowing `self`) lives.
        unsafe { std::slice::from_raw_parts(ptr, n) }
    }
}

/// A Bloom filter of request keys sized for `capacity` keys at a 1% false-positive rate
/// (see `request_filter.rs`): `add(key)`, `maybe(key)` (False: never added, certain), and
/// `add_column` over an Arrow string column's buffers, with the interpreter's lock
/// released. Any thread may call `maybe` while another adds: bits only ever gain, and a
/// key's bits are all set when its `add` or `add_column` returns.
#[pyclass(frozen, name = "RequestFilter", module = "contextd._core")]
struct PyRequestFilter {
    inner: request_filter::RequestFilter,
}

#[pymethods]
impl PyRequestFilter {
    #[new]
    fn new(capacity: u64) -> PyResult<Self> {
        guarded(|| {
            Ok(PyRequestFilter {
                inner: request_filter::RequestFilter::with_capacity(capacity),
            })
        })
    }

    /// Set the bits of `key` (attached: a hash and k bit sets, well under a microsecond).
    fn add(&self, key: &str) -> PyResult<()> {
        guarded(|| {
            self.inner.add(key.as_bytes());
            Ok(())
        })
    }

    /// False: `key` was never added (certain). True: it may have been.
    fn maybe(&self, key: &str) -> PyResult<bool> {
        guarded(|| Ok(self.inner.maybe(key.as_bytes())))
    }

    /// Add every value of an Arrow string column given by its buffers: `data` (the
    /// values), `offsets` (int64 ones when `large`, else int32) and the array's `offset`
    /// and `length`. The buffers are read in place with the interpreter's lock released,
    /// so they must not change meanwhile (Arrow buffers never do). Validity is not read:
    /// a null slot adds its (empty) range, costing at most a false positive. Offsets that
    /// do not fit the buffers raise ValueError before any bit is set.
    #[pyo3(signature = (data, offsets, large, offset, length))]
    fn add_column(
        &self,
        py: Python<'_>,
        data: &Bound<'_, PyAny>,
        offsets: &Bound<'_, PyAny>,
        large: bool,
        offset: usize,
        length: usize,
    ) -> PyResult<()> {
        let data = ByteBuffer::new(data, "data")?;
        let offsets = ByteBuffer::new(offsets, "offsets")?;
        let width = if large {
            OffsetWidth::I64
        } else {
            OffsetWidth::I32
        };
        // SAFETY: see `ByteBuffer::as_bytes`; the method's contract says the buffers do
        // not change during the call, and both exports outlive the slices.
        let (data, offsets) = unsafe { (data.as_bytes(), offsets.as_bytes()) };
        detached(py, || {
            self.inner.add_column(data, offsets, width, offset, length)
        })
    }

    /// The number of keys it was sized for.
    #[getter]
    fn capacity(&self) -> u64 {
        self.inner.capacity()
    }

    /// The bytes its bits take.
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.nbytes()
    }

    /// The number of probes per key.
    #[getter]
    fn probes(&self) -> u32 {
        self.inner.probes()
    }

    /// A copy of the bits (for tests comparing two filters).
    fn to_bytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = guarded(|| Ok(self.inner.to_bytes()))?;
        Ok(PyBytes::new(py, &bytes))
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(estimate_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(estimate_tokens_batch, m)?)?;
    m.add_function(wrap_pyfunction!(search_vectors, m)?)?;
    m.add_function(wrap_pyfunction!(encode_receipts, m)?)?;
    m.add_function(wrap_pyfunction!(encode_context_messages, m)?)?;
    m.add_function(wrap_pyfunction!(encode_packed_int64, m)?)?;
    m.add_function(wrap_pyfunction!(decode_append_messages, m)?)?;
    m.add_function(wrap_pyfunction!(count_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(count_tokens_batch, m)?)?;
    m.add_function(wrap_pyfunction!(count_tokens_for_model_batch, m)?)?;
    m.add_function(wrap_pyfunction!(model_info, m)?)?;
    m.add_function(wrap_pyfunction!(list_models, m)?)?;
    m.add_function(wrap_pyfunction!(trim_to_budget, m)?)?;
    m.add_function(wrap_pyfunction!(trim_columns_to_budget, m)?)?;
    m.add_function(wrap_pyfunction!(pair_orphans_columns, m)?)?;
    m.add_function(wrap_pyfunction!(tokenize, m)?)?;
    m.add_function(wrap_pyfunction!(keyword_scores, m)?)?;
    m.add_function(wrap_pyfunction!(keyword_select, m)?)?;
    m.add_function(wrap_pyfunction!(extract_specifics, m)?)?;
    m.add_function(wrap_pyfunction!(snippet_of, m)?)?;
    m.add_function(wrap_pyfunction!(extract_specifics_batch, m)?)?;
    m.add_class::<PyBm25Index>()?;
    m.add_class::<PyModelInfo>()?;
    m.add_class::<PyTrimResult>()?;
    m.add_class::<PyRequestFilter>()?;
    m.add("UnknownModelError", m.py().get_type::<UnknownModelError>())?;
    m.add("InternalError", m.py().get_type::<InternalError>())?;
    m.add("ENCODINGS", PyTuple::new(m.py(), Encoding::NAMES)?)?;
    m.add("DEFAULT_MAX_CHARS", trim::DEFAULT_MAX_CHARS)?;
    m.add("STOP_WORDS", PyTuple::new(m.py(), text::STOP_WORDS)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
