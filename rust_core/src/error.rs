//! The crate's one error type.
//!
//! Every fallible public function returns [`CoreError`], so the Python bindings need a
//! single `From<CoreError> for PyErr` to map each variant onto the Python exception a
//! caller would expect (`ValueError` for bad arguments, `KeyError` for unknown models).
//! [`catch_panic`] turns a panic (a bug in the core, never bad input) into
//! [`CoreError::Internal`], so the bindings raise an ordinary Python exception for it
//! rather than letting pyo3 raise its `PanicException`, a `BaseException` that the gRPC
//! handlers' `except Exception` does not catch.

use std::any::Any;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Everything that can go wrong in the core. All variants but [`CoreError::Internal`]
/// describe bad input: the core does no I/O, so there is nothing else to fail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoreError {
    /// A tokenizer name that is not one of [`crate::tokens::Encoding::NAMES`].
    UnknownEncoding(String),
    /// A model name with no entry (and no prefix entry) in the model registry.
    UnknownModel(String),
    /// Parallel input columns whose lengths differ.
    LengthMismatch {
        /// Which column disagrees with the first one.
        column: &'static str,
        /// Length of the first column.
        expected: usize,
        /// Length of the disagreeing column.
        actual: usize,
    },
    /// Any other malformed argument, with a message naming it.
    InvalidArgument(String),
    /// A bug: a panic caught by [`catch_panic`] (its message, cut to
    /// [`PANIC_MESSAGE_MAX_CHARS`]), or state an earlier caught panic left unusable.
    Internal(String),
}

impl fmt::Display for CoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CoreError::UnknownEncoding(name) => write!(
                f,
                "unknown encoding {name:?}; expected one of: {}",
                crate::tokens::Encoding::NAMES.join(", ")
            ),
            CoreError::UnknownModel(name) => write!(
                f,
                "unknown model {name:?}; no registry entry equals it or is a '-'-separated prefix \
                 of it (use \"default\" for an unlisted model, or list_models() for the names)"
            ),
            CoreError::LengthMismatch {
                column,
                expected,
                actual,
            } => write!(
                f,
                "column {column:?} has {actual} entries but the first column has {expected}"
            ),
            CoreError::InvalidArgument(msg) => f.write_str(msg),
            CoreError::Internal(msg) => write!(f, "internal error in contextd's core: {msg}"),
        }
    }
}

impl std::error::Error for CoreError {}

/// Result alias used throughout the crate.
pub type CoreResult<T> = Result<T, CoreError>;

/// Longest panic message [`catch_panic`] quotes, in characters. Panic messages can quote
/// their input (a slicing panic quotes up to 256 bytes of the string), which is no
/// business of an error reply.
pub const PANIC_MESSAGE_MAX_CHARS: usize = 200;

/// Run `work`, turning a panic into [`CoreError::Internal`] (converted into `E`).
///
/// This is the bindings' last line of defence, not error handling: every input-dependent
/// failure is a [`CoreError`] returned at its source. Panics on rayon's worker threads
/// are re-raised on the thread that started the parallel work, so they are caught too.
/// Nothing is caught when the crate is built with `panic = "abort"` (it is not).
///
/// `AssertUnwindSafe` is sound for what the core shares across calls: the BM25 index sits
/// behind an `RwLock` that a panic during a write poisons, and the bindings refuse a
/// poisoned index instead of reading a half-updated one; the per-thread piece caches of
/// [`crate::tokens`] only ever hold whole entries, each a correct count.
pub fn catch_panic<T, E: From<CoreError>>(work: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
    catch_unwind(AssertUnwindSafe(work))
        .unwrap_or_else(|payload| Err(CoreError::Internal(panic_message(payload.as_ref())).into()))
}

/// The text of a panic payload (`panic!` makes a `&str` or a `String`), cut to
/// [`PANIC_MESSAGE_MAX_CHARS`] characters.
fn panic_message(payload: &(dyn Any + Send)) -> String {
    let msg = payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic without a message");
    match msg.char_indices().nth(PANIC_MESSAGE_MAX_CHARS) {
        Some((cut, _)) => format!("{}...", &msg[..cut]),
        None => msg.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    fn caught<T: std::fmt::Debug>(work: impl FnOnce() -> CoreResult<T>) -> String {
        match catch_panic(work) {
            Err(CoreError::Internal(msg)) => msg,
            other => panic!("expected an internal error, got {other:?}"),
        }
    }

    #[test]
    fn results_and_errors_pass_through() {
        assert_eq!(catch_panic(|| Ok::<_, CoreError>(7)), Ok(7));
        let err = CoreError::InvalidArgument("bad".into());
        assert_eq!(catch_panic(|| Err::<(), _>(err.clone())), Err(err));
    }

    #[test]
    fn panics_become_internal_errors_with_their_message() {
        assert_eq!(
            caught(|| -> CoreResult<()> { panic!("static text") }),
            "static text"
        );
        let n = 3;
        assert_eq!(
            caught(|| -> CoreResult<()> { panic!("formatted {n}") }),
            "formatted 3"
        );
        assert_eq!(
            caught(|| -> CoreResult<()> { std::panic::panic_any(42u8) }),
            "a panic without a message"
        );
        // What an out-of-bounds index or a bad slice would raise.
        let v: Vec<u8> = Vec::new();
        let i = v.len() + 1;
        assert!(caught(|| Ok(v[i])).contains("out of bounds"));
        let s = String::from("é");
        let cut = s.len() - 1;
        assert!(caught(|| Ok(s[..cut].len())).contains("char boundary"));
    }

    #[test]
    fn long_messages_are_cut_on_a_char_boundary() {
        let long = "é".repeat(PANIC_MESSAGE_MAX_CHARS * 3);
        let msg = caught(|| -> CoreResult<()> { panic!("{long}") });
        assert_eq!(msg.chars().count(), PANIC_MESSAGE_MAX_CHARS + 3);
        assert!(msg.ends_with("é..."));
        let exact = "x".repeat(PANIC_MESSAGE_MAX_CHARS);
        assert_eq!(caught(|| -> CoreResult<()> { panic!("{exact}") }), exact);
    }

    #[test]
    fn panics_on_rayon_workers_are_caught_on_the_caller() {
        let msg = caught(|| {
            (0..10_000u32).into_par_iter().for_each(|i| {
                assert!(i != 9_999, "worker {i} failed");
            });
            Ok(())
        });
        assert_eq!(msg, "worker 9999 failed");
    }

    #[test]
    fn internal_errors_say_they_are_internal() {
        let msg = CoreError::Internal("boom".into()).to_string();
        assert_eq!(msg, "internal error in contextd's core: boom");
    }
}
