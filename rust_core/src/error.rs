//! The crate's one error type.
//!
//! Every fallible public function returns [`CoreError`], so the Python bindings need a
//! single `From<CoreError> for PyErr` to map each variant onto the Python exception a
//! caller would expect (`ValueError` for bad arguments, `KeyError` for unknown models).

use std::fmt;

/// Everything that can go wrong in the core. All variants describe bad input: the core
/// does no I/O, so there is nothing else to fail.
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
        }
    }
}

impl std::error::Error for CoreError {}

/// Result alias used throughout the crate.
pub type CoreResult<T> = Result<T, CoreError>;
