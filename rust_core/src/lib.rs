//! contextd's pure core: token estimation, budget trimming and relevance scoring.
//!
//! Everything here is a pure function or a small value type with no I/O, so it can be
//! tested with `cargo test` alone. The Python bindings live in `python.rs` behind the
//! `python` feature.

pub mod estimate;

#[cfg(feature = "python")]
mod python;

pub use estimate::{estimate_tokens, estimate_tokens_chars_div4};
